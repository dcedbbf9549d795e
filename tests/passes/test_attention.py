"""The attention pass and ``cache_attention``: kernels against fp64, stages against Hugging Face, structure.

Kernels: the Triton split-KV (decode, verify) and flash (prefill) kernels run on CPU tensors under
``TRITON_INTERPRET=1`` in fp32, with odd sizes, GQA ratios 1/4/8, outputs poisoned with NaN and the cache
poisoned past the live length (a kernel that reads a stale slot returns NaN). bf16 runs on a GPU.
Models: with the pass on, logits, taps (= ``output_hidden_states``) and greedy decoding equal HF's, and the
stage graphs hold ``cache_attention`` instead of the expanded K/V, the mask and SDPA/softmax.
"""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import ppsplit
import tests.serve.test_decode as decode_tests
from ppsplit import CacheConfig, ConfigError
from ppsplit.triton_kernels.attention import HAVE_TRITON, attention_reference, launch_cache_attention
from tests.support import VOCAB, decode, hf_greedy, tiny_model

ops = torch.ops.ppsplit
CACHE = decode_tests.CACHE
# (batch, batch rows in the cache, q heads, kv heads, tokens, max_len, head_dim, first position, extras)
KERNEL_CASES = [
    (1, 1, 8, 1, 1, 77, 64, 70, {}),                                   # decode, GQA 8, odd length
    (2, 3, 8, 2, 3, 100, 128, 37, {}),                                 # verify, GQA 4, batch < cache rows
    (1, 2, 4, 4, 5, 45, 64, 11, {}),                                   # verify, MHA (ratio 1)
    (2, 2, 4, 2, 3, 70, 64, 40, dict(window=7, softcap=20.0)),         # Gemma 2: sliding window + soft-cap
    (1, 1, 4, 4, 3, 37, 64, 10, dict(alibi=True)),                     # Bloom: ALiBi
    (2, 2, 4, 2, 5, 37, 64, 20, dict(sinks=True, window=4)),           # gpt-oss: sinks (+ window)
]


def _kernel_inputs(batch, rows, hq, hkv, tokens, max_len, dim, start, extras, seed, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, tokens, dim, generator=gen).to(device, dtype)
    k = torch.randn(rows, hkv, max_len, dim, generator=gen).to(device, dtype)
    v = torch.randn(rows, hkv, max_len, dim, generator=gen).to(device, dtype)
    positions = torch.arange(start, start + tokens, device=device)
    k[:, :, start + tokens:] = float("nan")  # stale slots: reading one poisons the output
    v[:, :, start + tokens:] = float("nan")
    alibi = torch.rand(hq, generator=gen).to(device) if extras.get("alibi") else None
    sinks = torch.randn(hq, generator=gen).to(device, dtype) if extras.get("sinks") else None
    args = (q, k[:batch], v[:batch], positions, dim ** -0.5, extras.get("window", 0), extras.get("softcap", 0.0),
            alibi, sinks)
    return args


