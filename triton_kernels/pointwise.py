"""Elementwise chains that Hugging Face writes as several ATen ops, each as one Triton kernel.

- ``ppsplit::rope(x, cos, sin)``: the rotate-half rotary embedding, ``x * cos + cat(-x2, x1) * sin`` (Llama,
  Mistral, Qwen, Gemma, ...: ``apply_rotary_pos_emb``), five ATen kernels per tensor (mul, neg, cat, mul, add).
- ``ppsplit::silu_mul(a, b)``: ``silu(a) * b``, the gated MLP's activation (two kernels).
- ``ppsplit::rope_write(q, k, cos, sin, pool, other_pool, v, slots)``: a paged stage's query and key rotations and
  its layer's key and value writes (``paged_write_pair``), three kernels, as one.

On a decode step these kernels each move a few KiB, so their cost is the launch, not the bytes: in a captured
Llama-3.1-8B step at batch 1 they were 12 of the 23 kernels of a layer (756 kernels a step; 468 with these ops). The
Triton kernels round every intermediate to the model's dtype where the ATen ops round (each product, the sum; SiLU
with an IEEE division and libdevice's ``exp``), to give the ATen result bit for bit in fp16 / bf16
(``tests/kernels/test_pointwise.py``, under Triton's interpreter and on a GPU). fp32 inputs, mixed dtypes, CPU
tensors and shapes the kernels do not cover take the ATen ops themselves.
"""
from __future__ import annotations

import os

import torch

from ppsplit.triton_kernels.common import HAVE_TRITON, launch_options, on_gpu, register, tl, triton, wrap_triton
from ppsplit.triton_kernels.paged import feature_rows, paged_write_pair

if HAVE_TRITON:
    from ppsplit.triton_kernels.paged import write_token

HALF = (torch.float16, torch.bfloat16)

