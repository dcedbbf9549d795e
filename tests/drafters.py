"""Random EAGLE-3 drafters written to disk in the published layouts (for tests; no downloads)."""
from __future__ import annotations

import json
import os

import torch


def drafter_config(target, aux_ids=None, draft_vocab: int | None = None, **overrides) -> dict:
    """An EAGLE-3 ``config.json`` for ``target`` (a HF config); ``aux_ids`` as a SpecForge checkpoint writes them."""
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": target.hidden_size,
           "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 256,
           "rope_theta": 5000.0,  # not transformers' default, so a theta lost on the way shows in the reference test
           "vocab_size": target.vocab_size, "draft_vocab_size": draft_vocab or target.vocab_size,
           "tie_word_embeddings": False}
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True}
    cfg.update(overrides)
    return cfg


def random_drafter_tensors(cfg: dict, n_taps: int = 3, seed: int = 0, scale: float = 0.2) -> dict:
    """Tensors of a one-layer EAGLE-3 drafter (``midlayer.`` naming), random but well conditioned."""
    g = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    th = cfg.get("target_hidden_size", h)
    vocab, draft = cfg["vocab_size"], cfg["draft_vocab_size"]

    def w(*shape):
        return torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5 * 4

    def norm():
        return 1 + 0.1 * torch.randn(h, generator=g)

    t = {"fc.weight": w(h, n_taps * th), "midlayer.hidden_norm.weight": norm(),
         "midlayer.input_layernorm.weight": norm(), "midlayer.post_attention_layernorm.weight": norm(),
         "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h), "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * h),
         "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * h), "midlayer.self_attn.o_proj.weight": w(h, heads * hd),
         "midlayer.mlp.gate_proj.weight": w(inter, h), "midlayer.mlp.up_proj.weight": w(inter, h),
         "midlayer.mlp.down_proj.weight": w(h, inter), "norm.weight": norm(), "lm_head.weight": w(draft, h)}
    ids = torch.sort(torch.randperm(vocab, generator=g)[:draft]).values  # the draft vocabulary: a subset of ids
    t["d2t"] = ids - torch.arange(draft)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    t["t2d"] = t2d
    return t


def write_drafter(folder: str, cfg: dict, tensors: dict, layout: str = "safetensors") -> str:
    """``layout``: ``"safetensors"`` (model.safetensors, ``midlayer.``) or ``"bin"`` (pytorch_model.bin,
    vLLM's ``layers.0.`` naming)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    if layout == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    else:
        renamed = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
        torch.save(renamed, os.path.join(folder, "pytorch_model.bin"))
    return folder
