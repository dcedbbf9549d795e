"""What an EAGLE-3 (or DFlash, at the end) checkpoint's ``config.json`` says, per format, as one flat drafter config
(pure data, no torch).

Formats (``detect_format``):

- ``speculators`` (vLLM's format; ``speculators`` ``save_pretrained``): ``speculators_model_type: "eagle3"``,
  ``speculators_config``, the layer's Llama/Qwen3 fields under ``transformer_layer_config``, tap ids in vLLM
  numbering (id ``j`` = ``hidden_states[j]``), ``norm_output`` = the normed output feeds the next draft (Eagle 3.1).
- ``specforge`` (SpecForge ``export_to_sglang`` / ``export_to_hf``, SafeAILab's EAGLE-3 ``LlamaForCausalLMEagle3``):
  a flat Llama config, tap ids (``eagle_config``) numbering layer outputs (+1), ``norm_output`` (default true) =
  ``norm`` before ``lm_head``.
- ``ppsplit``: what ``save_drafter`` writes into a compiled folder (already flat, taps resolved).

Every key is read, or listed here as changing nothing at inference (with the reason), or refused in one line naming
it: a setting ppsplit does not understand never passes silently.
"""
from __future__ import annotations

from ppsplit.core.errors import ConfigError

SPECULATORS, SPECFORGE, PPSPLIT = "speculators", "specforge", "ppsplit"
# The tap numbering each format writes (``ppsplit.core.options.TAP_NUMBERINGS``).
FORMAT_NUMBERING = {SPECULATORS: "vllm", SPECFORGE: "sglang"}

# The flat drafter config (``Eagle3Drafter``'s ``cfg``) and the type of each key.
DRAFTER_KEYS = {"hidden_size": int, "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int,
                "intermediate_size": int, "target_hidden_size": int, "draft_vocab_size": int, "vocab_size": int,
                "rms_norm_eps": float, "hidden_act": str, "attention_bias": bool, "fc_bias": bool,
                "norm_before_residual": bool, "input_norm": bool, "fc_norm": bool, "qk_norm": bool,
                "final_norm": bool, "feed_normed": bool, "sliding_window": int}

# Written by transformers into every config (some only by older versions); none changes a forward pass.
_GENERIC = {"_name_or_path", "architectures", "auto_map", "chunk_size_feed_forward", "dtype", "torch_dtype",
            "id2label", "label2id", "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type",
            "return_dict", "transformers_version", "_attn_implementation_autoset", "add_cross_attention",
            "bad_words_ids", "begin_suppress_tokens", "cross_attention_hidden_size", "decoder_start_token_id",
            "diversity_penalty", "do_sample", "early_stopping", "encoder_no_repeat_ngram_size",
            "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id", "forced_eos_token_id",
            "is_decoder", "length_penalty", "max_length", "min_length", "no_repeat_ngram_size", "num_beam_groups",
            "num_beams", "num_return_sequences", "output_scores", "prefix", "pruned_heads",
            "remove_invalid_values", "repetition_penalty", "return_dict_in_generate", "sep_token_id",
            "suppress_tokens", "task_specific_params", "temperature", "tf_legacy_loss", "tie_encoder_decoder",
            "tokenizer_class", "top_k", "top_p", "torchscript", "typical_p", "use_bfloat16"}
# Layer keys that change nothing at inference, and why.
_INERT = {"attention_dropout": "no dropout at inference", "initializer_range": "initialisation only",
          "bos_token_id": "tokenizer facts", "eos_token_id": "tokenizer facts", "pad_token_id": "tokenizer facts",
          "use_cache": "a runtime switch", "pretraining_tp": "the same matmuls, sliced",
          "tie_word_embeddings": "the drafter's lm_head is its own draft-vocabulary tensor in every format",
          "max_window_layers": "read through layer_types", "use_sliding_window": "read through layer_types"}
