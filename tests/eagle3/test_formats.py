"""EAGLE-3 checkpoints as the libraries that make them ship: speculators (vLLM's format) and SpecForge, each variant
drafting exactly like a reference written from the published description, and (where the libraries install) like
the libraries' own forward passes, from folders their own save functions wrote; every config key read or refused."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

import ppsplit
from ppsplit import ConfigError
from tests.eagle3.test_eagle3 import traced
from tests.support import VOCAB, first_drafts, random_drafter_tensors, write_drafter

TAPS = [1, 2, 4]  # ppsplit (= vLLM, speculators) numbering; SpecForge writes [0, 1, 3]
K = 3


pytestmark = pytest.mark.usefixtures("one_thread")


# -- a reference written from the published description (no library) ---------------------------------------------
def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_chain(t, flags, feats, tokens, embed, k):
    """EAGLE-3 drafting recomputed over the whole sequence each step. ``t``: tensors (``midlayer.`` naming); ``flags``:
    heads, kv_heads, theta, input_norm, fc_norm, qk_norm, final_norm, feed_normed, window, norm_before_residual;
    ``feats``: the taps ``[n, taps x Ht]``, ascending; ``tokens [n]`` the token after each position. Returns the first
    step's logits ``[n, V_draft]`` and ``k`` target-vocab drafts from the last row."""
    nh, kvh = flags["heads"], flags["kv_heads"]
    hd = t["midlayer.self_attn.q_proj.weight"].shape[0] // nh
    if flags.get("input_norm"):
        feats = rms(feats, t["input_norm.weight"])
    if flags.get("fc_norm"):
        feats = torch.cat([rms(c, t[f"fc_norm.{i}.weight"]) for i, c in enumerate(feats.chunk(len(TAPS), -1))], -1)
    x = feats @ t["fc.weight"].T

    def layer(x, toks):
        n = x.shape[0]
        pos = torch.arange(n, dtype=torch.float32)
        inv = 1.0 / flags["theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)

        def rope(v):
            return v * ang.cos() + torch.cat([-v[..., hd // 2:], v[..., :hd // 2]], -1) * ang.sin()

        hn = rms(x, t["midlayer.hidden_norm.weight"])
        both = torch.cat([rms(embed[toks], t["midlayer.input_layernorm.weight"]), hn], -1)
        q = (both @ t["midlayer.self_attn.q_proj.weight"].T).view(n, nh, hd).transpose(0, 1)
        kk = (both @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kvh, hd).transpose(0, 1)
        vv = (both @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kvh, hd).transpose(0, 1)
        if flags.get("qk_norm"):
            q, kk = rms(q, t["midlayer.self_attn.q_norm.weight"]), rms(kk, t["midlayer.self_attn.k_norm.weight"])
        q, kk = rope(q), rope(kk).repeat_interleave(nh // kvh, 0)
        vv = vv.repeat_interleave(nh // kvh, 0)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (j <= i) & ((i - j < flags["window"]) if flags.get("window") else True)
        scores = (q @ kk.transpose(1, 2) / hd ** 0.5).masked_fill(~allowed, float("-inf"))
        attn = (scores.softmax(-1) @ vv).transpose(0, 1).reshape(n, nh * hd) @ t["midlayer.self_attn.o_proj.weight"].T
        mid = (hn if flags.get("norm_before_residual") else x) + attn
        m = rms(mid, t["midlayer.post_attention_layernorm.weight"])
        out = mid + (F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T)) \
            @ t["midlayer.mlp.down_proj.weight"].T
        normed = rms(out, t["norm.weight"])
        logits = (normed if flags.get("final_norm", True) else out) @ t["lm_head.weight"].T
        return logits, (normed if flags.get("feed_normed") else out)

    toks, first, ids = tokens.clone(), None, []
    for _ in range(k):
        logits, out = layer(x, toks)
        first = logits if first is None else first
        d = int(logits[-1].argmax())
        ids.append(d + int(t["d2t"][d]))
        x, toks = torch.cat([x, out[-1:]]), torch.cat([toks, torch.tensor([ids[-1]])])
    return first, ids


def target_features(model, ids, taps=TAPS):
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True)
    feats = torch.cat([hf.hidden_states[j][0] for j in taps], -1)
    tokens = torch.cat([ids[0, 1:], hf.logits[0, -1].argmax()[None]])  # taps of position i pair with token i + 1
    return feats, tokens


# -- fixtures in each format, written from the formats' descriptions ------------------------------------------------
def speculators_config(model, draft_vocab, layer_extra=None, **top):
    c = model.config
    layer = {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": 96, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": c.hidden_size // 4, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
             "hidden_act": "silu", "max_position_embeddings": 256, "vocab_size": c.vocab_size,
             "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}, "attention_bias": False,
             "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": 1, "initializer_range": 0.02}
    layer.update(layer_extra or {})
    cfg = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                        "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                  "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": None}},
           "transformer_layer_config": layer, "draft_vocab_size": draft_vocab, "norm_before_residual": False,
           "norm_before_fc": False, "fc_norm": False, "norm_output": False, "target_hidden_size": None,
           "eagle_aux_hidden_state_layer_ids": TAPS, "embed_requires_grad": False, "tie_word_embeddings": False,
           "dtype": "float32"}
    cfg.update(top)
    return cfg


def specforge_config(model, draft_vocab, **extra):
    c = model.config
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
           "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 256, "rope_theta": 5000.0,
           "vocab_size": c.vocab_size, "draft_vocab_size": draft_vocab, "tie_word_embeddings": False,
           "torch_dtype": "float32", "pretraining_tp": 1, "use_cache": True,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in TAPS], "use_aux_hidden_state": True}}
    cfg.update(extra)
    return cfg