if HAVE_TRITON:
    from triton.language.extra import libdevice

    from ppsplit.triton_kernels.common import wait_for_previous

    @triton.jit
    def _rounded(a, b, zero, dt: tl.constexpr, ADD: tl.constexpr):
        """``a * b`` (``ADD``: ``a + b``) in fp32, rounded to ``dt``, back in fp32: one ATen op on half values.
        ``zero`` is a runtime 0 added to the result's bits. Written plainly, the kernel was one ulp off ATen in about
        a quarter of the values on an H200: most likely the compiler narrowed a product of half values to an fp16
        multiply and contracted it with the sum into one FMA, which rounds once where ATen rounds twice. It cannot
        see through the added argument."""
        r = a + b if ADD else a * b
        bits = r.to(tl.int32, bitcast=True) + zero
        return bits.to(tl.float32, bitcast=True).to(dt).to(tl.float32)

    @triton.jit
    def _rotate(x, c, s, o, ok, zero, HALF_D: tl.constexpr):
        """Rows of ``D = 2 * HALF_D`` values at ``x`` (pointers to their first halves, ``ok`` their mask), rotated by
        ``cos`` / ``sin`` at ``c`` / ``s`` and stored at ``o`` in ``o``'s dtype, rounded as the ATen ops round."""
        x1 = tl.load(x, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x + HALF_D, mask=ok, other=0.0).to(tl.float32)
        c1 = tl.load(c, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(c + HALF_D, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(s, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(s + HALF_D, mask=ok, other=0.0).to(tl.float32)
        dt = x.dtype.element_ty
        o1, o2 = rotated_halves(x1, x2, c1, c2, s1, s2, zero, dt)
        tl.store(o, o1.to(dt).to(o.dtype.element_ty), mask=ok)
        tl.store(o + HALF_D, o2.to(dt).to(o.dtype.element_ty), mask=ok)

    @triton.jit
    def rotated_halves(x1, x2, c1, c2, s1, s2, zero, dt: tl.constexpr):
        """The two halves of ``x * cos + rotate_half(x) * sin`` (``rotate_half(x) = (-x2, x1)``) from fp32 values of
        ``dt``, each product and the sum rounded to ``dt`` as the ATen ops round (back in fp32). Also the epilogue of
        the fused q/k/v GEMVs (``gemv.rope_store``)."""
        o1 = _rounded(_rounded(x1, c1, zero, dt, False), _rounded(-x2, s1, zero, dt, False), zero, dt, True)
        o2 = _rounded(_rounded(x2, c2, zero, dt, False), _rounded(x1, s2, zero, dt, False), zero, dt, True)
        return o1, o2

    @triton.jit(do_not_specialize=["zero"])
    def _rope_kernel(X, C, S, O, N, sxb, sxh, sxn, scb, sch, scn, ssb, ssh, ssn, sob, soh, son, H, zero,
                     HALF_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        """One program per (batch row, token): every head's ``D = 2 * HALF_D`` values, both halves at once.
        ``PDL``: ``common.launch_options``, as in every kernel of this file."""
        wait_for_previous(PDL)
        row = tl.program_id(0)
        b = (row // N).to(tl.int64)
        n = (row % N).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        ok = (h < H) & (d < HALF_D)
        _rotate(X + b * sxb + n * sxn + h * sxh + d, C + b * scb + n * scn + h * sch + d,
                S + b * ssb + n * ssn + h * ssh + d, O + b * sob + n * son + h * soh + d, ok, zero, HALF_D)

    @triton.jit(do_not_specialize=["zero"])
    def _rope_write_kernel(Q, K, V, C, S, QO, POOL, VPOOL, SLOTS, sqh, sqn, sch, scn, ssh, ssn, skh, skn, sckh,
                           sckn, sskh, sskn, soh, son, svt, svh, svw, HQ, HKV, FV, WV, zero, HALF_D: tl.constexpr,
                           BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_V: tl.constexpr, PDL: tl.constexpr):
        """One program per token ``t`` of a ragged step: its query heads rotated into ``QO``; where its slot is not
        negative, its key heads rotated into the key pool's row ``slot`` and its value into the value pool's."""
        wait_for_previous(PDL)
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)[None, :]
        h = tl.arange(0, BLOCK_HQ)[:, None]
        _rotate(Q + t * sqn + h * sqh + d, C + t * scn + h * sch + d, S + t * ssn + h * ssh + d,
                QO + t * son + h * soh + d, (h < HQ) & (d < HALF_D), zero, HALF_D)
        slot = tl.load(SLOTS + t)
        if slot >= 0:
            g = tl.arange(0, BLOCK_HKV)[:, None]
            _rotate(K + t * skn + g * skh + d, C + t * sckn + g * sckh + d, S + t * sskn + g * sskh + d,
                    POOL + slot.to(tl.int64) * (HKV * 2 * HALF_D) + g * (2 * HALF_D) + d, (g < HKV) & (d < HALF_D),
                    zero, HALF_D)
            write_token(VPOOL, V, t, slot, FV, WV, svt, svh, svw, BLOCK_V)

    @triton.jit(do_not_specialize=["zero"])
    def _silu_mul_kernel(A, B, O, I, sa, sb, zero, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
        """One program per (row, ``BLOCK`` columns) of ``[rows, I]`` inputs with unit column stride."""
        wait_for_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = i < I
        a = tl.load(A + row * sa + i, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(B + row * sb + i, mask=ok, other=0.0).to(tl.float32)
        dt = O.dtype.element_ty
        tl.store(O + row * I + i, silu_mul_rounded(a, b, zero, dt, LIBDEVICE).to(dt), mask=ok)

    @triton.jit
    def silu_mul_rounded(a, b, zero, dt: tl.constexpr, LIBDEVICE: tl.constexpr):
        """``silu(a) * b`` of fp32 values of ``dt``, rounded to ``dt`` where ATen's ``silu`` and ``mul`` round (back in
        fp32). ``LIBDEVICE``: libdevice's ``exp``, as ATen's CUDA ``silu`` (``tl.exp`` is an approximation; the
        interpreter has no libdevice). Also the epilogue of the gated GEMVs (``gemv.store_rows``)."""
        if LIBDEVICE:
            e = libdevice.exp(-a)
        else:
            e = tl.exp(-a)
        act = tl.math.div_rn(a, 1.0 + e).to(dt).to(tl.float32)  # ATen's silu, rounded
        return _rounded(act, b, zero, dt, False)


def compiled() -> bool:
    """Whether the kernels are compiled for the GPU, not run by Triton's interpreter (which has no libdevice)."""
    return os.environ.get("TRITON_INTERPRET") != "1"


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``q * cos + rotate_half(q) * sin``, op for op (the CPU path and the test reference)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _layout_like(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``x``'s shape and dtype with its dimensions in ``x``'s memory order (what an ATen
    elementwise op returns for ``x``), dense even where ``x`` is a slice."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    dense = torch.empty([x.shape[d] for d in order], dtype=x.dtype, device=x.device)
    return dense.permute([order.index(d) for d in range(x.dim())])


def rope_usable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel serves ``rope(x, cos, sin)``: a 4-D CUDA ``x`` of an even last dimension with unit stride,
    ``cos`` / ``sin`` of its dtype that broadcast to it with unit last stride."""
    if not (on_gpu(x) and x.dim() == 4 and x.dtype in HALF and x.shape[-1] % 2 == 0 and x.stride(-1) == 1):
        return False
    for t in (cos, sin):
        if t.dtype != x.dtype or t.device != x.device or t.shape[-1] != x.shape[-1] or t.stride(-1) != 1:
            return False
        try:
            if torch.broadcast_shapes(t.shape, x.shape) != x.shape:
                return False
        except RuntimeError:
            return False
    return True


def launch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, wrap=lambda kernel: kernel) -> torch.Tensor:
    B, H, N, D = x.shape
    c, s = cos.expand(x.shape), sin.expand(x.shape)
    out = _layout_like(x)
    if out.numel():
        wrap(_rope_kernel)[(B * N,)](
            x, c, s, out, N, x.stride(0), x.stride(1), x.stride(2), c.stride(0), c.stride(1), c.stride(2),
            s.stride(0), s.stride(1), s.stride(2), out.stride(0), out.stride(1), out.stride(2), H, 0,
            HALF_D=D // 2, BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D // 2), num_warps=4,
            **launch_options(x))
    return out


@register("ppsplit::rope")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + cat(-x2, x1, -1) * sin`` for ``x [B, H, N, D]`` and ``cos`` / ``sin`` that broadcast to it: one
    Triton kernel on CUDA fp16 / bf16 (bit-equal to the ATen ops), the ATen ops otherwise."""
    if rope_usable(x, cos, sin):
        with torch.cuda.device(x.device):
            return launch_rope(x, cos, sin, wrap=wrap_triton)
    return rope_reference(x, cos, sin)


def rope_write_usable(q, k, cos, sin, pool, other_pool, other_value, slots) -> bool:
    """Whether one kernel serves ``rope_write``: both rotations served by the rope kernel, one sequence row
    (a ragged step), contiguous pools whose rows are the keys' heads and the value's features, ``int32`` / ``int64``
    slots on the same device."""
    n = k.shape[2] if k.dim() == 4 else -1
    return (rope_usable(q, cos, sin) and rope_usable(k, cos, sin) and q.shape[0] == k.shape[0] == 1
            and q.shape[2] == n and q.shape[-1] == k.shape[-1] and pool.is_contiguous()
            and other_pool.is_contiguous() and pool.device == other_pool.device == k.device == slots.device
            and pool[0, 0].numel() == k.shape[1] * k.shape[-1] and other_value.shape[0] == n
            and other_value[0].numel() == other_pool[0, 0].numel() and slots.shape == (n,)
            and slots.dtype in (torch.int32, torch.int64))


def launch_rope_write(q, k, cos, sin, pool, other_pool, other_value, slots):
    _, hq, n, d = q.shape
    hkv = k.shape[1]
    cq, sq = cos.expand(q.shape), sin.expand(q.shape)
    ck, sk = cos.expand(k.shape), sin.expand(k.shape)
    out = _layout_like(q)
    v = feature_rows(other_value)
    if n:
        _rope_write_kernel[(n,)](
            q, k, v, cq, sq, out, pool, other_pool, slots, q.stride(1), q.stride(2), cq.stride(1), cq.stride(2),
            sq.stride(1), sq.stride(2), k.stride(1), k.stride(2), ck.stride(1), ck.stride(2), sk.stride(1),
            sk.stride(2), out.stride(1), out.stride(2), *v.stride(), hq, hkv, v[0].numel(), v.shape[2], 0,
            HALF_D=d // 2, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HKV=triton.next_power_of_2(hkv),
            BLOCK_D=triton.next_power_of_2(d // 2), BLOCK_V=min(triton.next_power_of_2(v[0].numel()), 1024),
            num_warps=4, **launch_options(q))
    return out


@register("ppsplit::rope_write", ("pool", "other_pool"), opaque=True)
def rope_write(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor,
               other_pool: torch.Tensor, other_value: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``rope(q, cos, sin)``, having written ``rope(k, cos, sin)[0].transpose(0, 1)`` and ``other_value`` to the pools
    at ``slots`` (``paged_write_pair``): a ragged step's query rotation and its layer's key and value writes. One
    Triton kernel on CUDA fp16 / bf16 (the values of the three ops it replaces, bit for bit), those ops otherwise."""
    if rope_write_usable(q, k, cos, sin, pool, other_pool, other_value, slots):
        with torch.cuda.device(q.device):
            return launch_rope_write(q, k, cos, sin, pool, other_pool, other_value, slots)
    paged_write_pair(pool, other_pool, rope(k, cos, sin)[0].transpose(0, 1), other_value, slots)
    return rope(q, cos, sin)


@rope_write.register_fake
def _(q, k, cos, sin, pool, other_pool, other_value, slots):
    return _layout_like(q)


def _rows(t: torch.Tensor) -> int | None:
    """The stride between rows of ``t`` seen as ``[numel / last, last]`` with unit column stride; None if it is not
    one such grid (e.g. a slice along a leading dimension). Dimensions of size 1 have no say: their strides are
    arbitrary (``unsqueeze`` gives one that is not the row stride)."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    dims = [d for d in range(t.dim() - 1) if t.shape[d] != 1]
    if not dims:
        return t.shape[-1]  # one row
    for outer, inner in zip(dims, dims[1:]):
        if t.stride(outer) != t.stride(inner) * t.shape[inner]:
            return None
    return t.stride(dims[-1])


def silu_mul_usable(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (on_gpu(a) and a.dtype in HALF and b.dtype == a.dtype and b.device == a.device and a.shape == b.shape
            and a.numel() > 0 and _rows(a) is not None and _rows(b) is not None)


def launch_silu_mul(a: torch.Tensor, b: torch.Tensor, *, wrap=lambda kernel: kernel) -> torch.Tensor:
    cols = a.shape[-1]
    out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    block = min(1024, triton.next_power_of_2(cols))
    wrap(_silu_mul_kernel)[(a.numel() // cols, triton.cdiv(cols, block))](
        a, b, out, cols, _rows(a), _rows(b), 0, BLOCK=block, LIBDEVICE=compiled(), num_warps=4, **launch_options(a))
    return out


@register("ppsplit::silu_mul")
def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` for two tensors of one shape: one Triton kernel on CUDA fp16 / bf16, the ATen ops otherwise."""
    return silu_mul_of(a, b)


def silu_mul_of(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu_mul``'s body, for the ops that end with it."""
    if silu_mul_usable(a, b):
        with torch.cuda.device(a.device):
            return launch_silu_mul(a, b, wrap=wrap_triton)
    return torch.nn.functional.silu(a) * b