# Layer keys the rotary embedding reads (through transformers' own Llama rotary code).
ROPE_KEYS = ("max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")
_LAYER_READ = {"hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "rms_norm_eps", "hidden_act", "vocab_size", "attention_bias", "mlp_bias", "model_type",
               "num_hidden_layers", "sliding_window", "layer_types", *ROPE_KEYS}
_FLAGS = {"norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "target_hidden_size",
          "draft_vocab_size", "eagle_aux_hidden_state_layer_ids"}
_SPECULATORS_TOP = {"speculators_model_type", "speculators_config", "speculators_version", "transformer_layer_config",
                    "embed_requires_grad", *_FLAGS}
_SPECFORGE_TOP = {"eagle_config", *_FLAGS}
_PPSPLIT_TOP = {*DRAFTER_KEYS, "rope", "ppsplit_taps", "ppsplit_rope_scale"}  # rope: the source's rotary keys
_MODEL_TYPES = ("llama", "qwen3")  # the draft layers the formats' model code builds (speculators model_classes)


def detect_format(cfg: dict) -> str:
    """``speculators``, ``specforge`` (also SafeAILab's EAGLE-3 and other flat Llama configs) or ``ppsplit``."""
    if "ppsplit_taps" in cfg:
        return PPSPLIT
    if "speculators_model_type" in cfg or "transformer_layer_config" in cfg:
        return SPECULATORS
    return SPECFORGE


def _refuse_unknown(cfg: dict, known: set, where: str) -> None:
    for key in cfg:
        if key not in known and key not in _GENERIC and key not in _INERT:
            raise ConfigError(f"drafter config key {where}{key} = {cfg[key]!r} is not one ppsplit reads, so it cannot "
                              "honour it; remove it if it does not change the drafter's forward, else this drafter "
                              "is not supported")


def _flag(cfg: dict, key: str, default: bool, where: str = "") -> bool:
    value = cfg.get(key, default)
    value = default if value is None else value
    if not isinstance(value, bool):
        raise ConfigError(f"drafter config {where}{key} must be true or false, but got {value!r}")
    return value


def _layer(layer: dict, where: str) -> tuple[dict, dict]:
    """The draft layer's fields of a Llama or Qwen3 config ``layer`` (flat, or speculators'
    ``transformer_layer_config``), checked."""
    model_type = layer.get("model_type", "llama")
    if model_type not in _MODEL_TYPES:
        raise ConfigError(f"drafter config {where}model_type {model_type!r} is not supported; the draft layer must be "
                          f"one of {', '.join(_MODEL_TYPES)}")
    h, heads = layer.get("hidden_size"), layer.get("num_attention_heads")
    if not isinstance(h, int) or not isinstance(heads, int) or h <= 0 or heads <= 0:
        raise ConfigError(f"the drafter config needs {where}hidden_size and {where}num_attention_heads (an EAGLE-3 "
                          f"Llama layer), but got {h!r} and {heads!r}")
    if layer.get("num_hidden_layers", 1) != 1:
        raise ConfigError(f"drafter config {where}num_hidden_layers is {layer['num_hidden_layers']}: ppsplit runs "
                          "one-layer EAGLE-3 drafters only")
    if _flag(layer, "mlp_bias", False, where):
        raise ConfigError(f"drafter config {where}mlp_bias is true: biased MLP projections are not supported")
    out = {"hidden_size": h, "num_attention_heads": heads,
           "num_key_value_heads": layer.get("num_key_value_heads") or heads,
           "head_dim": layer.get("head_dim") or h // heads, "intermediate_size": layer.get("intermediate_size"),
           "rms_norm_eps": float(layer.get("rms_norm_eps") or 1e-6), "hidden_act": layer.get("hidden_act", "silu"),
           "vocab_size": layer.get("vocab_size"), "attention_bias": _flag(layer, "attention_bias", False, where),
           "qk_norm": model_type == "qwen3", "sliding_window": _window(layer, where)}
    rope = {k: layer[k] for k in ROPE_KEYS if layer.get(k) is not None}
    return out, rope


