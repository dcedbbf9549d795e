"""The fused q/k/v projection whose GEMV epilogue rotates and writes the keys and values (``linear_rope_write``):
the kernel against the two kernels it replaces (the projection's GEMV, then ``rope_write``'s), bit for bit, for the
bf16 / fp16 GEMV and the FP8 one; the op's torch path against the two ops; the rewrite on paged splits.

Kernels under TRITON_INTERPRET=1 in fp16 on the CPU, in bf16 and fp16 on a GPU (marker ``gpu``).
"""
import os

import pytest
import torch

import ppsplit
from ppsplit.triton_kernels.common import HAVE_TRITON

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
ops = torch.ops.ppsplit

# (query heads, key heads, head dim, K, bias, the GEMV's tiles, slot): one GQA Llama-3.1-8B-like layer, a bias
# (Qwen2), K not a multiple of the tile, a padding token (slot -1: nothing written), 4 pairs a program
CASES = [
    (32, 8, 128, 4096, False, None, 5),
    (4, 2, 64, 160, True, (8, 64, 4, 2), 17),
    (6, 1, 32, 96, False, (2, 128, 4, 2), -1),
    (3, 3, 16, 64, True, (16, 64, 4, 2), 0),
]


def kernel_device(hq):
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1 (set by conftest)")
    if hq == 32:
        pytest.skip("the Llama-3.1-8B-sized case takes minutes under the interpreter: GPU only")
    return "cpu"


def inputs(hq, hkv, d, k, bias, dtype, device, block=16):
    """One decode token: the input row, a fused q | k | v weight (and bias), cos / sin at one position, NaN-filled
    key and value pools."""
    torch.manual_seed(hq * d + k)
    n = (hq + 2 * hkv) * d
    x = torch.randn(1, 1, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    angles = torch.rand(1, 1, d, device=device) * 100
    pools = [torch.full((4, block, hkv, d), float("nan"), dtype=dtype, device=device) for _ in range(2)]
    return x, w, b, angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1), pools


def heads(y, hq, hkv, d):
    """HF's head views of the projection's output, as the traced graph takes them."""
    view = lambda lo, h: y[..., lo * d:(lo + h) * d].reshape(1, 1, h, d).transpose(1, 2)  # noqa: E731
    return view(0, hq), view(hq, hkv), view(hq + hkv, hkv)[0].transpose(0, 1)


def check(got, got_pools, want, want_pools, what):
    assert got.shape == want.shape and torch.equal(got, want), \
        f"{what}: {(got != want).sum().item()} of {got.numel()} query values differ"
    for mine, theirs in zip(got_pools, want_pools):
        assert torch.equal(mine.isnan(), theirs.isnan()), f"{what}: a row written that the slot does not name"
        assert torch.equal(mine.nan_to_num(), theirs.nan_to_num()), f"{what}: a pool row differs"


@pytest.mark.parametrize("hq,hkv,d,k,bias,config,slot", CASES)
def test_gemv_epilogue_is_the_gemv_then_rope_write_bit_for_bit(hq, hkv, d, k, bias, config, slot):
    """bf16 / fp16 weights: ``launch_linear_rope_write`` against ``launch_gemv`` then ``launch_rope_write`` on the
    same tiles."""
    from ppsplit.triton_kernels.gemv import launch_gemv, pick_config
    from ppsplit.triton_kernels.pointwise import launch_rope_write
    from ppsplit.triton_kernels.qkv import launch_linear_rope_write, rope_epilogue_usable

    device = kernel_device(hq)
    slots = torch.tensor([slot], device=device)
    for dtype in (torch.float16,) + ((torch.bfloat16,) if device == "cuda" else ()):
        x, w, b, cos, sin, pools = inputs(hq, hkv, d, k, bias, dtype, device)
        tiles = config or pick_config(*w.shape)
        want_pools = [p.clone() for p in pools]
        q, kk, v = heads(launch_gemv(x, w, b, config=tiles), hq, hkv, d)
        want = launch_rope_write(q, kk, cos, sin, *want_pools, v, slots)
        if device == "cuda" and w.shape[0] >= 4096:
            assert rope_epilogue_usable(x, w, None, 0, cos, sin, *pools, slots, hq * d, hkv * d, d)
        got = launch_linear_rope_write(x, w, b, None, 0, 0, cos, sin, *pools, slots, hq * d, hkv * d, d, config=tiles)
        check(got, pools, want, want_pools, f"{dtype}")
        if slot >= 0:
            assert not pools[0].view(-1, hkv, d)[slot].isnan().any(), "the token's keys were not written"


