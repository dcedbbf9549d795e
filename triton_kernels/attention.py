"""Attention over a stage's static KV cache: ``ppsplit::cache_attention``, GQA-aware, live prefix only.

Exact math (what the attention pass proves the traced attention equals)::

    q [B, Hq, T, D], k [B, Hkv, L, D], v [B, Hkv, L, Dv], query head h reads KV head h // (Hq // Hkv)
    s[h, t, j] = scale * q[h, t] . k[h // G, j]
    s = softcap * tanh(s / softcap)                  if softcap > 0     (Gemma 2)
    s = s + alibi[h] * j                             if alibi is given  (Bloom: slope times the key's slot)
    visible(t, j) = j <= positions[t] and (window == 0 or positions[t] - j < window)
                    and (chunk_size == 0 or j // chunk_size == positions[t] // chunk_size)   (Llama 4's chunks)
    p = softmax over visible j of s  (with sinks[h] as one more logit in the denominator; gpt-oss)
    out[b, h, t] = sum_j p[h, t, j] * v[h // G, j]

This is Hugging Face's ``repeat_kv`` + mask + ``scaled_dot_product_attention`` (or ``eager_attention_forward``)
over the whole static cache, without expanding K/V to every query head and without touching slots past the
live length ``positions[-1] + 1``, which the GPU kernels read from memory: one captured CUDA graph serves every
length. CPU tensors take the same formula in torch (fp32 math, masked over the whole cache: no data-dependent
shapes, so it also traces under ``torch.compile``).

GPU kernels (Triton):

- split-KV decode (flash-decoding) for ``G * T <= 128`` rows per KV head (decode, verify): one program per
  (batch, KV head, split) holds all ``G`` query heads times ``T`` tokens, so each KV block is read once. When
  batch x KV heads fill the SMs there is one split and the kernel writes the output; otherwise the live range
  is split and a second small kernel combines the splits.
- flash forward for longer prompts: one program per (query block, batch x query head), causal block skipping;
  the key blocks every query of the block sees run without masks.
  Blocks of 64 queries x 64 keys, 4 warps, 3 stages for head dims up to 128: the fastest of the ten shapes swept at
  T=2048 on an H200, 1.29x SDPA's FlashAttention-2 there (``python bench/attention.py --sweep``).

The output is ``[B, Hq, T, Dv]`` laid out as ``[B, T, Hq, Dv]`` in memory, so the model's following
``transpose(1, 2).reshape(B, T, Hq * Dv)`` is a view.
"""
from __future__ import annotations

from typing import Optional

import torch

from ppsplit.triton_kernels.common import HAVE_TRITON, on_gpu, register, tl, triton, wrap_triton


