"""Which decoder architectures ppsplit splits, decodes and compiles, checked against Hugging Face (CPU, tiny models).

    python bench/arch_survey.py                        # every causal LM type the installed transformers maps
    python bench/arch_survey.py falcon bloom gemma4_text -j 2 --timeout 120 --markdown survey.md
    python bench/arch_survey.py --zoo                  # the 34 hand-tuned architectures of bench/RESULTS.md section 2
    python bench/arch_survey.py --checks build,engine  # only these checks (the others are reported as "-")

Model types come from ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``. Encoder-decoder configs and multimodal wrappers (a
vision / audio sub-config, or an assistant that reads another model's hidden states) are skipped and listed with
the reason. Each remaining type gets a tiny random fp32 model built from its config class: every size field the
config has (hidden, layers, heads, KV heads, head_dim, FFN, vocab, experts, LoRA ranks, state sizes, per-layer
lists, ...) is shrunk generically, with a small override table (``OVERRIDES``) where that alone is not valid.
Then, each check independent of the others:

  build    the tiny model (hidden 64, 4 layers, vocab 128) with weights perturbed by randn * 0.02
  split    split_model(model, pp, aux=[1, 2, L-1]) for pp 2 and 3: logits and taps equal model(ids,
           output_hidden_states=True, position_ids=0..T-1) (max abs error < 1e-4)
  decode   split_model(model, 2, cache=CacheConfig(2, 64))'s greedy tokens (generate; forward steps for a lockstep
           cache, which generate refuses) equal model.generate(ids, max_new_tokens=16, do_sample=False)
  engine   the decode check's split served by the engine: "paged" when its cache is paged and Engine(split)
           .generate of the two prompts as requests gives Hugging Face's greedy tokens (to its end-of-sequence);
           "lockstep" when the split keeps a lockstep cache (which the engine refuses), with the plan's reason
  compile  save_pretrained, ppsplit.compile_model(ckpt, out, pp=2, cache=CacheConfig(2, 64)), ppsplit.load(out)
           and its greedy tokens (as decode takes them) equal to Hugging Face's

Each model type runs in a forked child with a timeout, so a hang or crash in one cannot stop the survey.

``--cuda-rewrites``: the split and decode checks split with ``fuse_projections=True, fuse_pointwise=True``, the stage
rewrites a CUDA split applies by default, here on the CPU: their matchers meet every architecture's graph (the
pointwise ops take their ATen path on the CPU).
"""
from __future__ import annotations

import argparse
import inspect
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time
import traceback
import warnings

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import ppsplit
import ppsplit.compile.api  # noqa: F401  imported before forking so that each child does not pay for it
import ppsplit.artifact.loader  # noqa: F401
import ppsplit.compile.writer  # noqa: F401
from ppsplit.core.tensors import stream_rows
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams

warnings.filterwarnings("ignore")
L, H, V = 4, 64, 128
TOL = 1e-4
NEW_TOKENS = 16
CHECKS = ("build", "split", "decode", "engine", "compile")
SELECTED = set(CHECKS)  # --checks: the ones that run