def _reference64(q, k, v, positions, scale, window, softcap, alibi, sinks):
    live = int(positions[-1]) + 1  # the reference reads only live slots (NaN beyond would poison it)
    return attention_reference(q.double(), k[:, :, :live].double(), v[:, :, :live].double(), positions, scale,
                               window, softcap, None if alibi is None else alibi.double(),
                               None if sinks is None else sinks.double())


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("decode", [True, False], ids=["split_kv", "flash"])  # split_kv: 3 splits or 1 (no combine)
@pytest.mark.parametrize("case", range(len(KERNEL_CASES)))
def test_triton_kernels_match_fp64(case, decode):
    batch, rows, hq, hkv, tokens, max_len, dim, start, extras = KERNEL_CASES[case]
    args = _kernel_inputs(batch, rows, hq, hkv, tokens, max_len, dim, start, extras, seed=case)
    out = torch.full((batch, tokens, hq, dim), float("nan")).transpose(1, 2)
    launch_cache_attention(*args, out=out, decode=decode, n_splits=(3 if case % 2 else 1) if decode else None)
    assert not out.isnan().any(), "left part of the output unwritten, or read a stale cache slot"
    torch.testing.assert_close(out.double(), _reference64(*args), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("n_splits", [17, 40])
def test_split_kv_combine_over_many_splits_matches_fp64(n_splits):
    """More splits than the combine step reads at once (16), some of them past the live length (empty): the
    partials are rescaled chunk by chunk."""
    extras = dict(sinks=True) if n_splits == 40 else {}
    args = _kernel_inputs(1, 1, 8, 2, 2, 3000, 64, 2900, extras, seed=n_splits)
    args[1][:, :, 2000:2902] *= 3  # the largest scores in a later chunk of splits: earlier partials get rescaled
    out = torch.full((1, 2, 8, 64), float("nan")).transpose(1, 2)
    launch_cache_attention(*args, out=out, decode=True, n_splits=n_splits)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), _reference64(*args), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dim,extras", [(64, {}), (48, dict(window=21)), (48, dict(alibi=True, softcap=30.0))],
                         ids=["even", "uneven_window", "uneven_alibi_softcap"])
def test_flash_whole_and_diagonal_blocks_match_fp64(dim, extras):
    """A prompt spanning many small blocks: the blocks every query row sees run without masks, the diagonal
    (and window edge) with them; a head dim below its power of two keeps the column masks."""
    args = _kernel_inputs(2, 2, 4, 2, 90, 120, dim, 7, extras, seed=dim)
    out = torch.full((2, 90, 4, dim), float("nan")).transpose(1, 2)
    launch_cache_attention(*args, out=out, decode=False, config=dict(block_m=32, block_n=16))
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), _reference64(*args), atol=2e-5, rtol=2e-5)


def test_cpu_op_matches_fp64():
    for case, (batch, rows, hq, hkv, tokens, max_len, dim, start, extras) in enumerate(KERNEL_CASES):
        args = list(_kernel_inputs(batch, rows, hq, hkv, tokens, max_len, dim, start, extras, seed=case))
        for t in (1, 2):  # the CPU path masks the whole cache: stale slots are finite garbage there, not NaN
            args[t] = torch.nan_to_num(args[t], nan=1e4)
        out = ops.cache_attention(*args)
        assert out.shape == (batch, hq, tokens, dim) and out.transpose(1, 2).is_contiguous()
        torch.testing.assert_close(out.double(), _reference64(*args), atol=1e-5, rtol=1e-5)


# ---- models ----------------------------------------------------------------------------------------------------

_EXTRA_MODELS: dict = {}


def _extra_config(arch):
    common = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "bloom":  # ALiBi
        return AutoConfig.for_model("bloom", hidden_size=64, n_layer=4, n_head=4, **common)
    if arch == "gpt_oss":  # sinks, alternating sliding-window and full layers
        return AutoConfig.for_model("gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=4, **common)
    raise KeyError(arch)


def traced(arch):
    """(model, trace with the KV cache): shared with test_decode for its architectures."""
    if arch not in ("bloom", "gpt_oss"):
        return decode_tests.cached(arch)
    if arch not in _EXTRA_MODELS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_extra_config(arch)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        _EXTRA_MODELS[arch] = (model, ppsplit.trace_model(model, cache=CACHE))
    return _EXTRA_MODELS[arch]


def _reads_cache(node):
    return any(a.op == "get_attr" and a.target.startswith("kv_cache.") for a in node.all_input_nodes)


def _module(node):
    """Class name of the innermost module that ran ``node`` (a router's softmax is not the attention's)."""
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][1]) if stack else ""


MODELS = ["llama", "qwen3", "gemma2", "gpt2", "mixtral", "bloom", "gpt_oss"]
EXPECT = {"gemma2": ("softcap 50", "window 4"), "bloom": ("ALiBi",), "gpt_oss": ("sinks", "window 4")}


