"""The batch-1 GEMV: the Triton kernel against fp64, the pass that routes a stage's projections through
``ppsplit::linear``, and what it leaves alone.

Kernel: ``launch_gemv`` on CPU tensors under ``TRITON_INTERPRET=1`` (fp32; odd widths, a depth that is not a
multiple of the block, a bias, the output poisoned with NaN). Pass: a small Llama whose vocabulary and MLP are
4096 wide (``MIN_OUT``) so the head and the gate/up projections are routed; on the CPU the op makes the traced
ATen call, so logits, taps and greedy decoding are bit-equal to the unrouted stages (and equal HF).
"""
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import ppsplit
from ppsplit import CacheConfig
from ppsplit.triton_kernels.gemv import HAVE_TRITON, MIN_OUT, launch_gemv, pick_config

ops = torch.ops.ppsplit


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("n,k,bias,config", [
    (40, 64, False, (16, 64, 4, 2)),      # N not a multiple of BLOCK_N
    (33, 100, True, (8, 64, 4, 2)),       # K not a multiple of BLOCK_K, with a bias
    (64, 512, False, None),               # the default configuration
    (48, 96, True, (16, 1024, 8, 3)),     # BLOCK_K clamped to K's power of two
])
def test_kernel_matches_fp64(n, k, bias, config):
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, 1, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    y = launch_gemv(x, w, b, config=config)
    assert y.shape == (1, 1, n) and not y.isnan().any()
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("width,k,bias,config,gate_first", [
    (40, 64, False, (16, 64, 4, 2), True),     # outputs not a multiple of the 8 a program serves
    (33, 100, True, (8, 64, 4, 2), False),     # K not a multiple of BLOCK_K, a bias, up rows first
    (64, 512, False, None, True),              # the default configuration
    (24, 96, True, (2, 1024, 4, 2), True),     # one output a program, BLOCK_K clamped
])
def test_gated_kernel_is_the_gemv_then_silu_mul_bit_for_bit(width, k, bias, config, gate_first):
    """``launch_gemv(..., glu=(gate, up, width))`` (the GEMV whose epilogue multiplies) under TRITON_INTERPRET=1,
    fp16: the bits of the GEMV followed by ``silu_mul``'s kernel."""
    from ppsplit.triton_kernels.pointwise import launch_silu_mul

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1 (conftest)")
    gen = torch.Generator().manual_seed(width * k)
    x = torch.randn(1, 1, k, generator=gen).half()
    w = (torch.randn(2 * width, k, generator=gen) / k ** 0.5).half()
    b = torch.randn(2 * width, generator=gen).half() if bias else None
    gate, up = (0, width) if gate_first else (width, 0)
    y = launch_gemv(x, w, b, config=config)
    want = launch_silu_mul(y[..., gate:gate + width], y[..., up:up + width])
    got = launch_gemv(x, w, b, config=config, glu=(gate, up, width))
    assert got.shape == (1, 1, width) and torch.equal(got, want)
    with pytest.raises(ValueError, match="do not lie in a weight"):
        launch_gemv(x, w, b, config=config, glu=(gate, up, width + 1))


def test_pick_config_by_shape():
    assert pick_config(4096, 4096) == (16, 1024, 8, 3)     # o_proj: narrow
    assert pick_config(4096, 14336) == (16, 1024, 8, 3)    # down: deep
    assert pick_config(28672, 4096) == (8, 512, 4, 4)      # gate/up fused: wide
    assert pick_config(128256, 4096) == (8, 512, 4, 4)     # lm_head


def _wide_llama():
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=MIN_OUT, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=MIN_OUT, pad_token_id=0,
                               bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _routed(stage):
    """The projections routed to the GEMV (a gate/up whose ``silu_mul`` folded into it among them)."""
    return [n for n in stage.graph.nodes if n.op == "call_function"
            and n.target in (ops.linear.default, ops.linear_silu_mul.default)]


