"""Tap stores fused into the kernels that already read the tensor: residual add, RMSNorm, LayerNorm.

One Triton kernel, one program per row of ``H`` elements, computes (every step optional, chosen at compile
time)::

    s = x + r                       # residual add, in the model dtype (fp32 math, one rounding), written out
    aux[slot] = s                   # the tap: its bytes, no extra launch
    y = norm(s)                     # the next layer's normalised input

with ``norm`` one of the Hugging Face conventions (``KINDS``), reproduced op for op:

- ``rms``      LlamaRMSNorm (Llama, Mistral, Qwen2/3, Phi-3, Mixtral):
               ``w * (s_f32 * rsqrt(mean(s_f32^2) + eps)).to(dtype)``
- ``rms_1p``   GemmaRMSNorm (Gemma 1/2/3): ``(s_f32 * rsqrt(mean(s_f32^2) + eps) * (1 + w_f32)).to(dtype)``
- ``rms_f32w`` weight applied in fp32 (OLMo-2 style): ``(s_f32 * rsqrt(mean(s_f32^2) + eps) * w_f32).to(dtype)``
- ``layer``    nn.LayerNorm with optional bias (GPT-2, GPT-NeoX, OPT): fp32 mean/variance, affine, cast.

CPU tensors take the same formulas as plain torch ops (bit-identical to Hugging Face), so every graph runs
anywhere. The ops are registered with ``torch.library.triton_op`` so ``torch.compile``, ``torch.export`` and
CUDA-graph capture see through them.
"""
from __future__ import annotations

from typing import Optional

import torch

from ppsplit.triton_kernels.common import HAVE_TRITON, launch_options, on_gpu, register, tl, triton, wrap_triton

KINDS = {"none": 0, "rms": 1, "rms_1p": 2, "rms_f32w": 3, "layer": 4}  # the kernel's NORM argument
NORM_KINDS = tuple(k for k in KINDS if k != "none")


def norm_reference(kind: str, s: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float):
    """The Hugging Face op sequence of each norm convention (the CPU path, and the test reference)."""
    if kind == "layer":
        return torch.nn.functional.layer_norm(s, (s.shape[-1],), weight, bias, eps)
    f = s.to(torch.float32)
    normed = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "rms":
        return weight * normed.to(s.dtype)
    if kind == "rms_1p":
        return (normed * (1.0 + weight.float())).to(s.dtype)
    if kind == "rms_f32w":
        return (normed * weight.float()).to(s.dtype)
    raise ValueError(f"unknown norm kind {kind!r}; expected one of {', '.join(k for k in KINDS if k != 'none')}")


