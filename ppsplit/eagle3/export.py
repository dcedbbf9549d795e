"""Writing an ``Eagle3Drafter`` in the layouts the engines load: speculators (vLLM) and SpecForge (SGLang).

The configs are the ones those libraries' own ``save_pretrained`` write (``ppsplit.core.drafter_config`` reads both);
tap ids are written in the format's numbering. A drafter variant a format cannot express is refused, naming it.
"""
from __future__ import annotations

import json
import os

import torch

from ppsplit.core.errors import ConfigError
from ppsplit.core.drafter_config import SPECFORGE, SPECULATORS

EXPORT_FORMATS = (SPECULATORS, SPECFORGE)


def _layer(cfg: dict) -> dict:
    layer = {"model_type": "qwen3" if cfg.get("qk_norm") else "llama", "hidden_size": cfg["hidden_size"],
             "intermediate_size": cfg["intermediate_size"], "num_attention_heads": cfg["num_attention_heads"],
             "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
             "hidden_act": cfg["hidden_act"], "rms_norm_eps": cfg["rms_norm_eps"], "vocab_size": cfg["vocab_size"],
             "attention_bias": cfg["attention_bias"], "num_hidden_layers": 1, "mlp_bias": False,
             "tie_word_embeddings": False}
    rope = cfg.get("rope")
    if not isinstance(rope, dict):
        raise ConfigError("this drafter does not know the rotary settings it was loaded with (a compiled folder of an "
                          "older ppsplit); load it from its checkpoint to save it in another format")
    layer.update(rope)
    if cfg.get("sliding_window"):
        layer.update(sliding_window=cfg["sliding_window"], layer_types=["sliding_attention"])
    return layer


def _tensors(drafter, layer_prefix: str, embed: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in drafter.state_dict().items():
        if name.startswith("midlayer."):
            name = layer_prefix + name[len("midlayer."):]
        out[name] = t.detach().contiguous().cpu()
    targets = drafter.target_ids.cpu()
    vocab = drafter.embed_tokens.shape[0]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    out["t2d"] = t2d
    out["d2t"] = out["d2t"].long()
    if embed:
        out["embed_tokens.weight"] = drafter.embed_tokens.detach().contiguous().cpu()
    return out


def _speculators(drafter, verifier: str | None) -> tuple[dict, dict]:
    cfg = drafter.cfg
    if not drafter.final_norm:
        raise ConfigError("the speculators format cannot express a drafter without the final norm (SpecForge "
                          "norm_output false); save it with format='specforge'")
    out = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                        "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                  "verifier": {"name_or_path": verifier, "architectures": []}},
           "transformer_layer_config": _layer(cfg), "draft_vocab_size": cfg["draft_vocab_size"],
           "norm_before_residual": drafter.norm_before_residual, "norm_before_fc": drafter.input_norm is not None,
           "fc_norm": drafter.fc_norm is not None, "norm_output": drafter.feed_normed,
           "target_hidden_size": None if drafter.target_hidden_size == drafter.hidden_size
           else drafter.target_hidden_size,
           "eagle_aux_hidden_state_layer_ids": list(drafter.taps),  # vLLM numbering: ppsplit's
           "embed_requires_grad": False, "tie_word_embeddings": False}
    tensors = _tensors(drafter, "layers.0.", embed=True)
    if cfg["draft_vocab_size"] == drafter.embed_tokens.shape[0]:  # speculators keeps no mapping for a full vocabulary
        del tensors["d2t"], tensors["t2d"]
    return out, tensors


def _specforge(drafter, verifier: str | None) -> tuple[dict, dict]:
    cfg = drafter.cfg
    for refused, why in ((drafter.feed_normed, "feeds the normed output back (speculators norm_output true)"),
                         (drafter.input_norm is not None, "norms the concatenated taps (speculators norm_before_fc)"),
                         (cfg.get("qk_norm"), "has a Qwen3 draft layer (q_norm / k_norm)"),
                         (drafter.sliding_window, "attends within a sliding window")):
        if refused:
            raise ConfigError(f"the SpecForge format cannot express this drafter: it {why}; save it with "
                              "format='speculators'")
    out = {"architectures": ["LlamaForCausalLMEagle3"], **_layer(cfg),
           "draft_vocab_size": cfg["draft_vocab_size"], "target_hidden_size": drafter.target_hidden_size,
           "norm_before_residual": drafter.norm_before_residual, "fc_norm": drafter.fc_norm is not None,
           "norm_output": drafter.final_norm,
           # SpecForge numbers layer outputs: tap j is written j - 1
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in drafter.taps],
                            "use_aux_hidden_state": True}}
    if min(drafter.taps) < 1:
        raise ConfigError(f"the SpecForge numbering cannot write tap 0 (the embedding output); this drafter reads "
                          f"taps {list(drafter.taps)}: save it with format='speculators'")
    if cfg.get("fc_bias"):
        raise ConfigError("the SpecForge format has no fc bias; save it with format='speculators'")
    return out, _tensors(drafter, "midlayer.", embed=False)


def save_checkpoint(drafter, folder: str, format: str, verifier: str | None = None) -> str:
    """Write ``drafter`` to ``folder`` (``config.json`` + ``model.safetensors``) as ``format`` writes it;
    ``verifier``: the target's hub id or folder, which the speculators format records (its loader reads the
    target's config from there)."""
    from safetensors.torch import save_file

    if format not in EXPORT_FORMATS:
        raise ConfigError(f"drafter format must be one of {', '.join(EXPORT_FORMATS)}, but got {format!r}")
    if drafter.cfg.get("fc_bias") and format == SPECULATORS:
        raise ConfigError("the speculators format has no fc bias; this drafter cannot be written in it")
    cfg, tensors = (_speculators if format == SPECULATORS else _specforge)(drafter, verifier)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder
