"""Recurrent layers' scans over a ring of states addressed by position (the stages' state-space cache).

A Mamba or gated-delta layer remembers one state per sequence, not one entry per token, so it cannot be
overwritten by position the way keys and values are, and a verify pass must not leave the rejected drafts' effect
behind. Each such layer keeps a ring ``[batch, R, *state]`` of the states after its last ``R`` tokens: the state
after the token at position ``p`` lives in slot ``p % R``. A step at ``positions = [p0, ..., p0 + T - 1]`` starts
from slot ``(p0 - 1) % R`` (zeros at ``p0 = 0``) and writes the state after each of its last ``min(T, R)`` tokens.
A verify pass of ``K + 1 <= R`` tokens thus leaves the state after every one of them: when ``a`` drafts are
accepted the next step starts at ``p0 + a + 1`` and reads slot ``(p0 + a) % R``, the state after the last accepted
token. Nothing is copied or re-run on rejection.

The scans run token by token in float32, with the published recurrences:

- ``gated_delta_scan`` (Gated DeltaNet, Qwen3-Next / Qwen3.5 linear attention; Yang et al. 2024; and Kimi's delta
  attention, whose decay ``g`` has one entry per key channel):
  ``S = S * exp(g_t); S += k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t`` with ``q, k`` L2-normalised (when
  asked) and ``q`` scaled by ``1 / sqrt(d_k)``; the state is ``[heads, d_k, d_v]``.
- ``ssm_scan`` (Mamba's selective scan, Mamba-1 and Mamba-2 / SSD): ``h = exp(dt_t A) h + dt_t x_t B_t^T;
  y_t = h C_t`` per head; the state is ``[heads, head_dim, d_state]``. Mamba-2 has one ``A`` per head
  (``A [H]``); Mamba-1 one per channel and state entry (``A [H, N]``, ``head_dim = 1``). ``B``, ``C`` come in
  ``G`` groups shared by ``H / G`` heads.
- ``linear_attention_scan`` (MiniMax's lightning attention): gated linear attention, ``S = S * exp(g_t) + k_t v_t^T;
  o_t = scale * S^T q_t``, the gated-delta kernel without the delta rule.
- ``linear_recurrence`` (RecurrentGemma's RG-LRU): ``h_t = a_t * h_{t-1} + x_t`` per channel.
- ``wkv_scan`` (RWKV-4): the WKV numerator and denominator per channel, kept scaled by their running maximum.
- ``mlstm_scan`` (xLSTM's mLSTM): matrix memory ``C``, normaliser ``n`` and stabiliser ``m`` per head.

Each is a ``torch.library`` custom op that writes the ring in place, so a traced stage keeps them as one call each
and CUDA graphs capture them (no host reads: the slots come from ``positions`` on the device). On CUDA each is one
Triton kernel per call: a program per (sequence, head, tile of the state) holds its tile in registers and walks the
tokens in order (a prompt of ``T`` tokens is ``T`` sequential steps inside the kernel, not ``T`` launches; there is no
chunked parallel form). Elsewhere they run the torch reference below (one small step per token), which the kernels
are tested against (on CPU tensors under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import torch

from ppsplit.triton_kernels.common import HAVE_TRITON, on_gpu, register, tl, triton, wrap_triton


def _acc(x: torch.Tensor) -> torch.Tensor:
    """The references accumulate in float32, as the kernels do (float64 inputs stay float64: the tests' oracle)."""
    return x if x.dtype == torch.float64 else x.float()


def _ring_rows(ring: torch.Tensor, batch: int) -> torch.Tensor:
    return ring[:batch]  # batches smaller than the cache use its leading rows, like K/V


def _start_state(ring: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The state before ``positions[0]``: ring slot ``(p0 - 1) % R``, zeros when ``p0 == 0``."""
    slots = ring.shape[1]
    before = positions[:1] - 1
    state = ring.index_select(1, before.remainder(slots)).squeeze(1)
    return state * (before >= 0).to(state.dtype)


def _keep(ring: torch.Tensor, positions: torch.Tensor, t: int, tokens: int, state: torch.Tensor) -> None:
    """Write the state after token ``t`` into its slot, if it is one of the last ``R`` tokens of the step."""
    slots = ring.shape[1]
    if t >= tokens - slots:
        ring.index_copy_(1, positions[t:t + 1].remainder(slots), state.unsqueeze(1))


def gated_delta_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor | None, ring: torch.Tensor, positions: torch.Tensor, l2norm: bool,
                          scale: float | None = None) -> torch.Tensor:
    """Gated delta rule over ``query, key [B, T, Hk, Dk]``, ``value [B, T, Hv, Dv]``, ``g, beta [B, T, Hv]`` (``Hk``
    divides ``Hv``: each key head serves ``Hv / Hk`` consecutive value heads; ``g [B, T, Hv, Dk]`` decays each key
    channel on its own, as Kimi's delta attention does), starting from and writing the ring
    ``[B', R, Hv, Dk, Dv]`` (float32) at ``positions [T]``. Returns ``[B, T, Hv, Dv]`` in the query's dtype.
    Without ``beta``, plain gated linear attention (``linear_attention_scan``): ``S = S * exp(g_t) + k_t v_t^T``;
    ``scale`` (default ``1 / sqrt(Dk)``) multiplies the output."""
    batch, tokens, k_heads, _ = key.shape
    v_heads = value.shape[2]
    if k_heads != v_heads:
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    q, k, v, gate = (_acc(x) for x in (query, key, value, g))
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    rows = _ring_rows(ring, batch)
    state = _start_state(rows, positions)  # [B, Hv, Dk, Dv]
    out = []
    per_key = gate.dim() == 4  # Kimi's delta attention: one decay per key channel, not per head
    for t in range(tokens):
        state = state * (gate[:, t].exp()[..., None] if per_key else gate[:, t].exp()[..., None, None])
        delta = v[:, t]
        if beta is not None:
            remembered = (state * k[:, t, :, :, None]).sum(-2)  # S^T k: [B, Hv, Dv]
            delta = (delta - remembered) * _acc(beta[:, t, :, None])
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append((state * q[:, t, :, :, None]).sum(-2))
        _keep(rows, positions, t, tokens, state)
    return torch.stack(out, dim=1).to(query.dtype)


def ssm_scan_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       ring: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Selective scan over ``x [B, T, H, P]`` with step sizes ``dt [B, T, H]`` (already discretised: bias, softplus
    and limits applied), ``A [H]`` or ``[H, N]``, ``B, C [B, T, G, N]``, starting from and writing the ring
    ``[B', R, H, P, N]`` (float32) at ``positions [T]``. Returns ``y [B, T, H, P]`` in float32, without the ``D``
    skip term."""
    batch, tokens, heads, _ = x.shape
    groups = B.shape[2]
    xs, dts = _acc(x), _acc(dt)
    Bs = _acc(B).repeat_interleave(heads // groups, dim=2)  # [B, T, H, N]
    Cs = _acc(C).repeat_interleave(heads // groups, dim=2)
    decay_rate = _acc(A)
    if decay_rate.dim() == 1:
        decay_rate = decay_rate[:, None]  # one rate per head, the same for every state entry
    rows = _ring_rows(ring, batch)
    state = _start_state(rows, positions)  # [B, H, P, N]
    out = []
    for t in range(tokens):
        step = dts[:, t, :, None]  # [B, H, 1]
        decay = torch.exp(step * decay_rate)[:, :, None, :]  # [B, H, 1, N]
        state = state * decay + (step[..., None] * xs[:, t, :, :, None]) * Bs[:, t, :, None, :]
        out.append((state * Cs[:, t, :, None, :]).sum(-1))
        _keep(rows, positions, t, tokens, state)
    return torch.stack(out, dim=1)


def linear_recurrence_reference(x: torch.Tensor, a: torch.Tensor, ring: torch.Tensor,
                                positions: torch.Tensor) -> torch.Tensor:
    """The diagonal linear recurrence ``h_t = a_t * h_{t-1} + x_t`` over ``x, a [B, T, D]`` (RecurrentGemma's RG-LRU
    scan, ``RecurrentGemmaRglru._rnn_scan``, with its gate and input normalisation applied by the model), starting
    from and writing the ring ``[B', R, D]`` (float32) at ``positions [T]``. Returns every ``h_t``, ``[B, T, D]``
    in ``x``'s dtype."""
    rows = _ring_rows(ring, x.shape[0])
    state = _start_state(rows, positions)  # [B, D]
    xs, gates = _acc(x), _acc(a)
    out = []
    for t in range(x.shape[1]):
        state = gates[:, t] * state + xs[:, t]
        out.append(state)
        _keep(rows, positions, t, x.shape[1], state)
    return torch.stack(out, dim=1).to(x.dtype)


def wkv_reference(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  ring: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RWKV-4's WKV over ``key, value [B, T, D]`` with the per-channel ``time_decay`` (``w = -exp(time_decay)``) and
    ``time_first`` (``u``) ``[D]``, as ``rwkv_linear_attention_cpu`` computes it:
    ``wkv_t = (num + e^(u + k_t) v_t) / (den + e^(u + k_t))``, then ``num = e^w num + e^k_t v_t``,
    ``den = e^w den + e^k_t``, both kept scaled by ``e^-max`` (the state ``[num, den, max]`` per channel) so no
    exponential overflows. Starts from and writes the ring ``[B', R, 3, D]`` (float32) at ``positions [T]`` (a zero
    state is an empty one: num = den = 0 at any max). Returns ``[B, T, D]`` in ``key``'s dtype."""
    rows = _ring_rows(ring, key.shape[0])
    num, den, top = _start_state(rows, positions).unbind(1)  # [B, D] each
    decay, first = -torch.exp(_acc(time_decay)), _acc(time_first)
    out = []
    for t in range(key.shape[1]):
        k, v = _acc(key[:, t]), _acc(value[:, t])
        top_out = torch.maximum(top, k + first)
        e1, e2 = torch.exp(top - top_out), torch.exp(k + first - top_out)
        out.append((e1 * num + e2 * v) / (e1 * den + e2))
        top_next = torch.maximum(top + decay, k)
        e1, e2 = torch.exp(top + decay - top_next), torch.exp(k - top_next)
        num, den, top = e1 * num + e2 * v, e1 * den + e2, top_next
        _keep(rows, positions, t, key.shape[1], torch.stack([num, den, top], dim=1))
    return torch.stack(out, dim=1).to(key.dtype)


def mlstm_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, igate: torch.Tensor,
                    fgate: torch.Tensor, ring: torch.Tensor, positions: torch.Tensor, eps: float) -> torch.Tensor:
    """xLSTM's mLSTM over ``query, key [B, T, H, Dk]``, ``value [B, T, H, Dv]``, gate pre-activations
    ``igate, fgate [B, T, H]``, as ``mlstm_recurrent_step_native`` steps it: with ``m = max(logsigmoid(f) + m, i)``,
    ``C = e^(logsigmoid(f) + m_old - m) C + e^(i - m) k v^T``, ``n`` the same with ``k``, and
    ``h = (q C) / (max(|q . n|, e^-m) + eps)``, ``q`` scaled by ``1 / sqrt(Dk)`` (``C`` and ``n`` are kept scaled
    by ``e^-m``, so nothing overflows; ``h`` does not depend on the scaling). The ring ``[B', R, H, Dk, Dv + 2]``
    (float32) holds ``C``, then ``n``, then ``m`` in every row. Returns ``[B, T, H, Dv]`` in the query's dtype."""
    dv = value.shape[-1]
    rows = _ring_rows(ring, key.shape[0])
    state = _start_state(rows, positions)
    cell, norm, top = state[..., :dv], state[..., dv], state[..., 0, dv + 1]  # [B, H, Dk, Dv], [B, H, Dk], [B, H]
    q = _acc(query) * query.shape[-1] ** -0.5
    k, v, i, f = (_acc(x) for x in (key, value, igate, fgate))
    out = []
    for t in range(key.shape[1]):
        f_log = torch.nn.functional.logsigmoid(f[:, t])
        new_top = torch.maximum(f_log + top, i[:, t])
        forget, write = torch.exp(f_log + top - new_top), torch.exp(i[:, t] - new_top)
        cell = forget[..., None, None] * cell + write[..., None, None] * k[:, t, :, :, None] * v[:, t, :, None, :]
        norm = forget[..., None] * norm + write[..., None] * k[:, t]
        top = new_top
        below = torch.maximum((q[:, t] * norm).sum(-1).abs(), torch.exp(-top)) + eps
        out.append((q[:, t, :, :, None] * cell).sum(-2) / below[..., None])
        kept = torch.cat([cell, norm[..., None], top[..., None, None].expand_as(norm[..., None])], dim=-1)
        _keep(rows, positions, t, key.shape[1], kept)
    return torch.stack(out, dim=1).to(query.dtype)


if HAVE_TRITON:
    @triton.jit
    def _program_sequence(HEADS, STARTS, COUNTS, ROWS):
        """This program's sequence ``s`` (its ring row) and head ``h``; the sequence's tokens are ``t0 .. t0 + T - 1``
        of input row ``b``."""
        pid = tl.program_id(0)
        s = pid // HEADS
        return s, pid % HEADS, tl.load(STARTS + s), tl.load(COUNTS + s), tl.load(ROWS + s)

    @triton.jit
    def _mlstm_kernel(q, k, v, ig, fg, ring, positions, STARTS, COUNTS, ROWS, out, R, H, DV, scale, eps,
                      sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sib, sit, sih, sfb, sft, sfh, srb, srs, srh,
                      sob, sot, soh, DK: tl.constexpr, BLOCK_V: tl.constexpr):
        s, h, t0, T, b = _program_sequence(H, STARTS, COUNTS, ROWS)
        dk = tl.arange(0, DK)
        dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        vmask = dv < DV
        row = DV + 2  # a ring row: C (DV entries), n, m
        p0 = tl.load(positions + t0)
        start = ring + s * srb + h * srh
        before = start + ((p0 - 1 + R) % R) * srs
        cell = tl.load(before + dk[:, None] * row + dv[None, :], mask=vmask[None, :], other=0.0)
        cell = tl.where(p0 > 0, cell, 0.0)
        norm = tl.where(p0 > 0, tl.load(before + dk * row + DV), 0.0)
        top = tl.where(p0 > 0, tl.load(before + DV + 1), 0.0)
        for i in range(T):
            t = t0 + i
            kt = tl.load(k + b * skb + t * skt + h * skh + dk).to(tl.float32)
            qt = tl.load(q + b * sqb + t * sqt + h * sqh + dk).to(tl.float32) * scale
            vt = tl.load(v + b * svb + t * svt + h * svh + dv, mask=vmask, other=0.0).to(tl.float32)
            it = tl.load(ig + b * sib + t * sit + h * sih).to(tl.float32)
            ft = tl.load(fg + b * sfb + t * sft + h * sfh).to(tl.float32)
            f_log = tl.minimum(ft, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(ft)))  # logsigmoid
            new_top = tl.maximum(f_log + top, it)
            forget, write = tl.exp(f_log + top - new_top), tl.exp(it - new_top)
            cell = forget * cell + write * kt[:, None] * vt[None, :]
            norm = forget * norm + write * kt
            top = new_top
            below = tl.maximum(tl.abs(tl.sum(qt * norm, 0)), tl.exp(-top)) + eps
            o = tl.sum(cell * qt[:, None], 0) / below
            tl.store(out + b * sob + t * sot + h * soh + dv, o.to(out.dtype.element_ty), mask=vmask)
            if i >= T - R:
                slot = start + (tl.load(positions + t) % R) * srs
                tl.store(slot + dk[:, None] * row + dv[None, :], cell, mask=vmask[None, :])
                if tl.program_id(1) == 0:  # n and m are the same in every tile of C
                    tl.store(slot + dk * row + DV, norm)
                    tl.store(slot + dk * row + DV + 1, top + 0.0 * norm)

    @triton.jit
    def _wkv_kernel(w, u, k, v, ring, positions, STARTS, COUNTS, ROWS, out, R, D, skb, skt, svb, svt, srb, srs, srk,
                    sob, sot, BLOCK: tl.constexpr):
        s = tl.program_id(0)  # the sequence (ring row); its tokens are t0 .. t0 + T - 1 of row b
        t0, T, b = tl.load(STARTS + s), tl.load(COUNTS + s), tl.load(ROWS + s)
        d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = d < D
        decay = -tl.exp(tl.load(w + d, mask=mask, other=0.0).to(tl.float32))
        first = tl.load(u + d, mask=mask, other=0.0).to(tl.float32)
        p0 = tl.load(positions + t0)
        start = ring + s * srb
        before = start + ((p0 - 1 + R) % R) * srs + d
        num = tl.where(p0 > 0, tl.load(before, mask=mask, other=0.0), 0.0)
        den = tl.where(p0 > 0, tl.load(before + srk, mask=mask, other=0.0), 0.0)
        top = tl.where(p0 > 0, tl.load(before + 2 * srk, mask=mask, other=0.0), 0.0)
        for i in range(T):
            t = t0 + i
            kt = tl.load(k + b * skb + t * skt + d, mask=mask, other=0.0).to(tl.float32)
            vt = tl.load(v + b * svb + t * svt + d, mask=mask, other=0.0).to(tl.float32)
            top_out = tl.maximum(top, kt + first)
            e1, e2 = tl.exp(top - top_out), tl.exp(kt + first - top_out)
            tl.store(out + b * sob + t * sot + d, ((e1 * num + e2 * vt) / (e1 * den + e2)).to(out.dtype.element_ty),
                     mask=mask)
            top_next = tl.maximum(top + decay, kt)
            e1, e2 = tl.exp(top + decay - top_next), tl.exp(kt - top_next)
            num, den, top = e1 * num + e2 * vt, e1 * den + e2, top_next
            if i >= T - R:
                slot = start + (tl.load(positions + t) % R) * srs + d
                tl.store(slot, num, mask=mask)
                tl.store(slot + srk, den, mask=mask)
                tl.store(slot + 2 * srk, top, mask=mask)

    @triton.jit
    def _linear_recurrence_kernel(x, a, ring, positions, STARTS, COUNTS, ROWS, out, R, D, sxb, sxt, sab, sat,
                                  srb, srs, sob, sot, BLOCK: tl.constexpr):
        s = tl.program_id(0)  # the sequence (ring row); its tokens are t0 .. t0 + T - 1 of row b
        t0, T, b = tl.load(STARTS + s), tl.load(COUNTS + s), tl.load(ROWS + s)
        d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = d < D
        p0 = tl.load(positions + t0)
        start = ring + s * srb
        h = tl.load(start + ((p0 - 1 + R) % R) * srs + d, mask=mask, other=0.0)
        h = tl.where(p0 > 0, h, 0.0)
        for i in range(T):
            t = t0 + i
            xt = tl.load(x + b * sxb + t * sxt + d, mask=mask, other=0.0).to(tl.float32)
            at = tl.load(a + b * sab + t * sat + d, mask=mask, other=0.0).to(tl.float32)
            h = at * h + xt
            tl.store(out + b * sob + t * sot + d, h.to(out.dtype.element_ty), mask=mask)
            if i >= T - R:
                slot = tl.load(positions + t) % R
                tl.store(start + slot * srs + d, h, mask=mask)

    @triton.jit
    def _gated_delta_kernel(q, k, v, g, beta, ring, positions, STARTS, COUNTS, ROWS, out, R, HV, GROUP, scale,
                            sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sgb, sgt, sgh, sbb, sbt, sbh,
                            srb, srs, srh, sob, sot, soh,
                            DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
                            G_PER_KEY: tl.constexpr, DELTA: tl.constexpr):
        s, h, t0, T, b = _program_sequence(HV, STARTS, COUNTS, ROWS)
        hk = h // GROUP
        dk = tl.arange(0, DK)
        dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        vmask = dv < DV
        tile = dk[:, None] * DV + dv[None, :]
        p0 = tl.load(positions + t0)
        start = ring + s * srb + h * srh
        state = tl.load(start + ((p0 - 1 + R) % R) * srs + tile, mask=vmask[None, :], other=0.0)
        state = tl.where(p0 > 0, state, 0.0)
        for i in range(T):
            t = t0 + i
            kt = tl.load(k + b * skb + t * skt + hk * skh + dk).to(tl.float32)
            qt = tl.load(q + b * sqb + t * sqt + hk * sqh + dk).to(tl.float32)
            if L2NORM:
                kt = kt * tl.rsqrt(tl.sum(kt * kt, 0) + 1e-6)
                qt = qt * tl.rsqrt(tl.sum(qt * qt, 0) + 1e-6)
            qt = qt * scale
            vt = tl.load(v + b * svb + t * svt + h * svh + dv, mask=vmask, other=0.0).to(tl.float32)
            if G_PER_KEY:
                gk = tl.load(g + b * sgb + t * sgt + h * sgh + dk).to(tl.float32)
                state = state * tl.exp(gk)[:, None]
            else:
                state = state * tl.exp(tl.load(g + b * sgb + t * sgt + h * sgh).to(tl.float32))
            if DELTA:
                bt = tl.load(beta + b * sbb + t * sbt + h * sbh).to(tl.float32)
                remembered = tl.sum(state * kt[:, None], 0)
                delta = (vt - remembered) * bt
            else:
                delta = vt
            state = state + kt[:, None] * delta[None, :]
            o = tl.sum(state * qt[:, None], 0)
            tl.store(out + b * sob + t * sot + h * soh + dv, o.to(out.dtype.element_ty), mask=vmask)
            if i >= T - R:
                slot = tl.load(positions + t) % R
                tl.store(start + slot * srs + tile, state, mask=vmask[None, :])

    @triton.jit
    def _ssm_kernel(x, dt, A, B, C, ring, positions, STARTS, COUNTS, ROWS, out, R, H, GROUP, P,
                    sxb, sxt, sxh, sdb, sdt, sdh, sBb, sBt, sBg, sCb, sCt, sCg, srb, srs, srh, sob, sot, soh,
                    N: tl.constexpr, BLOCK_P: tl.constexpr, A_PER_STATE: tl.constexpr):
        s, h, t0, T, b = _program_sequence(H, STARTS, COUNTS, ROWS)
        grp = h // GROUP
        n = tl.arange(0, N)
        p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        pmask = p < P
        tile = p[:, None] * N + n[None, :]
        if A_PER_STATE:
            rate = tl.load(A + h * N + n).to(tl.float32)
        else:
            rate = tl.load(A + h + n * 0).to(tl.float32)
        p0 = tl.load(positions + t0)
        start = ring + s * srb + h * srh
        state = tl.load(start + ((p0 - 1 + R) % R) * srs + tile, mask=pmask[:, None], other=0.0)
        state = tl.where(p0 > 0, state, 0.0)
        for i in range(T):
            t = t0 + i
            step = tl.load(dt + b * sdb + t * sdt + h * sdh).to(tl.float32)
            xt = tl.load(x + b * sxb + t * sxt + h * sxh + p, mask=pmask, other=0.0).to(tl.float32)
            bt = tl.load(B + b * sBb + t * sBt + grp * sBg + n).to(tl.float32)
            ct = tl.load(C + b * sCb + t * sCt + grp * sCg + n).to(tl.float32)
            state = state * tl.exp(step * rate)[None, :] + (step * xt)[:, None] * bt[None, :]
            y = tl.sum(state * ct[None, :], 1)
            tl.store(out + b * sob + t * sot + h * soh + p, y, mask=pmask)
            if i >= T - R:
                slot = tl.load(positions + t) % R
                tl.store(start + slot * srs + tile, state, mask=pmask[:, None])


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _last_dim_contiguous(*tensors):
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _dense_segments(batch: int, tokens: int, device):
    """A lockstep call as segments: sequence ``b`` is row ``b``'s ``tokens`` tokens."""
    return (torch.zeros(batch, dtype=torch.long, device=device), torch.full((batch,), tokens, device=device),
            torch.arange(batch, device=device))


def launch_gated_delta(query, key, value, g, beta, ring, positions, l2norm: bool, segments=None, *,
                       scale: float | None = None, wrap=lambda kernel: kernel):
    """The Triton path of ``gated_delta_scan`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``), and of
    ``linear_attention_scan`` without ``beta``. ``segments``: ``(starts, counts, rows)`` per sequence (ring row);
    default: one per batch row."""
    batch, tokens, k_heads, dk = key.shape
    v_heads, dv = value.shape[2], value.shape[3]
    if dk != _pow2(dk):
        raise ValueError(f"gated_delta_scan's kernel needs a power-of-two key head dim, got {dk}")
    query, key, value, g = _last_dim_contiguous(query, key, value, g)
    starts, counts, rows = segments if segments is not None else _dense_segments(batch, tokens, query.device)
    out = torch.zeros(batch, tokens, v_heads, dv, dtype=query.dtype, device=query.device)  # padding: zeros
    block_v = min(_pow2(dv), 32)
    delta = beta is not None
    beta = beta if delta else g  # not read without the delta rule
    wrap(_gated_delta_kernel)[(starts.shape[0] * v_heads, triton.cdiv(dv, block_v))](
        query, key, value, g, beta, ring, positions, starts, counts, rows, out, ring.shape[1], v_heads,
        v_heads // k_heads,
        dk ** -0.5 if scale is None else scale, *query.stride()[:3], *key.stride()[:3], *value.stride()[:3],
        *g.stride()[:3], *beta.stride()[:3], *ring.stride()[:3], *out.stride()[:3], DK=dk, DV=dv, BLOCK_V=block_v,
        L2NORM=l2norm, G_PER_KEY=g.dim() == 4, DELTA=delta, num_warps=4)
    return out


def launch_ssm_scan(x, dt, A, B, C, ring, positions, segments=None, *, wrap=lambda kernel: kernel):
    """The Triton path of ``ssm_scan`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``); ``segments`` as in
    ``launch_gated_delta``."""
    batch, tokens, heads, head_dim = x.shape
    groups, n = B.shape[2], B.shape[3]
    if n != _pow2(n):
        raise ValueError(f"ssm_scan's kernel needs a power-of-two state size, got {n}")
    x, B, C = _last_dim_contiguous(x, B, C)
    A = A.contiguous()
    starts, counts, rows = segments if segments is not None else _dense_segments(batch, tokens, x.device)
    out = torch.zeros(batch, tokens, heads, head_dim, dtype=torch.float32, device=x.device)  # padding: zeros
    block_p = min(_pow2(head_dim), max(1, 4096 // n))
    wrap(_ssm_kernel)[(starts.shape[0] * heads, triton.cdiv(head_dim, block_p))](
        x, dt, A, B, C, ring, positions, starts, counts, rows, out, ring.shape[1], heads, heads // groups, head_dim,
        *x.stride()[:3], *dt.stride()[:3], *B.stride()[:3], *C.stride()[:3], *ring.stride()[:3], *out.stride()[:3],
        N=n, BLOCK_P=block_p, A_PER_STATE=A.dim() == 2, num_warps=4)
    return out


def launch_linear_recurrence(x, a, ring, positions, segments=None, *, wrap=lambda kernel: kernel):
    """The Triton path of ``linear_recurrence``; ``segments`` as in ``launch_gated_delta``."""
    batch, tokens, width = x.shape
    x, a = _last_dim_contiguous(x, a)
    starts, counts, rows = segments if segments is not None else _dense_segments(batch, tokens, x.device)
    out = torch.zeros_like(x)  # padding: zeros
    block = min(_pow2(width), 1024)
    wrap(_linear_recurrence_kernel)[(starts.shape[0], triton.cdiv(width, block))](
        x, a, ring, positions, starts, counts, rows, out, ring.shape[1], width, *x.stride()[:2], *a.stride()[:2],
        *ring.stride()[:2], *out.stride()[:2], BLOCK=block, num_warps=4)
    return out


def launch_wkv(time_decay, time_first, key, value, ring, positions, segments=None, *, wrap=lambda kernel: kernel):
    """The Triton path of ``wkv_scan``; ``segments`` as in ``launch_gated_delta``."""
    batch, tokens, width = key.shape
    key, value = _last_dim_contiguous(key, value)
    time_decay, time_first = time_decay.contiguous(), time_first.contiguous()
    starts, counts, rows = segments if segments is not None else _dense_segments(batch, tokens, key.device)
    out = torch.zeros_like(key)  # padding: zeros
    block = min(_pow2(width), 1024)
    wrap(_wkv_kernel)[(starts.shape[0], triton.cdiv(width, block))](
        time_decay, time_first, key, value, ring, positions, starts, counts, rows, out, ring.shape[1], width,
        *key.stride()[:2], *value.stride()[:2], *ring.stride()[:3], *out.stride()[:2], BLOCK=block, num_warps=4)
    return out


def launch_mlstm(query, key, value, igate, fgate, ring, positions, eps: float, segments=None, *,
                 wrap=lambda kernel: kernel):
    """The Triton path of ``mlstm_scan``; ``segments`` as in ``launch_gated_delta``."""
    batch, tokens, heads, dk = key.shape
    dv = value.shape[-1]
    if dk != _pow2(dk):
        raise ValueError(f"mlstm_scan's kernel needs a power-of-two key head dim, got {dk}")
    query, key, value = _last_dim_contiguous(query, key, value)
    starts, counts, rows = segments if segments is not None else _dense_segments(batch, tokens, query.device)
    out = torch.zeros(value.shape, dtype=query.dtype, device=query.device)  # padding: zeros
    block_v = min(_pow2(dv), 32)
    wrap(_mlstm_kernel)[(starts.shape[0] * heads, triton.cdiv(dv, block_v))](
        query, key, value, igate, fgate, ring, positions, starts, counts, rows, out, ring.shape[1], heads, dv,
        dk ** -0.5, eps, *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *igate.stride()[:3],
        *fgate.stride()[:3], *ring.stride()[:3], *out.stride()[:3], DK=dk, BLOCK_V=block_v, num_warps=4)
    return out


def _kernel_fits(*dims: int) -> bool:
    return all(d == _pow2(d) for d in dims)


@register("ppsplit::gated_delta_scan", ("ring",))
def gated_delta_scan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, ring: torch.Tensor, positions: torch.Tensor, l2norm: bool) -> torch.Tensor:
    """See ``gated_delta_reference``: the Triton kernel on CUDA, the reference elsewhere."""
    if on_gpu(query) and _kernel_fits(key.shape[-1]):
        with torch.cuda.device(query.device):
            return launch_gated_delta(query, key, value, g, beta, ring, positions, l2norm, wrap=wrap_triton)
    return gated_delta_reference(query, key, value, g, beta, ring, positions, l2norm)


@gated_delta_scan.register_fake
def _(query, key, value, g, beta, ring, positions, l2norm):
    return value.new_empty(value.shape, dtype=query.dtype)


@register("ppsplit::ssm_scan", ("ring",))
def ssm_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             ring: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """See ``ssm_scan_reference``: the Triton kernel on CUDA, the reference elsewhere."""
    if on_gpu(x) and _kernel_fits(B.shape[-1]):
        with torch.cuda.device(x.device):
            return launch_ssm_scan(x, dt, A, B, C, ring, positions, wrap=wrap_triton)
    return ssm_scan_reference(x, dt, A, B, C, ring, positions)


@ssm_scan.register_fake
def _(x, dt, A, B, C, ring, positions):
    return x.new_empty(x.shape, dtype=torch.float32)


def _ragged(scan, per_token: tuple, out: torch.Tensor, ring, positions, seq_start, seq_count) -> torch.Tensor:
    """A ragged step through a lockstep reference: ``scan(tensors of one sequence's tokens, ring row, positions)``
    per sequence (row 0, contiguous tokens, its own ring row) into ``out`` (zeros, which padding tokens keep)."""
    for s, (start, count) in enumerate(zip(seq_start.tolist(), seq_count.tolist())):
        if count:
            piece = [t[:, start:start + count] for t in per_token]
            out[:, start:start + count] = scan(*piece, ring[s:s + 1], positions[start:start + count])
    return out


@register("ppsplit::ragged_gated_delta_scan", ("ring",), opaque=True)
def ragged_gated_delta_scan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, ring: torch.Tensor, positions: torch.Tensor, seq_start: torch.Tensor,
                            seq_count: torch.Tensor, l2norm: bool) -> torch.Tensor:
    """``gated_delta_scan`` over a ragged step (``[1, N, ...]``): sequence slot ``s``'s tokens
    ``seq_start[s] .. + seq_count[s]`` start from and write ring row ``s``."""
    if on_gpu(query) and _kernel_fits(key.shape[-1]):
        with torch.cuda.device(query.device):
            return launch_gated_delta(query, key, value, g, beta, ring, positions, l2norm,
                                      (seq_start, seq_count, torch.zeros_like(seq_start)))
    out = torch.zeros(value.shape, dtype=query.dtype, device=query.device)

    def scan(q, k, v, g_, b_, ring_row, pos):
        return gated_delta_reference(q, k, v, g_, b_, ring_row, pos, l2norm)
    return _ragged(scan, (query, key, value, g, beta), out, ring, positions, seq_start, seq_count)


@ragged_gated_delta_scan.register_fake
def _(query, key, value, g, beta, ring, positions, seq_start, seq_count, l2norm):
    return value.new_empty(value.shape, dtype=query.dtype)


@register("ppsplit::ragged_ssm_scan", ("ring",), opaque=True)
def ragged_ssm_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    ring: torch.Tensor, positions: torch.Tensor, seq_start: torch.Tensor,
                    seq_count: torch.Tensor) -> torch.Tensor:
    """``ssm_scan`` over a ragged step, as ``ragged_gated_delta_scan``."""
    if on_gpu(x) and _kernel_fits(B.shape[-1]):
        with torch.cuda.device(x.device):
            return launch_ssm_scan(x, dt, A, B, C, ring, positions, (seq_start, seq_count, torch.zeros_like(seq_start)))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)

    def scan(x_, dt_, B_, C_, ring_row, pos):
        return ssm_scan_reference(x_, dt_, A, B_, C_, ring_row, pos)
    return _ragged(scan, (x, dt, B, C), out, ring, positions, seq_start, seq_count)


@ragged_ssm_scan.register_fake
def _(x, dt, A, B, C, ring, positions, seq_start, seq_count):
    return x.new_empty(x.shape, dtype=torch.float32)


@register("ppsplit::linear_attention_scan", ("ring",))
def linear_attention_scan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                          ring: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Gated linear attention, ``S = S * exp(g_t) + k_t v_t^T; o_t = scale * S^T q_t`` (MiniMax's lightning
    attention, ``g`` its per-head decay): ``gated_delta_reference`` without the delta rule, the same kernel."""
    if on_gpu(query) and _kernel_fits(key.shape[-1]):
        with torch.cuda.device(query.device):
            return launch_gated_delta(query, key, value, g, None, ring, positions, False, scale=scale,
                                      wrap=wrap_triton)
    return gated_delta_reference(query, key, value, g, None, ring, positions, False, scale)


@linear_attention_scan.register_fake
def _(query, key, value, g, ring, positions, scale):
    return value.new_empty(value.shape, dtype=query.dtype)


@register("ppsplit::ragged_linear_attention_scan", ("ring",), opaque=True)
def ragged_linear_attention_scan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                 ring: torch.Tensor, positions: torch.Tensor, seq_start: torch.Tensor,
                                 seq_count: torch.Tensor, scale: float) -> torch.Tensor:
    """``linear_attention_scan`` over a ragged step, as ``ragged_gated_delta_scan``."""
    if on_gpu(query) and _kernel_fits(key.shape[-1]):
        with torch.cuda.device(query.device):
            return launch_gated_delta(query, key, value, g, None, ring, positions, False,
                                      (seq_start, seq_count, torch.zeros_like(seq_start)), scale=scale)
    out = torch.zeros(value.shape, dtype=query.dtype, device=query.device)

    def scan(q, k, v, g_, ring_row, pos):
        return gated_delta_reference(q, k, v, g_, None, ring_row, pos, False, scale)
    return _ragged(scan, (query, key, value, g), out, ring, positions, seq_start, seq_count)


@ragged_linear_attention_scan.register_fake
def _(query, key, value, g, ring, positions, seq_start, seq_count, scale):
    return value.new_empty(value.shape, dtype=query.dtype)


@register("ppsplit::linear_recurrence", ("ring",))
def linear_recurrence(x: torch.Tensor, a: torch.Tensor, ring: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """See ``linear_recurrence_reference``: the Triton kernel on CUDA, the reference elsewhere."""
    if on_gpu(x):
        with torch.cuda.device(x.device):
            return launch_linear_recurrence(x, a, ring, positions, wrap=wrap_triton)
    return linear_recurrence_reference(x, a, ring, positions)


@linear_recurrence.register_fake
def _(x, a, ring, positions):
    return torch.empty_like(x)


@register("ppsplit::ragged_linear_recurrence", ("ring",), opaque=True)
def ragged_linear_recurrence(x: torch.Tensor, a: torch.Tensor, ring: torch.Tensor, positions: torch.Tensor,
                             seq_start: torch.Tensor, seq_count: torch.Tensor) -> torch.Tensor:
    """``linear_recurrence`` over a ragged step, as ``ragged_gated_delta_scan``."""
    if on_gpu(x):
        with torch.cuda.device(x.device):
            return launch_linear_recurrence(x, a, ring, positions, (seq_start, seq_count, torch.zeros_like(seq_start)))
    return _ragged(linear_recurrence_reference, (x, a), torch.zeros_like(x), ring, positions, seq_start, seq_count)


@ragged_linear_recurrence.register_fake
def _(x, a, ring, positions, seq_start, seq_count):
    return torch.empty_like(x)


@register("ppsplit::wkv_scan", ("ring",))
def wkv_scan(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             ring: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """See ``wkv_reference``: the Triton kernel on CUDA, the reference elsewhere."""
    if on_gpu(key):
        with torch.cuda.device(key.device):
            return launch_wkv(time_decay, time_first, key, value, ring, positions, wrap=wrap_triton)
    return wkv_reference(time_decay, time_first, key, value, ring, positions)


@wkv_scan.register_fake
def _(time_decay, time_first, key, value, ring, positions):
    return torch.empty_like(key)


@register("ppsplit::ragged_wkv_scan", ("ring",), opaque=True)
def ragged_wkv_scan(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    ring: torch.Tensor, positions: torch.Tensor, seq_start: torch.Tensor,
                    seq_count: torch.Tensor) -> torch.Tensor:
    """``wkv_scan`` over a ragged step, as ``ragged_gated_delta_scan``."""
    if on_gpu(key):
        with torch.cuda.device(key.device):
            return launch_wkv(time_decay, time_first, key, value, ring, positions,
                              (seq_start, seq_count, torch.zeros_like(seq_start)))

    def scan(k, v, ring_row, pos):
        return wkv_reference(time_decay, time_first, k, v, ring_row, pos)
    return _ragged(scan, (key, value), torch.zeros_like(key), ring, positions, seq_start, seq_count)


@ragged_wkv_scan.register_fake
def _(time_decay, time_first, key, value, ring, positions, seq_start, seq_count):
    return torch.empty_like(key)


@register("ppsplit::mlstm_scan", ("ring",))
def mlstm_scan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, igate: torch.Tensor, fgate: torch.Tensor,
               ring: torch.Tensor, positions: torch.Tensor, eps: float) -> torch.Tensor:
    """See ``mlstm_reference``: the Triton kernel on CUDA, the reference elsewhere."""
    if on_gpu(query) and _kernel_fits(key.shape[-1]):
        with torch.cuda.device(query.device):
            return launch_mlstm(query, key, value, igate, fgate, ring, positions, eps, wrap=wrap_triton)
    return mlstm_reference(query, key, value, igate, fgate, ring, positions, eps)


@mlstm_scan.register_fake
def _(query, key, value, igate, fgate, ring, positions, eps):
    return value.new_empty(value.shape, dtype=query.dtype)


@register("ppsplit::ragged_mlstm_scan", ("ring",), opaque=True)
def ragged_mlstm_scan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, igate: torch.Tensor,
                      fgate: torch.Tensor, ring: torch.Tensor, positions: torch.Tensor, seq_start: torch.Tensor,
                      seq_count: torch.Tensor, eps: float) -> torch.Tensor:
    """``mlstm_scan`` over a ragged step, as ``ragged_gated_delta_scan``."""
    if on_gpu(query) and _kernel_fits(key.shape[-1]):
        with torch.cuda.device(query.device):
            return launch_mlstm(query, key, value, igate, fgate, ring, positions, eps,
                                (seq_start, seq_count, torch.zeros_like(seq_start)))
    out = torch.zeros(value.shape, dtype=query.dtype, device=query.device)

    def scan(q, k, v, i, f, ring_row, pos):
        return mlstm_reference(q, k, v, i, f, ring_row, pos, eps)
    return _ragged(scan, (query, key, value, igate, fgate), out, ring, positions, seq_start, seq_count)


@ragged_mlstm_scan.register_fake
def _(query, key, value, igate, fgate, ring, positions, seq_start, seq_count, eps):
    return value.new_empty(value.shape, dtype=query.dtype)