def extra_tensors(t, flags, th, seed=7):
    g = torch.Generator().manual_seed(seed)
    hd = t["midlayer.self_attn.q_proj.weight"].shape[0] // flags["heads"]
    if flags.get("input_norm"):
        t["input_norm.weight"] = 1 + 0.2 * torch.randn(len(TAPS) * th, generator=g)
    if flags.get("fc_norm"):
        for i in range(len(TAPS)):
            t[f"fc_norm.{i}.weight"] = 1 + 0.2 * torch.randn(th, generator=g)
    if flags.get("qk_norm"):
        t["midlayer.self_attn.q_norm.weight"] = 1 + 0.2 * torch.randn(hd, generator=g)
        t["midlayer.self_attn.k_norm.weight"] = 1 + 0.2 * torch.randn(hd, generator=g)
    return t


# (format, top-level config, transformer_layer_config extras, reference flags)
VARIANTS = {
    "speculators": ("speculators", {}, {}, {}),
    "speculators-norm_output": ("speculators", {"norm_output": True}, {}, {"feed_normed": True}),
    "speculators-norm_before_fc": ("speculators", {"norm_before_fc": True}, {}, {"input_norm": True}),
    "speculators-fc_norm": ("speculators", {"fc_norm": True}, {}, {"fc_norm": True}),
    "speculators-norm_before_residual": ("speculators", {"norm_before_residual": True}, {},
                                         {"norm_before_residual": True}),
    "speculators-window": ("speculators", {}, {"sliding_window": 4, "layer_types": ["sliding_attention"]},
                           {"window": 4}),
    "speculators-window-off": ("speculators", {}, {"sliding_window": 4, "layer_types": ["full_attention"]}, {}),
    "speculators-qwen3": ("speculators", {}, {"model_type": "qwen3", "sliding_window": None, "max_window_layers": 1,
                                              "use_sliding_window": False, "layer_types": ["full_attention"]},
                          {"qk_norm": True}),
    "specforge": ("specforge", {}, {}, {}),
    "specforge-norm_output-false": ("specforge", {"norm_output": False}, {}, {"final_norm": False}),
    "specforge-fc_norm": ("specforge", {"fc_norm": True}, {}, {"fc_norm": True}),
    "specforge-norm_before_residual": ("specforge", {"norm_before_residual": True}, {}, {"norm_before_residual": True}),
}


