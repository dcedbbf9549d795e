"""One-row linear (GEMV) for decode at batch 1: ``y[1, N] = x[1, K] @ W[N, K].T (+ b)`` in one Triton kernel.

At batch 1 a projection is bound by its weight bytes. cuBLAS picks split-K kernels for the narrower ones (an
attention output projection, 4096 x 4096) and adds a second kernel to reduce the splits; this kernel gives each
program ``BLOCK_N`` whole weight rows instead (read once, contiguous, fp32 accumulation) and writes the output
directly: one launch, no partial buffer.

``torch.ops.ppsplit.linear(x, w, b)`` runs the kernel for a CUDA ``x`` with one row and a ``[N, K]`` weight
(``N >= MIN_OUT``, unit stride along K); anything else (more rows, the CPU) is ``torch.nn.functional.linear``,
the same call the traced graph made. The pass ``ppsplit.passes.rewrites.gemv`` routes a stage's projections here. The summation order differs from cuBLAS,
so on the GPU the result is not bit-equal to it (both accumulate in fp32).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ppsplit.triton_kernels.common import HAVE_TRITON, launch_options, on_gpu, register, tl, triton, wrap_triton

from ppsplit.triton_kernels.pointwise import compiled, silu_mul_of

if HAVE_TRITON:
    from ppsplit.triton_kernels.common import prefetch_l2, wait_for_previous
    from ppsplit.triton_kernels.pointwise import rotated_halves, silu_mul_rounded

DEFAULT_CONFIG = (16, 512, 4, 4)  # (BLOCK_N, BLOCK_K, num_warps, num_stages) when no config is given


if HAVE_TRITON:

    @triton.jit
    def gated_rows(N, GATE, UP, BLOCK_N: tl.constexpr, GLU: tl.constexpr, HALF_D: tl.constexpr):
        """``(rows, row_ok)``: a one-row GEMV program's ``BLOCK_N`` weight rows, and which serve one of the ``N``
        outputs. ``GLU`` (outputs ``silu(y[GATE + i]) * y[UP + i]`` of a fused gate/up projection ``y``): the gate
        rows of the program's ``BLOCK_N // 2`` outputs, then their up rows, on the tile a plain GEMV uses.
        ``HALF_D > 0`` (a fused q/k/v projection whose epilogue rotates, ``rope_store``): the first rows of the
        program's ``BLOCK_N // 2`` rotation pairs (head ``h``'s rows ``2 * HALF_D * h + j`` and ``+ HALF_D``), then
        their second rows."""
        i = tl.arange(0, BLOCK_N)
        if HALF_D > 0:
            pair = tl.program_id(0) * (BLOCK_N // 2) + i % (BLOCK_N // 2)
            rows = (pair // HALF_D) * (2 * HALF_D) + pair % HALF_D + tl.where(i < BLOCK_N // 2, 0, HALF_D)
            return rows, rows < N
        if GLU:
            outs = tl.program_id(0) * (BLOCK_N // 2) + i % (BLOCK_N // 2)
            rows = tl.where(i < BLOCK_N // 2, GATE, UP) + outs
        else:
            outs = tl.program_id(0) * BLOCK_N + i
            rows = outs
        return rows, outs < N

    @triton.jit
    def rope_store(y, N, zero, C, S, QO, POOL, VPOOL, SLOTS, HQ, HKV, BLOCK_N: tl.constexpr,
                   HALF_D: tl.constexpr):
        """The epilogue of a one-row fused q/k/v projection (``gated_rows``' rotation pairs; ``y`` fp32, bias
        added): each value rounded to ``QO``'s dtype as the projection's output is, then as ``rope_write`` goes on
        (``pointwise.rotated_halves``, bit for bit): the query heads (``h < HQ``) rotated by ``cos`` / ``sin`` at
        ``C`` / ``S`` into ``QO`` (``[HQ, D]`` rows), and where the token's slot is not negative the key heads rotated
        into the key pool's row ``slot`` (``[HKV, D]``) and the value's features (the heads after them) into the
        value pool's."""
        dt = QO.dtype.element_ty
        x1, x2 = tl.split(tl.permute(tl.reshape(y.to(dt).to(tl.float32), [2, BLOCK_N // 2]), [1, 0]))
        pair = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        h = pair // HALF_D
        j = pair % HALF_D
        ok = h * (2 * HALF_D) < N
        rotated = ok & (h < HQ + HKV)
        c1 = tl.load(C + j, mask=rotated, other=0.0).to(tl.float32)
        c2 = tl.load(C + j + HALF_D, mask=rotated, other=0.0).to(tl.float32)
        s1 = tl.load(S + j, mask=rotated, other=0.0).to(tl.float32)
        s2 = tl.load(S + j + HALF_D, mask=rotated, other=0.0).to(tl.float32)
        o1, o2 = rotated_halves(x1, x2, c1, c2, s1, s2, zero, dt)
        o1, o2 = o1.to(dt), o2.to(dt)
        q = QO + h * (2 * HALF_D) + j
        tl.store(q, o1, mask=ok & (h < HQ))
        tl.store(q + HALF_D, o2, mask=ok & (h < HQ))
        slot = tl.load(SLOTS).to(tl.int64)
        if slot >= 0:
            k = POOL + slot * (HKV * 2 * HALF_D) + (h - HQ) * (2 * HALF_D) + j
            is_k = ok & (h >= HQ) & (h < HQ + HKV)
            tl.store(k, o1.to(POOL.dtype.element_ty), mask=is_k)
            tl.store(k + HALF_D, o2.to(POOL.dtype.element_ty), mask=is_k)
            v = VPOOL + slot * (N - (HQ + HKV) * (2 * HALF_D)) + (h - HQ - HKV) * (2 * HALF_D) + j
            is_v = ok & (h >= HQ + HKV)
            tl.store(v, x1.to(dt).to(VPOOL.dtype.element_ty), mask=is_v)
            tl.store(v + HALF_D, x2.to(dt).to(VPOOL.dtype.element_ty), mask=is_v)

    @triton.jit
    def store_rows(Y, y, rows, row_ok, N, zero, BLOCK_N: tl.constexpr, GLU: tl.constexpr, LIBDEVICE: tl.constexpr):
        """A one-row GEMV program's fp32 results ``y`` (of ``gated_rows``' rows) into ``Y``; with ``GLU`` rounded to
        ``Y``'s dtype as the projection's output is, then multiplied as ``silu_mul`` does (``zero``, ``LIBDEVICE``:
        see ``pointwise.silu_mul_rounded``)."""
        dt = Y.dtype.element_ty
        if GLU:
            gate, up = tl.split(tl.permute(tl.reshape(y.to(dt).to(tl.float32), [2, BLOCK_N // 2]), [1, 0]))
            outs = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(Y + outs, silu_mul_rounded(gate, up, zero, dt, LIBDEVICE).to(dt), mask=outs < N)
        else:
            tl.store(Y + rows, y.to(dt), mask=row_ok)

    @triton.jit(do_not_specialize=["zero"])
    def _gemv_kernel(X, W, B, Y, N, K, stride_w, GATE, UP, zero, C, S, POOL, VPOOL, SLOTS, HQ, HKV,
                     HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GLU: tl.constexpr, HALF_D: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
                     LINES: tl.constexpr, LINE: tl.constexpr):
        """``BLOCK_N`` whole weight rows per program (``GLU``, ``HALF_D``: see ``gated_rows``; ``HALF_D > 0``: the
        epilogue is ``rope_store``'s, over ``C`` ... ``HKV``, with ``Y`` the rotated query). ``PDL``
        (``common.launch_options``): the first tile's ``LINES`` 128-byte lines (``LINE`` weights each) of each row
        are prefetched into L2 before the kernel waits for the one that writes ``X``."""
        rows, row_ok = gated_rows(N, GATE, UP, BLOCK_N, GLU, HALF_D)
        w_rows = W + rows[:, None].to(tl.int64) * stride_w
        if PDL:
            lines = tl.minimum(tl.arange(0, LINES) * LINE, K - 1)
            prefetch_l2(W + tl.where(row_ok, rows, GATE)[:, None].to(tl.int64) * stride_w + lines[None, :])
        wait_for_previous(PDL)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x = tl.load(X + k)
                w = tl.load(w_rows + k[None, :], mask=row_ok[:, None], other=0.0)
            else:
                x = tl.load(X + k, mask=k < K, other=0.0)
                w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
            acc += w.to(tl.float32) * x[None, :].to(tl.float32)
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
        if HALF_D > 0:
            rope_store(y, N, zero, C, S, Y, POOL, VPOOL, SLOTS, HQ, HKV, BLOCK_N, HALF_D)
        else:
            store_rows(Y, y, rows, row_ok, N, zero, BLOCK_N, GLU, LIBDEVICE)


def gemv_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``launch_gemv`` serves ``x @ w.T``: a CUDA input with one row, a ``[N, K]`` weight of its dtype
    with unit stride along K."""
    return (on_gpu(x) and x.numel() == x.shape[-1] and w.dim() == 2
            and w.dtype == x.dtype and w.stride(1) == 1 and x.dtype in (torch.float16, torch.bfloat16, torch.float32))


def launch_gemv(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None, *, config=None,
                wrap=lambda kernel: kernel, glu: tuple[int, int, int] | None = None, rope=None) -> torch.Tensor:
    """``x @ w.T + b`` for ``x`` with one row (any leading shape); returns ``x.shape[:-1] + (N,)``. ``glu``:
    ``(gate, up, width)``, the ``width`` outputs ``silu_mul(y[..., gate:gate + width], y[..., up:up + width])``
    instead (``linear_silu_mul``). ``rope``: a ``RopeEpilogue``, whose rotated query is returned instead
    (``linear_rope_write``)."""
    N, K = w.shape
    block_n, block_k, warps, stages = config or DEFAULT_CONFIG
    block_k = min(block_k, triton.next_power_of_2(K))
    xc = x.reshape(-1)
    xc = xc if xc.stride(0) == 1 else xc.contiguous()
    gate, up, outputs = glu or (0, 0, N)
    if glu is not None:
        check_halves(N, *glu, block_n)
    y = rope.query if rope is not None else torch.empty(*x.shape[:-1], outputs, dtype=x.dtype, device=x.device)
    wrap(_gemv_kernel)[(triton.cdiv(outputs, block_n // 2 if glu else block_n),)](
        xc, w, b if b is not None else xc, y, outputs, K, w.stride(0), gate, up, 0, *rope_arguments(rope, xc),
        HAS_BIAS=b is not None, EVEN_K=K % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, GLU=glu is not None,
        HALF_D=rope.half_d if rope is not None else 0, LIBDEVICE=compiled(),
        LINES=max(block_k * w.element_size() // 128, 1), LINE=128 // w.element_size(), num_warps=warps,
        num_stages=stages, **launch_options(xc))
    return y


class RopeEpilogue(NamedTuple):
    """What a one-row GEMV's ``rope_store`` epilogue writes (``linear_rope_write``): the rotated ``query`` out
    (``[1, HQ, 1, D]``), the token's ``cos`` / ``sin`` rows, the key and value pools and the token's slot (one
    element), the query and key head counts, and half the head dimension."""
    query: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    pool: torch.Tensor
    other_pool: torch.Tensor
    slots: torch.Tensor
    q_heads: int
    kv_heads: int
    half_d: int


def rope_arguments(rope: Optional[RopeEpilogue], dummy: torch.Tensor) -> tuple:
    """The ``C, S, POOL, VPOOL, SLOTS, HQ, HKV`` arguments of a GEMV kernel (``dummy`` where there is no ``rope``)."""
    if rope is None:
        return (dummy,) * 5 + (0, 0)
    return rope.cos, rope.sin, rope.pool, rope.other_pool, rope.slots, rope.q_heads, rope.kv_heads


def check_halves(n: int, gate: int, up: int, width: int, block_n: int) -> None:
    """A ``ValueError`` unless a gated GEMV's ``gate`` and ``up`` rows of ``width`` lie in a weight of ``n`` rows
    and ``block_n`` holds whole (gate, up) pairs."""
    if not (0 <= gate and 0 <= up and 0 < width and max(gate, up) + width <= n):
        raise ValueError(f"gate {gate} and up {up} rows of width {width} do not lie in a weight of {n} rows")
    if block_n < 2 or block_n % 2:
        raise ValueError(f"the gated GEMV needs an even BLOCK_N (a gate row and an up row per output), not {block_n}")


# Outputs below this stay with cuBLAS: the kernel was measured from 4096 outputs up (bench/gemv.py), and narrower
# projections leave SMs idle with one program per BLOCK_N rows.
MIN_OUT = 4096


def pick_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for an ``[n, k]`` weight: the fastest of ten configurations per
    Llama-3.1-8B projection on an H200 (``bench/gemv.py --sweep``): 16 rows x 1024 columns for the narrow or
    deep ones (o_proj, down), 8 x 512 for the wide ones (q/k/v, gate/up fused, lm_head)."""
    return (16, 1024, 8, 3) if n <= 4096 or k >= 8192 else (8, 512, 4, 4)


@register("ppsplit::linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)``; a one-row CUDA input with at least ``MIN_OUT`` outputs runs
    the Triton GEMV (see the module docstring)."""
    return linear_of(x, weight, bias)


def linear_of(x, weight, bias):
    if gemv_usable(x, weight) and weight.shape[0] >= MIN_OUT:
        with torch.cuda.device(x.device):
            return launch_gemv(x, weight, bias, config=pick_config(*weight.shape), wrap=wrap_triton)
    return torch.nn.functional.linear(x, weight, bias)


@register("ppsplit::linear_silu_mul")
def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], gate: int, up: int,
                    width: int) -> torch.Tensor:
    """``silu_mul(y[..., gate:gate + width], y[..., up:up + width])`` of ``y = ppsplit::linear(x, weight, bias)``: a
    gated MLP's activation folded into its fused gate/up projection (``passes.rewrites.gemv``). A one-row CUDA fp16 /
    bf16 input runs one GEMV whose epilogue multiplies, bit-equal to the GEMV then ``silu_mul``'s kernel; anything
    else those two ops' own paths."""
    if gemv_usable(x, weight) and weight.shape[0] >= MIN_OUT and x.dtype in (torch.float16, torch.bfloat16):
        with torch.cuda.device(x.device):
            return launch_gemv(x, weight, bias, config=pick_config(*weight.shape), wrap=wrap_triton,
                               glu=(gate, up, width))
    y = linear_of(x, weight, bias)
    return silu_mul_of(y[..., gate:gate + width], y[..., up:up + width])
