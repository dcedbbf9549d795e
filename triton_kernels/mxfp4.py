"""MXFP4 MoE experts (gpt-oss) read as the checkpoint stores them: ``y = x @ dequant(blocks, scales)^T`` per expert.

An expert's weight ``[N, K]`` is stored as ``blocks [N, K/32, 16]`` (uint8: two FP4 E2M1 values a byte, the low
nibble first) and ``scales [N, K/32]`` (uint8: an E8M0 exponent per 32 values, the scale ``2 ** (s - 127)``); a
layer's experts stack them as ``[E, N, K/32, 16]`` and ``[E, N, K/32]``. The value of ``W[n, k]`` is
``FP4[nibble] * 2 ** (scales[n, k // 32] - 127)`` with ``FP4 = (0, 0.5, 1, 1.5, 2, 3, 4, 6)`` and the nibble's top bit
the sign: what transformers' ``convert_moe_packed_tensors`` computes (it then transposes the expert to ``[K, N]``,
the layout gpt-oss's experts multiply by).

- ``mxfp4_grouped_mm(x, blocks, scales, offs)``: the rows of ``x`` sorted by expert, ``offs`` each expert's row end,
  as ``torch._grouped_mm`` over the dequantised experts (what a bfloat16 trace of gpt-oss runs). On CUDA one Triton
  kernel decodes the nibbles in registers: a program per expert and ``BLOCK_N`` columns loops over its rows.
- ``mxfp4_expert_weights(blocks, scales, ids, dtype)``: the experts the routed pairs chose, dequantised, in the
  model's ``[K, N]`` layout (what a float32 trace's ``batched_mm`` multiplies by).

Elsewhere a torch path dequantises (what the CPU tests compare); it is the correctness path, not the fast one.
"""
from __future__ import annotations

import torch

from ppsplit.triton_kernels.common import HAVE_TRITON, on_gpu, register, tl, triton, wrap_triton
from ppsplit.triton_kernels.fp8 import grouped_reference, k_ranges

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks [..., G, 16]`` and ``scales [..., G]`` as the weights ``[..., G * 32]`` they stand for (exact in
    fp32, then cast to ``dtype``)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    values = torch.stack([lut[b & 15], lut[b >> 4]], dim=-1).flatten(-2)  # [..., G, 32], low nibble first
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].to(torch.float32))
    return values.flatten(-2).to(dtype)