def write_variant(tmp_path, model, name, embed_in_file=False, seed=1, bf16=False):
    fmt, top, layer, flags = VARIANTS[name]
    flags = dict(flags, heads=4, kv_heads=2, theta=5000.0)
    draft = VOCAB * 3 // 4
    cfg = speculators_config(model, draft, layer, **top) if fmt == "speculators" else \
        specforge_config(model, draft, **top, **layer)
    flat = {"hidden_size": model.config.hidden_size, "intermediate_size": 96, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": VOCAB, "draft_vocab_size": draft}
    t = extra_tensors(random_drafter_tensors(flat, seed=seed), flags, model.config.hidden_size)
    if embed_in_file:
        t["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    layout = "bin" if fmt == "speculators" else "safetensors"  # speculators' layers.0. naming; SpecForge's midlayer.
    if bf16:  # stored in bf16 (as trainers ship them); the reference reads the same rounded values
        t = {k: v.bfloat16() if v.is_floating_point() else v for k, v in t.items()}
        write_drafter(str(tmp_path / name), cfg, t, layout)
        return str(tmp_path / name), {k: v.float() if v.is_floating_point() else v for k, v in t.items()}, flags
    return write_drafter(str(tmp_path / name), cfg, t, layout), t, flags


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_drafts_like_the_reference(name, tmp_path):
    model, graph = traced("llama")
    torch.manual_seed(5)
    ids = torch.randint(3, VOCAB, (1, 9))
    feats, tokens = target_features(model, ids)
    embed = model.get_input_embeddings().weight.detach()
    for pp in (1, 3):
        split = ppsplit.split_model(graph, pp, aux=TAPS)
        folder, t, flags = write_variant(tmp_path / f"pp{pp}", model, name, embed_in_file=pp == 3, bf16=pp == 3)
        drafter = ppsplit.load_drafter(folder, split=split)  # the format's own numbering: no aux_convention
        assert drafter.taps == tuple(TAPS)
        ref_logits, ref_ids = reference_chain(t, flags, feats, tokens, t.get("embed_tokens.weight", embed), k=4)
        T = ids.shape[1]
        _, aux = split(ids, torch.arange(T))
        with torch.no_grad():
            logits, _ = drafter(aux, tokens[None], torch.arange(T))
        torch.testing.assert_close(logits[0], ref_logits, atol=5e-5, rtol=1e-4)
        assert first_drafts(split, drafter, ids[0], 4) == ref_ids, (name, pp)


def test_variants_change_the_drafts(tmp_path):
    """The test above has power: each flag, dropped, changes the reference's logits."""
    model, _ = traced("llama")
    torch.manual_seed(5)
    ids = torch.randint(3, VOCAB, (1, 9))
    feats, tokens = target_features(model, ids)
    embed = model.get_input_embeddings().weight.detach()
    for name in VARIANTS:
        _, t, flags = write_variant(tmp_path, model, name)
        base = {k: flags[k] for k in ("heads", "kv_heads", "theta")}
        if flags == base:
            continue
        with_flag, _ = reference_chain(t, flags, feats, tokens, embed, k=2)
        # the window binds only after 4 positions, the fed-back norm only from the second step
        without, _ = reference_chain(t, base, feats, tokens, embed, k=2)
        if "norm_output" in name and "false" not in name:
            continue  # changes later steps only: covered by the draft comparison
        assert (with_flag - without).abs().max() > 1e-3, name


# -- config keys: every key read, or inert with a reason, or refused naming it --------------------------------------
def test_config_keys_are_read_or_refused_by_name(tmp_path):
    model, graph = traced("llama")
    split = ppsplit.split_model(graph, 1, aux=TAPS)

    def load(name, fmt="speculators", top=None, layer=None, drop=(), t_extra=None):
        draft = VOCAB * 3 // 4
        cfg = speculators_config(model, draft) if fmt == "speculators" else specforge_config(model, draft)
        cfg.update(top or {})
        if layer:
            cfg["transformer_layer_config"].update(layer)
        for key in drop:
            cfg.pop(key)
        flat = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": VOCAB, "draft_vocab_size": draft}
        t = random_drafter_tensors(flat)
        t.update(t_extra or {})
        return ppsplit.load_drafter(write_drafter(str(tmp_path / name), cfg, t), split=split)

    load("ok")
    load("ok-specforge", "specforge")
    refusals = [
        (dict(top={"mystery_flag": True}), "drafter config key mystery_flag = True is not one ppsplit reads"),
        (dict(layer={"mystery": 1}), "key transformer_layer_config.mystery = 1 is not one ppsplit reads"),
        (dict(fmt="specforge", top={"mystery": "x"}), "drafter config key mystery = 'x'"),
        (dict(top={"speculators_model_type": "mlp_speculator"}), "speculators_model_type is 'mlp_speculator'"),
        (dict(top={"speculators_config": {"algorithm": "eagle3", "proposal_methods": [
            {"proposal_type": "greedy", "accept_tolerance": 0.5}]}}), "accept_tolerance 0"),
        (dict(layer={"num_hidden_layers": 2}), "num_hidden_layers is 2: ppsplit runs one-layer"),
        (dict(layer={"mlp_bias": True}), "mlp_bias is true"),
        (dict(layer={"model_type": "mistral"}), "model_type 'mistral' is not supported"),
        (dict(layer={"layer_types": ["sliding_attention"], "sliding_window": None}), "sliding_window is None"),
        (dict(top={"norm_before_fc": True, "fc_norm": True}), "exclude each other"),
        (dict(top={"norm_before_fc": True}), "config needs tensors the checkpoint lacks: input_norm.weight"),
        (dict(t_extra={"input_norm.weight": torch.ones(192)}), "does not account for: input_norm.weight"),
        (dict(fmt="specforge", t_extra={"fc_norm.0.weight": torch.ones(64)}), "does not account for: fc_norm.0"),
        (dict(t_extra={"midlayer.self_attn.q_norm.weight": torch.ones(16)}),
         "does not account for: midlayer.self_attn.q_norm"),
        (dict(fmt="specforge", top={"eagle_config": {"use_aux_hidden_state": False}}), "use_aux_hidden_state is false"),
        (dict(t_extra={"t2d": torch.ones(VOCAB, dtype=torch.bool)}), "t2d .* does not mark exactly"),
        (dict(t_extra={"lm_head.weight": torch.full((96, 64), float("nan"))}), "lm_head.weight holds NaN"),
    ]
    for i, (kwargs, message) in enumerate(refusals):
        with pytest.raises(ConfigError, match=message):
            load(f"bad{i}", **kwargs)
            pytest.fail(f"loaded {kwargs}")


def test_numbering_follows_the_format_and_is_overridable(tmp_path):
    model, graph = traced("llama")
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    folder, _, _ = write_variant(tmp_path, model, "speculators")
    assert ppsplit.load_drafter(folder, split=split).taps == (1, 2, 4)  # as written
    with pytest.raises(ConfigError, match=r"reads taps \[2, 3, 5\] but the split carries \[1, 2, 4\]"):
        ppsplit.load_drafter(folder, split=split, aux_convention="sglang")
    folder, _, _ = write_variant(tmp_path, model, "specforge")
    assert ppsplit.load_drafter(folder, split=split).taps == (1, 2, 4)  # [0, 1, 3] + 1


# -- the libraries' own model code and save functions ----------------------------------------------------------------
def _random_init(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:  # norms: around 1
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.8 / p.shape[-1] ** 0.5)


def _vocab_map(draft, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randperm(VOCAB, generator=g)[:draft]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft), t2d


def speculators_model(model, **flags):
    """An ``Eagle3DraftModel`` built by speculators for the tiny llama target, random weights, its embedding."""
    pytest.importorskip("speculators")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig, Qwen3Config

    layer_cls = Qwen3Config if flags.pop("qwen3", False) else LlamaConfig
    window = flags.pop("window", None)
    extra = {"sliding_window": window, "layer_types": ["sliding_attention"]} if window else {}
    if layer_cls is Qwen3Config and not window:
        extra = {"layer_types": ["full_attention"]}
    layer = layer_cls(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=1, vocab_size=VOCAB, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **extra)
    layer._attn_implementation = "sdpa"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=VOCAB * 3 // 4, eagle_aux_hidden_state_layer_ids=TAPS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=K)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])),
        **flags)
    drafter = Eagle3DraftModel(cfg).eval()
    _random_init(drafter, 11)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    drafter.load_vocab_mappings(*reversed(_vocab_map(VOCAB * 3 // 4)))
    return drafter


def speculators_drafts(drafter, feats, tokens, drafts):
    """speculators' own forward for a chain from the last row: the test-time-training steps with teacher forcing on
    ``drafts`` (what an engine feeds back) — row ``n - 1`` at step ``j`` reads token ``drafts[j - 1]``; rows after it
    never reach it (causal). Returns each step's target-vocab draft at that row and step 0's logits."""
    n, k = feats.shape[0], len(drafts)
    hidden = torch.cat([feats, feats.new_zeros(k - 1, feats.shape[1])])[None]
    ids = torch.cat([tokens, torch.tensor(drafts[:-1], dtype=torch.long)])[None]
    seen = []
    hook = drafter.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    try:
        with torch.no_grad():
            out = drafter(hidden, ids, torch.zeros_like(ids), ttt_steps=k)
    finally:
        hook.remove()
    d2t = drafter.d2t
    return [int(step[0, n - 1]) + int(d2t[step[0, n - 1]]) for step in out], seen[0][0, :n]


SPECULATORS_FLAGS = {"default": {}, "norm_output": {"norm_output": True}, "norm_before_fc": {"norm_before_fc": True},
                     "fc_norm": {"fc_norm": True}, "norm_before_residual": {"norm_before_residual": True},
                     "qwen3": {"qwen3": True}, "window": {"window": 6}}


@pytest.mark.parametrize("variant", list(SPECULATORS_FLAGS))
def test_speculators_checkpoints_draft_like_speculators(variant, tmp_path):
    """Every draft of every verify step equals speculators' own forward (its save_pretrained wrote the folder), and
    the first step's logits match within 5e-5; greedy output equals the target's, at pp 1 and 3. With a window,
    speculators' training forward and an engine's positional window agree on the first draft and wherever the
    window does not bind; later drafts are checked against the reference above."""
    model, graph = traced("llama")
    lib = speculators_model(model, **dict(SPECULATORS_FLAGS[variant]))
    lib.save_pretrained(str(tmp_path / "spec"))
    assert json.load(open(tmp_path / "spec" / "config.json"))["speculators_model_type"] == "eagle3"
    torch.manual_seed(6)
    prompt = torch.randint(3, VOCAB, (1, 5))
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=8, do_sample=False)
    for pp in (1, 3):
        split = ppsplit.split_model(graph, pp, aux=TAPS)
        drafter = ppsplit.load_drafter(str(tmp_path / "spec"), split=split)
        out, stats = split.generate(prompt, 8, drafter=drafter, num_draft_tokens=K, return_stats=True)
        assert torch.equal(out, expected)
        committed = prompt.shape[1] + 1
        for s, drafts in enumerate(stats.draft_tokens):
            feats, _ = target_features(model, out[:, :committed - 1])
            tokens = out[0, 1:committed]
            lib_drafts, lib_logits = speculators_drafts(lib, feats, tokens, list(drafts))
            n = feats.shape[0]
            if "window" in SPECULATORS_FLAGS[variant] and n + K - 1 > 6:
                lib_drafts = lib_drafts[:1]  # the training forward's window differs from the engines' from step 2
            assert list(drafts)[:len(lib_drafts)] == lib_drafts, (variant, pp, s)
            if s == 0:
                T = committed - 1
                _, aux = split(out[:, :T], torch.arange(T))
                with torch.no_grad():
                    logits, _ = drafter(aux, tokens[None], torch.arange(T))
                torch.testing.assert_close(logits[0], lib_logits, atol=5e-5, rtol=0)
            committed += stats.accepted[s] + 1


def test_speculators_window_variant_against_the_reference(tmp_path):
    """The windowed draft layer, every draft against the reference (positional window, as the engines apply it)."""
    model, graph = traced("llama")
    lib = speculators_model(model, window=4)
    lib.save_pretrained(str(tmp_path / "spec"))
    t = {k.replace("layers.0.", "midlayer."): v.detach() for k, v in lib.state_dict().items()}
    torch.manual_seed(8)
    ids = torch.randint(3, VOCAB, (1, 9))
    feats, tokens = target_features(model, ids)
    split = ppsplit.split_model(graph, 3, aux=TAPS)
    drafter = ppsplit.load_drafter(str(tmp_path / "spec"), split=split)
    _, ref = reference_chain(t, {"heads": 4, "kv_heads": 2, "theta": 5000.0, "window": 4}, feats, tokens,
                             model.get_input_embeddings().weight.detach(), k=4)
    assert first_drafts(split, drafter, ids[0], 4) == ref


@pytest.fixture
def no_dynamo():
    """SpecForge compiles its RMSNorm with torch.compile; the CPU test runs it eagerly (the same math)."""
    with torch.compiler.set_stance("force_eager"):
        yield


def specforge_model(model, **flags):
    pytest.importorskip("specforge")
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=1, vocab_size=VOCAB, max_position_embeddings=256,
                      rope_theta=5000.0, draft_vocab_size=VOCAB * 3 // 4,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [t - 1 for t in TAPS]}, **flags)
    drafter = LlamaForCausalLMEagle3(cfg).eval()
    _random_init(drafter, 12)
    d2t, t2d = _vocab_map(VOCAB * 3 // 4)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
    return drafter


def specforge_drafts(drafter, feats, tokens, k):
    """SpecForge's modules (project_hidden_states, backbone, compute_logits) recomputed over the sequence each step,
    the pre-norm backbone output fed back as its training loop does."""
    x = drafter.project_hidden_states(feats[None])
    toks, ids, first = tokens[None], [], None
    with torch.no_grad():
        for _ in range(k):
            n = x.shape[1]
            mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
            out = drafter.backbone(drafter.embed_input_ids(toks), x, None, mask, torch.arange(n)[None])
            logits = drafter.compute_logits(out)
            first = logits[0] if first is None else first
            d = int(logits[0, -1].argmax())
            ids.append(d + int(drafter.d2t[d]))
            x, toks = torch.cat([x, out[:, -1:]], 1), torch.cat([toks, torch.tensor([[ids[-1]]])], 1)
    return first, ids


@pytest.mark.parametrize("flags", [{}, {"norm_output": False}, {"fc_norm": True}],
                         ids=["default", "no-norm", "fc_norm"])
def test_specforge_checkpoints_draft_like_specforge(flags, tmp_path, no_dynamo):
    model, graph = traced("llama")
    lib = specforge_model(model, **flags)
    lib.save_pretrained(str(tmp_path / "sf"))
    torch.manual_seed(9)
    ids = torch.randint(3, VOCAB, (1, 9))
    feats, tokens = target_features(model, ids)
    with torch.no_grad():
        ref_logits, ref_ids = specforge_drafts(lib, feats, tokens, 4)
    for pp in (1, 3):
        split = ppsplit.split_model(graph, pp, aux=TAPS)
        drafter = ppsplit.load_drafter(str(tmp_path / "sf"), split=split)
        _, aux = split(ids, torch.arange(9))
        with torch.no_grad():
            logits, _ = drafter(aux, tokens[None], torch.arange(9))
        torch.testing.assert_close(logits[0], ref_logits, atol=5e-5, rtol=0)
        assert first_drafts(split, drafter, ids[0], 4) == ref_ids, pp


@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_saved_drafters_are_read_back_by_the_owning_library(fmt, tmp_path, no_dynamo):
    """``Eagle3Drafter.save`` in each format, loaded by the library that owns the format, drafts the same."""
    model, graph = traced("llama")
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    variant = "specforge-fc_norm" if fmt == "specforge" else "speculators-norm_output"
    folder, _, _ = write_variant(tmp_path, model, variant)
    drafter = ppsplit.load_drafter(folder, split=split)
    model.save_pretrained(str(tmp_path / "target"))
    out = drafter.save(str(tmp_path / "saved"), format=fmt, verifier=str(tmp_path / "target"))
    torch.manual_seed(10)
    ids = torch.randint(3, VOCAB, (1, 9))
    feats, tokens = target_features(model, ids)
    ours = first_drafts(split, drafter, ids[0], K)
    if fmt == "speculators":
        pytest.importorskip("speculators")
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

        config = Eagle3SpeculatorConfig.from_pretrained(out)
        config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention's block masks need a GPU size
        lib = Eagle3DraftModel.from_pretrained(out, config=config).eval()
        assert lib.config.norm_output and lib.layers[0].self_attn.q_proj.weight.shape == (64, 128)
        lib_ids, _ = speculators_drafts(lib, feats, tokens, ours)
    else:
        pytest.importorskip("specforge")
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

        lib = LlamaForCausalLMEagle3.from_pretrained(out).eval()
        # Under transformers 5.24 (SpecForge pins 5.8.1) from_pretrained leaves the rotary cache's non-persistent
        # buffers uninitialised; SpecForge's own _init_rope rebuilds them from the config it read.
        lib.midlayer.self_attn._init_rope()
        with torch.no_grad():
            lib.embed_tokens.weight.copy_(model.get_input_embeddings().weight)  # the SGLang layout ships none
        _, lib_ids = specforge_drafts(lib, feats, tokens, K)
    assert ours == lib_ids
    again = ppsplit.load_drafter(out, split=split)  # and ppsplit reads its own export
    assert first_drafts(split, again, ids[0], K) == ours
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


def test_compile_with_a_speculators_drafter(tmp_path):
    """``ppsplit compile --drafter`` reads the speculators config (its numbering, its flags) and the compiled folder's
    drafter drafts like the one loaded in process."""
    from ppsplit.cli import main

    model, graph = traced("llama")
    model.save_pretrained(str(tmp_path / "target"))
    folder, _, _ = write_variant(tmp_path, model, "speculators-norm_output")
    out = str(tmp_path / "compiled")
    assert main(["compile", str(tmp_path / "target"), "--pp", "2", "--drafter", folder, "-o", out,
                 "--max-batch", "1", "--max-len", "32"]) == 0
    loaded = ppsplit.load(out)
    assert loaded.plan.taps == tuple(TAPS) and loaded.drafter.feed_normed
    split = ppsplit.split_model(graph, 1, aux=TAPS)
    drafter = ppsplit.load_drafter(folder, split=split)
    torch.manual_seed(12)
    ids = torch.randint(3, VOCAB, (1, 9))
    expected = first_drafts(split, drafter, ids[0], 4)
    assert first_drafts(loaded, loaded.drafter, ids[0], 4) == expected
    # ppsplit save-drafter: the compiled folder's drafter back out as a speculators checkpoint, read again
    assert main(["save-drafter", out, "--format", "speculators", "-o", str(tmp_path / "exported")]) == 0
    cfg = json.load(open(tmp_path / "exported" / "config.json"))
    assert cfg["speculators_model_type"] == "eagle3" and cfg["norm_output"] is True
    assert cfg["eagle_aux_hidden_state_layer_ids"] == TAPS
    again = ppsplit.load_drafter(str(tmp_path / "exported"), split=split)
    assert first_drafts(split, again, ids[0], 4) == expected
    assert main(["save-drafter", out, "--format", "specforge", "-o", str(tmp_path / "x")]) == 2  # cannot express it


@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_a_narrower_drafter_with_its_own_embedding(fmt, tmp_path):
    """``target_hidden_size`` (64) different from the drafter's width (32): fc maps 3 x 64 to 32, and the drafter
    embeds with its own ``embed_tokens`` of width 32."""
    model, graph = traced("llama")
    draft = VOCAB * 3 // 4
    layer = {"hidden_size": 32, "head_dim": 8, "intermediate_size": 48}
    if fmt == "speculators":
        cfg = speculators_config(model, draft, layer, target_hidden_size=64)
    else:
        cfg = specforge_config(model, draft, target_hidden_size=64, **layer)
    flat = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": VOCAB, "draft_vocab_size": draft, "target_hidden_size": 64}
    t = random_drafter_tensors(flat, seed=4)
    t["embed_tokens.weight"] = torch.randn(VOCAB, 32, generator=torch.Generator().manual_seed(2))
    folder = write_drafter(str(tmp_path / fmt), cfg, t)
    torch.manual_seed(13)
    ids = torch.randint(3, VOCAB, (1, 9))
    feats, tokens = target_features(model, ids)
    ref_logits, ref_ids = reference_chain(t, {"heads": 4, "kv_heads": 2, "theta": 5000.0}, feats, tokens,
                                          t["embed_tokens.weight"], k=4)
    split = ppsplit.split_model(graph, 3, aux=TAPS)
    drafter = ppsplit.load_drafter(folder, split=split)
    assert drafter.fc.weight.shape == (32, 192)
    _, aux = split(ids, torch.arange(9))
    with torch.no_grad():
        logits, _ = drafter(aux, tokens[None], torch.arange(9))
    torch.testing.assert_close(logits[0], ref_logits, atol=5e-5, rtol=1e-4)
    assert first_drafts(split, drafter, ids[0], 4) == ref_ids
