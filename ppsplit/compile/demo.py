"""The built-in demo model: a small Llama-style decoder with seeded random weights (no download)."""
from __future__ import annotations

import torch

DEMO_NAME = "demo"


def demo_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       torch_dtype="float32")


def demo_model(seed: int = 0) -> torch.nn.Module:
    """The demo model with the same weights on every machine (seeded initialisation)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(demo_config()).eval()