@pytest.mark.parametrize("arch", MODELS)
def test_pass_matches_hf_and_replaces_attention(arch):
    model, trace = traced(arch)
    split = ppsplit.split_model(trace, 2, aux=[1, 3])
    # Structure: every layer's attention is one paged_attention over the cache's pools; nothing else reads them
    # (their writes are one paged_write_pair a layer, keys and values in one launch).
    for k, (stage, sp) in enumerate(zip(split.stages, split.plan.stages)):
        nodes = list(stage.graph.nodes)
        attn = [n for n in nodes if n.target is ops.paged_attention.default]
        assert len(attn) == sp.num_layers
        writes = [n for n in nodes if n.target is ops.paged_write_pair.default]
        assert len(writes) == sp.num_layers and not [n for n in nodes if n.target is ops.paged_write.default]
        readers = [n for n in nodes if _reads_cache(n)]
        assert set(readers) == set(attn) | set(writes), [n.format_node() for n in readers if n not in attn]
        gone = {torch.ops.aten.scaled_dot_product_attention.default, torch.ops.aten.softmax.int,
                torch.ops.aten._softmax.default, torch.ops.aten.expand.default, torch.ops.aten.matmul.default}
        assert not [n for n in nodes if n.target in gone and "attention" in _module(n).lower()]
        n = sp.num_layers
        assert split.plan.attention_lines(k)[0].startswith(f"attention: {n} of {n} -> paged_attention")
        assert [a.layer for a in split.plan.attention if a.stage == k and a.replaced] == list(range(sp.start, sp.end))
    for word in EXPECT.get(arch, ()):
        if word.startswith("softcap") and model.config._attn_implementation != "eager":
            continue  # transformers' SDPA path drops the soft-cap (5.17 picks SDPA for tiny Gemma 2): HF has none
        assert any(word in a.detail for a in split.plan.attention), (word, split.plan.attention)
    assert "paged_attention" in split.plan.describe()

    # Numbers: prefill, decode, verify chunks equal HF's logits and hidden states (taps), in fp32.
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 13))
    with torch.no_grad():
        full = model(ids, output_hidden_states=True)
    for lo, hi in [(0, 7), (7, 8), (8, 13)]:
        logits, aux = split(ids[:, lo:hi], torch.arange(lo, hi))
        torch.testing.assert_close(logits, full.logits[:, lo:hi], atol=1e-5, rtol=1e-5)
        for slot, tap in enumerate((1, 3)):
            torch.testing.assert_close(aux[slot], full.hidden_states[tap][:, lo:hi], atol=1e-5, rtol=1e-5)
    # Greedy decoding with the cache; a smaller batch (leading cache rows) where test_decode does not cover it.
    prompt = torch.randint(3, VOCAB, (2, 6))
    for rows in (2, 1) if arch in ("bloom", "gpt_oss") else (2,):
        with torch.no_grad():
            expected = model.generate(prompt[:rows], max_new_tokens=12, do_sample=False)
        assert torch.equal(split.generate(prompt[:rows], 12), expected)


def test_attention_false_keeps_traced_ops():
    model, _ = traced("llama")
    with pytest.raises(ConfigError, match="a paged cache needs the attention pass"):
        ppsplit.split_model(traced("llama")[1], 1, attention=False)
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=CACHE, paged=False), 1, attention=False)
    nodes = list(split.stages[0].graph.nodes)
    assert not any(n.target is ops.cache_attention.default for n in nodes)
    assert any(n.target is torch.ops.aten.scaled_dot_product_attention.default for n in nodes)
    assert split.plan.attention == ()