def _window(layer: dict, where: str) -> int:
    """The draft attention's window, as transformers reads it: ``sliding_window`` applies when ``layer_types[0]`` is
    ``"sliding_attention"`` (speculators, Qwen3), or, without ``layer_types``, when ``use_sliding_window`` is set."""
    window, types = layer.get("sliding_window"), layer.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != 1 or types[0] not in ("full_attention", "sliding_attention"):
            raise ConfigError(f"drafter config {where}layer_types must be one entry, full_attention or "
                              f"sliding_attention, for the one draft layer; got {types!r}")
        sliding = types[0] == "sliding_attention"
    else:
        sliding = bool(layer.get("use_sliding_window", False)) and window is not None
    if not sliding:
        return 0
    if not isinstance(window, int) or window <= 0:
        raise ConfigError(f"drafter config {where}layer_types asks for sliding_attention but {where}sliding_window is "
                          f"{window!r}; it must be a positive integer")
    return window


def _speculators(cfg: dict) -> tuple[dict, dict]:
    if cfg.get("speculators_model_type") != "eagle3":
        raise ConfigError(f"drafter config speculators_model_type is {cfg.get('speculators_model_type')!r}; ppsplit "
                          "loads EAGLE-3 drafters (\"eagle3\") only")
    _refuse_unknown(cfg, _SPECULATORS_TOP, "")
    spec = cfg.get("speculators_config") or {}
    if not isinstance(spec, dict):
        raise ConfigError(f"drafter config speculators_config must be an object, but got {spec!r}")
    _refuse_unknown(spec, {"algorithm", "proposal_methods", "default_proposal_method", "verifier"},
                    "speculators_config.")
    if spec.get("algorithm", "eagle3") != "eagle3":
        raise ConfigError(f"drafter config speculators_config.algorithm is {spec['algorithm']!r}; ppsplit loads "
                          "EAGLE-3 drafters only")
    for method in spec.get("proposal_methods") or []:
        # ppsplit drafts one greedy (or sampled) chain and accepts losslessly: a tolerance would change outputs
        _refuse_unknown(method, {"proposal_type", "speculative_tokens", "accept_tolerance", "verifier_accept_k"},
                        "speculators_config.proposal_methods[].")
        if method.get("proposal_type", "greedy") != "greedy" or method.get("accept_tolerance", 0.0) != 0.0 \
                or method.get("verifier_accept_k", 1) != 1:
            raise ConfigError(f"drafter config speculators_config.proposal_methods entry {method} is not a greedy "
                              "chain accepted exactly (proposal_type greedy, accept_tolerance 0, verifier_accept_k "
                              "1), which is what ppsplit runs")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError("the speculators drafter config needs a transformer_layer_config object (the draft layer's "
                          "Llama fields)")
    _refuse_unknown(layer, _LAYER_READ, "transformer_layer_config.")
    out, rope = _layer(layer, "transformer_layer_config.")
    norm_before_fc, fc_norm = _flag(cfg, "norm_before_fc", False), _flag(cfg, "fc_norm", False)
    if norm_before_fc and fc_norm:
        raise ConfigError("drafter config sets both norm_before_fc and fc_norm; they exclude each other")
    out.update(input_norm=norm_before_fc, fc_norm=fc_norm, final_norm=True,
               feed_normed=_flag(cfg, "norm_output", False))
    return out, rope


