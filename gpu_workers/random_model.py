"""Random-initialised Llama models built from a config: tests (tiny) and GPU throughput runs (~1B).

The weights are random (fixed seed), so the text is noise, but the compute per token is that of
a real model of the same shape. The tokenizer is SmolLM2's (offline), so prompts are real text.
"""

from __future__ import annotations

from pathlib import Path

SHAPES = {
    # ~3.3M params, mostly the 49k-token embedding: steps take milliseconds on a CPU
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # ~1.2B params, the shape of Llama-3.2-1B with SmolLM2's vocabulary
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
}


def build(folder: Path | str, shape: str = "tiny", seed: int = 0, dtype: str = "float32") -> Path:
    """Write a random model of `shape` with SmolLM2's tokenizer and chat template to `folder` (once)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from gpu_workers.model_loader import smollm2_dir

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    config = LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
