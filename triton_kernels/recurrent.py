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

- ``gated_delta_scan`` (Gated DeltaNet, Qwen3-Next / Qwen3.5 linear attention; Yang et al. 2024):
  ``S = S * exp(g_t); S += k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t`` with ``q, k`` L2-normalised (when
  asked) and ``q`` scaled by ``1 / sqrt(d_k)``; the state is ``[heads, d_k, d_v]``.
- ``ssm_scan`` (Mamba's selective scan, Mamba-1 and Mamba-2 / SSD): ``h = exp(dt_t A) h + dt_t x_t B_t^T;
  y_t = h C_t`` per head; the state is ``[heads, head_dim, d_state]``. Mamba-2 has one ``A`` per head
  (``A [H]``); Mamba-1 one per channel and state entry (``A [H, N]``, ``head_dim = 1``). ``B``, ``C`` come in
  ``G`` groups shared by ``H / G`` heads.

Both are ``torch.library`` custom ops that write the ring in place, so a traced stage keeps them as one call each
and CUDA graphs capture them (no host reads: the slots come from ``positions`` on the device). The cost: a prompt
of ``T`` tokens runs ``T`` small steps per layer (no chunked parallel form yet), which makes prefill of long
prompts slow; one decode token is one step.
"""
from __future__ import annotations

import torch


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


@torch.library.custom_op("ppsplit::gated_delta_scan", mutates_args=("ring",))
def gated_delta_scan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, ring: torch.Tensor, positions: torch.Tensor, l2norm: bool) -> torch.Tensor:
    """Gated delta rule over ``query, key [B, T, Hk, Dk]``, ``value [B, T, Hv, Dv]``, ``g, beta [B, T, Hv]`` (``Hk``
    divides ``Hv``: each key head serves ``Hv / Hk`` consecutive value heads), starting from and writing the ring
    ``[B', R, Hv, Dk, Dv]`` (float32) at ``positions [T]``. Returns ``[B, T, Hv, Dv]`` in the query's dtype."""
    batch, tokens, k_heads, _ = key.shape
    v_heads = value.shape[2]
    if k_heads != v_heads:
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    q, k, v, gate, b = (x.float() for x in (query, key, value, g, beta))
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / (q.shape[-1] ** 0.5)
    rows = _ring_rows(ring, batch)
    state = _start_state(rows, positions)  # [B, Hv, Dk, Dv]
    out = []
    for t in range(tokens):
        state = state * gate[:, t].exp()[..., None, None]
        remembered = (state * k[:, t, :, :, None]).sum(-2)  # S^T k: [B, Hv, Dv]
        delta = (v[:, t] - remembered) * b[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append((state * q[:, t, :, :, None]).sum(-2))
        _keep(rows, positions, t, tokens, state)
    return torch.stack(out, dim=1).to(query.dtype)


@gated_delta_scan.register_fake
def _(query, key, value, g, beta, ring, positions, l2norm):
    return value.new_empty(value.shape, dtype=query.dtype)


@torch.library.custom_op("ppsplit::ssm_scan", mutates_args=("ring",))
def ssm_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             ring: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Selective scan over ``x [B, T, H, P]`` with step sizes ``dt [B, T, H]`` (already discretised: bias, softplus
    and limits applied), ``A [H]`` or ``[H, N]``, ``B, C [B, T, G, N]``, starting from and writing the ring
    ``[B', R, H, P, N]`` (float32) at ``positions [T]``. Returns ``y [B, T, H, P]`` in float32, without the ``D``
    skip term."""
    batch, tokens, heads, _ = x.shape
    groups = B.shape[2]
    xs, dts = x.float(), dt.float()
    Bs = B.float().repeat_interleave(heads // groups, dim=2)  # [B, T, H, N]
    Cs = C.float().repeat_interleave(heads // groups, dim=2)
    decay_rate = A.float()
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


@ssm_scan.register_fake
def _(x, dt, A, B, C, ring, positions):
    return x.new_empty(x.shape, dtype=torch.float32)
