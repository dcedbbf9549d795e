"""Fused tap kernels against an fp64 reference: odd sizes, every norm convention, poisoned outputs.

On the CPU the Triton kernels run under TRITON_INTERPRET=1 (fp32, fp16: the interpreter gives NaN for bf16);
bf16 runs on a GPU (marker ``gpu``).
"""
import pytest
import torch

from ppsplit.triton_kernels import HAVE_TRITON, KINDS, norm_reference
from ppsplit.triton_kernels.fused_norm import launch_store_kernel, launch_tap_kernel

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")

# Tolerances of the kernel against the fp64 reference, per dtype (outputs are rounded to the dtype once or twice).
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=6e-2, rtol=2e-2)}
SHAPES = [(1, 1, 769), (2, 3, 769), (1, 3, 64), (3, 5, 4096)]


def reference64(kind, x, r, w, b, eps):
    """s rounded to the dtype (it is an output); the norm of that s computed in fp64."""
    s = (x.double() + r.double()).to(x.dtype) if r is not None else x
    sd = s.double()
    if kind == "none":
        return s, None
    if kind == "layer":
        y = torch.nn.functional.layer_norm(sd, (sd.shape[-1],), w.double(), None if b is None else b.double(), eps)
    else:
        normed = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps)
        y = normed * (1.0 + w.double()) if kind == "rms_1p" else normed * w.double()
    return s, y


def poisoned(*shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def run_case(kind, shape, dtype, device, with_add, with_bias=False, with_store=True):
    torch.manual_seed(hash((kind, shape, str(dtype), with_add)) % 1000)
    B, T, H = shape
    x = torch.randn(B, T, H, dtype=dtype, device=device)
    r = torch.randn(B, T, H, dtype=dtype, device=device) if with_add else None
    w = (torch.randn(H, dtype=dtype, device=device) * 0.5 + 1) if kind != "none" else None
    b = torch.randn(H, dtype=dtype, device=device) * 0.1 if with_bias else None
    aux = poisoned(3, B, T, H, dtype=dtype, device=device)
    out = (poisoned(B, T, H, dtype=dtype, device=device), poisoned(B, T, H, dtype=dtype, device=device))
    s, y = launch_tap_kernel(x, r, w, b, aux if with_store else None, 1e-5, kind, want_s=True, slot=1, out=out)
    s_ref, y_ref = reference64(kind, x, r, w, b, 1e-5)
    if with_add:
        torch.testing.assert_close(s, s_ref, atol=0, rtol=0)  # one rounding of an exact fp32 sum
    if with_store:
        torch.testing.assert_close(aux[1], s_ref, atol=0, rtol=0)
    else:
        assert aux[1].isnan().all()
    assert aux[0].isnan().all() and aux[2].isnan().all(), "wrote outside its slot"
    if kind != "none":
        assert not y.isnan().any(), "left part of y unwritten"
        torch.testing.assert_close(y.double(), y_ref, **TOL[dtype])
    return s, y


def interpreter_only():
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernel on CPU tensors, which needs TRITON_INTERPRET=1 (set by conftest)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["rms", "rms_1p", "rms_f32w", "layer", "none"])
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_fused_kernel_interpreted(kind, shape, dtype):
    interpreter_only()
    run_case(kind, shape, dtype, "cpu", with_add=True, with_bias=kind == "layer")
    if kind != "none":
        run_case(kind, shape, dtype, "cpu", with_add=False)  # norm (+ store) only
        run_case(kind, shape, dtype, "cpu", with_add=True, with_store=False)  # add + norm, no tap


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_store_kernel_interpreted(shape):
    interpreter_only()
    value = torch.randn(*shape)
    aux = torch.full((2, *shape), float("nan"))
    launch_store_kernel(value, aux, 1)
    assert torch.equal(aux[1], value) and aux[0].isnan().all()
    # A non-contiguous source (a transposed view) is read through its strides.
    src = torch.randn(shape[2], shape[0] * shape[1]).t().reshape(*shape)
    launch_store_kernel(src, aux, 0)
    assert torch.equal(aux[0], src)


