"""Paged state for ragged steps: one call holds ``N`` tokens of many sequences, each with its own position.

The cache of a layer is a pool of fixed-size blocks, ``[num_blocks, block_size, *feature]`` (keys and values:
``[num_blocks, block_size, kv_heads, head_dim]``; short-convolution inputs: ``[num_blocks, block_size, channels]``).
A sequence slot ``s`` owns the blocks ``block_table[s]``; the entry of position ``p`` lives at flat slot
``block_table[s, p // block_size] * block_size + p % block_size``. Per token a step passes its position, its
sequence slot (``seq``, ``-1`` for padding, which writes nowhere and reads nothing), and per sequence slot where
its tokens start among the ``N`` and how many there are (``seq_start``, ``seq_count``; a slot's tokens are
contiguous and at consecutive positions). Rejected drafts are simply overwritten by the next step.

Ops (each with a torch path for CPU tensors, which the tests compare, and a Triton kernel on CUDA):

- ``slot_mapping(positions, seq, block_table, block_size)``: the flat slot of each token (``-1`` for padding);
- ``paged_write(pool, value [N, *feature], slots)``: ``pool.flat[slots[t]] = value[t]`` for every real token;
  ``paged_write_pair`` two of them at the same slots (a layer's keys and values) in one launch;
- ``paged_attention(q [1, Hq, N, D], keys, values, positions, seq, block_table, seq_start, seq_count, scale,
  window, softcap, alibi, sinks, chunk_size)``: token ``t`` attends to the keys of its own sequence at positions
  ``<= positions[t]`` (and ``> positions[t] - window`` with a window, and in the same chunk of ``chunk_size``
  positions as ``positions[t]`` with chunks), the math of ``attention_reference``;
- ``paged_latent_attention(q [1, H, N, dn + dr], latents, ropes, weight, nope_dim, positions, seq, ...)``: MLA over
  pools of latents ``[num_blocks, block_size, 1, r]`` and rotary keys ``[..., 1, dr]``, the math of
  ``latent_attention_reference`` per sequence (the kernel is ``paged_attention``'s with a second key part); with
  ``selected [1, N, K]`` (DeepSeek-V3.2's sparse attention) each token over the positions listed, gathered (torch);
- ``paged_indexer_topk(q [1, N, H, D], weights, keys [num_blocks, block_size, D], positions, seq, ...)``: the
  positions a sparse-attention indexer picks per token over its own sequence's keys (torch, no host read);
- ``paged_conv1d(x [1, C, N], weight [C, 1, k], bias, pool, positions, seq, block_table)``: the depthwise causal
  convolution of each token over the last ``k`` inputs of its sequence (already written into ``pool``), laid out
  as ``aten.convolution`` with padding ``k - 1`` lays out a single sequence's window (see the paged pass).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ppsplit.triton_kernels.attention import (attention_reference, indexer_scores, latent_attention_reference,
                                              latent_weight, top_positions)
from ppsplit.triton_kernels.common import HAVE_TRITON, launch_options, on_gpu, register, tl, triton


def slot_mapping_reference(positions, seq, block_table, block_size: int) -> torch.Tensor:
    real = seq >= 0
    rows = seq.clamp(min=0)
    blocks = block_table[rows, (positions // block_size).clamp(0, block_table.shape[1] - 1)].long()
    slots = blocks * block_size + positions % block_size
    return torch.where(real, slots, torch.full_like(slots, -1))


@torch.library.custom_op("ppsplit::slot_mapping", mutates_args=())
def slot_mapping(positions: torch.Tensor, seq: torch.Tensor, block_table: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """The flat cache slot of each token: ``block_table[seq, pos // bs] * bs + pos % bs``, ``-1`` for padding."""
    return slot_mapping_reference(positions, seq, block_table, block_size)


@slot_mapping.register_fake
def _(positions, seq, block_table, block_size):
    return torch.empty_like(positions)


@register("ppsplit::paged_write", ("pool",), opaque=True)
def paged_write(pool: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """``pool.view(-1, *feature)[slots[t]] = value[t]`` for every token whose slot is not negative."""
    if on_gpu(value):
        with torch.cuda.device(value.device):
            launch_paged_write(pool, value, slots)
        return
    _write_rows(pool, value, slots)


def _write_rows(pool: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """The torch path of a paged write (CPU tensors)."""
    flat = pool.view(pool.shape[0] * pool.shape[1], *pool.shape[2:])
    real = slots >= 0
    flat.index_copy_(0, slots[real], value[real].to(pool.dtype))


@paged_write.register_fake
def _(pool, value, slots):
    return None


@register("ppsplit::paged_write_pair", ("pool", "other_pool"), opaque=True)
def paged_write_pair(pool: torch.Tensor, other_pool: torch.Tensor, value: torch.Tensor, other_value: torch.Tensor,
                     slots: torch.Tensor) -> None:
    """``paged_write(pool, value, slots)`` and ``paged_write(other_pool, other_value, slots)`` (a layer's keys and
    values) in one launch."""
    if on_gpu(value):
        with torch.cuda.device(value.device):
            launch_paged_write(pool, value, slots, other=(other_pool, other_value))
        return
    _write_rows(pool, value, slots)
    _write_rows(other_pool, other_value, slots)


@paged_write_pair.register_fake
def _(pool, other_pool, value, other_value, slots):
    return None


def _segments(seq_start: torch.Tensor, seq_count: torch.Tensor):
    """``(slot, start, count)`` of every sequence slot with tokens in this call (host read: the torch paths)."""
    counts = seq_count.tolist()
    starts = seq_start.tolist()
    return [(s, starts[s], c) for s, c in enumerate(counts) if c > 0]


def _gather(pool: torch.Tensor, block_table: torch.Tensor, slot: int, length: int) -> torch.Tensor:
    """Entries ``0 .. length - 1`` of sequence ``slot``: ``[length, *feature]``."""
    bs = pool.shape[1]
    where = torch.arange(length, device=pool.device)
    return pool[block_table[slot, where // bs].long(), where % bs]


def paged_attention_reference(q, keys, values, positions, seq, block_table, seq_start, seq_count, scale: float,
                              window: int = 0, softcap: float = 0.0, alibi=None, sinks=None,
                              chunk_size: int = 0) -> torch.Tensor:
    """Per sequence, ``attention_reference`` over the keys it has so far; padding tokens get zeros.
    ``q [1, Hq, N, D]`` -> ``[1, Hq, N, Dv]``."""
    out = torch.zeros(q.shape[:-1] + (values.shape[-1],), dtype=q.dtype, device=q.device)
    for slot, start, count in _segments(seq_start, seq_count):
        pos = positions[start:start + count]
        length = int(pos.max()) + 1
        k = _gather(keys, block_table, slot, length).permute(1, 0, 2)[None]  # [1, Hkv, L, D]
        v = _gather(values, block_table, slot, length).permute(1, 0, 2)[None]
        got = attention_reference(q[:, :, start:start + count], k.to(q.dtype), v.to(q.dtype), pos, scale, window,
                                  softcap, alibi, sinks, chunk_size=chunk_size)
        out[:, :, start:start + count] = got.to(q.dtype)
    return out


def paged_attention_grouped(q, keys, values, positions, block_table, seq_start, seq_count, scale: float,
                            window: int = 0, softcap: float = 0.0, alibi=None, sinks=None,
                            chunk_size: int = 0) -> torch.Tensor:
    """``paged_attention_reference`` with the sequences of a step grouped by their token count (all decode tokens,
    all verify windows of K + 1, each prefill chunk length): one batched ``attention_reference`` per group over its
    sequences' keys, gathered through the block table up to the group's longest. The torch path of the op (a host
    read of the counts, no loop over the sequences)."""
    out = torch.zeros(q.shape[:-1] + (values.shape[-1],), dtype=q.dtype, device=q.device)
    groups: dict[int, list[int]] = {}
    for slot, _, count in _segments(seq_start, seq_count):
        groups.setdefault(count, []).append(slot)
    bs = keys.shape[1]
    for count, slots in groups.items():
        slots = torch.tensor(slots, device=q.device)
        rows = seq_start[slots][:, None] + torch.arange(count, device=q.device)  # [B, count]
        pos = positions[rows]
        where = torch.arange(int(pos.max()) + 1, device=q.device)
        blocks = block_table[slots][:, where // bs].clamp(min=0)  # [B, L]
        # Past a sequence's own length the rows hold other sequences' entries (or nothing written yet): masked out
        # by position, and zeroed, so that a stale value (even a NaN) weighs nothing.
        stale = (where >= pos.max(1).values[:, None] + 1)[:, None, :, None]
        k, v = (pool[blocks, where % bs].transpose(1, 2).to(q.dtype).masked_fill(stale, 0)
                for pool in (keys, values))  # [B, Hkv, L, *]
        got = attention_reference(q[0][:, rows].transpose(0, 1), k, v, pos, scale, window, softcap, alibi, sinks,
                                  chunk_size=chunk_size)
        out[0][:, rows] = got.transpose(0, 1)
    return out


@register("ppsplit::paged_attention", opaque=True)
def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                    seq: torch.Tensor, block_table: torch.Tensor, seq_start: torch.Tensor, seq_count: torch.Tensor,
                    scale: float, window: int, softcap: float, alibi: Optional[torch.Tensor],
                    sinks: Optional[torch.Tensor], chunk_size: int = 0) -> torch.Tensor:
    """Ragged causal attention over paged keys and values (see the module docstring). ``[1, Hq, N, Dv]``, stored
    as ``[1, N, Hq, Dv]`` (the layout the model's output projection reads)."""
    if on_gpu(q):
        with torch.cuda.device(q.device):
            return launch_paged_attention(q, keys, values, positions, seq, block_table, seq_start, seq_count, scale,
                                          window, softcap, alibi, sinks, chunk_size=chunk_size)
    out = torch.empty(q.shape[0], q.shape[2], q.shape[1], values.shape[-1], dtype=q.dtype,
                      device=q.device).transpose(1, 2)
    out.copy_(paged_attention_grouped(q, keys, values, positions, block_table, seq_start, seq_count, scale, window,
                                      softcap, alibi, sinks, chunk_size))
    return out


@paged_attention.register_fake
def _(q, keys, values, positions, seq, block_table, seq_start, seq_count, scale, window, softcap, alibi, sinks,
      chunk_size=0):
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], values.shape[-1]).transpose(1, 2)


def paged_latent_attention_reference(q, latents, ropes, weight, nope_dim: int, positions, seq, block_table,
                                     seq_start, seq_count, scale: float, window: int = 0, softcap: float = 0.0,
                                     selected=None) -> torch.Tensor:
    """Per sequence, ``latent_attention_reference`` over the latents and rotary keys it has so far; padding tokens
    get zeros. ``q [1, H, N, dn + dr]`` -> ``[1, H, N, dv]``."""
    if selected is not None:
        return _sparse_latent_attention(q, latents, ropes, weight, nope_dim, positions, seq, block_table, scale,
                                        window, softcap, selected)
    dv = weight.shape[0] // q.shape[1] - nope_dim
    out = torch.zeros(q.shape[:-1] + (dv,), dtype=q.dtype, device=q.device)
    for slot, start, count in _segments(seq_start, seq_count):
        pos = positions[start:start + count]
        length = int(pos.max()) + 1
        c, kr = (_gather(pool, block_table, slot, length).permute(1, 0, 2)[None].to(q.dtype)
                 for pool in (latents, ropes))  # [1, 1, L, r] and [1, 1, L, dr]
        out[:, :, start:start + count] = latent_attention_reference(
            q[:, :, start:start + count], c, kr, weight.to(q.dtype), nope_dim, pos, scale, window, softcap)
    return out


def _sparse_latent_attention(q, latents, ropes, weight, nope_dim: int, positions, seq, block_table, scale: float,
                             window: int, softcap: float, selected) -> torch.Tensor:
    """``latent_attention_reference`` of each token over the ``K`` positions of its own sequence that ``selected [1,
    N, K]`` lists, each once, as a top-k gives them (``-1``: none; positions past the token's own, or out of its
    window, are not seen): the listed
    latents and rotary keys gathered through the block table, each token a batch of one query over ``K`` slots. No
    host read, so it runs on any device and captures."""
    sel = selected[0]
    bs, k = latents.shape[1], sel.shape[-1]
    live = (sel >= 0) & (sel <= positions[:, None]) & (seq[:, None] >= 0)
    if window > 0:
        live = live & (positions[:, None] - sel < window)
    where = sel.clamp(min=0)
    blocks = block_table[seq.clamp(min=0)[:, None], where // bs].clamp(min=0)
    # [N, 1, K, *]; what is not seen is zeroed, so that a stale entry (even a NaN) weighs nothing
    c, kr = (pool[blocks, where % bs].masked_fill(~live[:, :, None, None], 0).transpose(1, 2).to(q.dtype)
             for pool in (latents, ropes))
    slots = torch.arange(k, device=q.device)
    out = latent_attention_reference(q[0].transpose(0, 1)[:, :, None], c, kr, weight.to(q.dtype), nope_dim,
                                     slots[-1:], scale, 0, softcap, torch.where(live, slots, -1)[:, None])
    return out[:, :, 0].transpose(0, 1)[None].nan_to_num(0.0)  # a token with nothing to see (padding): zeros


def paged_indexer_topk_reference(q, weights, keys, positions, seq, block_table, scale: float,
                                 topk: int) -> torch.Tensor:
    """``indexer_topk`` of each token over its own sequence's keys in the pool ``[num_blocks, block_size, D]``
    (every position a block table can hold, gathered: no host read) -> ``[1, N, topk]``; padding tokens get ``-1``."""
    bs = keys.shape[1]
    where = torch.arange(block_table.shape[1] * bs, device=q.device)
    blocks = block_table[seq.clamp(min=0)][:, where // bs].clamp(min=0)  # [N, L]
    visible = (where <= positions[:, None]) & (seq[:, None] >= 0)
    return top_positions(indexer_scores(q[0], weights, keys[blocks, where % bs], visible, scale), topk)[None]


@register("ppsplit::paged_indexer_topk", opaque=True)
def paged_indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                       seq: torch.Tensor, block_table: torch.Tensor, scale: float, topk: int) -> torch.Tensor:
    """See ``paged_indexer_topk_reference`` (the same torch on every device)."""
    return paged_indexer_topk_reference(q, weights, keys, positions, seq, block_table, scale, topk)


@paged_indexer_topk.register_fake
def _(q, weights, keys, positions, seq, block_table, scale, topk):
    return q.new_empty(1, q.shape[1], min(topk, block_table.shape[1] * keys.shape[1]), dtype=torch.long)


@register("ppsplit::paged_latent_attention", opaque=True)
def paged_latent_attention(q: torch.Tensor, latents: torch.Tensor, ropes: torch.Tensor, weight: torch.Tensor,
                           nope_dim: int, positions: torch.Tensor, seq: torch.Tensor, block_table: torch.Tensor,
                           seq_start: torch.Tensor, seq_count: torch.Tensor, scale: float, window: int,
                           softcap: float, selected: Optional[torch.Tensor],
                           weight_scale: Optional[torch.Tensor] = None, block_n: int = 0,
                           block_k: int = 0) -> torch.Tensor:
    """Ragged MLA over paged latents (see the module docstring). ``[1, H, N, dv]``, stored as ``[1, N, H, dv]``.
    ``weight_scale``: ``weight`` is FP8 with these ``(block_n, block_k)`` block scales; on CUDA its two per-head
    products read it as stored where its blocks hold whole heads (``latent_fp8_views``), else it is dequantised."""
    dv = weight.shape[0] // q.shape[1] - nope_dim
    out = torch.empty(q.shape[0], q.shape[2], q.shape[1], dv, dtype=q.dtype, device=q.device).transpose(1, 2)
    fp8 = None
    if weight_scale is not None:
        fp8 = latent_fp8_views(weight, weight_scale, block_n, block_k, q.shape[1], nope_dim) \
            if on_gpu(q) and selected is None else None
        if fp8 is None:
            weight = latent_weight(weight, weight_scale, block_n, block_k, q.dtype)
    if on_gpu(q) and selected is None:
        with torch.cuda.device(q.device):
            out.copy_(launch_paged_latent_attention(q, latents, ropes, weight, nope_dim, positions, seq, block_table,
                                                    seq_start, seq_count, scale, window, softcap, fp8=fp8))
        return out
    out.copy_(paged_latent_attention_reference(q, latents, ropes, weight, nope_dim, positions, seq, block_table,
                                               seq_start, seq_count, scale, window, softcap, selected))
    return out


@paged_latent_attention.register_fake
def _(q, latents, ropes, weight, nope_dim, positions, seq, block_table, seq_start, seq_count, scale, window, softcap,
      selected, weight_scale=None, block_n=0, block_k=0):
    dv = weight.shape[0] // q.shape[1] - nope_dim
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], dv).transpose(1, 2)


def paged_conv1d_reference(x, weight, bias, pool, positions, seq, block_table) -> torch.Tensor:
    """``[1, C, N + 2(k - 1)]`` in the weight's dtype (what ``conv1d`` with padding ``k - 1`` returns for a window
    of ``k - 1 + N`` inputs): column ``k - 1 + t`` holds token ``t``'s depthwise convolution over the inputs of its
    sequence at positions ``p_t - k + 1 .. p_t`` (zeros before position 0), read from ``pool``."""
    channels, kernel = weight.shape[0], weight.shape[-1]
    n = x.shape[-1]
    bs = pool.shape[1]
    taps = positions[:, None] - torch.arange(kernel - 1, -1, -1, device=positions.device)  # [N, k]
    real = (seq[:, None] >= 0) & (taps >= 0)
    rows = seq.clamp(min=0)[:, None].expand_as(taps)
    blocks = block_table[rows, (taps.clamp(min=0) // bs).clamp(max=block_table.shape[1] - 1)].long()
    window = pool[blocks, taps.clamp(min=0) % bs].float() * real[..., None]  # [N, k, C]
    y = torch.einsum("nkc,ck->nc", window, weight.reshape(channels, kernel).float())
    if bias is not None:
        y = y + bias.float()
    y = y * (seq[:, None] >= 0)
    out = torch.zeros(1, channels, n + 2 * (kernel - 1), dtype=weight.dtype, device=x.device)
    out[0, :, kernel - 1:kernel - 1 + n] = y.t().to(weight.dtype)
    return out


@register("ppsplit::paged_conv1d", opaque=True)
def paged_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], pool: torch.Tensor,
                 positions: torch.Tensor, seq: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """See ``paged_conv1d_reference``."""
    if on_gpu(x):
        with torch.cuda.device(x.device):
            return launch_paged_conv1d(x, weight, bias, pool, positions, seq, block_table)
    return paged_conv1d_reference(x, weight, bias, pool, positions, seq, block_table)


@paged_conv1d.register_fake
def _(x, weight, bias, pool, positions, seq, block_table):
    kernel = weight.shape[-1]
    return weight.new_empty(1, weight.shape[0], x.shape[-1] + 2 * (kernel - 1))


# ---- Triton kernels ------------------------------------------------------------------------------------------

if HAVE_TRITON:
    from ppsplit.triton_kernels.common import wait_for_previous

    @triton.jit
    def write_token(POOL, VALUE, t, slot, F, W, svt, svh, svw, BLOCK: tl.constexpr):
        """Token ``t``'s value, ``F`` entries read as rows of ``W`` (``value[t, f // W, f % W]`` over strides, so a
        head-major view of the keys needs no copy), into pool slot ``slot``."""
        for f0 in range(0, F, BLOCK):
            f = f0 + tl.arange(0, BLOCK)
            ok = f < F
            v = tl.load(VALUE + t.to(tl.int64) * svt + (f // W) * svh + (f % W) * svw, mask=ok)
            tl.store(POOL + slot.to(tl.int64) * F + f, v.to(POOL.dtype.element_ty), mask=ok)

    @triton.jit
    def _paged_write_kernel(POOL, VALUE, POOL2, VALUE2, SLOTS, F, W, svt, svh, svw, F2, W2, s2t, s2h, s2w,
                            BLOCK: tl.constexpr, BLOCK2: tl.constexpr):
        """One program per (token, value): the second value (``POOL2``, ``VALUE2``) on ``program_id(1) == 1``."""
        t = tl.program_id(0)
        slot = tl.load(SLOTS + t)
        if slot >= 0:
            if tl.program_id(1) == 0:
                write_token(POOL, VALUE, t, slot, F, W, svt, svh, svw, BLOCK)
            else:
                write_token(POOL2, VALUE2, t, slot, F2, W2, s2t, s2h, s2w, BLOCK2)

    @triton.jit
    def _tile_of(COUNTS, program, S: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_Q: tl.constexpr):
        """``(tiles, s, before)``: the step's query tiles (each slot's tokens cut into tiles of ``BLOCK_Q``), the
        sequence slot whose tiles hold tile ``program`` and the tiles of the slots before it. Computed from
        ``COUNTS`` by every program (a few registers), so a step needs no separate kernel for the running count."""
        i = tl.arange(0, BLOCK_S)
        per = (tl.load(COUNTS + i, mask=i < S, other=0) + BLOCK_Q - 1) // BLOCK_Q
        ends = tl.cumsum(per, 0)  # the running count of tiles through each slot
        s = tl.sum((ends <= program).to(tl.int32), 0)  # slots that end at or before the tile: the first that holds it
        before = tl.sum(tl.where(i == s, ends - per, 0), 0)
        return tl.sum(per, 0), s, before

    @triton.jit
    def _paged_keys(m_i, l_i, acc, k_lo, k_hi, q, q2, K, V, K2, TABLE, s, stable, skb, sks, skh, svb, svs, svh, sk2b,
                    sk2s, sk2h, kvh, d, d2, dv, p, lo_row, end, slope, qk_scale, softcap, D: tl.constexpr,
                    DV: tl.constexpr, D2: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_ROPE: tl.constexpr, IEEE: tl.constexpr,
                    MASKED: tl.constexpr, INT64: tl.constexpr):
        """The online softmax of ``_paged_attention_kernel`` over the key positions ``[k_lo, k_hi)``, in
        ``BLOCK_N``-position tiles gathered through sequence ``s``'s block table. ``MASKED``: each row sees only the
        keys at or before its position ``p``, at or past ``lo_row``, and before ``end``; else the caller knows every
        row sees every key of the range and the range is whole tiles, so no mask is built. ``INT64``: offsets into
        the pools in 64 bits (a pool of 2**31 elements or more); else in 32, a quarter of a decode loop's instructions
        fewer (bench/sass.py)."""
        j = tl.arange(0, BLOCK_N)
        for k0 in range(k_lo, k_hi, BLOCK_N):
            kpos = k0 + j
            if MASKED:
                in_range = kpos < end
            else:
                in_range = kpos >= 0  # every position of the range lies before end
            block = tl.load(TABLE + s.to(tl.int64) * stable + kpos // BS, mask=in_range, other=0)
            off = kpos % BS
            if INT64:
                block, off = block.to(tl.int64), off.to(tl.int64)
            else:  # the step's metadata are int64 (RaggedStep): narrowed here, or the offsets stay 64-bit
                block, off = block.to(tl.int32), off.to(tl.int32)
            krow = block * skb + off * sks + kvh * skh  # each key's offset, before it is spread over the dimensions
            k = tl.load(K + krow[:, None] + d[None, :], mask=in_range[:, None] & (d[None, :] < D), other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k.to(q.dtype)))
            if HAS_ROPE:
                k2row = block * sk2b + off * sk2s + kvh * sk2h
                k2 = tl.load(K2 + k2row[:, None] + d2[None, :], mask=in_range[:, None] & (d2[None, :] < D2), other=0.0)
                if IEEE:
                    scores += tl.dot(q2, tl.trans(k2), input_precision="ieee")
                else:
                    scores += tl.dot(q2, tl.trans(k2.to(q2.dtype)))
            scores = (scores * qk_scale).to(tl.float32)  # fp32 whatever type the scale arrives in (Inductor: fp64)
            if HAS_SOFTCAP:
                x = scores / (softcap * 1.4426950408889634)
                scores = (softcap * 1.4426950408889634 * (2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0)).to(tl.float32)
            if HAS_ALIBI:
                scores += slope[:, None] * kpos[None, :].to(tl.float32)
            if MASKED:
                live = (kpos[None, :] <= p[:, None]) & (kpos[None, :] >= lo_row[:, None]) & in_range[None, :]
                scores = tl.where(live, scores, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            if MASKED:
                w = tl.where(live, tl.exp2(scores - m_new[:, None]), 0.0)
            else:
                w = tl.exp2(scores - m_new[:, None])
            vrow = block * svb + off * svs + kvh * svh
            v = tl.load(V + vrow[:, None] + dv[None, :], mask=in_range[:, None] & (dv[None, :] < DV), other=0.0)
            if IEEE:
                pv = tl.dot(w, v, input_precision="ieee")
            else:
                pv = tl.dot(w.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(w, 1)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _paged_attention_kernel(Q, K, V, Q2, K2, POS, TABLE, STARTS, COUNTS, SLOPES, SINKS, O, PART, STATS,
                                sqh, sqt, skb, sks, skh, svb, svs, svh, sq2h, sq2t, sk2b, sk2s, sk2h, soh, sot,
                                stable, sps, spt, sph, sss, sst, scale, window, softcap, chunk, attn_chunk,
                                S: tl.constexpr, BLOCK_S: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                                DV: tl.constexpr, D2: tl.constexpr, BS: tl.constexpr, BLOCK_Q: tl.constexpr,
                                BLOCK_G: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                                BLOCK_D2: tl.constexpr, SPLIT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                                HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_ROPE: tl.constexpr,
                                IEEE: tl.constexpr, REVERSE: tl.constexpr, PHASES: tl.constexpr,
                                INT64: tl.constexpr, PDL: tl.constexpr):
        """One program per (query tile, KV head, key chunk). A query tile is up to ``BLOCK_Q`` consecutive tokens of
        one sequence times the ``G`` query heads of the KV head (``BLOCK_Q * BLOCK_G`` rows), so each key block it
        reads serves every token of the tile (a prefill chunk reads its keys once per tile, not once per token).
        The keys the tile sees, up to its last position, are cut into chunks of ``chunk`` positions, one per program
        (``SPLIT``: the partial softmax of each chunk goes to ``PART`` / ``STATS`` and ``_paged_combine_kernel``
        adds them up; else the one chunk holds every key and the program writes the output). Online softmax in
        log2 units over ``BLOCK_N``-position tiles gathered through the block table (``_paged_keys``: the whole tiles
        of keys that every row of the query tile sees run without masks, the edges of the range with them; without
        ``PHASES``, one masked loop over the range); the products in the model's dtype with fp32 accumulation
        (``IEEE``: fp32 models, fp32 products, no TF32). ``HAS_ROPE``: the key has a second part in its own pool
        (MLA's rotary key ``K2``, ``D2`` wide) that the query's ``Q2`` part meets.
        ``PDL``: ``common.launch_options``."""
        wait_for_previous(PDL)
        program = tl.program_id(0)
        if REVERSE:  # the last tiles first: a prefill's last tiles see the most keys, and the GPU starts low ids first
            program = tl.num_programs(0) - 1 - program
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        tiles, s, before = _tile_of(COUNTS, program, S, BLOCK_S, BLOCK_Q)
        if program < tiles:
            first = (program - before) * BLOCK_Q  # the tile's first token within the sequence
            count = tl.load(COUNTS + s)
            rows = tl.arange(0, BLOCK_Q * BLOCK_G)
            r = rows // BLOCK_G
            g = rows % BLOCK_G
            row_ok = (g < G) & (first + r < count)
            t = tl.load(STARTS + s) + first + r  # the row's token among the step's N
            h = kvh * G + g
            p = tl.load(POS + t, mask=row_ok, other=-1)
            p_last = tl.load(POS + tl.load(STARTS + s) + tl.minimum(first + BLOCK_Q, count) - 1)
            p_first = tl.load(POS + tl.load(STARTS + s) + first)
            # The first key each row sees (``lo_row``), and the first row's (``lo``, the least: both bounds grow
            # with the position, so the last row's is the most).
            lo_row = p * 0
            lo = p_last * 0
            if window > 0:
                lo_row = tl.maximum(p - window + 1, 0)
                lo = tl.maximum(p_first - window + 1, 0)
            if attn_chunk > 0:  # chunked attention: the start of the row's own chunk
                lo_row = tl.maximum(lo_row, p - p % attn_chunk)
                lo = tl.maximum(lo, p_first - p_first % attn_chunk)
            begin = lo + part * chunk
            end = tl.minimum(begin + chunk, p_last + 1)
            d = tl.arange(0, BLOCK_D)
            q = tl.load(Q + h[:, None] * sqh + t.to(tl.int64)[:, None] * sqt + d[None, :],
                        mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
            d2, q2 = d, q  # never read without a rotary part
            if HAS_ROPE:
                d2 = tl.arange(0, BLOCK_D2)
                q2 = tl.load(Q2 + h[:, None] * sq2h + t.to(tl.int64)[:, None] * sq2t + d2[None, :],
                             mask=row_ok[:, None] & (d2[None, :] < D2), other=0.0)
            qk_scale = scale * 1.4426950408889634
            slope = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
            if HAS_ALIBI:
                slope = tl.load(SLOPES + h, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_i = tl.full([BLOCK_Q * BLOCK_G], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
            dv = tl.arange(0, BLOCK_DV)
            acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_DV], dtype=tl.float32)
            # Keys that every row of the tile sees (at or past the last row's window start, at or before the first
            # row's position) run without masks, in whole tiles [a, b); the tiles before and after are masked.
            see_all = begin
            if window > 0:
                see_all = tl.maximum(p_last - window + 1, begin)
            if attn_chunk > 0:
                see_all = tl.maximum(p_last - p_last % attn_chunk, see_all)
            a = tl.minimum(begin + tl.cdiv(see_all - begin, BLOCK_N) * BLOCK_N, end)
            seen = tl.maximum(tl.minimum(end, p_first + 1), begin)  # no negative quotient: C and numpy round apart
            b = tl.maximum(a, tl.minimum(begin + (seen - begin) // BLOCK_N * BLOCK_N, end))
            if PHASES:
                m_i, l_i, acc = _paged_keys(m_i, l_i, acc, begin, a, q, q2, K, V, K2, TABLE, s, stable, skb, sks,
                                            skh, svb, svs, svh, sk2b, sk2s, sk2h, kvh, d, d2, dv, p, lo_row, end,
                                            slope, qk_scale, softcap, D, DV, D2, BS, BLOCK_N, HAS_SOFTCAP, HAS_ALIBI,
                                            HAS_ROPE, IEEE, True, INT64)
                m_i, l_i, acc = _paged_keys(m_i, l_i, acc, a, b, q, q2, K, V, K2, TABLE, s, stable, skb, sks, skh,
                                            svb, svs, svh, sk2b, sk2s, sk2h, kvh, d, d2, dv, p, lo_row, end, slope,
                                            qk_scale, softcap, D, DV, D2, BS, BLOCK_N, HAS_SOFTCAP, HAS_ALIBI,
                                            HAS_ROPE, IEEE, False, INT64)
            else:
                b = begin  # one masked loop over the whole range
            m_i, l_i, acc = _paged_keys(m_i, l_i, acc, b, end, q, q2, K, V, K2, TABLE, s, stable, skb, sks, skh,
                                        svb, svs, svh, sk2b, sk2s, sk2h, kvh, d, d2, dv, p, lo_row, end, slope,
                                        qk_scale, softcap, D, DV, D2, BS, BLOCK_N, HAS_SOFTCAP, HAS_ALIBI, HAS_ROPE,
                                        IEEE, True, INT64)
            out_mask = row_ok[:, None] & (dv[None, :] < DV)
            if SPLIT:
                tl.store(STATS + part * sss + t.to(tl.int64) * sst + h * 2, m_i, mask=row_ok)
                tl.store(STATS + part * sss + t.to(tl.int64) * sst + h * 2 + 1, l_i, mask=row_ok)
                tl.store(PART + part * sps + t.to(tl.int64)[:, None] * spt + h[:, None] * sph + dv[None, :], acc,
                         mask=out_mask)
            else:
                if HAS_SINKS:
                    sink = tl.load(SINKS + h, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
                    l_i += tl.exp2(sink - m_i)
                tl.store(O + h[:, None] * soh + t.to(tl.int64)[:, None] * sot + dv[None, :],
                         (acc / l_i[:, None]).to(O.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _paged_combine_kernel(PART, STATS, SEQ, SINKS, O, sps, spt, sph, sss, sst, soh, sot,
                              SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, DV: tl.constexpr,
                              BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr):
        """The output of token ``t``, head ``h`` from its chunks' partial softmaxes (a chunk with no key for the row
        has ``m = -1e30`` and weighs nothing; its partial is never read); zeros for a padding token, so the output
        needs no fill of its own."""
        wait_for_previous(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)
        if tl.load(SEQ + t) < 0:
            dv = tl.arange(0, BLOCK_DV)
            tl.store(O + h * soh + t.to(tl.int64) * sot + dv, tl.zeros([BLOCK_DV], dtype=tl.float32).to(
                O.dtype.element_ty), mask=dv < DV)
        else:
            k = tl.arange(0, BLOCK_SPLITS)
            ok = k < SPLITS
            m = tl.load(STATS + k * sss + t.to(tl.int64) * sst + h * 2, mask=ok, other=-1.0e30)
            l = tl.load(STATS + k * sss + t.to(tl.int64) * sst + h * 2 + 1, mask=ok, other=0.0)
            top = tl.max(m, 0)
            if HAS_SINKS:
                sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
                top = tl.maximum(top, sink)
            w = tl.exp2(m - top)
            used = ok & (m > -1.0e29)
            dv = tl.arange(0, BLOCK_DV)
            part = tl.load(PART + k[:, None] * sps + t.to(tl.int64) * spt + h * sph + dv[None, :],
                           mask=used[:, None] & (dv[None, :] < DV), other=0.0)
            den = tl.sum(w * l, 0)
            if HAS_SINKS:
                den += tl.exp2(sink - top)
            out = tl.sum(w[:, None] * part, 0) / den
            tl.store(O + h * soh + t.to(tl.int64) * sot + dv, out.to(O.dtype.element_ty), mask=dv < DV)

    @triton.jit
    def _paged_conv_kernel(W, BIAS, POOL, POS, SEQ, TABLE, O, C, sob, soc, stable, spb, sps,
                           K: tl.constexpr, BS: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr):
        t = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = c < C
        s = tl.load(SEQ + t)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        if s >= 0:
            p = tl.load(POS + t)
            for j in range(K):
                q = p - (K - 1) + j
                if q >= 0:
                    block = tl.load(TABLE + s.to(tl.int64) * stable + q // BS).to(tl.int64)
                    x = tl.load(POOL + block * spb + (q % BS) * sps + c, mask=ok, other=0.0).to(tl.float32)
                    acc += x * tl.load(W + c * K + j, mask=ok, other=0.0).to(tl.float32)
            if HAS_BIAS:
                acc += tl.load(BIAS + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(O + c * soc + (K - 1 + t), acc.to(O.dtype.element_ty), mask=ok)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (int(n) - 1).bit_length())


def launch_paged_write(pool, value, slots, *, other: tuple | None = None, wrap=lambda kernel: kernel) -> None:
    """``value [N, *feature]`` read through its strides: ``[N, H, W]`` (the keys' ``k[0].transpose(0, 1)``, a
    head-major view) or ``[N, C]``; more feature dimensions are flattened to ``[N, H, W]`` first. ``other``: a
    second ``(pool, value)`` at the same slots, in the same launch."""
    n = value.shape[0]
    if not n:
        return
    pool2, value2 = other or (pool, value)
    value, value2 = feature_rows(value), feature_rows(value2)
    wrap(_paged_write_kernel)[(n, 2 if other else 1)](
        pool, value, pool2, value2, slots, value[0].numel(), value.shape[2], *value.stride(), value2[0].numel(),
        value2.shape[2], *value2.stride(), BLOCK=min(_pow2(value[0].numel()), 1024),
        BLOCK2=min(_pow2(value2[0].numel()), 1024))


def feature_rows(value):
    """``value [N, *feature]`` as ``[N, H, W]``, a view where the strides allow."""
    if value.dim() == 2:
        return value.unsqueeze(1)
    return value if value.dim() == 3 else value.reshape(value.shape[0], -1, value.shape[-1])


def attention_plan(n: int, hq: int, hkv: int, slots: int, max_positions: int, block_size: int, device,
                   width: int = 128, itemsize: int = 2) -> dict:
    """The launch shape of ``paged_attention`` for steps of ``n`` tokens (fixed per token count, so a captured
    bucket replays it): rows per query tile, key positions per program, the upper bound of query tiles, warps and
    pipeline stages. ``width``: the widest of a key (with its rope part) and a value, of ``itemsize`` bytes.

    A decode step (no more tokens than sequence slots) takes query tiles of one token, the G query heads of a KV
    head, and cuts each sequence's keys into chunks while there are too few programs to keep the GPU busy through the
    longest sequence. Verify steps (a few tokens per sequence) take tiles of 16 rows, chunked likewise. Steps holding
    a prefill chunk take tiles of 128 rows and 64 keys over 8 warps (64 rows and 32 keys over 4 warps for rows over
    256 bytes, as heads wider than 128 or fp32 ones, or GPUs with less shared memory), and never chunk: the combine
    of chunked keys cost more than the programs it adds (bench/ragged.py --sweep on an H200, bench/RESULTS.md section
    31). The query tiles run last first (a prefill's last tiles see the most keys). ``phases``: the keys every row
    sees run in a loop without masks between two masked ones (else one masked loop). Decode tiles take one masked
    loop: the three loops need 104 registers a thread where one needs 74 (sm_90, ``bench/sass.py``), so an SM holds
    4 decode programs instead of 6 to hide its loads behind, and the ragged decode step was 0.21 ms slower once they
    came (RESULTS sections 30-32); masks cost a memory-bound decode little. Verify and prefill tiles keep the three
    (no more registers there). Decode tiles read 32 keys a step over three stages: 84 us a layer for 32 decodes of
    128..4096 positions against 98 us with 64 keys over two (the H200 sweep of RESULTS section 34).

    Decode chunks aim at 8 programs an SM, but one for tiles whose fp32 accumulator (``block_g`` heads of ``width``)
    is over 4096 values: MLA's 16 heads of 576-wide latent keys take 255 registers a thread, and each chunk writes
    16 x 512 fp32 partials a program for the combine to read back. At 8 an SM one MLA decode at 4096 positions took
    65 chunks (17 MB of partials a layer against 4.7 MB of latents) and twice the time of 17 (RESULTS section 42)."""
    g = hq // hkv
    block_g = _pow2(g, least=1)
    if n > 4 * slots:  # a prefill chunk
        if width * itemsize <= 256 and _shared_memory(device) >= 160 * 1024:  # 128 KiB of tiles at three stages
            return dict(block_q=max(1, 128 // block_g), block_g=block_g, block_n=max(64, block_size),
                        chunk=max_positions, splits=1, warps=8, stages=3, reverse=True, phases=True)
        return dict(block_q=max(1, 64 // block_g), block_g=block_g, block_n=max(32, block_size), chunk=max_positions,
                    splits=1, warps=4, stages=3, reverse=True, phases=True)
    block_q = 1 if n <= slots else max(1, 16 // block_g)
    block_n = max(64 if block_q > 1 and block_g * block_q <= 32 else 32, block_size)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    chunk = max_positions
    live = -(-n // block_q) * hkv  # programs that hold tokens when every sequence fills its tiles
    per_sm = 8 if block_g * width <= 4096 else 1  # a latent tile (MLA) fills an SM's registers alone
    if live < per_sm * sms:  # too few programs to keep the GPU busy through the longest sequence: chunk the keys
        want = -(-per_sm * sms // live)
        chunk = _pow2(-(-max_positions // want), least=block_n)  # a power of two: 1024, not 832, for 4112 keys
    return dict(block_q=block_q, block_g=block_g, block_n=block_n, chunk=chunk, splits=-(-max_positions // chunk),
                warps=4, stages=3, reverse=True, phases=block_q > 1)


@functools.lru_cache(maxsize=None)
def _shared_memory(device) -> int:
    """Shared memory one program may opt into on ``device`` (an H100's or H200's 227 KiB off CUDA)."""
    if device.type != "cuda":
        return 227 * 1024
    optin = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    if not optin:  # a torch without the field: ask Triton's driver, which sizes its own launches by it
        index = device.index if device.index is not None else torch.cuda.current_device()
        optin = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return optin


def _query_tiles(n: int, slots: int, block_q: int) -> int:
    """An upper bound of the query tiles of a step of ``n`` tokens: a sequence's tokens fill whole tiles but its last
    one (tiles past the step's own exit at once)."""
    return -(-n // block_q) + min(slots, n)


def launch_paged_attention(q, keys, values, positions, seq, block_table, seq_start, seq_count, scale: float,
                           window: int = 0, softcap: float = 0.0, alibi=None, sinks=None, *, chunk_size: int = 0,
                           config: dict | None = None, rope: tuple | None = None):
    """The Triton path of ``paged_attention`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``); ``config``
    overrides ``attention_plan`` (the tests force chunking on small shapes, and ``int64``: the offsets of pools of
    2**31 elements or more, which the kernel takes by itself for such pools). ``rope = (q2 [1, Hq, N, D2], pool2
    [num_blocks, block_size, 1, D2])``: a second key part, scored as ``q2 . k2`` beside ``q . k`` (MLA)."""
    _, hq, n, d = q.shape
    hkv, dv, bs = keys.shape[2], values.shape[-1], keys.shape[1]
    q2, k2 = rope if rope is not None else (q, keys)  # never read without a rope part
    strides = [keys.stride(2), values.stride(2), k2.stride(2)]
    if rope is not None:
        # MLA's one KV head serves every query head: programs take a group of heads each (as many registers as a
        # GQA group needs) and all read KV head 0 (head stride 0).
        hkv, strides = hq // _heads_per_program(hq), [0, 0, 0]
    slots = seq_count.shape[0]
    plan = attention_plan(n, hq, hkv, slots, block_table.shape[1] * bs, bs, q.device,
                          width=max(d + (q2.shape[-1] if rope is not None else 0), dv), itemsize=q.element_size())
    plan.update(config or {})
    q, q2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, q2))
    split = plan["splits"] > 1
    # Padding tokens get zeros: from the combine kernel when the keys are split, else from a fill.
    out = (torch.empty if split else torch.zeros)(1, n, hq, dv, dtype=q.dtype, device=q.device).transpose(1, 2)
    part = stats = out
    if split:
        part = torch.empty(plan["splits"], n, hq, dv, dtype=torch.float32, device=q.device)
        stats = torch.empty(plan["splits"], n, hq, 2, dtype=torch.float32, device=q.device)
    dummy = positions
    alibi_ = alibi if alibi is not None else dummy
    sinks_ = sinks if sinks is not None else dummy
    d2 = q2.shape[-1] if rope is not None else 1
    _paged_attention_kernel[(_query_tiles(n, slots, plan["block_q"]), hkv, plan["splits"])](
        q, keys, values, q2, k2, positions, block_table, seq_start, seq_count, alibi_, sinks_, out, part, stats,
        q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), strides[0], values.stride(0), values.stride(1),
        strides[1], q2.stride(1), q2.stride(2), k2.stride(0), k2.stride(1), strides[2], out.stride(1), out.stride(2),
        block_table.stride(0), *(part.stride()[:3] if split else (0, 0, 0)), *(stats.stride()[:2] if split else (0, 0)),
        scale, window, softcap, plan["chunk"], chunk_size, S=slots, BLOCK_S=_pow2(slots, least=2), G=hq // hkv, D=d,
        DV=dv, D2=d2, BS=bs, BLOCK_Q=plan["block_q"], BLOCK_G=plan["block_g"], BLOCK_N=plan["block_n"],
        BLOCK_D=_pow2(d), BLOCK_DV=_pow2(dv), BLOCK_D2=_pow2(d2),
        SPLIT=split, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi is not None, HAS_SINKS=sinks is not None,
        HAS_ROPE=rope is not None, IEEE=q.dtype == torch.float32, REVERSE=plan["reverse"], PHASES=plan["phases"],
        INT64=plan.get("int64", False) or max(t.numel() for t in (keys, values, k2)) >= 2 ** 31,
        num_warps=plan["warps"], num_stages=plan["stages"], **launch_options(q))
    if split:
        _paged_combine_kernel[(n, hq)](
            part, stats, seq, sinks_, out, *part.stride()[:3], *stats.stride()[:2], out.stride(1), out.stride(2),
            SPLITS=plan["splits"], BLOCK_SPLITS=_pow2(plan["splits"], least=2), DV=dv, BLOCK_DV=_pow2(dv),
            HAS_SINKS=sinks is not None, num_warps=4, **launch_options(q))
    return out


def _heads_per_program(heads: int, most: int = 16) -> int:
    return max(g for g in range(1, min(heads, most) + 1) if heads % g == 0)


def launch_paged_latent_attention(q, latents, ropes, weight, nope_dim: int, positions, seq, block_table, seq_start,
                                  seq_count, scale: float, window: int = 0, softcap: float = 0.0, *,
                                  config: dict | None = None, fp8: tuple | None = None):
    """The Triton path of ``paged_latent_attention``: each head's query into the latent space (``W_uk``), the
    paged kernel over one KV head whose key is ``[latent; rope]`` and value the latent, then ``W_uv``.
    ``[1, H, N, dv]``. ``fp8``: ``latent_fp8_views`` of an FP8 ``weight``, whose two products are then FP8 grouped
    products, one group a head."""
    if fp8 is not None:
        w_uk, w_uv = fp8
        q_lat = _per_head(q[..., :nope_dim], *w_uk)
    else:
        w = weight.to(q.dtype).view(q.shape[1], -1, weight.shape[-1])  # [H, dn + dv, r]
        q_lat = torch.matmul(q[..., :nope_dim], w[:, :nope_dim])  # [1, H, N, r]
    o_lat = launch_paged_attention(q_lat, latents, latents, positions, seq, block_table, seq_start, seq_count, scale,
                                   window, softcap, config=config, rope=(q[..., nope_dim:], ropes))
    if fp8 is not None:
        return _per_head(o_lat, *w_uv)
    return torch.matmul(o_lat, w[:, nope_dim:].transpose(-1, -2))


def latent_fp8_views(weight, weight_scale, block_n: int, block_k: int, heads: int, nope_dim: int) -> tuple | None:
    """MLA's FP8 ``kv_b_proj`` (``[H * (dn + dv), r]``, per head ``W_uk`` then ``W_uv``) as the two stacks of
    per-head weights ``launch_fp8_grouped_mm`` reads, without a copy: ``W_uk^T [H, r, dn]`` (a transposed view) and
    ``W_uv [H, dv, r]``, each ``(weight, scale, block_n, block_k, tiles)`` (``LATENT_TILES``). ``None`` where the
    scale blocks do not hold whole heads' parts (a row block that straddles ``dn`` or a head) or the grouped kernel
    cannot read a view."""
    from ppsplit.triton_kernels.fp8 import fp8_stack_readable

    rows, r = weight.shape
    per, gk = rows // heads, -(-r // block_k)
    w = weight.view(heads, per, r)
    if block_n >= rows:  # one block of rows (a per-tensor scale): every head reads it
        s_uk = s_uv = weight_scale.reshape(1, 1, gk).expand(heads, 1, gk)
    elif per % block_n == 0 and nope_dim % block_n == 0:
        s = weight_scale.reshape(heads, per // block_n, gk)
        s_uk, s_uv = s[:, :nope_dim // block_n], s[:, nope_dim // block_n:]
    else:
        return None
    w_uk = (w[:, :nope_dim].transpose(1, 2), s_uk.transpose(1, 2), block_k, block_n, LATENT_TILES["W_uk"])
    w_uv = (w[:, nope_dim:], s_uv, block_n, block_k, LATENT_TILES["W_uv"])
    return (w_uk, w_uv) if all(fp8_stack_readable(v[0], v[3]) for v in (w_uk, w_uv)) else None


# The grouped kernel's tiles (BLOCK_M, BLOCK_N, warps, stages) for MLA's two per-head products, the fastest of ten
# for DeepSeek-V3's shapes at decode batches 1, 8 and 32 on an H200 (``bench/mla.py --grouped-tiles``, RESULTS section
# 42): 11-13% faster than the experts' default for W_uk^T ([r, dn] a head, read along r), 5-6% for W_uv.
LATENT_TILES = {"W_uk": (16, 32, 2, 2), "W_uv": (16, 32, 4, 3)}


def _per_head(x, weight, scale, block_n: int, block_k: int, config):
    """``x [1, H, N, K]`` times each head's ``weight [H, M, K]`` (FP8, ``launch_fp8_grouped_mm`` on the tiles
    ``config``): ``[1, H, N, M]``."""
    from ppsplit.triton_kernels.fp8 import launch_fp8_grouped_mm

    heads, n = x.shape[1], x.shape[2]
    ends = torch.arange(1, heads + 1, device=x.device, dtype=torch.int32) * n
    y = launch_fp8_grouped_mm(x[0].reshape(heads * n, x.shape[-1]), weight, scale, ends, block_n, block_k,
                              config=config)
    return y.view(1, heads, n, weight.shape[1])


def launch_paged_conv1d(x, weight, bias, pool, positions, seq, block_table, *, wrap=lambda kernel: kernel):
    channels, kernel = weight.shape[0], weight.shape[-1]
    n = x.shape[-1]
    out = torch.zeros(1, channels, n + 2 * (kernel - 1), dtype=weight.dtype, device=x.device)
    w = weight.reshape(channels, kernel).contiguous()
    block_c = min(_pow2(channels), 256)
    wrap(_paged_conv_kernel)[(n, triton.cdiv(channels, block_c))](
        w, bias if bias is not None else w, pool, positions, seq, block_table, out, channels, out.stride(0),
        out.stride(1), block_table.stride(0), pool.stride(0), pool.stride(1), K=kernel, BS=pool.shape[1],
        BLOCK_C=block_c, HAS_BIAS=bias is not None)
    return out
