"""A paged stage's fused q/k/v projection with its rotary embedding and key and value writes in the GEMV's epilogue:
``ppsplit::linear_rope_write``.

After ``fuse_projections`` and the ``rope_write`` fold (``passes.rewrites.pointwise``) a Llama-style attention block
of a paged stage starts with::

    y = linear(x, W_qkv, b)                          # or fp8_linear(x, W_qkv, scale, b, block_n, block_k)
    q = y[..., :Wq].reshape(1, T, -1, D).transpose(1, 2)
    k = y[..., Wq:Wq + Wk].reshape(1, T, -1, D).transpose(1, 2)
    v = y[..., Wq + Wk:].reshape(1, T, -1, Dv).transpose(1, 2)[0].transpose(0, 1)
    q2 = rope_write(q, k, cos, sin, K, V, v, slots)

At decode batch 1 that is a GEMV and a kernel of a few KiB, whose cost is its launch. Here the GEMV's programs take
rotation pairs (a head's rows ``j`` and ``j + D / 2``, ``gemv.gated_rows``) and its epilogue rotates the query and
key heads and writes the keys and values (``gemv.rope_store``): one kernel, bit-equal to the two, since every row is
summed as the plain GEMV sums it (same tiles) and the epilogue rounds as ``rope_write`` does. Every other call (more
rows, the CPU, shapes the epilogue does not cover) runs the projection's op and ``rope_write``, as the graph did.
"""
from __future__ import annotations

from typing import Optional

import torch

from ppsplit.triton_kernels.common import on_gpu, register
from ppsplit.triton_kernels.fp8 import fp8_linear_of, fp8_usable, launch_fp8_gemv, linear_config
from ppsplit.triton_kernels.gemv import MIN_OUT, RopeEpilogue, gemv_usable, launch_gemv, linear_of, pick_config
from ppsplit.triton_kernels.pointwise import HALF, rope_write


def rope_epilogue_usable(x, weight, scale, block_k: int, cos, sin, pool, other_pool, slots, q_width: int,
                         k_width: int, head_dim: int) -> bool:
    """Whether one GEMV serves ``linear_rope_write``: one fp16 / bf16 CUDA row whose projection the GEMV serves
    (``gemv_usable`` with ``MIN_OUT`` rows, or ``fp8_usable`` on the GEMV's tiles), widths of whole heads of an even
    ``head_dim``, one ``cos`` / ``sin`` row of ``head_dim`` in the row's dtype (shared by the heads), contiguous
    pools whose rows are the keys' and the value's widths, and one slot."""
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    v_width = n - q_width - k_width
    if not (on_gpu(x) and x.dtype in HALF and x.numel() == x.shape[-1] == k and head_dim % 2 == 0
            and q_width % head_dim == 0 and k_width % head_dim == 0 and v_width > 0 and v_width % head_dim == 0):
        return False
    if scale is None:
        served = gemv_usable(x, weight) and n >= MIN_OUT
    else:
        served = fp8_usable(x, weight, block_k) and len(linear_config(1, n, k, x.device)) == 4
    return (served and all(t.dtype == x.dtype and t.device == x.device and t.numel() == head_dim
                           and t.stride(-1) == 1 for t in (cos, sin))
            and pool.is_contiguous() and other_pool.is_contiguous() and pool.dim() >= 3 and other_pool.dim() >= 3
            and pool[0, 0].numel() == k_width and other_pool[0, 0].numel() == v_width
            and pool.device == other_pool.device == slots.device == x.device
            and slots.numel() == 1 and slots.dtype in (torch.int32, torch.int64))


def launch_linear_rope_write(x, weight, bias, scale, block_n: int, block_k: int, cos, sin, pool, other_pool, slots,
                             q_width: int, k_width: int, head_dim: int, wrap=lambda kernel: kernel, config=None):
    """The one-kernel path of ``linear_rope_write`` (``rope_epilogue_usable``): returns the rotated query
    ``[1, HQ, 1, D]`` (laid out as ``rope_write`` lays it out)."""
    n, k = weight.shape
    query = torch.empty(1, 1, q_width // head_dim, head_dim, dtype=x.dtype, device=x.device).transpose(1, 2)
    rope = RopeEpilogue(query, cos, sin, pool, other_pool, slots, q_width // head_dim, k_width // head_dim,
                        head_dim // 2)
    x2 = x.reshape(1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if scale is None:
        launch_gemv(x2, weight, bias, config=config or pick_config(n, k), wrap=wrap, rope=rope)
    else:
        launch_fp8_gemv(x2, weight, scale.reshape(-1), bias, query, block_n, block_k, config, wrap, rope=rope)
    return query


@register("ppsplit::linear_rope_write", ("pool", "other_pool"), opaque=True)
def linear_rope_write(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      scale: Optional[torch.Tensor], block_n: int, block_k: int, cos: torch.Tensor, sin: torch.Tensor,
                      pool: torch.Tensor, other_pool: torch.Tensor, slots: torch.Tensor, q_width: int, k_width: int,
                      head_dim: int) -> torch.Tensor:
    """``rope_write(q, k, cos, sin, pool, other_pool, v, slots)`` of the query, key and value heads (``head_dim``
    wide; the value's as the value pool's rows hold them) in the column spans ``[0, q_width)``, ``[q_width, q_width
    + k_width)`` and the rest of ``y = linear(x, weight, bias)`` (``scale`` not ``None``: ``fp8_linear(x, weight,
    scale, bias, block_n, block_k)``). At one CUDA row (``rope_epilogue_usable``) one GEMV kernel, bit-equal to
    the two ops; otherwise the two ops' own paths."""
    if rope_epilogue_usable(x, weight, scale, block_k, cos, sin, pool, other_pool, slots, q_width, k_width,
                            head_dim):
        with torch.cuda.device(x.device):
            return launch_linear_rope_write(x, weight, bias, scale, block_n, block_k, cos, sin, pool, other_pool,
                                            slots, q_width, k_width, head_dim)
    y = linear_of(x, weight, bias) if scale is None else fp8_linear_of(x, weight, scale, bias, block_n, block_k)
    t = y.shape[-2]
    q, k = (y[..., lo:hi].reshape(1, t, -1, head_dim).transpose(1, 2)
            for lo, hi in ((0, q_width), (q_width, q_width + k_width)))
    v = y[..., q_width + k_width:].reshape(t, *other_pool.shape[2:])
    return rope_write(q, k, cos, sin, pool, other_pool, v, slots)


@linear_rope_write.register_fake
def _(x, weight, bias, scale, block_n, block_k, cos, sin, pool, other_pool, slots, q_width, k_width, head_dim):
    return x.new_empty(1, x.shape[-2], q_width // head_dim, head_dim).transpose(1, 2)
