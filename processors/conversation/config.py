"""Conversation knobs, from TOKENSTREAM_CONVERSATION_* environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.models import SMOLLM2_CONTEXT, context_length


class ConversationSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENSTREAM_CONVERSATION_", extra="ignore")

    tokenizer_by_model: dict[str, str] = Field(
        default_factory=dict,
        description="model name -> name whose tokenizer counts its tokens "
        "(default: the model's own; unknown models use smollm2's)",
    )
    max_history_messages: int = Field(200, ge=2, description="turns kept per conversation in the table")
    pending_timeout_s: float = Field(120.0, gt=0, description="stop waiting for an answer after this long")
    parked_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a turn parked until the previous answer lands is refused (and that answer given "
        "up) once it has waited this long since its admission; keep it below the gateway's "
        "progress timeout (TOKENSTREAM_GATEWAY_PROGRESS_TIMEOUT_S, 60 s)",
    )

    def window_for(self, model: str) -> int:
        """The model's context (common.models.context_length: TOKENSTREAM_CONTEXT_TOKENS or the
        model's config, the same figure the worker uses); SmolLM2's for a model with no files here."""
        return context_length(model) or SMOLLM2_CONTEXT
