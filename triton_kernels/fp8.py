"""Weight-only FP8 linear: ``y = x @ dequant(W_q, scale).T (+ b)`` for FP8 checkpoints stored as shipped.

``W_q`` is ``[N, K]`` ``float8_e4m3fn``; ``scale`` holds one float per ``[block_n, block_k]`` block, in any shape
with ``ceil(N / block_n) * ceil(K / block_k)`` elements, row-major over the blocks (the last block of a row or
column may be partial, as in DeepSeek-V3's ``weight_dequant``). The three layouts ppsplit reads:

- block-scaled FP8 (``quant_method: "fp8"``): ``weight_scale_inv [ceil(N/128), ceil(K/128)]``, block ``(128, 128)``;
- compressed-tensors per channel: ``weight_scale [N, 1]``, block ``(1, K)``;
- compressed-tensors per tensor: ``weight_scale [1]`` (or ``[]``), block ``(N, K)``.

The math is ``W[n, k] = float(W_q[n, k]) * scale[n // block_n, k // block_k]`` (transformers'
``Fp8Dequantize`` / compressed-tensors' ``dequantize``, both multiply), then ``F.linear`` in ``x``'s dtype.
On CUDA (``fp8_usable``) one Triton kernel reads the FP8 weight and its scales directly (weight-only: the
activations stay in their dtype): a GEMV for one row (decode at batch 1: each program holds ``BLOCK_N`` whole
weight rows, the scale applied per ``BLOCK_K`` tile), a tiled ``tl.dot`` GEMM for more rows, with each
``[BLOCK_M, BLOCK_N]`` partial product scaled by its weight block's scale as it is accumulated (as DeepSeek-V3's
``fp8_gemm`` does), so no dequantised weight is ever written. ``BLOCK_K`` divides ``block_k`` (or one k-block
spans the whole row), so a tile never straddles two scales. Elsewhere a torch path dequantises the weight on the
fly (what the CPU tests compare); it is the correctness path, not the fast one.
"""
from __future__ import annotations

from typing import Optional

import torch

from ppsplit.triton_kernels.common import HAVE_TRITON, on_gpu, register, tl, triton, wrap_triton

FP8_DTYPE = torch.float8_e4m3fn


def scale_grid(n: int, k: int, block_n: int, block_k: int) -> tuple[int, int]:
    """How many scale blocks an ``[n, k]`` weight has along each dimension (a last partial block counts)."""
    return -(-n // block_n), -(-k // block_k)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float(W_q) * scale`` per block, as ``dtype`` (computed in fp32)."""
    n, k = weight.shape
    gn, gk = scale_grid(n, k, block_n, block_k)
    s = scale.to(torch.float32).reshape(gn, gk)
    s = s.repeat_interleave(block_n, dim=0)[:n].repeat_interleave(block_k, dim=1)[:, :k]
    return (weight.to(torch.float32) * s).to(dtype)


if HAVE_TRITON:

    @triton.jit
    def _fp8_gemv_kernel(X, W, S, B, Y, N, K, stride_w, GK, QN, QK,
                         HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        w_rows = W + rows[:, None].to(tl.int64) * stride_w
        s_rows = S + (rows // QN) * GK
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + k, mask=k < K, other=0.0).to(tl.float32)
            w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & (k[None, :] < K), other=0.0).to(tl.float32)
            s = tl.load(s_rows + k0 // QK, mask=row_ok, other=0.0).to(tl.float32)
            acc += w * x[None, :] * s[:, None]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _fp8_gemm_kernel(X, W, S, B, Y, M, N, K, stride_x, stride_w, stride_y, GK, QN, QK,
                         HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        s_cols = S + (rn // QN) * GK
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            w = tl.load(W + rn[None, :].to(tl.int64) * stride_w + rk[:, None],
                        mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
            s = tl.load(s_cols + k0 // QK, mask=rn < N, other=0.0).to(tl.float32)
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION) * s[None, :]
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rm[:, None].to(tl.int64) * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


GEMV_CONFIG = (16, 128, 4, 3)      # BLOCK_N, BLOCK_K, warps, stages
GEMM_CONFIG = (64, 128, 4, 3)  # BLOCK_N, BLOCK_K, warps, stages; BLOCK_M from the rows (gemm_block_m)


def gemm_block_m(m: int) -> int:
    """Rows per GEMM tile: the fewest of 16, 32, 64 that cover ``m`` (each extra row tile re-reads the weight)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def fp8_usable(x: torch.Tensor, weight: torch.Tensor, block_k: int, block_kernel: int = 128) -> bool:
    """Whether the Triton kernels serve this call: CUDA (or the interpreter), an ``[N, K]`` FP8 weight with unit
    stride along K, and a ``BLOCK_K`` tile that never straddles two k-blocks."""
    return (weight.dim() == 2 and weight.dtype == FP8_DTYPE and weight.stride(1) == 1
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and (block_k % block_kernel == 0 or block_k >= weight.shape[1]))


def launch_fp8_linear(x, weight, scale, bias, block_n: int, block_k: int, wrap=lambda kernel: kernel):
    """The Triton path of ``fp8_linear`` (see the module docstring); ``x`` of any leading shape."""
    n, k = weight.shape
    gk = scale_grid(n, k, block_n, block_k)[1]
    qk = block_k if block_k < k else k  # one k-block over the row: every tile reads scale column 0
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    s = scale.reshape(-1)
    b = bias if bias is not None else s
    if m == 1:
        bn_, bk_, warps, stages = GEMV_CONFIG
        wrap(_fp8_gemv_kernel)[(triton.cdiv(n, bn_),)](
            x2, weight, s, b, y, n, k, weight.stride(0), gk, block_n, qk, HAS_BIAS=bias is not None,
            BLOCK_N=bn_, BLOCK_K=bk_, num_warps=warps, num_stages=stages)
    else:
        bn_, bk_, warps, stages = GEMM_CONFIG
        bm_ = gemm_block_m(m)
        wrap(_fp8_gemm_kernel)[(triton.cdiv(m, bm_), triton.cdiv(n, bn_))](
            x2, weight, s, b, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0), gk, block_n, qk,
            HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # no TF32 for fp32
            BLOCK_M=bm_, BLOCK_N=bn_, BLOCK_K=bk_, num_warps=warps, num_stages=stages)
    return y.reshape(*x.shape[:-1], n)


@register("ppsplit::fp8_linear")
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
               block_n: int, block_k: int) -> torch.Tensor:
    """``F.linear(x, dequantize(weight, scale, block_n, block_k, x.dtype), bias)``; on CUDA one Triton kernel that
    reads the FP8 weight directly (see the module docstring)."""
    if on_gpu(x) and fp8_usable(x, weight, block_k):
        with torch.cuda.device(x.device):
            return launch_fp8_linear(x, weight, scale, bias, block_n, block_k, wrap=wrap_triton)
    return torch.nn.functional.linear(x, dequantize(weight, scale, block_n, block_k, x.dtype), bias)