@pytest.mark.parametrize("hq,hkv,d,k,bias,config,slot", CASES)
def test_fp8_gemv_epilogue_is_the_fp8_gemv_then_rope_write_bit_for_bit(hq, hkv, d, k, bias, config, slot):
    """FP8 weights in 32x32 blocks (a last partial k-block where K is not a multiple): ``launch_linear_rope_write``
    against ``launch_fp8_linear`` then ``launch_rope_write`` on the same tiles."""
    from ppsplit.triton_kernels.fp8 import launch_fp8_linear, linear_config
    from ppsplit.triton_kernels.pointwise import launch_rope_write
    from ppsplit.triton_kernels.qkv import launch_linear_rope_write

    device = kernel_device(hq)
    slots = torch.tensor([slot], device=device)
    block = 32
    for dtype in (torch.float16,) + ((torch.bfloat16,) if device == "cuda" else ()):
        x, w, b, cos, sin, pools = inputs(hq, hkv, d, k, bias, dtype, device)
        n = w.shape[0]
        w8 = (w.float() * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-n // block), -(-k // block), device=device) / 8 + 0.01
        tiles = config or linear_config(1, n, k, x.device)
        want_pools = [p.clone() for p in pools]
        q, kk, v = heads(launch_fp8_linear(x, w8, scale, b, block, block, config=tiles), hq, hkv, d)
        want = launch_rope_write(q, kk, cos, sin, *want_pools, v, slots)
        got = launch_linear_rope_write(x, w8, b, scale, block, block, cos, sin, *pools, slots, hq * d, hkv * d, d,
                                       config=tiles)
        check(got, pools, want, want_pools, f"fp8, {dtype}")


def test_the_op_on_the_cpu_is_the_projection_then_rope_write():
    """The op's torch path (CPU, fp32, two tokens: a prefill chunk the GEMV never serves), bf16 and FP8 weights."""
    from ppsplit.triton_kernels.fp8 import dequantize

    torch.manual_seed(0)
    hq, hkv, d, k, t = 4, 2, 16, 48, 2
    n = (hq + 2 * hkv) * d
    x, w, b = torch.randn(1, t, k), torch.randn(n, k), torch.randn(n)
    angles = torch.rand(1, t, d) * 100
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    slots = torch.tensor([3, -1])
    w8, scale = w.clamp(-448, 448).to(torch.float8_e4m3fn), torch.rand(n // 16, k // 16) + 0.5
    for weight, s, dense in ((w, None, w), (w8, scale, dequantize(w8, scale, 16, 16))):
        pools = [torch.zeros(2, 4, hkv, d) for _ in range(2)]
        want_pools = [p.clone() for p in pools]
        y = torch.nn.functional.linear(x, dense, b)
        view = lambda lo, h: y[..., lo * d:(lo + h) * d].reshape(1, t, h, d).transpose(1, 2)  # noqa: E731
        want = ops.rope_write(view(0, hq), view(hq, hkv), cos, sin, *want_pools,
                              view(hq + hkv, hkv)[0].transpose(0, 1), slots)
        got = ops.linear_rope_write(x, weight, b, s, 16, 16, cos, sin, *pools, slots, hq * d, hkv * d, d)
        check(got, pools, want, want_pools, "fp8" if s is not None else "float")


def _count(split, op):
    return [sum(n.target == op for n in stage.graph.nodes) for stage in split.stages]


def test_paged_splits_fold_each_layers_qkv_rotation_and_change_nothing(monkeypatch):
    """A paged llama split with fused projections: the pointwise and GEMV rewrites (CUDA stages run them by default;
    forced here on the CPU, with the GEMV's 4096-row floor lowered to these small projections) fold each layer's
    q/k/v projection, rotations and cache writes into one ``linear_rope_write``; a mixed ragged step's logits and
    taps equal the split without the rewrites bit for bit, and Hugging Face's. Qwen3 normalises its query and key
    heads before the rotation, so its projection is not folded."""
    from ppsplit.passes.rewrites import gemv
    from tests.serve.test_ragged import FILL, MIXED, TAPS, assert_matches, build, references, run, sequences

    monkeypatch.setattr(gemv, "MIN_OUT", 1)
    seqs = sequences({0: 7, 1: 31, 2: 16, 3: 25})
    tables = {s: list(range(3 * s, 3 * s + 3)) for s in range(4)}
    for arch, folded in (("llama", [2, 2]), ("qwen3", [0, 0])):
        model, traced = build(arch)
        fused = ppsplit.split_model(traced, 2, aux=list(TAPS), fuse_projections=True, fuse_pointwise=True)
        for stage in fused.stages:
            gemv.route_gemv(stage)
        plain = ppsplit.split_model(traced, 2, aux=list(TAPS), fuse_projections=True, fuse_pointwise=False,
                                    gemv=False)
        assert _count(fused, ops.linear_rope_write.default) == folded, arch
        assert _count(fused, ops.rope_write.default) == [2 - f for f in folded], arch
        for segments in (FILL, MIXED):
            (a, a_aux), (b, b_aux) = run(fused, seqs, segments, tables), run(plain, seqs, segments, tables)
            assert torch.equal(a, b) and torch.equal(a_aux, b_aux), arch
        assert_matches(MIXED, a, a_aux, references(model, seqs))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_steps_with_the_fold_equal_the_split_without_it_on_gpu(arch, monkeypatch):
    """bf16 on a GPU, the default paged split (the GEMV's 4096-row floor lowered to these small projections, so the
    q/k/v GEMV serves them and folds the rotary and writes; Qwen2's projections have a bias) against the same split
    without the fold: a prefill, then eight decode steps of one sequence (each reading the keys and values the ones
    before wrote), eager and captured, give bit-equal logits and taps."""
    from ppsplit.passes.rewrites import gemv as gemv_pass
    from ppsplit.passes.rewrites import pointwise as pointwise_pass
    from ppsplit.triton_kernels import gemv, qkv
    from tests.support import assert_decode_steps_equal, tiny_model

    for module in (gemv_pass, gemv, qkv):
        monkeypatch.setattr(module, "MIN_OUT", 1)
    model = tiny_model(arch).to(device="cuda", dtype=torch.bfloat16)
    cache = ppsplit.CacheConfig(batch_size=2, max_len=64, num_blocks=8, block_size=16)
    fused = ppsplit.split_model(model, 2, aux=[0, 2], cache=cache)
    with monkeypatch.context() as apart:
        for module in (gemv_pass, pointwise_pass):
            apart.setattr(module, "fold_qkv_rotation", lambda node, projection: False)
        plain = ppsplit.split_model(model, 2, aux=[0, 2], cache=cache)
    assert all(_count(fused, ops.linear_rope_write.default)) and not any(_count(plain, ops.linear_rope_write.default))
    graphed = ppsplit.split_model(model, 2, aux=[0, 2], cache=cache).capture(0, [1])
    assert_decode_steps_equal(fused, plain, graphed, f"{arch}: ")