# Generic shrinking: every field of these names that the config has (and that is set) gets this value.
_SIZES = [
    (("hidden_size", "n_embd", "d_model", "embed_dim", "model_dim", "embedding_size", "word_embed_proj_dim"), H),
    (("num_hidden_layers", "n_layer", "num_layers", "n_layers"), L),
    (("num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads", "decoder_attention_heads",
      "mamba_n_heads", "mamba_num_heads", "linear_num_value_heads", "index_n_heads"), 4),
    (("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "kv_n_heads",
      "linear_num_key_heads"), 2),
    (("head_dim", "attention_head_dim", "kv_channels", "d_head", "head_size", "mamba_d_head", "mamba_head_dim",
      "linear_key_head_dim", "linear_value_head_dim", "index_head_dim", "v_head_dim", "attention_head_size"), 16),
    (("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff", "mlp_dim", "intermediate_dim",
      "decoder_ffn_dim", "ff_intermediate_size", "dense_intermediate_size", "block_ff_dim"), 128),
    (("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size", "moe_ffn_hidden_size",
      "moe_shared_expert_intermediate_size", "intermediate_size_mlp", "expert_dim"), 64),
    (("vocab_size", "vocab_size_per_layer_input"), V),
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts", "n_experts"),
     4),
    (("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "n_activated_experts",
      "num_selected_experts"), 2),
    (("n_group", "topk_group", "n_groups", "mamba_n_groups", "linear_n_groups"), 1),
    (("kv_lora_rank", "q_lora_rank", "laurel_rank"), 16),
    (("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim", "time_step_rank"), 8),
    (("state_size", "mamba_d_state", "ssm_state_size", "hidden_size_per_layer_input"), 16),
    (("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "max_sequence_length"), 256),
    (("sliding_window", "attention_window", "window_size"), 4),
    (("first_k_dense_replace",), 1),
]
_SHRINK = {name: value for names, value in _SIZES for name in names}
_POSITIVE_ONLY = {"n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
                  "num_kv_shared_layers": 2}
_DROP = {"architectures", "transformers_version", "model_type", "_name_or_path", "dtype", "torch_dtype",
         "auto_map", "quantization_config"}
_MULTIMODAL = {"vision_config", "audio_config", "vq_config", "audio_encoder_config", "audio_encoder", "text_encoder",
               "vision_encoder", "speech_config"}
_INDEX_LIST = re.compile(r"(_layers|_indices|_idxs|_layer_ids)$")

# Model types that are not decoder-only text LMs, beyond what the generic rules detect.
SKIP = {
    "gemma4_assistant": "drafter: reads the target model's hidden states",
    "gemma4_unified_assistant": "drafter: reads the target model's hidden states",
    "fuyu": "multimodal wrapper: image patches through its causal LM (text part is persimmon)",
}

# Per-architecture overrides where the generic rule cannot make a valid config.
OVERRIDES = {
    "mamba2": dict(num_heads=8, head_dim=16),  # num_heads * head_dim = expand * hidden
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "falcon": dict(new_decoder_architecture=False, multi_query=True),
    "dots3_note_text": dict(head_dim=16),
    "falcon_h1": dict(mamba_d_ssm=128),  # mamba_d_ssm = mamba_n_heads * mamba_d_head
    "bamba": dict(attn_layer_indices=[1]),  # default: no attention layer at all, which its generate cannot cache
    "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"] * 2),  # shared-KV layers need both kinds
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"] * 2),  # default: all Mamba
    "zaya": dict(num_experts_per_tok=1),  # its config validator: top-1 routing only
    "xlstm": dict(qk_dim_factor=1.0),  # HF's chunkwise mLSTM kernel fails for a key dim below the value dim here
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),  # default None experts  # its sliding layers' head_dim is qk_nope + qk_rope
    # n_input + n_recurrent + n_output = layers; its released layer_types list attention and MLP blocks apart
    "dory": dict(layer_types=["sliding_attention", "full_attention"] * 2, n_input_layers=1, n_recurrent_layers=2,
                 n_output_layers=1),
    "reformer": dict(is_decoder=True, axial_pos_shape=[16, 16], axial_pos_embds_dim=[16, 48]),  # shape product = positions
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),  # sub-configs take no shrunk defaults
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    "longcat_flash": dict(expert_ffn_hidden_size=32, zero_expert_num=2, head_dim=8),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=4),  # its indexer has no defaults
    "inkling2_text": dict(unpadded_vocab_size=V),
    "inkling2_loop_text": dict(unpadded_vocab_size=V),
}