def test_pass_routes_wide_projections_and_keeps_results():
    model = _wide_llama()
    cache = CacheConfig(batch_size=2, max_len=32)
    routed = ppsplit.split_model(model, 2, aux="1,3", cache=cache)
    plain = ppsplit.split_model(model, 2, aux="1,3", cache=cache, gemv=False)
    # gate and up of every layer (4096 outputs) and the head; o_proj, q/k/v and down are 64 wide
    assert [len(_routed(s)) for s in routed.stages] == [4, 5]
    assert [s.meta["ppsplit.gemv"] for s in routed.stages] == [4, 5]
    assert not any(_routed(s) for s in plain.stages)
    ids = torch.randint(3, MIN_OUT, (2, 6))
    positions = torch.arange(6)
    (a, aux_a), (b, aux_b) = routed(ids, positions), plain(ids, positions)
    assert torch.equal(a, b) and torch.equal(aux_a, aux_b)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    torch.testing.assert_close(a, ref.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(aux_a[0], ref.hidden_states[1], atol=1e-5, rtol=1e-5)
    one = ppsplit.split_model(model, 2, cache=CacheConfig(batch_size=1, max_len=32))
    prompt = torch.randint(3, MIN_OUT, (1, 5))
    out = one.generate(prompt, max_new_tokens=6)
    with torch.no_grad():
        hf = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, hf)


def test_pass_folds_silu_mul_into_the_routed_gate_up():
    """With fused projections and the pointwise ops (the CUDA defaults, asked for here on the CPU), each layer's
    ``silu_mul`` of its routed gate/up projection's halves becomes one ``linear_silu_mul``; on the CPU the op is the
    two ops, so logits and taps equal the split without the GEMV bit for bit. Without the GEMV nothing folds."""
    model = _wide_llama()
    cache = CacheConfig(batch_size=2, max_len=32)
    options = dict(aux="1,3", cache=cache, fuse_projections=True, fuse_pointwise=True)
    folded, plain = ppsplit.split_model(model, 2, **options), ppsplit.split_model(model, 2, **options, gemv=False)
    for stage in folded.stages:
        targets = [n.target for n in stage.graph.nodes]
        assert targets.count(ops.linear_silu_mul.default) == 2 and ops.silu_mul.default not in targets
    assert all(ops.silu_mul.default in [n.target for n in s.graph.nodes] for s in plain.stages)
    ids = torch.randint(3, MIN_OUT, (2, 6))
    (a, aux_a), (b, aux_b) = folded(ids, torch.arange(6)), plain(ids, torch.arange(6))
    assert torch.equal(a, b) and torch.equal(aux_a, aux_b)


def test_narrow_and_unheld_projections_stay():
    """Below MIN_OUT outputs nothing is routed (the tiny test models), and gemv=False is checked."""
    from tests.support import tiny_model

    split = ppsplit.split_model(tiny_model("llama"), 2)
    assert not any(_routed(s) for s in split.stages) and [s.meta["ppsplit.gemv"] for s in split.stages] == [0, 0]
    with pytest.raises(ppsplit.ConfigError, match="gemv must be True or False"):
        ppsplit.split_model(tiny_model("llama"), 2, gemv="yes")


def _compiled_folder(tmp_path):
    from ppsplit.cli import main

    model = _wide_llama()
    model.save_pretrained(tmp_path / "ckpt")
    out = str(tmp_path / "wide-pp2")
    assert main(["compile", str(tmp_path / "ckpt"), "--pp", "2", "--aux", "1", "--no-cache", "-o", out]) == 0
    return out


