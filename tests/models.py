"""Tiny decoder configs with random weights, one per architecture (no downloads)."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

NUM_LAYERS = 5
VOCAB = 128

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# Per-architecture overrides of the common tiny shape.
_EXTRA = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=4),
    "phi3": {},
    "gpt2": dict(n_embd=64, n_layer=None, n_head=4, n_positions=256),
    "gpt_neox": dict(num_key_value_heads=None),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64, num_key_value_heads=None, intermediate_size=None),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}

ARCHS = list(_EXTRA)


def tiny_config(arch: str, num_layers: int = NUM_LAYERS, **overrides):
    kw = dict(_COMMON, num_hidden_layers=num_layers)
    for key, value in _EXTRA[arch].items():
        if value is None:
            kw.pop(key, None)
        else:
            kw[key] = value
    if arch == "gpt2":
        kw = {k: v for k, v in kw.items() if k not in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                                       "intermediate_size", "max_position_embeddings")}
        kw["n_layer"] = num_layers
    kw.update(overrides)
    return AutoConfig.for_model(arch, **kw)


def tiny_model(arch: str, num_layers: int = NUM_LAYERS, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, num_layers, **overrides)).eval()
    # Random init leaves some weights at exactly 0 or 1 (norms, biases); perturb them so that every
    # parameter matters and a wrong or missing weight changes the numbers.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model