# The 34 hand-tuned configs of bench/RESULTS.md section 2 (``--zoo``), unchanged.
ZOO_BASE = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ZOO = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": dict(head_dim=16), "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=4), "gemma3_text": dict(head_dim=16, sliding_window=4),
    "phi3": {}, "phi": {}, "gpt2": dict(n_embd=H, n_layer=L, n_head=4, n_positions=256),
    "gpt_neox": {}, "opt": dict(ffn_dim=128, word_embed_proj_dim=H), "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "falcon": dict(new_decoder_architecture=False, multi_query=True), "bloom": dict(n_layer=L, n_head=4),
    "gpt_bigcode": dict(n_embd=H, n_layer=L, n_head=4, n_positions=256), "gptj": dict(n_embd=H, n_layer=L, n_head=4, rotary_dim=8, n_positions=256),
    "codegen": dict(n_embd=H, n_layer=L, n_head=4, rotary_dim=8, n_positions=256, n_ctx=256),
    "starcoder2": {}, "stablelm": {}, "olmo": {}, "olmo2": {}, "cohere": {}, "cohere2": dict(sliding_window=4),
    "granite": {}, "smollm3": {}, "biogpt": {}, "xglm": dict(d_model=H, ffn_dim=128, num_layers=L, attention_heads=4),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
                        n_group=1, topk_group=1, num_key_value_heads=4),
    "nemotron": dict(head_dim=16), "glm": dict(head_dim=16), "helium": dict(head_dim=16), "exaone4": dict(sliding_window=4),
}


# Hugging Face's Mamba models record each layer's output in output_hidden_states (no embedding entry): their
# index j is ppsplit's tap j + 1.
TAP_SHIFT = {"mamba": 1, "mamba2": 1, "falcon_mamba": 1, "rwkv": 1}
# Model types whose own batched generate is not the model's greedy continuation: compared with the uncached forward,
# token by token. RWKV: its stateful one-token step broadcasts the kept [B, C] token shift against the [B, 1, C]
# token (modeling_rwkv.py, extract_key_value), mixing the rows of a batch; batch 1 is right.
UNCACHED_ORACLE = {"rwkv"}

def skip_reason(model_type: str) -> str | None:
    """Why ``model_type`` is not surveyed (None: it is)."""
    if model_type in SKIP:
        return SKIP[model_type]
    cls = CONFIG_MAPPING[model_type]
    multimodal = sorted(set(getattr(cls, "sub_configs", None) or {}) & _MULTIMODAL)
    if multimodal:
        return f"multimodal wrapper ({MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}: {', '.join(multimodal)})"
    try:
        if cls().is_encoder_decoder:
            return f"encoder-decoder (its {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]} is the cross-attending decoder)"
    except Exception:  # a config that cannot be built with defaults is reported by the build check
        pass
    return None


def _fit_list(values, old_layers: int):
    """A per-layer list (or pattern string) of ``old_layers`` entries cut to ``L``, keeping every kind it had."""
    out = list(values[:L])
    missing = [kind for kind in dict.fromkeys(values) if kind not in out]
    for i, kind in enumerate(missing[:L - 1]):  # a trimmed hybrid pattern keeps its rarer layer kinds at the end
        out[L - 1 - i] = kind
    return "".join(out) if isinstance(values, str) else out


