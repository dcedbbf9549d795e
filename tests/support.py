"""Shared test support: tiny decoders with random weights (no downloads), random EAGLE-3 drafters in the
published layouts, Hugging Face references, and traced models shared between test modules."""
from __future__ import annotations

import json
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import ppsplit
from ppsplit import CacheConfig
from ppsplit.core.layers import find_layers

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
    return random_model(tiny_config(arch, num_layers, **overrides), seed)


def random_model(config, seed: int = 0) -> torch.nn.Module:
    """The causal LM of ``config`` (or of ``{"model_type": ..., **fields}``) with seeded random weights."""
    if isinstance(config, dict):
        fields = dict(config)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Random init leaves some weights at exactly 0 or 1 (norms, biases); perturb them so that every
    # parameter matters and a wrong or missing weight changes the numbers.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


# ---- EAGLE-3 drafters written to disk

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


# ---- references and stage runs

L = NUM_LAYERS


def run_stages(split, input_ids, positions):
    """Run the stages by hand on a NaN-poisoned aux buffer; return logits, aux and each stage's input."""
    batch, tokens = input_ids.shape
    aux = split.new_aux(batch, tokens).fill_(float("nan"))
    x, inputs = input_ids, []
    for k, stage in enumerate(split.stages):
        inputs.append(x)
        x, aux_out = stage(x, positions, aux)
        assert aux_out is aux  # written in place
        filled = split.plan.filled(k)
        assert not aux[:filled].isnan().any(), f"stage {k} left a slot of aux[:{filled}] unwritten"
        assert aux[filled:].isnan().all(), f"stage {k} wrote past its prefix aux[:{filled}]"
    return x, aux, inputs


def reference(model, input_ids, positions=None):
    kwargs = {} if positions is None else {"position_ids": positions[None]}
    with torch.no_grad():
        out = model(input_ids, output_hidden_states=True, **kwargs)
    # hidden_states[j] enters layer j for j < L; tap L is the last layer's output, before the final norm,
    # which HF does not return: capture it from the last decoder layer.
    return out.logits, list(out.hidden_states[:L])


def last_layer_output(model, input_ids, positions=None):
    stack = find_layers(model)
    captured = {}

    def hook(module, args, output):
        captured["h"] = output[0] if isinstance(output, tuple) else output

    handle = model.get_submodule(stack.fqn)[-1].register_forward_hook(hook)
    kwargs = {} if positions is None else {"position_ids": positions[None]}
    try:
        with torch.no_grad():
            model(input_ids, **kwargs)
    finally:
        handle.remove()
    return captured["h"]


_TRACED: dict = {}


def traced_with_cache(arch: str, cache: CacheConfig):
    """(tiny model, its trace with ``cache``) per architecture and cache, traced once per test session."""
    if (arch, cache) not in _TRACED:
        model = tiny_model(arch)
        _TRACED[(arch, cache)] = (model, ppsplit.trace_model(model, cache=cache))
    return _TRACED[(arch, cache)]


def decode(split, ids, new: int) -> torch.Tensor:
    """Greedy decoding of ``ids [B, T]`` through ``split``: the engine (``split.generate``) when the split pages its
    cache. A split that keeps a lockstep cache runs ``forward`` only (generation refuses it, as checked here), so the
    test drives that cache with forward steps itself, padding a sequence after its end-of-sequence token as Hugging
    Face's ``generate`` does."""
    import pytest

    if split.plan.paged:
        return split.generate(ids, new)
    with pytest.raises(ppsplit.ConfigError, match="keeps a lockstep one because"):
        split.generate(ids, new)
    batch, prompt = ids.shape
    eos = torch.tensor(split.eos_token_id, dtype=torch.long)
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


def hf_greedy(model, ids, new: int):
    """Hugging Face's greedy continuation of ``ids`` (the decoding oracle)."""
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False)