def check_mxfp4(x: torch.Tensor | None, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """A ``ValueError`` before any kernel reads past a tensor: experts ``[E, N, G, 16]`` uint8, scales ``[E, N, G]``
    uint8, and ``x`` of ``G * 32`` features."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16 \
            or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"MXFP4 experts must be uint8 blocks [E, N, G, 16] and uint8 scales [E, N, G], but got "
                         f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    if x is not None and x.shape[-1] != blocks.shape[2] * GROUP:
        raise ValueError(f"MXFP4 experts of {blocks.shape[2] * GROUP} inputs cannot take rows of {x.shape[-1]}")


if HAVE_TRITON:
    from ppsplit.triton_kernels.fp8 import expert_rows, split_sum_kernel

    @triton.jit
    def _fp4_values(v):
        """E2M1 nibbles (int32) as fp32: sign, two exponent bits, one mantissa bit (0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
        e = (v >> 1) & 3
        m = (v & 1).to(tl.float32)
        magnitude = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
        return tl.where((v & 8) != 0, -magnitude, magnitude)

    @triton.jit
    def _mxfp4_grouped_kernel(X, B, S, OFFS, Y, N, K, K_PER, stride_x, stride_be, stride_bn, stride_se, stride_sn,
                              stride_y, stride_split, PRECISION: tl.constexpr, MX_FORMAT: tl.constexpr,
                              SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        """Expert ``program_id(0)``'s rows ``[OFFS[e - 1], OFFS[e])`` times its ``BLOCK_N`` output columns
        ``program_id(1)``, ``BLOCK_M`` rows at a time, over the inputs ``[K_PER * z, K_PER * (z + 1))``,
        ``z = program_id(2)``. Each ``BLOCK_K`` step loads ``BLOCK_K / 2`` bytes a column and ``BLOCK_K / 32``
        scales, decodes the two nibbles of each byte, scales each group of 32 and multiplies in ``x``'s dtype (an FP4
        value times a power of two is exact there), accumulating in fp32. ``SPLIT``: the input range is one of
        several, and the tile goes to its fp32 slice of ``Y`` (``fp8.split_sum_kernel`` adds them up, in
        order): at decode a few experts have rows, and more, shorter programs keep more bytes in flight."""
        e = tl.program_id(0)
        z = tl.program_id(2)
        k_lo = z * K_PER
        k_hi = tl.minimum(k_lo + K_PER, K)
        start, end = expert_rows(OFFS, e)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        b_cols = B + e.to(tl.int64) * stride_be + rn[:, None].to(tl.int64) * stride_bn
        s_cols = S + e.to(tl.int64) * stride_se + rn[:, None].to(tl.int64) * stride_sn
        for m0 in range(start, end, BLOCK_M):
            rm = m0 + tl.arange(0, BLOCK_M)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(X + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                            mask=(rm[:, None] < end) & (rk[None, :] < k_hi), other=0.0)
                rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                b = tl.load(b_cols + rb[None, :], mask=(rn[:, None] < N) & (rb[None, :] < k_hi // 2), other=0)
                rg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
                s = tl.load(s_cols + rg[None, :], mask=(rn[:, None] < N) & (rg[None, :] < k_hi // 32), other=127)
                if MX_FORMAT == "none":  # decoded here (fp32 rows, which tl.dot_scaled does not take)
                    b = b.to(tl.int32)
                    w = tl.reshape(tl.join(_fp4_values(b & 15), _fp4_values(b >> 4)), [BLOCK_N, BLOCK_K])
                    scale = tl.exp2(s.to(tl.float32) - 127.0)
                    w = tl.reshape(tl.reshape(w, [BLOCK_N, BLOCK_K // 32, 32]) * scale[:, :, None],
                                   [BLOCK_N, BLOCK_K])
                    acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
                else:  # Triton's microscaled product: its own E2M1 upcast where the GPU has no FP4 tensor cores
                    acc = tl.dot_scaled(x, None, MX_FORMAT, tl.trans(b), s, "e2m1", acc=acc)
            out = Y + z.to(tl.int64) * stride_split + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
            ok = (rm[:, None] < end) & (rn[None, :] < N)
            if SPLIT:
                tl.store(out, acc, mask=ok)
            else:
                tl.store(out, acc.to(Y.dtype.element_ty), mask=ok)


_MX_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def launch_mxfp4_grouped_mm(x, blocks, scales, offs, wrap=lambda kernel: kernel, config=(16, 64, 128, 4, 3),
                            dot_scaled: bool = True):
    """The Triton path of ``mxfp4_grouped_mm``; ``config`` is ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)``
    (``BLOCK_K`` a multiple of 32; the default the fastest or within 3% of it at every batch of gpt-oss-120b's
    experts on an H200, ``bench/experts.py --sweep``, RESULTS section 34), or with a sixth element, how many input
    ranges to split the product over (their fp32 partial sums added by a second kernel; timed by the sweep, not yet
    a default). ``dot_scaled``: bf16/fp16 rows go through ``tl.dot_scaled`` (else, and for fp32 rows, the kernel
    decodes the nibbles itself)."""
    e, n, g, _ = blocks.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape[0], g * GROUP
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    blocks, scales = blocks.contiguous(), scales.contiguous()
    bm_, bn_, bk_, warps, stages, *split = config
    k_per, splits = k_ranges(k, split[0] if split else 1, bk_)
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    wrap(_mxfp4_grouped_kernel)[(e, triton.cdiv(n, bn_), splits)](
        x, blocks, scales, offs, out, n, k, k_per, x.stride(0), blocks.stride(0), blocks.stride(1), scales.stride(0),
        scales.stride(1), n, m * n, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        MX_FORMAT=_MX_FORMATS.get(x.dtype, "none") if dot_scaled else "none", SPLIT=splits > 1, BLOCK_M=bm_,
        BLOCK_N=bn_, BLOCK_K=bk_, num_warps=warps, num_stages=stages)
    if splits > 1:
        wrap(split_sum_kernel)[(triton.cdiv(m * n, 1024),)](
            out, out, y, m * n, n, SPLITS=splits, HAS_BIAS=False, BLOCK=1024, PDL=False)
    return y


@register("ppsplit::mxfp4_grouped_mm")
def mxfp4_grouped_mm(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, W.transpose(-2, -1), offs=offs)`` with ``W`` the MXFP4 experts ``[E, N, K]`` (see the
    module docstring): on CUDA one Triton kernel over the stored bytes; elsewhere the experts are dequantised to
    ``x``'s dtype and ``grouped_reference`` runs them."""
    check_mxfp4(x, blocks, scales)
    if on_gpu(x) and x.dtype in (torch.float16, torch.bfloat16, torch.float32):
        with torch.cuda.device(x.device):
            return launch_mxfp4_grouped_mm(x, blocks, scales, offs, wrap=wrap_triton)
    return grouped_reference(x, dequantize_mxfp4(blocks, scales, x.dtype), offs)


@register("ppsplit::mxfp4_expert_weights")
def mxfp4_expert_weights(blocks: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """The experts ``ids`` chose, dequantised to ``dtype`` in the model's ``[K, N]`` layout: ``[len(ids), K, N]``."""
    check_mxfp4(None, blocks, scales)
    return dequantize_mxfp4(blocks[ids], scales[ids], dtype).transpose(-2, -1)
