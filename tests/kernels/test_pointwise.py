"""The pointwise kernels (rotary embedding, SiLU-and-multiply) and the stage rewrite that routes a graph to them.

The kernels round where the ATen ops round, so the tests ask for equality, not closeness: under TRITON_INTERPRET=1
in fp16 on the CPU, in bf16 and fp16 on a GPU (marker ``gpu``). The rewrite is checked on CPU splits (the ops'
ATen path) against Hugging Face bit for bit, and on a GPU against the same split without it.
"""
import os

import pytest
import torch

from ppsplit.triton_kernels.common import HAVE_TRITON
from tests.support import reference, tiny_model

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")

# (batch, heads, tokens, head_dim, rotary dim) and the layouts a traced graph hands the op: x a head-split slice of
# a fused q/k/v output, cos/sin [B or 1, 1, N, D].
ROPE_CASES = [(1, 32, 1, 128, 128), (3, 4, 7, 64, 64), (2, 5, 33, 256, 256), (1, 3, 9, 96, 48), (2, 8, 5, 80, 80)]


def kernel_device():
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernel on CPU tensors, which needs TRITON_INTERPRET=1 (set by conftest)")
    return "cpu"


def rope_inputs(case, dtype, device, batch_cos=False):
    B, H, N, D, R = case
    torch.manual_seed(sum(case))
    fused = torch.randn(B, N, (H + 2) * D, dtype=dtype, device=device) * 4  # q | k | v of one linear
    x = fused[..., :H * D].reshape(B, N, H, D).transpose(1, 2)[..., :R]  # R < D: a partial rotary's slice
    angles = torch.rand(B if batch_cos else 1, N, R, device=device) * 100
    return x, angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1)


@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize("batch_cos", [False, True])
def test_rope_kernel_is_the_aten_ops_bit_for_bit(case, batch_cos):
    from ppsplit.triton_kernels.pointwise import launch_rope, rope_reference

    device = kernel_device()
    for dtype in (torch.float16,) + ((torch.bfloat16,) if device == "cuda" else ()):
        x, cos, sin = rope_inputs(case, dtype, device, batch_cos)
        out = launch_rope(x, cos, sin)
        ref = rope_reference(x, cos, sin)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert torch.equal(out, ref), f"{dtype}: {(out != ref).sum().item()} of {out.numel()} values differ"
        big = [d for d in range(4) if out.shape[d] > 1]  # a dimension of size 1 has no meaningful stride
        assert [out.stride(d) for d in big] == [ref.stride(d) for d in big], "the layout an ATen op gives"


