"""Weight-only FP8 linear: ``y = x @ dequant(W_q, scale).T (+ b)`` for FP8 checkpoints stored as shipped.

``W_q`` is ``[N, K]`` ``float8_e4m3fn``; ``scale`` holds one float per ``[block_n, block_k]`` block, in any shape
with ``ceil(N / block_n) * ceil(K / block_k)`` elements, row-major over the blocks (the last block of a row or
column may be partial, as in DeepSeek-V3's ``weight_dequant``). The three layouts ppsplit reads:

- block-scaled FP8 (``quant_method: "fp8"``): ``weight_scale_inv [ceil(N/128), ceil(K/128)]``, block ``(128, 128)``;
- compressed-tensors per channel: ``weight_scale [N, 1]``, block ``(1, K)``;
- compressed-tensors per tensor: ``weight_scale [1]`` (or ``[]``), block ``(N, K)``.

The math is ``W[n, k] = float(W_q[n, k]) * scale[n // block_n, k // block_k]`` (transformers'
``Fp8Dequantize`` / compressed-tensors' ``dequantize``, both multiply), then ``F.linear`` in ``x``'s dtype.
The torch path dequantises the weight on the fly on every call (what the CPU tests compare); it is the
correctness path, not the fast one.
"""
from __future__ import annotations

from typing import Optional

import torch

from ppsplit.triton_kernels.common import register

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


@register("ppsplit::fp8_linear")
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
               block_n: int, block_k: int) -> torch.Tensor:
    """``F.linear(x, dequantize(weight, scale, block_n, block_k, x.dtype), bias)``."""
    return torch.nn.functional.linear(x, dequantize(weight, scale, block_n, block_k, x.dtype), bias)