def _specforge(cfg: dict) -> tuple[dict, dict]:
    _refuse_unknown(cfg, _SPECFORGE_TOP | _LAYER_READ, "")
    eagle = cfg.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise ConfigError(f"drafter config eagle_config must be an object, but got {eagle!r}")
    _refuse_unknown(eagle, {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"}, "eagle_config.")
    if not _flag(eagle, "use_aux_hidden_state", True, "eagle_config."):
        raise ConfigError("drafter config eagle_config.use_aux_hidden_state is false: an EAGLE-1/2 drafter, which "
                          "reads the last hidden state; ppsplit runs EAGLE-3 drafters (taps)")
    out, rope = _layer(cfg, "")
    norm_before_fc, fc_norm = _flag(cfg, "norm_before_fc", False), _flag(cfg, "fc_norm", False)
    if norm_before_fc and fc_norm:
        raise ConfigError("drafter config sets both norm_before_fc and fc_norm; they exclude each other")
    out.update(input_norm=norm_before_fc, fc_norm=fc_norm, final_norm=_flag(cfg, "norm_output", True),
               feed_normed=False)
    return out, rope


def aux_ids(cfg: dict):
    """The tap ids a checkpoint config writes (``eagle_config`` or top level), or ``None`` for EAGLE-3's default."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids)):
        raise ConfigError(f"drafter config eagle_aux_hidden_state_layer_ids must be a list of integers, got {ids!r}")
    return ids or None


def drafter_config(cfg: dict, tensors=()) -> tuple[dict, dict, str]:
    """``(flat drafter config, rotary keys, format)`` of a checkpoint config; ``tensors``: the tensor names (``fc.bias``
    is read from them)."""
    fmt = detect_format(cfg)
    if fmt == PPSPLIT:
        _refuse_unknown(cfg, _PPSPLIT_TOP, "")
        return dict(cfg), dict(cfg.get("rope") or {}), fmt
    out, rope = _speculators(cfg) if fmt == SPECULATORS else _specforge(cfg)
    out["norm_before_residual"] = _flag(cfg, "norm_before_residual", False)
    out["target_hidden_size"] = cfg.get("target_hidden_size") or out["hidden_size"]
    out["draft_vocab_size"] = cfg.get("draft_vocab_size") or out["vocab_size"]
    out["fc_bias"] = "fc.bias" in tensors
    out["rope"] = rope
    if out["intermediate_size"] is None:
        raise ConfigError("the drafter config needs intermediate_size (the draft layer's MLP width)")
    return out, rope, fmt


# -- DFlash (block diffusion) --------------------------------------------------------------------------------------
# z-lab's folders (the ``dflash`` package's ``DFlashDraftModel``): a flat Qwen3 config plus ``dflash_config``, whose
# keys the library also reads from the top level (``_draft_value``); tap ids are layer outputs (vLLM adds 1).
# speculators' ``dflash``: ``transformer_layer_config`` plus top-level DFlash keys; tap ids as vLLM numbers them.
_DFLASH_VALUES = {"target_layer_ids", "block_size", "mask_token_id", "input_embedding_scale", "output_multiplier",
                  "final_logit_softcapping"}
# dflash_config keys vLLM reads that must keep their plain-DFlash value (anything else is a variant ppsplit refuses).
_DFLASH_FIXED = {"causal": False, "use_swa": False, "attention_sink_bias": False, "use_aux_hidden_state": True}
_DFLASH_TOP = {"dflash_config", "num_target_layers", "is_causal", "is_neox_style", *_DFLASH_VALUES}
# What a compiled folder's DFlash drafter config holds beside the flat layer keys (``DRAFTER_KEYS``), by type.
DFLASH_KEYS = {"num_hidden_layers": int, "block_size": int, "mask_token_id": int, "input_embedding_scale": float,
               "output_multiplier": float, "final_logit_softcapping": float, "num_target_layers": int,
               "ppsplit_family": str}
_DFLASH_STORED_NEEDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                        "rms_norm_eps", "hidden_act", "attention_bias", "target_hidden_size", "draft_vocab_size",
                        "vocab_size", *[k for k in DFLASH_KEYS if k not in ("num_target_layers", "ppsplit_family")])
_DFLASH_SPECULATORS_TOP = {"speculators_model_type", "speculators_config", "speculators_version",
                           "transformer_layer_config", "draft_vocab_size", "block_size", "target_hidden_size",
                           "aux_hidden_state_layer_ids", "mask_token_id", "sliding_window_non_causal",
                           "sample_from_anchor", "embed_requires_grad"}


# speculators' ``dspark``: its ``dflash`` layout plus a Markov head and a confidence head (speculators'
# ``DSparkSpeculatorConfig``); ``sample_from_anchor`` (default true) makes the anchor row draft too.
_DSPARK_TOP = {"markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"}
_MARKOV_HEADS = ("vanilla", "gated", "rnn")
# DFlash2 (z-lab's ``DFlash2DraftModel``, speculators' ``dflash2``): convolutions around each sublayer, a candidate
# selector after the head; the library reads these from ``dflash_config`` or the top level, speculators at the top.
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# DeepSpec's own DSpark folders (deepseek-ai/DeepSpec ``deepspec/modeling/dspark``: ``build_draft_config`` deep-copies
# the target's config and sets the keys below, ``save_pretrained`` writes the draft model's own tensors). Qwen3's is
# read; Gemma4's (DeepSpec) and DeepseekV2's (a fork) have other draft layers and are refused.
DEEPSPEC_DSPARK = "Qwen3DSparkModel"
_DEEPSPEC_OTHERS = {"Gemma4DSparkModel", "DeepseekV2DSparkModel"}
_DEEPSPEC_TOP = {"target_layer_ids", "num_target_layers", "block_size", "mask_token_id", "num_anchors",
                 "enable_confidence_head", "confidence_head_with_markov", "markov_rank", "markov_head_type"}


def is_dflash(cfg: dict) -> bool:
    """Whether a drafter config is a DFlash-family one (z-lab's ``dflash_config`` or architecture, speculators'
    ``dflash`` and ``dspark``, DeepSpec's DSpark architectures)."""
    return bool("dflash_config" in cfg or cfg.get("speculators_model_type") in ("dflash", "dspark", "dflash2")
            or cfg.get("ppsplit_family") == "dflash"
            or {"DFlashDraftModel", "DFlash2DraftModel", DEEPSPEC_DSPARK, *_DEEPSPEC_OTHERS}
            & set(cfg.get("architectures") or ()))


def dflash_family(cfg: dict) -> str:
    """``dflash``, ``dflash2`` or ``dspark``: the drafter module a DFlash-family config (``is_dflash``) builds."""
    archs = set(cfg.get("architectures") or ())
    if cfg.get("speculators_model_type") == "dspark" or DEEPSPEC_DSPARK in archs:
        return "dspark"
    return "dflash2" if cfg.get("speculators_model_type") == "dflash2" or "DFlash2DraftModel" in archs else "dflash"


def is_deepspec(cfg: dict) -> bool:
    """Whether a drafter config is DeepSpec's own DSpark folder (``Qwen3DSparkModel``)."""
    return DEEPSPEC_DSPARK in (cfg.get("architectures") or ()) and not cfg.get("speculators_model_type")


def dflash_drafter_config(cfg: dict) -> tuple[dict, dict, list | None, str]:
    """``(flat config, rotary keys, tap ids or None, their numbering)`` of a DFlash drafter config. Every key is read,
    listed as inert, or refused naming it."""
    if cfg.get("speculators_model_type") in ("dflash", "dspark", "dflash2"):
        return _dflash_speculators(cfg)
    if "ppsplit_taps" in cfg:
        return _dflash_stored(cfg)
    other = _DEEPSPEC_OTHERS & set(cfg.get("architectures") or ())
    if other:
        raise ConfigError(f"drafter architecture {sorted(other)[0]} is a DSpark drafter with {sorted(other)[0][:-11]} "
                          f"draft layers; ppsplit reads DeepSpec's {DEEPSPEC_DSPARK} (Qwen3 draft layers) only")
    if is_deepspec(cfg):
        return _deepspec(cfg)
    two = "DFlash2DraftModel" in (cfg.get("architectures") or ())
    extra = set(_DFLASH2_KEYS) if two else set()
    inner = cfg.get("dflash_config") or {}
    if not isinstance(inner, dict):
        raise ConfigError(f"drafter config dflash_config must be an object, but got {inner!r}")
    _refuse_unknown(inner, _DFLASH_VALUES | set(_DFLASH_FIXED) | extra, "dflash_config.")
    for key, plain in _DFLASH_FIXED.items():
        if inner.get(key, plain) != plain:
            raise ConfigError(f"drafter config dflash_config.{key} = {inner[key]!r} asks for a DFlash variant ppsplit "
                              f"does not run; plain DFlash has {key} = {plain!r}")
    for key in ("is_causal",):
        if cfg.get(key):
            raise ConfigError(f"drafter config {key} is true: causal draft blocks are not supported (plain DFlash "
                              "attends within a block both ways)")
    if cfg.get("is_neox_style", True) is not True:
        raise ConfigError("drafter config is_neox_style is false: interleaved rotary is not supported")
    _refuse_unknown(cfg, _DFLASH_TOP | _LAYER_READ | extra, "")
    value = lambda key, default=None: inner.get(key, cfg.get(key, default))  # noqa: E731  (the library's order)
    out, rope = _dflash_layers(cfg, "")
    out.update(block_size=value("block_size", 16), mask_token_id=value("mask_token_id"),
               input_embedding_scale=float(value("input_embedding_scale", 1.0)),
               output_multiplier=float(value("output_multiplier", 1.0)),
               final_logit_softcapping=float(value("final_logit_softcapping") or 0.0),
               draft_vocab_size=out["vocab_size"], target_hidden_size=out["hidden_size"])
    ids = value("target_layer_ids")
    if ids is None:  # the library's default spread (dflash.model.build_target_layer_ids)
        n, layers = cfg.get("num_target_layers"), out["num_hidden_layers"]
        if not isinstance(n, int):
            raise ConfigError("the DFlash drafter config has neither dflash_config.target_layer_ids nor "
                              "num_target_layers; it cannot say which taps it reads")
        ids = [n // 2] if layers == 1 else [round(1 + i * (n - 4) / (layers - 1)) for i in range(layers)]
    out["num_target_layers"] = cfg.get("num_target_layers")
    out["family"] = "dflash2" if two else "dflash"
    if two:
        out.update(_dflash2_fields(value, out))
    return _dflash_checked(out), rope, ids, "sglang"


def _dflash_speculators(cfg: dict) -> tuple[dict, dict, list | None, str]:
    family = cfg["speculators_model_type"]
    own = {"dspark": _DSPARK_TOP, "dflash2": set(_DFLASH2_KEYS)}.get(family, set())
    _refuse_unknown(cfg, _DFLASH_SPECULATORS_TOP | own, "")
    spec = cfg.get("speculators_config") or {}
    if not isinstance(spec, dict) or spec.get("algorithm", family) != family:
        raise ConfigError(f"drafter config speculators_config.algorithm is {spec.get('algorithm')!r}; a speculators "
                          f"{family} drafter has \"{family}\"")
    _refuse_unknown(spec, {"algorithm", "proposal_methods", "default_proposal_method", "verifier"},
                    "speculators_config.")
    if family != "dspark" and _flag(cfg, "sample_from_anchor", False):
        raise ConfigError("drafter config sample_from_anchor is true (the anchor position drafts too, DSpark's "
                          "layout); ppsplit runs DFlash blocks whose anchor is the bonus token (false)")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError("the speculators dflash config needs a transformer_layer_config object (the draft layers' "
                          "Qwen3 fields)")
    _refuse_unknown(layer, _LAYER_READ, "transformer_layer_config.")
    out, rope = _dflash_layers(layer, "transformer_layer_config.")
    # sliding_window_non_causal only shapes sliding-window layers, which _dflash_layers refuses: inert here.
    out.update(block_size=cfg.get("block_size", 8), mask_token_id=cfg.get("mask_token_id"),
               input_embedding_scale=1.0, output_multiplier=1.0, final_logit_softcapping=0.0,
               draft_vocab_size=cfg.get("draft_vocab_size") or out["vocab_size"],
               target_hidden_size=cfg.get("target_hidden_size") or out["hidden_size"], num_target_layers=None,
               family=family, sample_from_anchor=False)
    if family == "dspark":
        out.update(_dspark_heads(cfg))
    if family == "dflash2":
        defaults = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
        out.update(_dflash2_fields(lambda key: cfg.get(key, defaults[key]), out))
        if out["draft_vocab_size"] != out["vocab_size"]:
            raise ConfigError(f"drafter config draft_vocab_size {out['draft_vocab_size']} differs from the vocabulary "
                              f"({out['vocab_size']}); a DFlash2 selector scores target ids (speculators requires "
                              "a full vocabulary too)")
    ids = cfg.get("aux_hidden_state_layer_ids")
    if not ids:
        raise ConfigError("the speculators dflash config has no aux_hidden_state_layer_ids; it cannot say which taps "
                          "it reads")
    return _dflash_checked(out), rope, ids, "vllm"


def _deepspec(cfg: dict) -> tuple[dict, dict, list | None, str]:
    """DeepSpec's ``Qwen3DSparkModel`` folder: the target's Qwen3 config with the draft layers' count and DSpark's
    keys. Tap ids (``target_layer_ids``) name layer outputs (``hidden_states[id + 1]``, -1: the embedding output).
    Every block row drafts (row ``i`` predicts ``P + i + 1``), so ``K <= block_size``."""
    _refuse_unknown(cfg, _DEEPSPEC_TOP | _LAYER_READ, "")
    needed = ["block_size", "mask_token_id", "target_layer_ids", "enable_confidence_head", "markov_rank"]
    if cfg.get("markov_rank"):
        needed.append("markov_head_type")
    if cfg.get("enable_confidence_head"):
        needed.append("confidence_head_with_markov")
    missing = [key for key in needed if cfg.get(key) is None]
    if missing:
        raise ConfigError(f"the DeepSpec DSpark config lacks {', '.join(missing)}, which its {DEEPSPEC_DSPARK} "
                          "requires; this folder was not written by DeepSpec's save_pretrained")
    out, rope = _dflash_layers(cfg, "")
    # num_anchors: how many blocks a training sample draws (DeepSpec's sampler), nothing at inference.
    out.update(block_size=cfg["block_size"], mask_token_id=cfg["mask_token_id"], input_embedding_scale=1.0,
               output_multiplier=1.0, final_logit_softcapping=0.0, draft_vocab_size=out["vocab_size"],
               target_hidden_size=out["hidden_size"], num_target_layers=cfg.get("num_target_layers"),
               family="dspark", confidence_rule="each")  # DeepSpec's evaluator trims at the first low confidence
    kind = cfg.get("markov_head_type", "vanilla")
    heads = {**cfg, "markov_head_type": kind.lower() if isinstance(kind, str) else kind, "sample_from_anchor": True}
    if not _flag(cfg, "enable_confidence_head", False):
        heads["confidence_head_with_markov"] = False  # DeepSpec reads it only beside a confidence head
    out.update(_dspark_heads(heads))
    return _dflash_checked(out), rope, cfg["target_layer_ids"], "sglang"


def _dflash_stored(cfg: dict) -> tuple[dict, dict, list | None, str]:
    """What ``ppsplit compile --drafter`` wrote into a folder: the flat config, taps resolved (ppsplit numbering)."""
    _refuse_unknown(cfg, {*_PPSPLIT_TOP, *DFLASH_KEYS}, "")
    missing = [k for k in _DFLASH_STORED_NEEDS if k not in cfg]
    if missing:
        raise ConfigError(f"the stored DFlash drafter config lacks {', '.join(missing)}; compile the folder again "
                          "with ppsplit compile --drafter")
    out = {k: v for k, v in cfg.items() if k not in ("rope", "ppsplit_taps", "ppsplit_family")}
    if out.get("sliding_window"):
        raise ConfigError(f"the stored DFlash drafter config has sliding_window = {out['sliding_window']}; DFlash "
                          "drafters run with full attention only: compile the folder again")
    out.update(num_target_layers=out.get("num_target_layers"), sliding_window=0, family="dflash",
               sample_from_anchor=False)
    return _dflash_checked(out), dict(cfg.get("rope") or {}), list(cfg["ppsplit_taps"]), "vllm"


def _dflash2_fields(value, out: dict) -> dict:
    """DFlash2's convolution and selector sizes, checked (``value(key)``: the config's reading order)."""
    got = {key: value(key) for key in _DFLASH2_KEYS}
    for key, v in got.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"DFlash2 drafter config {key} must be an integer >= 1, but got {v!r}")
    if out["hidden_size"] % got["conv_group_size"]:
        raise ConfigError(f"drafter config conv_group_size {got['conv_group_size']} does not divide hidden_size "
                          f"{out['hidden_size']}")
    if got["selector_top_k"] > out["vocab_size"]:
        raise ConfigError(f"drafter config selector_top_k {got['selector_top_k']} exceeds the vocabulary "
                          f"({out['vocab_size']})")
    return got


def _dspark_heads(cfg: dict) -> dict:
    """DSpark's heads, with speculators' defaults (``DSparkSpeculatorConfig``)."""
    rank = cfg.get("markov_rank", 256)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ConfigError(f"drafter config markov_rank must be an integer >= 0 (0: no Markov head), but got {rank!r}")
    kind = cfg.get("markov_head_type", "vanilla")
    if kind not in _MARKOV_HEADS:
        raise ConfigError(f"drafter config markov_head_type {kind!r} is not one of {', '.join(_MARKOV_HEADS)}")
    confidence = _flag(cfg, "enable_confidence_head", True)
    with_markov = confidence and _flag(cfg, "confidence_head_with_markov", True)
    if with_markov and not rank:
        raise ConfigError("drafter config confidence_head_with_markov is true but markov_rank is 0 (no Markov "
                          "embedding to feed it); set confidence_head_with_markov false")
    return dict(sample_from_anchor=_flag(cfg, "sample_from_anchor", True), markov_rank=rank, markov_head_type=kind,
                confidence_head=confidence, confidence_with_markov=with_markov)


def _dflash_layers(layer: dict, where: str) -> tuple[dict, dict]:
    """The draft layers' Qwen3 fields: as EAGLE-3's one layer, but any number of them and full attention only."""
    types = layer.get("layer_types")
    if types is not None and (not isinstance(types, list) or any(t != "full_attention" for t in types)):
        raise ConfigError(f"drafter config {where}layer_types {types!r} has sliding-window layers; ppsplit runs "
                          "DFlash drafters with full attention only")
    if types is None and layer.get("use_sliding_window"):
        raise ConfigError(f"drafter config {where}use_sliding_window is true; ppsplit runs DFlash drafters with full "
                          "attention only")
    if layer.get("model_type", "qwen3") != "qwen3":
        raise ConfigError(f"drafter config {where}model_type {layer.get('model_type')!r}: DFlash draft layers are "
                          "Qwen3 layers (q_norm / k_norm)")
    layers = layer.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise ConfigError(f"drafter config {where}num_hidden_layers must be the number of draft layers (>= 1), but "
                          f"got {layers!r}")
    flat = {k: v for k, v in layer.items() if k not in ("layer_types", "num_hidden_layers")}
    out, rope = _layer({**flat, "model_type": "qwen3", "num_hidden_layers": 1}, where)
    out.update(num_hidden_layers=layers, sliding_window=0)
    if out["intermediate_size"] is None:
        raise ConfigError(f"the drafter config needs {where}intermediate_size (the draft layers' MLP width)")
    return out, rope


def _dflash_checked(out: dict) -> dict:
    block, mask = out["block_size"], out["mask_token_id"]
    if not isinstance(block, int) or isinstance(block, bool) or block < 2:
        raise ConfigError(f"drafter config block_size must be an integer >= 2 (the bonus token and at least one "
                          f"draft), but got {block!r}")
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < (out["vocab_size"] or mask + 1):
        raise ConfigError(f"drafter config mask_token_id must be a token id of the target's vocabulary, but got "
                          f"{mask!r}")
    if out["final_logit_softcapping"] < 0:
        raise ConfigError("drafter config final_logit_softcapping must be >= 0 (0: none)")
    return out