if HAVE_TRITON:
    from ppsplit.triton_kernels.common import wait_for_previous

    # The kernel branches on these at compile time (globals a kernel reads must be constexpr).
    _NONE = tl.constexpr(KINDS["none"])
    _RMS = tl.constexpr(KINDS["rms"])
    _RMS_1P = tl.constexpr(KINDS["rms_1p"])
    _LAYER = tl.constexpr(KINDS["layer"])

    @triton.jit
    def _tap_row(X, R, W, B, S, Y, AUX, row, stride_x, stride_r, stride_s, stride_y, n_cols, eps, aux_start,
                 HAS_ADD: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, STORE: tl.constexpr,
                 BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        dtype = X.dtype.element_ty
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_ADD:
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
            s = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(S + row * stride_s + cols, s, mask=mask)
        else:
            s = x
        if STORE:
            tl.store(AUX + aux_start + row * n_cols + cols, s, mask=mask)
        if NORM != _NONE:
            sf = s.to(tl.float32)
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            if NORM == _LAYER:
                mean = tl.sum(sf, axis=0) / n_cols
                d = tl.where(mask, sf - mean, 0.0)
                rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n_cols + eps)
                y = d * rstd * w
                if HAS_BIAS:
                    y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                normed = sf * tl.rsqrt(tl.sum(sf * sf, axis=0) / n_cols + eps)
                if NORM == _RMS:
                    y = normed.to(dtype).to(tl.float32) * w
                elif NORM == _RMS_1P:
                    y = normed * (1.0 + w)
                else:  # rms_f32w
                    y = normed * w
            tl.store(Y + row * stride_y + cols, y.to(dtype), mask=mask)

    @triton.jit
    def _tap_kernel(X, R, W, B, S, Y, AUX, stride_x, stride_r, stride_s, stride_y, n_cols, eps, aux_start,
                    HAS_ADD: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, STORE: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr):
        # One program per row (a grid-stride variant measured no faster at T = 2048: bench/RESULTS.md).
        wait_for_previous(PDL)  # PDL: common.launch_options
        _tap_row(X, R, W, B, S, Y, AUX, tl.program_id(0).to(tl.int64), stride_x, stride_r, stride_s, stride_y,
                 n_cols, eps, aux_start, HAS_ADD, NORM, HAS_BIAS, STORE, BLOCK)

    @triton.jit
    def _store_kernel(V, AUX, stride_v, n_cols, aux_start, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < n_cols
        tl.store(AUX + aux_start + row * n_cols + col, tl.load(V + row * stride_v + col, mask=mask), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, H]`` with unit stride along H (a copy only if it is not already)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _slot(aux: torch.Tensor, slot: int) -> int:
    """Where ``aux[slot]`` starts in ``aux``, in elements; the slot must be contiguous.

    The kernels take the whole ``aux`` and this offset, never the view ``aux[slot]``. Under ``torch.compile``
    (pytorch/pytorch#192226, reported on a 2.14 pre-release), a view with a storage offset that a Triton kernel
    mutates is cloned by reading ``offset + span`` elements from a buffer Inductor sized to the view alone, past
    its end: the likely cause of the compiled stages' illegal memory accesses (bench/RESULTS.md section 29)."""
    if not aux[slot].is_contiguous():
        raise ValueError("the aux slot must be contiguous")
    return slot * aux.stride(0)


def launch_tap_kernel(x, r, weight, bias, aux, eps: float, kind: str, *, want_s: bool, slot: int = 0,
                      wrap=lambda k: k, out: tuple = (None, None)):
    """Run the fused kernel on ``x`` (and ``r``): returns ``(s or None, y or None)``. ``s`` is stored into
    ``aux[slot]`` (a contiguous ``[..., H]`` slot) unless ``aux`` is ``None``; ``out`` optionally gives the ``s``
    and ``y`` buffers. Works on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (the kernel tests)."""
    n_cols = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(r) if r is not None else x2
    s = (out[0] if out[0] is not None else torch.empty_like(x)) if r is not None and want_s else None
    y = (out[1] if out[1] is not None else torch.empty_like(x)) if kind != "none" else None
    s2 = s.view(-1, n_cols) if s is not None else x2
    y2 = y.view(-1, n_cols) if y is not None else x2
    aux_start = _slot(aux, slot) if aux is not None else 0
    block = triton.next_power_of_2(n_cols)
    wrap(_tap_kernel)[(x2.shape[0],)](
        x2, r2, weight if weight is not None else x2, bias if bias is not None else x2, s2, y2,
        aux if aux is not None else x2, x2.stride(0), r2.stride(0), s2.stride(0), y2.stride(0),
        n_cols, eps, aux_start, HAS_ADD=r is not None, NORM=KINDS[kind], HAS_BIAS=bias is not None,
        STORE=aux is not None, BLOCK=block, num_warps=_warps(block), **launch_options(x2))
    return s, y


def launch_store_kernel(value, aux, slot: int, *, wrap=lambda k: k):
    """``aux[slot][...] = value`` with one strided copy kernel."""
    n_cols = value.shape[-1]
    v2 = _rows(value)
    block = min(triton.next_power_of_2(n_cols), 4096)
    wrap(_store_kernel)[(v2.shape[0], triton.cdiv(n_cols, block))](v2, aux, v2.stride(0), n_cols, _slot(aux, slot),
                                                                   BLOCK=block, num_warps=_warps(block))


def _copy_rows(slot: torch.Tensor, value: torch.Tensor) -> None:
    """``slot = value`` row by row: the value may be ``[B*T, H]`` (OPT flattens its MLP input) or ``[B, T, H]``."""
    slot.view(-1, slot.shape[-1]).copy_(value.reshape(-1, value.shape[-1]))


@register("ppsplit::tap_store", ("aux",))
def tap_store(aux: torch.Tensor, slot: int, value: torch.Tensor) -> None:
    """``aux[slot] = value``: the store of one tap that no kernel could absorb."""
    if on_gpu(value):
        with torch.cuda.device(value.device):
            launch_store_kernel(value, aux, slot, wrap=wrap_triton)
    else:
        _copy_rows(aux[slot], value)


@register("ppsplit::add_store", ("aux",))
def add_store(x: torch.Tensor, r: torch.Tensor, aux: torch.Tensor, slot: int) -> torch.Tensor:
    """``s = x + r; aux[slot] = s`` (a tap on a stage boundary: its norm runs on the next stage)."""
    if on_gpu(x):
        with torch.cuda.device(x.device):
            return launch_tap_kernel(x, r, None, None, aux, 0.0, "none", want_s=True, slot=slot, wrap=wrap_triton)[0]
    s = x + r
    _copy_rows(aux[slot], s)
    return s


@register("ppsplit::add_norm")
def add_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
             kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + r; y = norm(s)``: the residual add and the next norm in one kernel (no tap here)."""
    if on_gpu(x):
        with torch.cuda.device(x.device):
            return launch_tap_kernel(x, r, weight, bias, None, eps, kind, want_s=True, wrap=wrap_triton)
    s = x + r
    return s, norm_reference(kind, s, weight, bias, eps)


@register("ppsplit::add_norm_store", ("aux",))
def add_norm_store(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   aux: torch.Tensor, slot: int, eps: float, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + r; aux[slot] = s; y = norm(s)`` in one kernel."""
    if on_gpu(x):
        with torch.cuda.device(x.device):
            return launch_tap_kernel(x, r, weight, bias, aux, eps, kind, want_s=True, slot=slot, wrap=wrap_triton)
    s = x + r
    _copy_rows(aux[slot], s)
    return s, norm_reference(kind, s, weight, bias, eps)


@register("ppsplit::norm")
def norm(s: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, kind: str) -> torch.Tensor:
    """``y = norm(s)`` in one kernel."""
    if on_gpu(s):
        with torch.cuda.device(s.device):
            return launch_tap_kernel(s, None, weight, bias, None, eps, kind, want_s=False, wrap=wrap_triton)[1]
    return norm_reference(kind, s, weight, bias, eps)


@register("ppsplit::norm_store", ("aux",))
def norm_store(s: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], aux: torch.Tensor, slot: int,
               eps: float, kind: str) -> torch.Tensor:
    """``aux[slot] = s; y = norm(s)`` in one kernel (tap 0: the embedding output entering layer 0's norm)."""
    if on_gpu(s):
        with torch.cuda.device(s.device):  # Triton launches on the current device, not the tensors'
            return launch_tap_kernel(s, None, weight, bias, aux, eps, kind, want_s=False, slot=slot,
                                     wrap=wrap_triton)[1]
    _copy_rows(aux[slot], s)
    return norm_reference(kind, s, weight, bias, eps)