@pytest.mark.parametrize("shape", [(1, 1, 14336), (3, 5, 769), (2, 1000), (7, 64)])
def test_silu_mul_kernel_is_the_aten_ops_bit_for_bit(shape):
    from ppsplit.triton_kernels.pointwise import launch_silu_mul

    device = kernel_device()
    for dtype in (torch.float16,) + ((torch.bfloat16,) if device == "cuda" else ()):
        torch.manual_seed(shape[-1])
        gate_up = torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype, device=device) * 6  # one fused linear
        a, b = gate_up[..., :shape[-1]], gate_up[..., shape[-1]:]
        if len(shape) == 2:  # rows behind a dimension of size 1 whose stride is not theirs (unsqueeze)
            a, b = a[:, None], b[:, None]
            assert a.stride(1) != a.stride(0)
        out = launch_silu_mul(a, b)
        ref = torch.nn.functional.silu(a) * b
        if device == "cuda":  # ATen's CUDA silu: libdevice exp and an IEEE division, as the kernel
            assert torch.equal(out, ref), f"{dtype}: {(out != ref).sum().item()} of {out.numel()} values differ"
        else:  # the CPU's vectorised exp and the interpreter's numpy exp may round the last bit apart
            differ = out != ref
            assert differ.sum() <= max(2, out.numel() // 1000)
            one_ulp = ref[differ].float().abs() * 2.0 ** -10 + 2.0 ** -24
            assert ((out[differ].float() - ref[differ].float()).abs() <= one_ulp * 2).all()


def rope_write_inputs(hq, hkv, n, d, dtype, device, block=16):
    """A ragged step's fused q | k | v projection output for ``n`` tokens, HF's head-split views of it, cos / sin,
    NaN-filled pools and slots: token 1 is padding (slot -1), the others in shuffled blocks."""
    torch.manual_seed(hq * n + d)
    fused = torch.randn(1, n, (hq + 2 * hkv) * d, dtype=dtype, device=device) * 4
    heads = lambda lo, h: fused[..., lo * d:(lo + h) * d].reshape(1, n, h, d).transpose(1, 2)  # noqa: E731
    q, k, v = heads(0, hq), heads(hq, hkv), heads(hq + hkv, hkv)
    angles = torch.rand(1, n, d, device=device) * 100
    blocks = -(-n // block) + 2
    pools = [torch.full((blocks, block, hkv, d), float("nan"), dtype=dtype, device=device) for _ in range(2)]
    slots = torch.randperm(blocks * block)[:n].to(device)
    if n > 1:
        slots[1] = -1
    return q, k, v, angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1), pools, slots


@pytest.mark.parametrize("hq,hkv,n,d", [(4, 2, 7, 64), (32, 8, 1, 128), (6, 1, 33, 96), (3, 3, 2, 256)])
def test_rope_write_kernel_is_the_three_ops_bit_for_bit(hq, hkv, n, d):
    """The fused kernel against what it replaces, ``rope(q)``, ``rope(k)`` and ``paged_write_pair``: the rotated
    query, and every pool row, bit for bit; a padding token (slot -1) writes nothing."""
    from ppsplit.triton_kernels.paged import _write_rows
    from ppsplit.triton_kernels.pointwise import launch_rope_write, rope_reference, rope_write_usable

    device = kernel_device()
    for dtype in (torch.float16,) + ((torch.bfloat16,) if device == "cuda" else ()):
        q, k, v, cos, sin, pools, slots = rope_write_inputs(hq, hkv, n, d, dtype, device)
        value = v[0].transpose(0, 1)  # the value's head-major view, as the paged pass writes it
        if device == "cuda":
            assert rope_write_usable(q, k, cos, sin, *pools, value, slots)
        want = [p.clone() for p in pools]
        _write_rows(want[0], rope_reference(k, cos, sin)[0].transpose(0, 1), slots)
        _write_rows(want[1], value, slots)
        out = launch_rope_write(q, k, cos, sin, *pools, value, slots)
        ref = rope_reference(q, cos, sin)
        assert torch.equal(out, ref), f"{dtype}: {(out != ref).sum().item()} of {out.numel()} query values differ"
        for got, expected in zip(pools, want):
            assert torch.equal(got.isnan(), expected.isnan()), "a row written that the slots do not name, or missed"
            assert torch.equal(got.nan_to_num(), expected.nan_to_num())


def test_rope_write_op_on_the_cpu_is_the_three_ops():
    """The op's torch path (CPU tensors, fp32): the rotated query returned, the rotated keys and the values written."""
    from ppsplit.triton_kernels.pointwise import rope_reference

    q, k, v, cos, sin, pools, slots = rope_write_inputs(4, 2, 5, 16, torch.float32, "cpu")
    value = v[0].transpose(0, 1)
    out = torch.ops.ppsplit.rope_write(q, k, cos, sin, *pools, value, slots)
    assert torch.equal(out, rope_reference(q, cos, sin))
    real = slots >= 0
    keys = rope_reference(k, cos, sin)[0].transpose(0, 1)
    for pool, written in zip(pools, (keys, value)):
        flat = pool.view(-1, *pool.shape[2:])
        assert torch.equal(flat[slots[real]], written[real])
        assert int((~flat.isnan().flatten(1).all(1)).sum()) == int(real.sum()), "padding wrote a row"


def test_ops_take_the_aten_path_where_the_kernel_does_not_apply():
    """fp32, mixed dtypes, CPU tensors: the ATen ops themselves (the op never changes a result)."""
    from ppsplit.triton_kernels.pointwise import rope_reference

    x, cos, sin = rope_inputs((2, 4, 5, 16, 16), torch.float32, "cpu")
    assert torch.equal(torch.ops.ppsplit.rope(x, cos, sin), rope_reference(x, cos, sin))
    assert torch.equal(torch.ops.ppsplit.rope(x.half(), cos, sin), rope_reference(x.half(), cos, sin))
    a, b = torch.randn(3, 10), torch.randn(3, 10)
    assert torch.equal(torch.ops.ppsplit.silu_mul(a, b), torch.nn.functional.silu(a) * b)
    assert torch.equal(torch.ops.ppsplit.silu_mul(a, b[:1]), torch.nn.functional.silu(a) * b[:1])  # broadcast


def counts(split):
    return [stage.meta.get("ppsplit.pointwise") for stage in split.stages]


@pytest.mark.parametrize("arch,rope_per_layer,silu_per_layer", [("llama", 2, 1), ("phi3", 2, 1), ("gpt_neox", 2, 0),
                                                                ("gemma2", 2, 0)])
def test_rewrite_routes_the_chains_and_keeps_logits_bit_equal(arch, rope_per_layer, silu_per_layer):
    """CPU splits with ``fuse_pointwise=True``: every layer's q and k rotary (GPT-NeoX: partial, on a slice) and the
    SwiGLU MLPs (Phi-3: ``up * silu(gate)``) go through the ops, and logits and taps equal Hugging Face's bit for
    bit, with fused projections (whose slices carry no recorded shape) and, for Llama, without."""
    import ppsplit

    model = tiny_model(arch, num_layers=4)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    logits_ref, hidden_ref = reference(model, ids)
    for fuse_projections in ((False, True) if arch == "llama" else (True,)):
        split = ppsplit.split_model(model, 2, aux="1,3", fuse_pointwise=True, fuse_projections=fuse_projections)
        per_stage = counts(split)
        assert per_stage == [{"rope": 2 * rope_per_layer, "silu_mul": 2 * silu_per_layer}] * 2, per_stage
        logits, aux = split(ids, torch.arange(9))
        assert torch.equal(logits, logits_ref)
        assert torch.equal(aux[0], hidden_ref[1]) and torch.equal(aux[1], hidden_ref[3])
    assert counts(ppsplit.split_model(model, 2)) == [None, None], "the CPU default leaves the traced ops"


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_compiled_folders_stages_get_the_rotary_folds(arch, tmp_path):
    """A compiled folder's program keeps each node's static shape (``ppsplit.shape``; the fake values a trace has are
    gone), so the pointwise pass matches the rotary embedding in a loaded stage as in a split: each layer's
    rotations and key and value writes become one ``rope_write`` (the pass runs on CUDA stages at load; here by hand
    on the CPU, where its ops are the ATen ones), and the logits and taps equal the unfused stages' bit for bit."""
    import ppsplit
    from ppsplit.cli import main
    from ppsplit.passes.rewrites.pointwise import fuse_pointwise

    tiny_model(arch, num_layers=4).save_pretrained(tmp_path / "model")
    assert main(["compile", str(tmp_path / "model"), "--pp", "2", "--aux", "1,3", "-o", str(tmp_path / "out")]) == 0
    plain, fused = ppsplit.load(str(tmp_path / "out")), ppsplit.load(str(tmp_path / "out"))
    reports = [fuse_pointwise(stage) for stage in fused.stages]
    assert [r["rope_write"] for r in reports] == [2, 2] and [r["rope"] for r in reports] == [0, 0], reports
    ids = torch.randint(3, 60, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        (a, a_aux), (b, b_aux) = fused(ids), plain(ids)
    assert torch.equal(a, b) and torch.equal(a_aux, b_aux)


def test_rewrite_leaves_what_it_does_not_recognise():
    """A rotate-half whose halves are swapped the other way (cat(x1, -x2)) is not HF's rotary: it stays as traced."""
    from ppsplit.passes.rewrites.pointwise import fuse_pointwise

    class Odd(torch.nn.Module):
        def forward(self, x, cos, sin):
            h = x.shape[-1] // 2
            return x * cos + torch.cat((x[..., :h], -x[..., h:]), dim=-1) * sin

    args = (torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8))
    gm = torch.export.export(Odd(), args).module()
    assert fuse_pointwise(gm) == {"rope": 0, "silu_mul": 0}
    assert torch.equal(gm(*args), Odd()(*args))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_default_cuda_split_routes_and_equals_the_traced_ops_in_bf16():
    import ppsplit

    model = tiny_model("llama", num_layers=4).to("cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), device="cuda")
    pos = torch.arange(9, device="cuda")
    fused = ppsplit.split_model(model, 2, aux="1,3")
    assert counts(fused) == [{"rope": 4, "silu_mul": 2}] * 2
    plain = ppsplit.split_model(model, 2, aux="1,3", fuse_pointwise=False)
    a, b = fused(ids, pos), plain(ids, pos)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert counts(ppsplit.split_model(model, 2, compile=True)) == [None, None], "Inductor fuses them under compile"