def decode_through_rejected_drafts(split, ids, greedy):
    """The tokens a cached split decodes after ``ids`` through verify passes that reject drafts, to compare with
    ``greedy`` (Hugging Face's continuation, at least 9 tokens): prefill, a verify pass of [committed token, right
    draft, two wrong drafts] (the wrong ones overwrite keys and update recurrent states), one-token steps from the
    first wrong position, a verify pass that rejects all its three drafts, then one-token steps again. Each step must
    start from the cache after the accepted tokens only. Asserts the rejections took place."""
    n = ids.shape[1]
    split.reset_cache()
    with torch.no_grad():
        vocab = split(ids, torch.arange(n))[0].shape[-1]
        wrong = (greedy[:, 2:4] + 1) % vocab
        logits, _ = split(torch.cat([greedy[:, :2], wrong], dim=1), torch.arange(n, n + 4))
        picked = logits.argmax(-1)
        assert torch.equal(picked[:, :2], greedy[:, 1:3])  # the right draft is accepted, the next is greedy[2]
        assert not torch.equal(picked[:, 2:], greedy[:, 3:5])  # what follows a wrong draft differs
        tokens, token = [greedy[:, :2], picked[:, 1:2]], picked[:, 1:2]
        for position in range(n + 2, n + 5):
            logits, _ = split(token, torch.tensor([position]))
            token = logits[:, -1:].argmax(-1)
            tokens.append(token)
        drafts = (greedy[:, 6:9] + 7) % vocab  # all wrong: only the committed token counts
        logits, _ = split(torch.cat([token, drafts], dim=1), torch.arange(n + 5, n + 9))
        token = logits[:, :1].argmax(-1)
        tokens.append(token)
        for position in range(n + 6, n + 9):
            logits, _ = split(token, torch.tensor([position]))
            token = logits[:, -1:].argmax(-1)
            tokens.append(token)
    return torch.cat(tokens, dim=1)


def assert_decode_steps_equal(changed, plain, graphed, what: str = "") -> None:
    """A prefill of 30 tokens, then eight decode steps of one sequence (each reading the keys and values the ones
    before wrote), through three paged splits of one model on CUDA: ``changed`` (eager) and ``graphed`` (its captured
    twin) give ``plain``'s logits and taps bit for bit at every step."""
    from ppsplit.core.ragged import RaggedStep, Segment

    tables = {0: [3, 0, 5]}
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (40,), device="cuda")
    for position, count in [(0, 30)] + [(30 + i, 1) for i in range(8)]:
        step = RaggedStep.build([Segment(0, position, count)], tables, plain.layout).to("cuda")
        tokens = ids[position:position + count]
        with torch.no_grad():
            (a, a_aux), (b, b_aux), (c, c_aux) = (s.step(tokens, step) for s in (changed, plain, graphed))
        assert torch.equal(a, b) and torch.equal(a_aux, b_aux), f"{what}eager, position {position}"
        assert torch.equal(c, b) and torch.equal(c_aux, b_aux), f"{what}captured, position {position}"


def first_drafts(split, drafter, prompt, k: int) -> list[int]:
    """The ``k`` drafts the engine's draft loop proposes after ``prompt``'s step: the chain drafted from its last row
    (its taps, and the target's greedy next token), which the first verify window holds."""
    from ppsplit.serve.engine import Engine
    from ppsplit.serve.sampling import SamplingParams

    out = Engine(split, drafter=drafter, num_draft_tokens=k).generate(
        [prompt], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    return out.drafts[0]


def bigram_markov(model):
    """A Markov head that knows the target: its bias (rank = vocabulary) favours the token that most often follows
    the previous one in the target's greedy continuations of 32 random prompts."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        seqs = model.generate(torch.randint(6, vocab, (32, 4), generator=torch.Generator().manual_seed(0)),
                              max_new_tokens=24, do_sample=False)
    counts = torch.zeros(vocab, vocab).index_put_((seqs[:, :-1].flatten(), seqs[:, 1:].flatten()),
                                                  torch.ones(seqs[:, 1:].numel()), accumulate=True)

    def prepare(lib):
        with torch.no_grad():
            lib.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
            lib.markov_head.markov_w2.weight.copy_(20.0 * torch.nn.functional.one_hot(counts.argmax(1), vocab).T)
    return prepare