@pytest.mark.parametrize("kind", ["rms", "rms_1p", "rms_f32w", "layer"])
def test_torch_path_is_the_hf_op_sequence(kind):
    """The CPU path equals the HF module bit for bit (fp32 and bf16)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        mod = {"rms": LlamaRMSNorm(769, eps=1e-6), "rms_1p": GemmaRMSNorm(769, eps=1e-6),
               "rms_f32w": Olmo2RMSNorm(769, eps=1e-6), "layer": torch.nn.LayerNorm(769, eps=1e-6)}[kind].to(dtype)
        with torch.no_grad():
            for p in mod.parameters():
                p.copy_(torch.randn_like(p) * 0.3 + 0.5)
            s = torch.randn(2, 3, 769, dtype=dtype)
            bias = getattr(mod, "bias", None)
            got = norm_reference(kind, s, mod.weight, bias, 1e-6)
            assert torch.equal(got, mod(s)), f"{kind} {dtype}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["rms", "rms_1p", "rms_f32w", "layer", "none"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_kernel_gpu(kind, shape, dtype):
    run_case(kind, shape, dtype, "cuda", with_add=True, with_bias=kind == "layer")
    if kind != "none":
        run_case(kind, shape, dtype, "cuda", with_add=False)
        run_case(kind, shape, dtype, "cuda", with_add=True, with_store=False)


@pytest.mark.gpu
def test_ops_on_gpu_match_torch_path():
    import ppsplit.triton_kernels  # noqa: F401

    torch.manual_seed(0)
    for H in (769, 4096):
        x = torch.randn(2, 7, H, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
        aux = torch.full((2, 2, 7, H), float("nan"), device="cuda", dtype=torch.bfloat16)
        for kind in ("rms", "rms_1p", "rms_f32w"):
            s, y = torch.ops.ppsplit.add_norm_store(x, r, w, None, aux, 1, 1e-5, kind)
            s_ref = x + r
            assert torch.equal(s, s_ref) and torch.equal(aux[1], s_ref)
            torch.testing.assert_close(y, norm_reference(kind, s_ref, w, None, 1e-5), atol=3e-2, rtol=2e-2)
        torch.ops.ppsplit.tap_store(aux, 0, x)
        assert torch.equal(aux[0], x)


@pytest.mark.gpu
def test_compiled_stores_write_their_slot_and_nothing_else():
    """The store ops under ``torch.compile``, into the last slot of an aux buffer followed by a NaN canary. Passed
    the view ``aux[slot]``, a compiled graph cloned it by reading past the buffer Inductor held it in
    (pytorch/pytorch#192226), the likely cause of the compiled stages' illegal memory accesses (bench/RESULTS.md
    section 29); the kernels now take the whole buffer and the slot's offset."""
    import ppsplit.triton_kernels  # noqa: F401

    torch.manual_seed(0)
    T, H, slots = 2048, 4096, 3
    x = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16)
    r, w = torch.randn_like(x), torch.randn(H, device="cuda", dtype=torch.bfloat16)
    block = torch.full((slots + 1, 1, T, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    aux, canary = block[:slots], block[slots]  # one allocation: a write past aux lands in the canary

    def step(x, r, aux):
        s, y = torch.ops.ppsplit.add_norm_store(x, r, w, None, aux, 2, 1e-5, "rms")
        s2 = torch.ops.ppsplit.add_store(s, r, aux, 1)
        torch.ops.ppsplit.tap_store(aux, 0, y)
        return s, s2, y

    s, s2, y = torch.compile(step, fullgraph=True)(x, r, aux)
    torch.cuda.synchronize()
    assert torch.equal(aux[2], x + r) and torch.equal(aux[1], s2) and torch.equal(aux[0], y)
    assert canary.isnan().all(), "a store wrote past the aux buffer"