def shrink(defaults: dict) -> dict:
    """Overrides that make a config with these default fields tiny (recursing into nested sub-config dicts)."""
    old_layers = next((defaults[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
                       if isinstance(defaults.get(k), int)), None)
    kw = {}
    for key, value in defaults.items():
        if key in _DROP:
            continue
        if key in _SHRINK and isinstance(value, int) and not isinstance(value, bool):
            kw[key] = _SHRINK[key]
        elif key in _POSITIVE_ONLY and isinstance(value, int) and value > 0:
            kw[key] = _POSITIVE_ONLY[key]
        elif key.endswith("lora_rank") and isinstance(value, int) and value > 0:
            kw[key] = 16
        elif isinstance(value, dict) and "model_type" in value or key.endswith("_config") and isinstance(value, dict):
            kw[key] = shrink(value)  # only the overrides: the sub-config class fills in the rest
        elif old_layers and (isinstance(value, list) or isinstance(value, str) and "pattern" in key) \
                and len(value) == old_layers > L:
            kw[key] = _fit_list(value, old_layers)
        elif isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value) \
                and _INDEX_LIST.search(key) and max(value) >= L:
            kw[key] = [v for v in value if v < L] or [L - 1]
    if "head_dim" in defaults and defaults["head_dim"] is None and "num_attention_heads" in kw:
        kw["head_dim"] = H // kw["num_attention_heads"]  # what most configs derive from None; some do not (hunyuan)
    if "kv_lora_rank" in kw:  # MLA: one latent KV per query head; head_dim is derived from the rope/nope parts
        kw.pop("head_dim", None)
        if "num_key_value_heads" in kw:
            kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    if "num_experts_per_tok" in defaults and defaults["num_experts_per_tok"] is None and "n_routed_experts" in kw:
        kw["num_experts_per_tok"] = 2
    for heads, dim, expand in (("mamba_n_heads", "mamba_d_head", "mamba_expand"),):  # heads * dim = expand * hidden
        if heads in kw and dim in kw and isinstance(defaults.get(expand), int):
            kw[heads] = defaults[expand] * H // kw[dim]
    if "type_vocab_size" in defaults and "is_decoder" in defaults:  # BERT-family encoders as causal decoders
        kw["is_decoder"] = True
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # inside the tiny vocab, where the config sets one
        if isinstance(defaults.get(key), int):
            kw[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[key]
    return kw


def tiny_config(model_type: str, zoo: bool = False):
    if zoo:
        return AutoConfig.for_model(model_type, **{**ZOO_BASE, **ZOO[model_type]})
    cls = CONFIG_MAPPING[model_type]
    kw = shrink(cls().to_dict())
    kw.update(OVERRIDES.get(model_type, {}))
    return cls(**kw)


def tiny_model(model_type: str, zoo: bool = False):
    torch.manual_seed(0)
    cfg = tiny_config(model_type, zoo)
    with torch.device("meta"):  # refuse a config the rules did not shrink before allocating gigabytes
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    if params > 20_000_000:
        raise RuntimeError(f"config not shrunk: {params / 1e6:.0f}M parameters")
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # random init leaves norms and biases at 0 or 1: make every weight matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def reason(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    line = lines[0] if lines else ""
    if line.endswith(":") and len(lines) > 1:  # "validation error for ...:" says what only on its next line
        line = f"{line} {lines[1]}"
    return f"{type(e).__name__}: {line}"[:200]


def positions_of(model, ids) -> dict:
    """``position_ids`` 0..T-1, as ``split(ids)`` and Hugging Face's generate give them, where the forward takes them.
    Without them the RoBERTa family numbers its positions from ``padding_idx + 1``, unlike its own generate."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return {}
    return {"position_ids": torch.arange(ids.shape[1]).expand(ids.shape[0], -1)}


STAGE_OPTIONS: dict = {}  # --cuda-rewrites: the stage rewrites of split_model's split and decode checks


def _run_checks(model_type: str, zoo: bool, send):
    """The checks; ``send(check, status)`` after each, so a timeout later keeps what is known."""
    torch.manual_seed(1)
    ids = torch.randint(3, V, (2, 9))
    try:  # a config the shrinking rules made invalid fails here, in Hugging Face's own forward
        model = tiny_model(model_type, zoo)
        with torch.no_grad():
            ref = model(ids, output_hidden_states=True, **positions_of(model, ids))
    except Exception as e:
        send("build", reason(e))
        for check in CHECKS[1:]:
            send(check, "-")
        return
    send("build", "ok")
    if "split" in SELECTED:
        _split_check(model, model_type, ids, ref, send)
    else:
        send("split", "-")
    _generation_checks(model, model_type, ids, send)


def _generation_checks(model, model_type: str, ids, send):
    """decode, engine and compile, each against Hugging Face's greedy tokens."""
    skipped = [c for c in CHECKS[2:] if c not in SELECTED]
    for check in skipped:
        send(check, "-")
    if len(skipped) == 3:
        return
    try:
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            if model_type in UNCACHED_ORACLE:
                expected = ids
                for _ in range(NEW_TOKENS):
                    expected = torch.cat([expected, model(expected).logits[:, -1:].argmax(-1)], dim=1)
    except Exception as e:
        for check in CHECKS[2:]:
            if check not in skipped:
                send(check, f"HF generate: {reason(e)}" if check == "decode" else "- (no HF generate to compare)")
        return

    def compare(got):
        if got.shape != expected.shape:
            return f"mismatch: shape {tuple(got.shape)} != HF {tuple(expected.shape)}"
        if torch.equal(got, expected):
            return "ok"
        return f"mismatch at token {int((got != expected).any(0).nonzero()[0]) - ids.shape[1]}"

    if SELECTED & {"decode", "engine"}:
        try:
            cached = ppsplit.split_model(model, 2, cache=ppsplit.CacheConfig(2, 64), **STAGE_OPTIONS)
        except Exception as e:
            cached = None
            for check in ("decode", "engine"):
                if check in SELECTED:
                    send(check, reason(e) if check == "decode" or "decode" not in SELECTED else "-")
        if cached is not None and "decode" in SELECTED:
            try:
                send("decode", compare(greedy(cached, ids, NEW_TOKENS)))
            except Exception as e:
                send("decode", reason(e))
        if cached is not None and "engine" in SELECTED:
            send("engine", _engine_check(cached, model, ids, expected))
    if "compile" in SELECTED:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(os.path.join(tmp, "ckpt"))
                folder = ppsplit.compile_model(os.path.join(tmp, "ckpt"), os.path.join(tmp, "pp2"), pp=2,
                                               cache=ppsplit.CacheConfig(2, 64))
                send("compile", compare(greedy(ppsplit.load(folder), ids, NEW_TOKENS)))
        except Exception as e:
            send("compile", reason(e))


def greedy(split, ids, new: int) -> torch.Tensor:
    """Greedy tokens after ``ids [B, T]``: ``split.generate`` (the engine) for a paged cache; a lockstep cache, which
    generation refuses, through forward steps, a row padded after its end-of-sequence as Hugging Face's generate
    pads it (the engine check says which of the two a split takes)."""
    if split.plan.paged:
        return split.generate(ids, new)
    batch, prompt = ids.shape
    eos = torch.tensor(split.eos_token_id or [], dtype=torch.long)
    pad = split.pad_token_id if split.pad_token_id is not None else (split.eos_token_id or (0,))[0]
    out, done = [ids], torch.zeros(batch, dtype=torch.bool)
    with torch.no_grad():
        logits, _ = split(ids, torch.arange(prompt))
        for step in range(new):
            token = torch.where(done, pad, logits[:, -1].argmax(-1))
            done |= torch.isin(token, eos)
            out.append(token[:, None])
            if bool(done.all()) or step == new - 1:
                break
            logits, _ = split(token[:, None], torch.tensor([prompt + step]))
    return torch.cat(out, dim=1)


def _engine_check(split, model, ids, expected) -> str:
    """``paged`` when the engine serves ``split`` and each prompt's tokens equal Hugging Face's up to its
    end-of-sequence; ``lockstep: <why>`` when the split keeps a lockstep cache."""
    if not split.plan.paged:
        return f"lockstep: {split.plan.lockstep_reason}"
    try:
        outs = Engine(split).generate([row.tolist() for row in ids],
                                      SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    except Exception as e:
        return reason(e)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    for row, out in enumerate(outs):
        want = expected[row, ids.shape[1]:].tolist()
        end = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
        if out.token_ids[:end] != want[:end]:
            return f"mismatch: request {row} differs at token {next(i for i in range(end) if out.token_ids[i] != want[i])}"
    return "paged"


def _split_check(model, model_type: str, ids, ref, send):
    try:
        n = ppsplit.core.layers.find_layers(model).num_layers
        taps = [1, 2, n - 1]
        statuses = []
        for pp in (2, 3):
            try:
                split = ppsplit.split_model(model, pp, aux=taps, **STAGE_OPTIONS)
                with torch.no_grad():
                    logits, aux = split(ids)
                shift = TAP_SHIFT.get(model_type, 0)
                if shift and torch.equal(ref.hidden_states[0], model.get_input_embeddings()(ids)):
                    shift = 0  # this transformers counts the embeddings in hidden_states (Mamba-2 from 5.25)
                err = max((logits - ref.logits).abs().max().item(),  # a stream of several vectors, as aux holds it
                          *((aux[k] - stream_rows(split.plan, ref.hidden_states[t - shift])).abs().max().item()
                            for k, t in enumerate(taps)))
                statuses.append("ok" if err < TOL else f"pp={pp}: mismatch, max abs error {err:.1e}")
            except Exception as e:
                statuses.append(f"pp={pp}: {reason(e)}")
        bad = [s for s in statuses if s != "ok"]
        send("split", "ok" if not bad else bad[0] if len(bad) == 1 or bad[0][6:] != bad[1][6:] else
             "pp=2,3" + bad[0][4:])
    except Exception as e:
        send("split", reason(e))


def _child(model_type: str, zoo: bool, conn, verbose: bool):
    torch.set_num_threads(1)
    if not verbose:  # Hugging Face and torch warnings would drown the table
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    try:
        _run_checks(model_type, zoo, lambda check, status: conn.send((check, status)))
    except BaseException as e:
        if verbose:
            traceback.print_exc()
        conn.send(("error", reason(e)))
    conn.close()
    os._exit(0)  # skip interpreter teardown: exit handlers inherited through fork can hang a child


def survey(model_types, zoo, jobs, timeout, verbose, report):
    """Run each model type in its own forked child, ``jobs`` at a time; ``report(type, statuses, seconds)``."""
    ctx = mp.get_context("fork")
    pending, running = list(model_types), {}
    while pending or running:
        while pending and len(running) < jobs:
            model_type = pending.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(model_type, zoo, send, verbose), daemon=True)
            proc.start()
            send.close()
            running[model_type] = (proc, recv, {}, time.monotonic())
        time.sleep(0.05)
        for model_type, (proc, recv, statuses, start) in list(running.items()):
            eof = False
            try:
                while recv.poll():
                    check, status = recv.recv()
                    statuses[check] = status
            except (EOFError, OSError):  # the child exited (or died) and everything it sent has been read
                eof = True
            elapsed = time.monotonic() - start
            done = eof or all(c in statuses for c in CHECKS)
            if not done and elapsed < timeout:
                continue
            if done and proc.is_alive():
                proc.kill()
                proc.join()
            if proc.is_alive():
                proc.kill()
                proc.join()
                note = f"timeout after {timeout:.0f}s"
            else:
                proc.join()
                note = statuses.pop("error", None) or (f"child died (exit code {proc.exitcode})"
                                                       if proc.exitcode else "no result")
            missing = [check for check in CHECKS if check not in statuses]
            for check in missing:
                statuses[check] = note if check == missing[0] else "-"
            recv.close()
            del running[model_type]
            report(model_type, statuses, elapsed)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: all, or the zoo with --zoo)")
    parser.add_argument("--zoo", action="store_true", help="the 34 hand-tuned architectures of RESULTS.md section 2")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="parallel workers (default 1)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per model type (default 120)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown to FILE")
    parser.add_argument("-v", "--verbose", action="store_true", help="keep the children's output and tracebacks")
    parser.add_argument("--cuda-rewrites", action="store_true",
                        help="split with fuse_projections=True, fuse_pointwise=True (CUDA's default rewrites)")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated checks to run (default: all of {','.join(CHECKS)}; build always runs)")
    args = parser.parse_args()
    if args.cuda_rewrites:
        STAGE_OPTIONS.update(fuse_projections=True, fuse_pointwise=True)
    wanted = {c.strip() for c in args.checks.split(",") if c.strip()}
    if wanted - set(CHECKS):
        parser.error(f"unknown checks: {', '.join(sorted(wanted - set(CHECKS)))} (choose from {', '.join(CHECKS)})")
    SELECTED.clear()
    SELECTED.update(wanted | {"build"})

    skipped = {}
    if args.zoo:
        types = args.types or list(ZOO)
        unknown = [t for t in types if t not in ZOO]
    else:
        types = args.types or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        unknown = [t for t in types if t not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
        for t in [t for t in types if t not in unknown]:
            why = skip_reason(t)
            if why:
                skipped[t] = why
    if unknown:
        parser.error(f"not a causal LM model type{' of the zoo' if args.zoo else ''}: {', '.join(unknown)}")
    types = [t for t in types if t not in skipped]

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, ppsplit {ppsplit.__version__}; "
          f"{len(types)} model types, {len(skipped)} skipped; -j {args.jobs}, timeout {args.timeout:.0f}s", flush=True)
    print(f"{'model type':<26} {'build':<6} {'split':<6} {'decode':<7} {'engine':<9} {'compile':<8} time", flush=True)
    results = {}

    def report(model_type, statuses, seconds):
        results[model_type] = statuses
        mark = {k: cell(statuses[k]) for k in CHECKS}
        print(f"{model_type:<26} {mark['build']:<6} {mark['split']:<6} {mark['decode']:<7} {mark['engine']:<9} "
              f"{mark['compile']:<8} {seconds:.0f}s", flush=True)
        for check in CHECKS:
            if mark[check] in ("FAIL", "lockstep"):
                print(f"    {check}: {statuses[check]}", flush=True)

    start = time.monotonic()
    survey(types, args.zoo, max(1, args.jobs), args.timeout, args.verbose, report)
    counts = {k: sum(r[k] in ("ok", "paged") for r in results.values()) for k in CHECKS}
    lockstep = sum(r["engine"].startswith("lockstep") for r in results.values())
    if skipped:
        print(f"\nskipped ({len(skipped)}):")
        for t, why in skipped.items():
            print(f"    {t}: {why}")
    summary = (f"{len(types)} model types: {counts['build']} build, {counts['split']} split, {counts['decode']} decode, "
               f"{counts['engine']} served by the engine (paged), {lockstep} lockstep, {counts['compile']} compile")
    print(f"\n{summary}  ({time.monotonic() - start:.0f}s)", flush=True)
    if args.markdown:
        write_markdown(args.markdown, types, results, skipped, summary)


def cell(status: str) -> str:
    """A check's mark in the table: ok, paged or lockstep (the engine check), - (not run), FAIL."""
    if status in ("ok", "paged"):
        return status
    if status.startswith("lockstep"):
        return "lockstep"
    return "-" if status.startswith("-") else "FAIL"


def write_markdown(path, types, results, skipped, summary):
    rows = ["| model type | build | split pp 2, 3 | decode | engine | compile | reason |",
            "|---|---|---|---|---|---|---|"]
    for t in types:
        r = results[t]
        why = "; ".join(f"{k}: {r[k]}" for k in CHECKS if cell(r[k]) in ("FAIL", "lockstep")).replace("|", "\\|")
        rows.append(f"| {t} | " + " | ".join(cell(r[k]) for k in CHECKS) + f" | {why} |")
    text = [f"torch {torch.__version__}, transformers {transformers.__version__}", "", summary, "", *rows]
    if skipped:
        text += ["", f"Skipped ({len(skipped)}):", ""] + [f"- {t}: {why}" for t, why in skipped.items()]
    with open(path, "w") as f:
        f.write("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
