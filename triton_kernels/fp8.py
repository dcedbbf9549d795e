"""Weight-only FP8 linear: ``y = x @ dequant(W_q, scale).T (+ b)`` for FP8 checkpoints stored as shipped.

``W_q`` is ``[N, K]`` ``float8_e4m3fn``; ``scale`` holds one float per ``[block_n, block_k]`` block, in any shape
with ``ceil(N / block_n) * ceil(K / block_k)`` elements, row-major over the blocks (the last block of a row or
column may be partial, as in DeepSeek-V3's ``weight_dequant``). The three layouts ppsplit reads:

- block-scaled FP8 (``quant_method: "fp8"``): ``weight_scale_inv [ceil(N/128), ceil(K/128)]``, block ``(128, 128)``;
- compressed-tensors per channel: ``weight_scale [N, 1]``, block ``(1, K)``;
- compressed-tensors per tensor: ``weight_scale [1]`` (or ``[]``), block ``(N, K)``.

The math is ``W[n, k] = float(W_q[n, k]) * scale[n // block_n, k // block_k]`` (transformers'
``Fp8Dequantize`` / compressed-tensors' ``dequantize``, both multiply), then ``F.linear`` in ``x``'s dtype.
On CUDA (``fp8_usable``) Triton kernels read the FP8 weight and its scales directly (weight-only: the
activations stay in their dtype), so no dequantised weight is ever written:

- one row (decode at batch 1): a GEMV, each program ``BLOCK_N`` whole weight rows; a ``BLOCK_K`` tile may span
  several k-blocks, whose products are summed apart and scaled by their block's scale (``fp8_linear_silu_mul``:
  the same GEMV over a fused gate/up weight, whose epilogue applies the gated MLP's SiLU-and-multiply);
- more rows: a tiled ``tl.dot`` GEMM, each ``[BLOCK_M, BLOCK_N]`` partial product scaled by its weight block's
  scale as it is accumulated (as DeepSeek-V3's ``fp8_gemm`` does; ``BLOCK_K`` lies inside one k-block), with the
  k-range split over several programs whose fp32 partial tiles a second kernel adds up in a fixed order.

Elsewhere a torch path dequantises the weight on the fly (what the CPU tests compare); it is the correctness path,
not the fast one.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ppsplit.triton_kernels.common import HAVE_TRITON, launch_options, on_gpu, register, tl, triton, wrap_triton
from ppsplit.triton_kernels.gemv import check_halves, rope_arguments
from ppsplit.triton_kernels.pointwise import compiled, silu_mul_of

if HAVE_TRITON:
    from ppsplit.triton_kernels.common import prefetch_l2, wait_for_previous
    from ppsplit.triton_kernels.gemv import gated_rows, rope_store, store_rows

FP8_DTYPE = torch.float8_e4m3fn


def scale_grid(n: int, k: int, block_n: int, block_k: int) -> tuple[int, int]:
    """How many scale blocks an ``[n, k]`` weight has along each dimension (a last partial block counts)."""
    return -(-n // block_n), -(-k // block_k)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float(W_q) * scale`` per block, as ``dtype`` (computed in fp32). ``weight`` is ``[..., N, K]`` (a stack of
    experts ``[E, N, K]``: each its own ``[N, K]`` weight), ``scale`` one value per block of each."""
    *lead, n, k = weight.shape
    gn, gk = scale_grid(n, k, block_n, block_k)
    s = scale.to(torch.float32).reshape(*lead, gn, gk)
    s = s.repeat_interleave(block_n, dim=-2)[..., :n, :].repeat_interleave(block_k, dim=-1)[..., :k]
    return (weight.to(torch.float32) * s).to(dtype)


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["zero"])
    def _fp8_gemv_kernel(X, W, S, B, Y, N, K, stride_w, GK, QN, QK, GATE, UP, zero, C, SN, POOL, VPOOL, SLOTS, HQ,
                         HKV, HAS_BIAS: tl.constexpr, ONE_K_BLOCK: tl.constexpr, SUB: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr, HALF_D: tl.constexpr,
                         LIBDEVICE: tl.constexpr, PDL: tl.constexpr, LINES: tl.constexpr):
        """``BLOCK_N`` whole weight rows per program. A ``BLOCK_K`` tile spans ``SUB`` k-blocks (``SUB = 1``: the
        tile lies inside one): its products are summed per k-block and scaled by that block's scale, so the scales
        cost ``SUB`` loads per row and tile, not one per weight. ``ONE_K_BLOCK``: one scale per row (per channel,
        per tensor), applied once at the end.

        ``GLU``: the ``N`` outputs are ``silu(y[GATE + i]) * y[UP + i]`` of the projection ``y`` (a fused gate/up
        weight): a program's rows are the gate rows of its ``BLOCK_N // 2`` outputs, then their up rows, and ``y`` is
        rounded to the output dtype, then multiplied as ``silu_mul`` does (``zero``, ``LIBDEVICE``: see there).
        ``HALF_D > 0``: a fused q/k/v projection's rotation pairs, whose epilogue rotates and writes the keys and
        values (``gemv.rope_store``, over ``C`` ... ``HKV``; ``SN`` its ``sin``), with ``Y`` the rotated query.

        ``PDL`` (``common.launch_options``): the first tile's ``LINES`` 128-byte lines of each row are prefetched into
        L2 before the kernel waits for the one that writes ``X``."""
        rows, row_ok = gated_rows(N, GATE, UP, BLOCK_N, GLU, HALF_D)
        w_rows = W + rows[:, None].to(tl.int64) * stride_w
        s_rows = S + (rows // QN) * GK
        if PDL:
            lines = tl.minimum(tl.arange(0, LINES) * 128, K - 1)
            prefetch_l2(W + tl.where(row_ok, rows, GATE)[:, None].to(tl.int64) * stride_w + lines[None, :])
        wait_for_previous(PDL)
        if ONE_K_BLOCK:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, SUB], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + k, mask=k < K, other=0.0).to(tl.float32)
            w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & (k[None, :] < K), other=0.0).to(tl.float32)
            if ONE_K_BLOCK:
                acc += w * x[None, :]
            else:
                kb = k0 // QK + tl.arange(0, SUB)
                s = tl.load(s_rows[:, None] + kb[None, :], mask=row_ok[:, None] & (kb[None, :] < GK), other=0.0)
                if SUB == 1:
                    acc += tl.sum(w * x[None, :], axis=1)[:, None] * s
                else:
                    acc += tl.sum(tl.reshape(w * x[None, :], [BLOCK_N, SUB, BLOCK_K // SUB]), axis=2) * s
        y = tl.sum(acc, axis=1)
        if ONE_K_BLOCK:
            y *= tl.load(s_rows, mask=row_ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
        if HALF_D > 0:
            rope_store(y, N, zero, C, SN, Y, POOL, VPOOL, SLOTS, HQ, HKV, BLOCK_N, HALF_D)
        else:
            store_rows(Y, y, rows, row_ok, N, zero, BLOCK_N, GLU, LIBDEVICE)

    @triton.jit
    def _fp8_gemm_kernel(X, W, S, B, Y, M, N, K, K_PER, stride_x, stride_w, stride_y, stride_split, GK, QN, QK,
                         HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """A ``[BLOCK_M, BLOCK_N]`` output tile of the k-range ``[K_PER * z, K_PER * (z + 1))`` per program; each
        ``BLOCK_K`` step lies inside one k-block, and its partial product is scaled by the weight block's scale as it
        is accumulated. ``SPLIT``: the k-range is one of several, and the tile goes to its fp32 slice of ``Y``
        (``split_sum_kernel`` adds the slices up, in a fixed order); else it is the output. ``PDL``: the first
        ``BLOCK_K`` step's weights (a 128-byte line per row at most) are prefetched into L2 before the kernel waits."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        z = tl.program_id(2)
        k_lo = z * K_PER
        k_hi = tl.minimum(k_lo + K_PER, K)
        if PDL:
            prefetch_l2(W + tl.minimum(rn, N - 1).to(tl.int64) * stride_w + tl.minimum(k_lo, K - 1))
        wait_for_previous(PDL)
        s_cols = S + (rn // QN) * GK
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                        mask=(rm[:, None] < M) & (rk[None, :] < k_hi), other=0.0)
            w = tl.load(W + rn[None, :].to(tl.int64) * stride_w + rk[:, None],
                        mask=(rn[None, :] < N) & (rk[:, None] < k_hi), other=0.0)
            s = tl.load(s_cols + k0 // QK, mask=rn < N, other=0.0).to(tl.float32)
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION) * s[None, :]
        out = Y + z.to(tl.int64) * stride_split + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
        ok = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT:
            tl.store(out, acc, mask=ok)
        else:
            if HAS_BIAS:
                acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out, acc.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def split_sum_kernel(P, B, Y, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        """``Y = sum_z P[z] (+ b)``: the k-ranges' fp32 slices of a split product, added in order (deterministic).
        The FP8 GEMM's and the MXFP4 experts' (``mxfp4.py``)."""
        wait_for_previous(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < MN
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for z in tl.static_range(SPLITS):
            acc += tl.load(P + z * MN + i, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(B + i % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + i, acc.to(Y.dtype.element_ty), mask=ok)


# The fastest tiles per Llama-3.1-8B projection, each timed alone with its weights out of the L2 cache
# (``bench/fp8.py --sweep``, bench/RESULTS.md sections 25, 35, 40 and 41).
def gemv_config(n: int, k: int, device: torch.device | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) of the one-row kernel on ``device``: 2 rows of 2048-wide tiles a program
    over 4 warps; on an H200, 8 rows for the fused gate/up projection ([28672, 4096]: 4% faster there, where 2 rows
    are 7% faster on an H100)."""
    return (8, 2048, 4, 2) if n > 16384 and "H200" in card_name(device) else (2, 2048, 4, 4)


@functools.lru_cache(maxsize=None)
def _cuda_card(index: int) -> str:
    return torch.cuda.get_device_name(index)


def card_name(device: torch.device | None) -> str:
    """The name of ``device``'s GPU ("NVIDIA H200", ...); empty for none or a CPU."""
    if device is None or device.type != "cuda":
        return ""
    return _cuda_card(device.index if device.index is not None else torch.cuda.current_device())


def gemm_config(n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages, k-ranges) of the GEMM: 64 columns per tile, the k split over 4 ranges (4x
    the programs of an unsplit GEMM at 32 rows, whose few programs could not hide the loads' latency); over 2 for
    the fused gate/up projection, which has programs enough."""
    return (64, 128, 4, 3, 2 if n > 16384 else 4) if n >= 4096 else (16, 128, 4, 3, 4)


def linear_config(m: int, n: int, k: int, device: torch.device | None = None) -> tuple:
    """The tiles of an ``[m, k] x [n, k]^T`` call on ``device``: ``gemv_config``'s at one row, else
    ``gemm_config``'s."""
    return gemv_config(n, k, device) if m == 1 else gemm_config(n)


def gemm_block_m(m: int) -> int:
    """Rows per GEMM tile: the fewest of 16, 32, 64 that cover ``m`` (each extra row tile re-reads the weight)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def fp8_usable(x: torch.Tensor, weight: torch.Tensor, block_k: int, block_kernel: int = 128) -> bool:
    """Whether the Triton kernels serve this call: CUDA (or the interpreter), an ``[N, K]`` FP8 weight with unit
    stride along K, and k-blocks that ``block_kernel``-wide tiles never straddle."""
    return (weight.dim() == 2 and weight.dtype == FP8_DTYPE and weight.stride(1) == 1
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and (block_k % block_kernel == 0 or block_k >= weight.shape[1]))


def _tile_k(block_k: int, k: int, tile: int, spans: bool) -> tuple[int, int]:
    """``(BLOCK_K, SUB)``: the configured ``tile`` where k-blocks allow it (one k-block over the row: any tile;
    a tile inside one k-block; with ``spans``, a tile of ``SUB`` whole k-blocks), else 128 (``fp8_usable``)."""
    tile = min(tile, triton.next_power_of_2(k))
    if block_k >= k or block_k % tile == 0:
        return tile, 1
    if spans and tile % block_k == 0:
        return tile, tile // block_k
    return 128, 1


def launch_fp8_linear(x, weight, scale, bias, block_n: int, block_k: int, wrap=lambda kernel: kernel, config=None):
    """The Triton path of ``fp8_linear`` (see the module docstring); ``x`` of any leading shape. ``config``
    overrides ``linear_config``: ``(BLOCK_N, BLOCK_K, warps, stages)`` the GEMV's tiles at one row (the GEMM's,
    unsplit, at more), ``(BLOCK_N, BLOCK_K, warps, stages, k-ranges)`` the GEMM's at any row count
    (``bench/fp8.py --sweep``)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    s = scale.reshape(-1)
    b = bias if bias is not None else s
    config = config or linear_config(m, n, k, x.device)
    if m == 1 and len(config) == 4:
        launch_fp8_gemv(x2, weight, s, bias, y, block_n, block_k, config, wrap)
    else:
        bn_, bk_, warps, stages, *split = config
        bk_ = max(_tile_k(block_k, k, bk_, spans=False)[0], 16)
        bm_ = gemm_block_m(m)
        gk = scale_grid(n, k, block_n, block_k)[1]
        qk = k if block_k >= k else block_k  # one k-block over the row: every tile reads scale column 0
        k_per, splits = k_ranges(k, split[0] if split else 1, bk_)
        out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        wrap(_fp8_gemm_kernel)[(triton.cdiv(m, bm_), triton.cdiv(n, bn_), splits)](
            x2, weight, s, b, out, m, n, k, k_per, x2.stride(0), weight.stride(0), n, m * n, gk, block_n, qk,
            HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # no TF32 for fp32
            SPLIT=splits > 1, BLOCK_M=bm_, BLOCK_N=bn_, BLOCK_K=bk_, num_warps=warps, num_stages=stages,
            **launch_options(x2))
        if splits > 1:
            wrap(split_sum_kernel)[(triton.cdiv(m * n, 1024),)](
                out, b, y, m * n, n, SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=1024, **launch_options(x2))
    return y.reshape(*x.shape[:-1], n)


def k_ranges(k: int, splits: int, tile: int) -> tuple[int, int]:
    """``(K_PER, count)``: ``k`` inputs split over about ``splits`` ranges of whole ``tile``-wide steps (the last
    range may be shorter), for a split product and ``split_sum_kernel``."""
    k_per = triton.cdiv(triton.cdiv(k, splits), tile) * tile
    return k_per, triton.cdiv(k, k_per)


def launch_fp8_gemv(x2, weight, s, bias, y, block_n: int, block_k: int, config, wrap, glu=None, rope=None):
    """The one-row kernel into ``y``, on ``config``'s ``(BLOCK_N, BLOCK_K, warps, stages)`` (``None``:
    ``linear_config``'s for the weight on ``x2``'s device, so the plain, gated and rotary GEMVs of one weight sum in
    the same order). ``glu``: the ``(gate, up)`` offsets of ``launch_fp8_linear_silu_mul`` (``y`` is then its
    ``width`` wide output). ``rope``: a ``gemv.RopeEpilogue`` (``y`` is then its query)."""
    n, k = weight.shape
    gk = scale_grid(n, k, block_n, block_k)[1]
    one = block_k >= k
    bn_, bk_, warps, stages = config or linear_config(1, n, k, x2.device)
    bk_, sub = _tile_k(block_k, k, bk_, spans=True)
    outputs = n if rope is not None else y.shape[-1]
    if glu is not None:
        check_halves(n, *glu, outputs, bn_)
    wrap(_fp8_gemv_kernel)[(triton.cdiv(outputs, bn_ // 2 if glu else bn_),)](
        x2, weight, s, bias if bias is not None else s, y, outputs, k, weight.stride(0), gk, block_n,
        k if one else block_k, *(glu or (0, 0)), 0, *rope_arguments(rope, x2), HAS_BIAS=bias is not None,
        ONE_K_BLOCK=one, SUB=sub, BLOCK_N=bn_, BLOCK_K=bk_, GLU=glu is not None,
        HALF_D=rope.half_d if rope is not None else 0, LIBDEVICE=compiled(), LINES=max(bk_ // 128, 1),
        num_warps=warps, num_stages=stages, **launch_options(x2))


@register("ppsplit::fp8_linear")
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
               block_n: int, block_k: int) -> torch.Tensor:
    """``F.linear(x, dequantize(weight, scale, block_n, block_k, x.dtype), bias)``; on CUDA one Triton kernel that
    reads the FP8 weight directly (see the module docstring)."""
    return fp8_linear_of(x, weight, scale, bias, block_n, block_k)


def fp8_linear_of(x, weight, scale, bias, block_n: int, block_k: int) -> torch.Tensor:
    if on_gpu(x) and fp8_usable(x, weight, block_k):
        with torch.cuda.device(x.device):
            return launch_fp8_linear(x, weight, scale, bias, block_n, block_k, wrap=wrap_triton)
    return torch.nn.functional.linear(x, dequantize(weight, scale, block_n, block_k, x.dtype), bias)


# A gated MLP's activation folded into its fused gate/up projection (``passes.rewrites.pointwise``): at decode batch 1
# the SiLU-and-multiply is a kernel of its own between two GEMVs; the GEMV's epilogue can do it instead.

def fp8_silu_mul_usable(x: torch.Tensor, weight: torch.Tensor, block_k: int) -> bool:
    """Whether ``launch_fp8_linear_silu_mul`` serves the call: one row, fp16 / bf16 (``silu_mul``'s kernel's
    dtypes), a weight ``fp8_usable`` serves, and ``linear_config`` gives the GEMV's tiles for it."""
    return (x.numel() == x.shape[-1] and x.dtype in (torch.float16, torch.bfloat16) and fp8_usable(x, weight, block_k)
            and len(linear_config(1, *weight.shape, x.device)) == 4)


def launch_fp8_linear_silu_mul(x, weight, scale, bias, block_n: int, block_k: int, gate: int, up: int, width: int,
                               wrap=lambda kernel: kernel, config=None):
    """The Triton path of ``fp8_linear_silu_mul``: one row, one kernel, on ``config`` (the GEMV's ``(BLOCK_N, BLOCK_K,
    warps, stages)`` of the whole fused weight, ``linear_config``'s if not given)."""
    n, k = weight.shape
    y = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    x2 = x.reshape(1, k)
    launch_fp8_gemv(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight, scale.reshape(-1), bias, y, block_n,
                    block_k, config, wrap, glu=(gate, up))
    return y


@register("ppsplit::fp8_linear_silu_mul")
def fp8_linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                        block_n: int, block_k: int, gate: int, up: int, width: int) -> torch.Tensor:
    """``silu_mul(y[..., gate:gate + width], y[..., up:up + width])`` of ``y = fp8_linear(x, weight, scale, bias,
    block_n, block_k)``. On CUDA at one row (``fp8_silu_mul_usable``) one GEMV kernel, bit-equal to ``fp8_linear``'s
    then ``silu_mul``'s; otherwise those two ops' own paths."""
    if on_gpu(x) and fp8_silu_mul_usable(x, weight, block_k):
        with torch.cuda.device(x.device):
            return launch_fp8_linear_silu_mul(x, weight, scale, bias, block_n, block_k, gate, up, width,
                                              wrap=wrap_triton)
    y = fp8_linear_of(x, weight, scale, bias, block_n, block_k)
    return silu_mul_of(y[..., gate:gate + width], y[..., up:up + width])


# MoE experts: transformers stacks a layer's per-expert weights into one ``[E, N, K]`` parameter
# (``experts.gate_up_proj``, ``experts.down_proj``); FP8 checkpoints ship each expert's ``[N, K]`` weight with its
# own block scales, stacked the same way into ``[E, ceil(N / block_n), ceil(K / block_k)]``.

if HAVE_TRITON:

    @triton.jit
    def expert_rows(OFFS, e):
        """``[start, end)``: the rows of expert ``e`` in a grouped product, from the row ends ``OFFS`` (device
        memory, so a CUDA graph replays any routing)."""
        start = tl.where(e > 0, tl.load(OFFS + tl.maximum(e - 1, 0)), 0)
        return start, tl.load(OFFS + e)

    @triton.jit
    def _fp8_grouped_kernel(X, W, S, OFFS, Y, N, K, stride_x, stride_we, stride_wn, stride_wk, stride_se,
                            stride_sn, stride_sk, stride_y, QN, QK, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Expert ``program_id(0)``'s rows ``[OFFS[e - 1], OFFS[e])`` of ``X`` (sorted by expert) times the
        ``BLOCK_N`` output columns ``program_id(1)`` of its weight, ``BLOCK_M`` rows at a time (an expert no token
        chose does nothing). Each ``BLOCK_K`` step lies inside one k-block; its partial product is scaled by the
        weight block's scale as it is accumulated, as in ``_fp8_gemm_kernel``. The weight and its scales are read
        through their strides: a stack of experts (``stride_wk`` 1), or per-head views of MLA's ``kv_b_proj``, one of
        them transposed (``stride_wn`` 1)."""
        e = tl.program_id(0)
        start, end = expert_rows(OFFS, e)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_cols = W + e.to(tl.int64) * stride_we + rn[None, :] * stride_wn  # 32-bit offsets in an expert
        s_cols = S + e * stride_se + (rn // QN) * stride_sn
        for m0 in range(start, end, BLOCK_M):
            rm = m0 + tl.arange(0, BLOCK_M)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(X + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                            mask=(rm[:, None] < end) & (rk[None, :] < K), other=0.0)
                w = tl.load(w_cols + rk[:, None] * stride_wk, mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
                s = tl.load(s_cols + (k0 // QK) * stride_sk, mask=rn < N, other=0.0).to(tl.float32)
                acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION) * s[None, :]
            tl.store(Y + rm[:, None].to(tl.int64) * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
                     mask=(rm[:, None] < end) & (rn[None, :] < N))


def grouped_tile_k(block_k: int, k: int) -> int | None:
    """``BLOCK_K`` of the grouped kernel: 128 columns, or fewer where a k-block is narrower (a power of two that
    divides it, at least 16 for ``tl.dot``); ``None`` when no tile fits inside the k-blocks."""
    if block_k >= k:
        return min(128, max(16, triton.next_power_of_2(k)))
    tile = 128
    while tile >= 16 and block_k % tile:
        tile //= 2
    return tile if tile >= 16 else None


def fp8_grouped_usable(x: torch.Tensor, weight: torch.Tensor, block_k: int) -> bool:
    """Whether the Triton grouped kernel serves this call: a float ``x`` and a stack it reads
    (``fp8_stack_readable``)."""
    return x.dtype in (torch.float16, torch.bfloat16, torch.float32) and fp8_stack_readable(weight, block_k)


def fp8_stack_readable(weight: torch.Tensor, block_k: int) -> bool:
    """Whether the grouped kernel reads ``weight``: an ``[E, N, K]`` FP8 stack with unit stride along K or N (and
    its offsets in an expert under 2**31: the kernel's are 32-bit), whose k-blocks a tile of at least 16 columns
    fits inside."""
    return (weight.dim() == 3 and weight.dtype == FP8_DTYPE and 1 in (weight.stride(2), weight.stride(1))
            and (weight.shape[1] - 1) * weight.stride(1) + (weight.shape[2] - 1) * weight.stride(2) < 2 ** 31
            and grouped_tile_k(block_k, weight.shape[2]) is not None)


def launch_fp8_grouped_mm(x, weight, scale, offs, block_n: int, block_k: int, wrap=lambda kernel: kernel,
                          config=(16, 64, 4, 3)):
    """The Triton path of ``fp8_grouped_mm``; ``config`` is ``(BLOCK_M, BLOCK_N, warps, stages)``. ``weight``
    and ``scale`` (``[E, ceil(N / block_n), ceil(K / block_k)]``) may be strided views (``fp8_grouped_usable``)."""
    e, n, k = weight.shape
    scale = scale.reshape(e, *scale_grid(n, k, block_n, block_k))
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    bm_, bn_, warps, stages = config
    wrap(_fp8_grouped_kernel)[(e, triton.cdiv(n, bn_))](
        x, weight, scale, offs, y, n, k, x.stride(0), *weight.stride(), *scale.stride(), n, block_n,
        k if block_k >= k else block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=bm_, BLOCK_N=bn_, BLOCK_K=grouped_tile_k(block_k, k), num_warps=warps, num_stages=stages)
    return y


@register("ppsplit::fp8_grouped_mm")
def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor, block_n: int,
                   block_k: int) -> torch.Tensor:
    """``torch._grouped_mm(x, dequantize(weight, scale).transpose(-2, -1), offs=offs)``: the rows of ``x`` [S, K]
    sorted by expert, ``offs`` [E] the end of each expert's rows, ``weight`` the FP8 experts [E, N, K]. On CUDA one
    Triton kernel that reads the FP8 experts directly (rows past ``offs[-1]`` are left unwritten, as
    ``torch._grouped_mm`` leaves them); elsewhere (the tests' reference) the experts are dequantised and
    ``grouped_reference`` runs them, as the unquantised stage does."""
    if on_gpu(x) and fp8_grouped_usable(x, weight, block_k):
        with torch.cuda.device(x.device):
            return launch_fp8_grouped_mm(x, weight, scale, offs, block_n, block_k, wrap=wrap_triton)
    return grouped_reference(x, dequantize(weight, scale, block_n, block_k, x.dtype), offs)


def grouped_reference(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)`` for float experts ``[E, N, K]``; in float32 and
    float16, which ``torch._grouped_mm`` does not take on every device, each row times its expert's weight (rows
    past ``offs[-1]`` read the last expert)."""
    if x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)
    rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
    expert = torch.searchsorted(offs, rows, right=True).clamp(max=weight.shape[0] - 1)
    return torch.bmm(weight[expert], x.unsqueeze(-1)).squeeze(-1)


@register("ppsplit::fp8_expert_weights")
def fp8_expert_weights(weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, block_n: int, block_k: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(weight, scale)[ids]`` as ``dtype``: the experts chosen per routed token [S, N, K], for the
    stages that run experts as one batched product per token (transformers' ``batched_mm``, what a float32 or
    float16 compile traces). Only the chosen experts are dequantised."""
    return dequantize(weight[ids], scale.reshape(weight.shape[0], -1)[ids], block_n, block_k, dtype)