def test_compiled_folder_keeps_traced_calls(tmp_path):
    """The stored program keeps the traced ATen calls; ``load`` routes them only onto a CUDA device (on the CPU
    the op would be the same call, and serving there imports no pass)."""
    out = _compiled_folder(tmp_path)
    stored = "".join(open(os.path.join(out, f)).read() for f in os.listdir(out) if f.endswith(".json"))
    assert "aten::linear" in stored and "ppsplit::linear" not in stored
    loaded = ppsplit.load(out)
    assert not any(_routed(s) for s in loaded.stages)
    ids = torch.randint(3, MIN_OUT, (1, 5))
    torch.testing.assert_close(loaded(ids)[0], ppsplit.split_model(_wide_llama(), 2, aux="1")(ids)[0], atol=0, rtol=0)


# ---- GPU ---------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n,k,bias", [(4096, 4096, False), (6144, 4096, True), (4096, 14336, False),
                                      (5000, 1000, True)])
def test_kernel_on_gpu_matches_fp64(n, k, bias):
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    y = ops.linear(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(y.double(), ref, atol=2e-2, rtol=2e-2)
    xs = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)  # more rows: cuBLAS, bit-equal to F.linear
    assert torch.equal(ops.linear(xs, w, b), torch.nn.functional.linear(xs, w, b))


@pytest.mark.gpu
def test_gated_kernel_on_gpu_is_the_gemv_then_silu_mul_and_captures():
    """bf16 at Llama-3.1-8B's fused gate/up (2 x 14336 rows, 4096 wide): ``linear_silu_mul`` against the GEMV then
    ``silu_mul``'s kernel, bit for bit (libdevice's ``exp`` and the IEEE division, compiled), then captured and
    replayed on another input."""
    from ppsplit.triton_kernels.pointwise import launch_silu_mul

    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * 14336, 4096, device="cuda", dtype=torch.bfloat16) / 64

    def two_kernels():
        y = ops.linear(x, w, None)
        return launch_silu_mul(y[..., :14336], y[..., 14336:])
    assert torch.equal(ops.linear_silu_mul(x, w, None, 0, 14336, 14336), two_kernels())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.linear_silu_mul(x, w, None, 0, 14336, 14336)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, two_kernels())


@pytest.mark.gpu
def test_routed_decode_on_gpu_matches_unrouted():
    model = _wide_llama().to("cuda", torch.bfloat16)
    cache = CacheConfig(batch_size=1, max_len=32)
    routed = ppsplit.split_model(model, 2, aux="1", cache=cache)
    plain = ppsplit.split_model(model, 2, aux="1", cache=cache, gemv=False)
    prompt = torch.randint(3, MIN_OUT, (1, 5), device="cuda")
    for split in (routed, plain):
        split.capture(1, (5, 1))
    a, b = routed.generate(prompt, max_new_tokens=8), plain.generate(prompt, max_new_tokens=8)
    assert torch.equal(a[:, :6], b[:, :6])  # bf16: later tokens may flip on a near tie, the first must not
    ids = torch.randint(3, MIN_OUT, (1, 1), device="cuda")
    la, lb = routed(ids, torch.tensor([5], device="cuda"))[0], plain(ids, torch.tensor([5], device="cuda"))[0]
    torch.testing.assert_close(la.float(), lb.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_compiled_folder_routes_when_loaded_on_gpu(tmp_path):
    out = _compiled_folder(tmp_path)
    # projections left separate (fused, the default on CUDA, gate/up would route as one): 2 per layer + lm_head
    loaded = ppsplit.load(out, ["cuda", "cuda"], fuse_projections=False)
    plain = ppsplit.load(out, ["cuda", "cuda"], fuse_projections=False, gemv=False)
    assert [len(_routed(s)) for s in loaded.stages] == [4, 5] and not any(_routed(s) for s in plain.stages)
    fused = ppsplit.load(out, ["cuda", "cuda"])
    assert [len(_routed(s)) for s in fused.stages] == [2, 3]
    ids = torch.randint(3, MIN_OUT, (1, 1), device="cuda")
    with torch.no_grad():
        a, b = loaded(ids)[0], plain(ids)[0]
    torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)  # float32 folder: both accumulate in fp32
