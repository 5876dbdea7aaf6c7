"""Router knobs, from TOKENSTREAM_ROUTER_* environment variables (JSON for the mappings)."""

from __future__ import annotations

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Route(BaseModel):
    """Where requests for one requested model go.

    weights   target model -> share (canary rollouts); empty means "the model itself"
    fallback  target when the chosen one's estimated wait is over budget
    tiers     tenant tier -> target, taking precedence over weights (e.g. "free" -> a smaller model)
    """

    weights: dict[str, float] = Field(default_factory=dict)
    fallback: str | None = None
    tiers: dict[str, str] = Field(default_factory=dict)


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENSTREAM_ROUTER_", extra="ignore")

    routes: dict[str, Route] = Field(default_factory=dict, description="requested model -> Route")
    tenant_tiers: dict[str, str] = Field(default_factory=dict, description="tenant -> tier")
    default_tier: str = "standard"
    wait_budget_s: float = Field(10.0, gt=0, description="overflow to the fallback above this wait")
    min_rate: float = Field(0.5, gt=0, description="requests/s assumed when a group drains nothing")
    poll_s: float = Field(0.5, gt=0, description="how often the lag of each worker group is sampled")
    prefix_routing: bool = Field(
        True,
        description="send a conversation's next turn to the worker whose KV "
        "cache holds its prefix (ts.kv.prefixes), unless that worker is overloaded "
        "(a prompt_cache_key places a request either way)",
    )
    prefix_catch_up_s: float = Field(
        0.3,
        ge=0,
        description="longest wait of a later turn whose prefix is not "
        "known for ts.kv.prefixes to be read to its end",
    )
    prefix_stale_s: float = Field(
        5.0, gt=0, description="a worker not heard from for this long is not routed to by prefix"
    )