def attention_reference(q, k, v, positions, scale: float, window: int = 0, softcap: float = 0.0,
                        alibi: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
                        selected: Optional[torch.Tensor] = None, chunk_size: int = 0):
    """The exact math above in torch, over the whole cache with a mask (fp32 math, or fp64 for fp64 inputs).
    ``positions``: ``[T]``, or ``[B, T]`` when the rows of the batch sit at positions of their own.
    ``selected [B, T, K]``: each query also sees only the slots it lists (sparse attention; ``-1`` lists none).
    ``chunk_size``: each query sees only the slots of its own chunk of that many positions (chunked attention)."""
    B, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    f = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.to(f).reshape(B, Hkv, G * T, D)
    s = torch.matmul(qg, k.to(f).transpose(-1, -2)).view(B, Hq, T, L) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    slots = torch.arange(L, device=q.device)
    if alibi is not None:
        s = s + alibi.to(f).view(1, Hq, 1, 1) * slots.to(f)
    qpos = positions.view(-1, 1, T, 1)  # [T] for the batch, or [B, T]: each row's own
    visible = slots <= qpos
    if window > 0:
        visible = visible & (qpos - slots < window)
    if chunk_size > 0:
        visible = visible & (slots // chunk_size == qpos // chunk_size)
    if selected is not None:
        visible = visible & (selected[..., None] == slots).any(-2)[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.to(f).view(1, Hq, 1, 1).expand(B, Hq, T, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :L]
    else:
        p = torch.softmax(s, dim=-1)
    out = torch.matmul(p.reshape(B, Hkv, G * T, L), v.to(f)).view(B, Hq, T, v.shape[-1])
    return out.to(q.dtype)


if HAVE_TRITON:

    @triton.jit
    def _scores(q, k_blk, slots, qpos, live, slope, scale, window, softcap,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr):
        """Logits of one block in base-2 units (times log2 e); ``MASKED``: -inf where not visible."""
        if IEEE:
            s = tl.dot(q, k_blk, input_precision="ieee")
        else:
            s = tl.dot(q, k_blk)
        s = s * scale
        if HAS_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both tails in fp32
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        if HAS_ALIBI:
            s = s + slope[:, None] * slots[None, :].to(tl.float32)
        # fp32 whatever type the scalar arguments arrive in (Inductor passes Python floats as fp64).
        s = (s * 1.4426950408889634).to(tl.float32)
        if MASKED:
            visible = (slots[None, :] <= qpos[:, None]) & (slots[None, :] < live)
            if window > 0:
                visible = visible & (qpos[:, None] - slots[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
        return s

    @triton.jit
    def _attend(q, k_base, v_base, skl, svl, d, dv, start, stop, qpos, slope, scale, window, softcap,
                m_i, l_i, acc, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr,
                EVEN_D: tl.constexpr):
        """Online softmax of the queries ``q`` over cache slots ``[start, stop)`` of one KV head, block by block,
        continuing the running row max ``m_i``, row sum ``l_i`` and unnormalised output ``acc``. ``MASKED=False``
        is for whole blocks every query row sees (the caller proves it): no bounds or visibility masks."""
        for n0 in range(start, stop, BLOCK_N):
            slots = n0 + tl.arange(0, BLOCK_N)
            if MASKED:
                in_range = slots < stop
                k_blk = tl.load(k_base + slots[None, :].to(tl.int64) * skl + d[:, None],
                                mask=in_range[None, :] & (d[:, None] < D), other=0.0)
            elif EVEN_D:
                k_blk = tl.load(k_base + slots[None, :].to(tl.int64) * skl + d[:, None])
            else:
                k_blk = tl.load(k_base + slots[None, :].to(tl.int64) * skl + d[:, None], mask=d[:, None] < D,
                                other=0.0)
            s = _scores(q, k_blk, slots, qpos, stop, slope, scale, window, softcap, HAS_SOFTCAP, HAS_ALIBI, IEEE,
                        MASKED)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if MASKED:
                v_blk = tl.load(v_base + slots[:, None].to(tl.int64) * svl + dv[None, :],
                                mask=in_range[:, None] & (dv[None, :] < DV), other=0.0)
            elif EVEN_D:
                v_blk = tl.load(v_base + slots[:, None].to(tl.int64) * svl + dv[None, :])
            else:
                v_blk = tl.load(v_base + slots[:, None].to(tl.int64) * svl + dv[None, :], mask=dv[None, :] < DV,
                                other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v_blk.dtype), v_blk, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v_blk.dtype), v_blk)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _attend_range(q, k_base, v_base, skl, svl, d, dv, start, stop, qpos, first_q, slope, scale, window, softcap,
                      D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_DV: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                      IEEE: tl.constexpr, EVEN_D: tl.constexpr):
        """``_attend`` over ``[start, stop)`` from an empty state: the whole blocks that every row sees (slots up
        to the smallest query position ``first_q``, no window) without masks, the rest with them."""
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        full = start
        if window == 0:
            full = start + tl.maximum(tl.minimum(stop, first_q + 1) - start, 0) // BLOCK_N * BLOCK_N
        m_i, l_i, acc = _attend(q, k_base, v_base, skl, svl, d, dv, start, full, qpos, slope, scale, window, softcap,
                                m_i, l_i, acc, D, DV, BLOCK_N, HAS_SOFTCAP, HAS_ALIBI, IEEE, False, EVEN_D)
        m_i, l_i, acc = _attend(q, k_base, v_base, skl, svl, d, dv, full, stop, qpos, slope, scale, window, softcap,
                                m_i, l_i, acc, D, DV, BLOCK_N, HAS_SOFTCAP, HAS_ALIBI, IEEE, True, EVEN_D)
        return m_i, l_i, acc

    @triton.jit
    def _decode_kernel(Q, K, V, POS, SLOPES, SINKS, O, M_OUT, L_OUT, ACC_OUT,
                       sqb, sqh, sqt, skb, skh, skl, svb, svh, svl, sob, soh, sot,
                       T, Hkv, n_splits, scale, window, softcap,
                       G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
                       DIRECT: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // Hkv
        kvh = bh % Hkv
        rows = tl.arange(0, BLOCK_M)  # row r = query head kvh*G + r // T, token r % T
        row_ok = rows < G * T
        t = tl.where(row_ok, rows % T, 0)
        h = kvh * G + tl.where(row_ok, rows // T, 0)
        qpos = tl.load(POS + t)
        live = tl.load(POS + T - 1) + 1
        first = tl.load(POS)
        lo = first * 0  # a tensor of the type the window branch gives (the compiler wants both branches alike)
        if window > 0:
            lo = tl.maximum(first - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        n_blocks = tl.cdiv(live - lo, BLOCK_N)
        per_split = tl.cdiv(n_blocks, n_splits)
        start = lo + split * per_split * BLOCK_N
        stop = tl.minimum(start + per_split * BLOCK_N, live)

        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        q = tl.load(Q + b.to(tl.int64) * sqb + h[:, None] * sqh + t[:, None] * sqt + d[None, :],
                    mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
        slope = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_ALIBI:
            slope = tl.load(SLOPES + h).to(tl.float32) * 1.0
        k_base = K + b.to(tl.int64) * skb + kvh * skh
        v_base = V + b.to(tl.int64) * svb + kvh * svh
        m_i, l_i, acc = _attend_range(q, k_base, v_base, skl, svl, d, dv, start, stop, qpos, first, slope, scale,
                                      window, softcap, D, DV, BLOCK_M, BLOCK_N, BLOCK_DV, HAS_SOFTCAP, HAS_ALIBI,
                                      IEEE, EVEN_D)
        # No early return: with one split the partial buffers are one-element placeholders, so the partial stores
        # must not be emitted at all (an early `return` here let a GPU build write past them).
        if DIRECT:  # one split: this program saw the whole live range, normalise and write the output
            if HAS_SINKS:
                l_i += tl.exp2(tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634 - m_i)
            out = acc / l_i[:, None]
            tl.store(O + b.to(tl.int64) * sob + h[:, None] * soh + t[:, None] * sot + dv[None, :],
                     out.to(O.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
        else:
            part = (bh * n_splits + split) * BLOCK_M + rows
            tl.store(M_OUT + part, m_i)
            tl.store(L_OUT + part, l_i)
            tl.store(ACC_OUT + part[:, None].to(tl.int64) * BLOCK_DV + dv[None, :], acc)

    @triton.jit
    def _combine_kernel(M_IN, L_IN, ACC_IN, SINKS, O, sob, soh, sot, T, Hkv, n_splits,
                        G: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
                        HAS_SINKS: tl.constexpr, SPLITS: tl.constexpr):
        bh = tl.program_id(0)
        r = tl.program_id(1)  # one row: query head kvh*G + r // T, token r % T
        b = bh // Hkv
        kvh = bh % Hkv
        h = kvh * G + r // T
        t = r % T
        dv = tl.arange(0, BLOCK_DV)
        # SPLITS partials at a time, rescaled online: a few wide loads instead of 2 x n_splits dependent ones.
        m = tl.full([1], -1.0e30, dtype=tl.float32)
        l_sum = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
        for s0 in range(0, n_splits, SPLITS):
            s = s0 + tl.arange(0, SPLITS)
            live = s < n_splits
            part = (bh * n_splits + s) * BLOCK_M + r
            ms = tl.load(M_IN + part, mask=live, other=-1.0e30)
            m_new = tl.maximum(m, tl.max(ms, axis=0))
            rescale = tl.exp2(m - m_new)
            w = tl.where(live, tl.exp2(ms - m_new), 0.0)
            l_sum = l_sum * rescale + tl.sum(w * tl.load(L_IN + part, mask=live, other=0.0), axis=0)
            parts = tl.load(ACC_IN + part[:, None].to(tl.int64) * BLOCK_DV + dv[None, :], mask=live[:, None], other=0.0)
            acc = acc * rescale + tl.sum(w[:, None] * parts, axis=0)
            m = m_new
        if HAS_SINKS:
            sink = tl.load(SINKS + h + tl.zeros([1], dtype=tl.int32)).to(tl.float32) * 1.4426950408889634
            l_sum += tl.exp2(sink - m)
        out = acc / tl.sum(l_sum, axis=0)
        tl.store(O + b.to(tl.int64) * sob + h * soh + t * sot + dv, out.to(O.dtype.element_ty), mask=dv < DV)

    @triton.jit
    def _prefill_kernel(Q, K, V, POS, SLOPES, SINKS, O,
                        sqb, sqh, sqt, skb, skh, skl, svb, svh, svl, sob, soh, sot,
                        T, Hq, scale, window, softcap,
                        G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
                        IEEE: tl.constexpr, EVEN_D: tl.constexpr):
        m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # the longest (latest) query blocks first
        bh = tl.program_id(1)
        b = bh // Hq
        h = bh % Hq
        kvh = h // G
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < T
        qpos = tl.load(POS + rows, mask=row_ok, other=-1)
        live = tl.load(POS + T - 1) + 1
        hi = tl.minimum(tl.max(qpos, axis=0) + 1, live)  # causal: nothing past this block's last query
        first_q = tl.min(tl.where(row_ok, qpos, 2147483647), axis=0)
        lo = hi * 0  # a tensor of the type the window branch gives (the compiler wants both branches alike)
        if window > 0:
            lo = tl.maximum(first_q - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        q = tl.load(Q + b.to(tl.int64) * sqb + h * sqh + rows[:, None].to(tl.int64) * sqt + d[None, :],
                    mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
        slope = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_ALIBI:
            slope = slope + tl.load(SLOPES + h).to(tl.float32)
        k_base = K + b.to(tl.int64) * skb + kvh * skh
        v_base = V + b.to(tl.int64) * svb + kvh * svh
        m_i, l_i, acc = _attend_range(q, k_base, v_base, skl, svl, d, dv, lo, hi, qpos, first_q, slope, scale,
                                      window, softcap, D, DV, BLOCK_M, BLOCK_N, BLOCK_DV, HAS_SOFTCAP, HAS_ALIBI,
                                      IEEE, EVEN_D)
        if HAS_SINKS:
            sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
            l_i += tl.exp2(sink - m_i)
        out = acc / l_i[:, None]
        tl.store(O + b.to(tl.int64) * sob + h * soh + rows[:, None].to(tl.int64) * sot + dv[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (int(n) - 1).bit_length())


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, so the combine step is exercised


def launch_cache_attention(q, k, v, positions, scale: float, window: int = 0, softcap: float = 0.0,
                           alibi=None, sinks=None, *, wrap=lambda kernel: kernel, out=None,
                           decode: bool | None = None, n_splits: int | None = None, config: dict | None = None):
    """Run the Triton kernels: returns ``out`` ``[B, Hq, T, Dv]`` (``[B, T, Hq, Dv]`` in memory). ``decode``
    forces the split-KV (True) or the flash (False) kernel; by default ``G * T <= 128`` takes split-KV.
    ``config`` overrides the flash kernel's ``block_m``, ``block_n``, ``num_warps`` and ``num_stages`` (for
    ``bench/attention.py``). Works on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (the kernel tests)."""
    B, Hq, T, D = q.shape
    Hkv, L, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = Hq // Hkv
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # the kernels index d with stride 1
    if out is None:
        out = torch.empty(B, T, Hq, Dv, dtype=q.dtype, device=q.device).transpose(1, 2)
    block_d, block_dv = _pow2(D), _pow2(Dv)
    ieee = q.dtype == torch.float32
    dummy = positions  # stands in for absent optional pointers; never read
    common = dict(HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi is not None, IEEE=ieee,
                  EVEN_D=block_d == D and block_dv == Dv)
    if decode is None:
        decode = G * T <= 128
    if decode:
        block_m = _pow2(G * T)
        block_n = 64 if max(block_d, block_dv) <= 128 else 32
        if n_splits is None:
            # Enough (batch, KV head) programs to fill the SMs: one split, no combine step. Otherwise split the
            # live range so that about two programs run per SM.
            sms = _sm_count(q.device)
            n_splits = 1 if B * Hkv >= sms else max(1, min(triton.cdiv(2 * sms, B * Hkv), triton.cdiv(L, block_n)))
        parts = B * Hkv * n_splits * block_m if n_splits > 1 else 1
        m_part = torch.empty(parts, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(parts, block_dv if n_splits > 1 else 1, dtype=torch.float32, device=q.device)
        wrap(_decode_kernel)[(B * Hkv, n_splits)](
            q, k, v, positions, alibi if alibi is not None else dummy, sinks if sinks is not None else dummy, out,
            m_part, l_part, acc_part,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            T, Hkv, n_splits, scale, window, softcap,
            G=G, D=D, DV=Dv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
            HAS_SINKS=sinks is not None, DIRECT=n_splits == 1, num_warps=4, num_stages=2, **common)
        if n_splits == 1:
            return out
        wrap(_combine_kernel)[(B * Hkv, G * T)](
            m_part, l_part, acc_part, sinks if sinks is not None else dummy, out,
            out.stride(0), out.stride(1), out.stride(2), T, Hkv, n_splits,
            G=G, DV=Dv, BLOCK_M=block_m, BLOCK_DV=block_dv, HAS_SINKS=sinks is not None,
            SPLITS=16, num_warps=4 if n_splits > 4 else 1)
    else:
        big = max(block_d, block_dv) > 128
        block_n = 32 if big else 64
        cfg = dict(dict(block_m=64, block_n=block_n, num_warps=4, num_stages=3), **(config or {}))
        block_m, block_n = cfg["block_m"], cfg["block_n"]
        wrap(_prefill_kernel)[(triton.cdiv(T, block_m), B * Hq)](
            q, k, v, positions, alibi if alibi is not None else dummy, sinks if sinks is not None else dummy, out,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            T, Hq, scale, window, softcap,
            G=G, D=D, DV=Dv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
            HAS_SINKS=sinks is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common)
    return out


@register("ppsplit::cache_attention")
def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                    scale: float, window: int, softcap: float, alibi: Optional[torch.Tensor],
                    sinks: Optional[torch.Tensor], chunk_size: int = 0) -> torch.Tensor:
    """Causal attention of ``q [B, Hq, T, D]`` at ``positions`` over the cache rows ``k_cache/v_cache
    [B, Hkv, L, D]`` (already written at ``positions``); see the module docstring for the exact math. Chunked
    attention (``chunk_size``) is proposed by the attention pass only for a paged cache, whose pass turns it into
    ``paged_attention``: the lockstep kernels here have no chunks."""
    if on_gpu(q):
        if chunk_size:
            raise NotImplementedError("cache_attention's kernels have no chunked attention; it runs as paged_attention")
        with torch.cuda.device(q.device):
            return launch_cache_attention(q, k_cache, v_cache, positions, scale, window, softcap, alibi, sinks,
                                          wrap=wrap_triton)
    B, Hq, T, _ = q.shape
    out = torch.empty(B, T, Hq, v_cache.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
    out.copy_(attention_reference(q, k_cache, v_cache, positions, scale, window, softcap, alibi, sinks,
                                  chunk_size=chunk_size))
    return out


def latent_attention_reference(q, latents, ropes, weight, nope_dim: int, positions, scale: float, window: int = 0,
                               softcap: float = 0.0, selected: Optional[torch.Tensor] = None):
    """Multi-head latent attention (MLA: DeepSeek-V2/V3 and the models built like them) in the absorbed form.

    ``q [B, H, T, dn + dr]`` (each head's non-rotary part, then its rotary part), ``latents [B, 1, L, r]`` and
    ``ropes [B, 1, L, dr]`` (the cached latent and rotary key of every position, one for all heads), ``weight
    [H * (dn + dv), r]`` (``kv_b_proj``: per head ``W_uk [dn, r]`` then ``W_uv [dv, r]``). Hugging Face expands every
    cached position to per-head keys ``[W_uk c; k_r]`` and values ``W_uv c``; the same attention, per head::

        q_lat = W_uk^T q_nope                       (r wide)
        s_j   = scale * (q_lat . c_j + q_rope . k_r_j), masked as in ``attention_reference``
        out   = W_uv (sum_j p_j c_j)                -> [B, H, T, dv]

    i.e. ``attention_reference`` of the query ``[q_lat; q_rope]`` over one KV head whose key is ``[c; k_r]`` and value
    ``c``, then ``W_uv``: no expanded key or value exists (vLLM's and FlashMLA's MLA). fp32 math (fp64 for fp64).
    ``selected [B, T, K]``: DeepSeek-V3.2's sparse attention, each token over the positions its indexer picked."""
    heads = q.shape[1]
    f = torch.float64 if q.dtype == torch.float64 else torch.float32
    w = weight.to(f).view(heads, -1, weight.shape[-1])
    q_lat = torch.matmul(q[..., :nope_dim].to(f), w[:, :nope_dim])
    query = torch.cat([q_lat, q[..., nope_dim:].to(f)], dim=-1)
    keys = torch.cat([latents.to(f), ropes.to(f)], dim=-1)
    o_lat = attention_reference(query, keys, latents.to(f), positions, scale, window, softcap, selected=selected)
    return torch.matmul(o_lat, w[:, nope_dim:].transpose(-1, -2)).to(q.dtype)


def latent_weight(weight: torch.Tensor, weight_scale: Optional[torch.Tensor], block_n: int, block_k: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """MLA's ``kv_b_proj`` weight in ``dtype``: an FP8 one (``weight_scale`` given) dequantised per block."""
    if weight_scale is None:
        return weight.to(dtype)
    from ppsplit.triton_kernels.fp8 import dequantize

    return dequantize(weight, weight_scale, block_n, block_k, dtype)


@register("ppsplit::latent_attention", opaque=True)
def latent_attention(q: torch.Tensor, latents: torch.Tensor, ropes: torch.Tensor, weight: torch.Tensor,
                     nope_dim: int, positions: torch.Tensor, scale: float, window: int, softcap: float,
                     selected: Optional[torch.Tensor], weight_scale: Optional[torch.Tensor] = None, block_n: int = 0,
                     block_k: int = 0) -> torch.Tensor:
    """``latent_attention_reference`` over a dense cache, ``[B, H, T, dv]`` laid out as ``[B, T, H, dv]``: what the
    attention pass proves an MLA layer equal to in a paged trace; the paged pass then makes it
    ``paged_latent_attention`` (so it never reaches a stage, and runs in torch only). ``weight_scale``: ``weight``
    is FP8, with these block scales of ``(block_n, block_k)`` blocks (a model transformers loaded FP8)."""
    out = torch.empty(q.shape[0], q.shape[2], q.shape[1], weight.shape[0] // q.shape[1] - nope_dim, dtype=q.dtype,
                      device=q.device).transpose(1, 2)
    w = latent_weight(weight, weight_scale, block_n, block_k, q.dtype)
    out.copy_(latent_attention_reference(q, latents, ropes, w, nope_dim, positions, scale, window, softcap, selected))
    return out


@latent_attention.register_fake
def _(q, latents, ropes, weight, nope_dim, positions, scale, window, softcap, selected, weight_scale=None,
      block_n=0, block_k=0):
    dv = weight.shape[0] // q.shape[1] - nope_dim
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], dv).transpose(1, 2)


def indexer_scores(q, weights, keys, visible, scale: float) -> torch.Tensor:
    """A sparse-attention indexer's scores (DeepSeek-V3.2's DSA; ``DeepseekV32Indexer`` in transformers):
    ``s[j] = sum_h weights[h] * relu(scale * q[h] . keys[j])`` where ``visible[j]``, ``-inf`` elsewhere. ``q [..., H,
    D]``, ``weights`` (``H`` per token, any shape), ``keys [..., L, D]``, ``visible [..., L]`` -> ``[..., L]`` in fp32
    (fp64 for fp64)."""
    f = torch.float64 if q.dtype == torch.float64 else torch.float32
    per_head = torch.relu(torch.einsum("...hd,...ld->...hl", q.to(f), keys.to(f)) * scale)
    s = torch.einsum("...h,...hl->...l", weights.to(f).reshape(q.shape[:-1]), per_head)
    return s.masked_fill(~visible, float("-inf"))


def top_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` best-scored positions along the last dim, ``-1`` where fewer than ``topk`` are visible."""
    values, where = scores.topk(min(topk, scores.shape[-1]), dim=-1)
    return where.masked_fill(values == float("-inf"), -1)


@register("ppsplit::indexer_topk", opaque=True)
def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scale: float,
                 topk: int) -> torch.Tensor:
    """The positions a sparse-attention indexer picks for each token over a dense cache: ``q [B, T, H, D]``, ``keys
    [B, L, D]``, the ``topk`` positions ``<= positions[t]`` of best ``indexer_scores`` -> ``[B, T, topk]`` int64 (``-1``
    past the visible ones). What the attention pass proves a DSA indexer equal to in a paged trace; the paged pass
    makes it ``paged_indexer_topk``."""
    visible = torch.arange(keys.shape[1], device=q.device) <= positions.view(-1, 1)  # [T, L]
    return top_positions(indexer_scores(q, weights, keys[:, None], visible, scale), topk)


@indexer_topk.register_fake
def _(q, weights, keys, positions, scale, topk):
    return q.new_empty(q.shape[0], q.shape[1], min(topk, keys.shape[1]), dtype=torch.long)