def test_unrecognised_attention_is_left_and_reported():
    """A per-head temperature is not cache_attention's math: the traced ops stay, the plan says why, and the
    numbers still equal HF's."""
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import repeat_kv

    def per_head_temperature(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        scores = scores * torch.linspace(0.5, 1.5, query.shape[1], device=query.device).view(1, -1, 1, 1)
        if attention_mask is None:  # HF's SDPA mask skips a plainly causal mask: apply it here
            q_len, k_len = scores.shape[-2:]
            attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs

    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register("ppsplit_test_per_head_temperature", per_head_temperature)
    # Without a registered mask function HF hands custom attention no mask: use SDPA's boolean one.
    AttentionMaskInterface.register("ppsplit_test_per_head_temperature", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    from tests.support import tiny_model

    model = tiny_model("llama", num_layers=2)
    model.set_attn_implementation("ppsplit_test_per_head_temperature")
    split = ppsplit.split_model(model, 2, cache=CACHE)
    for k in range(2):
        assert split.plan.attention_lines(k)[0] == "attention: 0 of 1 -> cache_attention"
        assert "left as traced: no scale/window/chunk/soft-cap/ALiBi/sinks" in split.plan.attention_lines(k)[1]
        assert not any(n.target is ops.cache_attention.default for n in split.stages[k].graph.nodes)
    prompt = torch.randint(3, VOCAB, (2, 6))
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(decode(split, prompt, 8), expected)


def _deepseek_v3(attn_implementation="sdpa"):
    from tests.serve.test_ragged import COMMON, CONFIGS

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("deepseek_v3", **{**COMMON, **CONFIGS["deepseek_v3"]})
    cfg._attn_implementation = attn_implementation
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_mla_becomes_latent_attention_in_a_paged_split(impl):
    """DeepSeek-V3 (SDPA and eager): the traced expansion of the cached latents and the attention over it become one
    ``paged_latent_attention`` per layer (proved by evaluation), and chunks of a prompt equal HF's logits."""
    model = _deepseek_v3(impl)
    split = ppsplit.split_model(model, 2, cache=CacheConfig(2, 32))
    assert split.plan.paged, split.plan.lockstep_reason
    assert all(a.replaced and a.detail.startswith("MLA: latent 24 + rotary 8") for a in split.plan.attention)
    for stage in split.stages:
        targets = [n.target for n in stage.graph.nodes]
        assert ops.paged_latent_attention.default in targets
        assert torch.ops.aten.scaled_dot_product_attention.default not in targets
        assert torch.ops.aten.softmax.int not in targets and torch.ops.aten._softmax.default not in targets
    ids = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
    for lo, hi in [(0, 7), (7, 8), (8, 13)]:
        torch.testing.assert_close(split(ids[:, lo:hi], torch.arange(lo, hi))[0], full[:, lo:hi], atol=1e-5,
                                   rtol=1e-5)


def test_an_expansion_that_is_not_mla_stays_lockstep_and_says_why():
    """A layer built like MLA whose values are doubled after the split is not ``latent_attention``'s math (the proof
    by evaluation fails): the split keeps a lockstep cache naming the reason, and its numbers still equal HF's. The
    lockstep split keeps the traced MLA, as before."""
    model = _deepseek_v3()
    for layer in model.model.layers:
        attn = layer.self_attn
        expand = attn.expand_kv
        attn.expand_kv = lambda kv, rot, expand=expand: (lambda k, v: (k, v * 2))(*expand(kv, rot))
    split = ppsplit.split_model(model, 2, cache=CacheConfig(2, 32))
    assert not split.plan.paged
    assert "its cache holds MLA latents, but no scale/window/soft-cap makes latent_attention equal it" in \
        split.plan.lockstep_reason
    assert not any(n.target is ops.latent_attention.default for s in split.stages for n in s.graph.nodes)
    prompt = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(decode(split, prompt, 6), expected)


def test_plan_json_round_trip_keeps_the_report():
    _, trace = traced("gemma2")
    plan = ppsplit.split_model(trace, 2).plan
    assert ppsplit.SplitPlan.from_json(plan.to_json()) == plan and plan.attention


@pytest.mark.parametrize("rows,batch", [(1, 1), (3, 2)])
def test_compiled_stage_equals_eager(rows, batch):
    """compile=True (Inductor on the CPU): the same numbers and the same cache writes as the eager stage. The paged
    cache's writes are ``ppsplit::paged_write_pair`` into whole pools (in place under Inductor), here on a batch below
    the cache's sequence slots; a lockstep cache's writes of more than one row go through ``ppsplit::cache_write``."""
    from tests.support import tiny_model

    model = tiny_model("llama", num_layers=1)
    trace = ppsplit.trace_model(model, cache=CacheConfig(batch_size=rows, max_len=16))
    eager = ppsplit.split_model(trace, 1, aux=[1])
    compiled = ppsplit.split_model(trace, 1, aux=[1], compile=True)
    writes = [n for n in compiled.stages[0].graph.nodes if n.target is torch.ops.ppsplit.paged_write_pair.default]
    assert len(writes) == 1 and compiled.stages[0].meta["ppsplit.compile"] == {"cache_writes_in_place": 0}
    lockstep = ppsplit.split_model(ppsplit.trace_model(model, cache=CacheConfig(batch_size=rows, max_len=16),
                                                       paged=False), 1, aux=[1], compile=True)
    writes = [n for n in lockstep.stages[0].graph.nodes if n.target is torch.ops.ppsplit.cache_write.default]
    assert len(writes) == (2 if rows > 1 else 0)
    ids = torch.randint(3, VOCAB, (batch, 8))
    for lo in (0, 4):  # one shape, two steps: the second attends over what the first wrote
        positions = torch.arange(lo, lo + 4)
        expected, aux_e = eager(ids[:, lo:lo + 4], positions)
        got, aux_c = compiled(ids[:, lo:lo + 4], positions)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(aux_c, aux_e, atol=1e-5, rtol=1e-5)
    caches = [dict(s.stages[0].named_buffers()) for s in (eager, compiled)]
    for name in caches[0]:
        if name.startswith("kv_cache."):
            torch.testing.assert_close(caches[1][name], caches[0][name], atol=1e-6, rtol=1e-6)
    assert compiled.stages[0].meta["ppsplit.plan"] is compiled.plan  # still the same GraphModule


# ---- GPU ---------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(KERNEL_CASES)))
def test_op_on_gpu_matches_fp64(case, dtype):
    batch, rows, hq, hkv, tokens, max_len, dim, start, extras = KERNEL_CASES[case]
    args = _kernel_inputs(batch, rows, hq, hkv, tokens, max_len, dim, start, extras, seed=case, dtype=dtype,
                          device="cuda")
    for decode in (True, False):
        out = launch_cache_attention(*args, decode=decode)
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), _reference64(*args), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_long_prefill_on_gpu_matches_fp64():
    args = _kernel_inputs(1, 1, 8, 2, 300, 512, 128, 100, {}, seed=7, dtype=torch.bfloat16, device="cuda")
    out = ops.cache_attention(*args)
    torch.testing.assert_close(out.double(), _reference64(*args), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_captured_stage_equals_eager_on_gpu(compile):
    """gemma2 (sliding window, soft-caps) in bf16, eager ops or compiled: a captured ragged bucket equals eager."""
    from tests.serve.test_cuda_graphs import ragged_replay_equals_eager
    from tests.support import tiny_model

    ragged_replay_equals_eager(tiny_model("gemma2").to(device="cuda", dtype=torch.bfloat16), compile=compile)

def test_a_head_count_equal_to_the_traced_token_count_leaves_the_step_size_open():
    """Llama with 8 query heads, traced with an example of 8 tokens: the pass looks at the shapes of every node
    reading the cache ([B, T, H, D] among them) without fixing the token count to 8, so the paged cache's checks
    run at other step sizes too and pass: the split is paged and decodes as Hugging Face does."""
    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=2)
    split = ppsplit.split_model(model, 2, cache=CacheConfig(batch_size=1, max_len=16))
    assert split.plan.paged, split.plan.lockstep_reason
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(split.generate(ids, 6), hf_greedy(model, ids, 6))
