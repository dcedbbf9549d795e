"""Serving: the last stage's work after the logits, for every request of a step at once, on the device.

Per drawing request: its window's logits (the last known token and its drafts) give the drafts it accepts (greedy:
the longest prefix equal to the target's argmax; sampling: the rejection rule, lossless) and one more token; then the
drafter (``ppsplit.serve.speculative``) proposes the next window's drafts. What the host reads back is one tensor per
step, ``[R, 3 + 3K]`` int64, a row per request in plan order::

    0          tokens committed (0: a prefill chunk that draws nothing)
    1          drafts accepted (-1: nothing verified)
    2 .. K+2   the committed tokens (accepted drafts, then the drawn one; -1 after them)
    K+3 ..     the drafts this window verified (K columns), then the next window's drafts (K columns)

The sampler also keeps, per sequence slot, what a request's next window needs without the host: its sampling
parameters (written once, at admission), the output index of its next draw (the counter its randomness hashes),
its last token and that token's position, and its drafts (and their distributions when sampling).
"""
from __future__ import annotations

import torch

from ppsplit.serve.sampling import (GREEDY_BELOW, SALT_ACCEPT, SALT_TARGET, accept_greedy, accept_sampled,
                                    filter_batch, uniform)

_U64 = (1 << 64) - 1


def result_width(k: int) -> int:
    return 3 + 3 * k


class Sampler:
    """Slot state and the per-step draw on ``device`` for a cache of ``slots`` sequence slots; ``proposer``: the
    drafter's loop (``ppsplit.serve.speculative.Proposer``) proposing ``k`` drafts per request, or ``None``."""

    def __init__(self, slots: int, device, proposer=None):
        self.device, self.proposer = torch.device(device), proposer
        self.k = proposer.k if proposer is not None else 0
        zeros = lambda dtype=torch.long: torch.zeros(slots, dtype=dtype, device=self.device)  # noqa: E731
        self.temperature, self.top_p, self.top_k = zeros(torch.float32), zeros(torch.float32), zeros()
        self.seed, self.index = zeros(), zeros()
        self.last_token, self.last_position = zeros(), zeros()
        self.drafts = torch.zeros(slots, max(self.k, 1), dtype=torch.long, device=self.device)

    def admit(self, admissions) -> None:
        """Write each admitted request's parameters into its slot (a few tensor writes, ordered with the steps)."""
        if admissions:
            self.admit_tensors(*(to_device(t, self.device) for t in admission_tensors(admissions)))

    def admit_tensors(self, floats: torch.Tensor, ints: torch.Tensor) -> None:
        """``admit`` from ``admission_tensors``."""
        slots = ints[:, 0]
        self.temperature[slots], self.top_p[slots] = floats[:, 0], floats[:, 1]
        self.top_k[slots], self.seed[slots], self.index[slots] = ints[:, 1], ints[:, 2], ints[:, 3]

    def window(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's ids and positions with the device-fed windows filled in (``batch.fed``)."""
        fed = batch.fed >= 0
        slot, offset = batch.seq.clamp_min(0), batch.fed.clamp_min(0)
        window = torch.cat([self.last_token[:, None], self.drafts[:, :self.k]], 1)
        ids = torch.where(fed, window[slot, offset], batch.tokens)
        positions = torch.where(fed, self.last_position[slot] + offset, batch.positions)
        return ids, positions

    @torch.no_grad()
    def run(self, logits: torch.Tensor, aux: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, batch, *,
            sampled: bool, cut_k: bool, cut_p: bool) -> torch.Tensor:
        """The step's results ``[R, 3 + 3K]`` (see the module docstring) from ``logits [N, V]`` and ``aux [n_slots,
        N, H]``; ``ids`` and ``positions``: what the stages ran. ``sampled`` / ``cut_k`` / ``cut_p``: whether any
        drawing request samples, cuts to top-k, to top-p (host knowledge, so a greedy step skips that work)."""
        k, dev = self.k, self.device
        rows = batch.num_rows
        out = torch.full((rows, result_width(k)), -1, dtype=torch.long, device=dev)
        out[:, 0] = 0
        d = batch.drawing
        if batch.num_drawing == 0:
            if self.proposer is not None:
                self.proposer.feed(aux, ids, positions, batch, None, None, self, False)
            return out
        slot = batch.slot[d]
        num = batch.num_drafts[d]
        first = batch.start[d] + batch.count[d] - 1 - num  # the row of each request's last known token
        j = torch.arange(k + 1, device=dev)
        window = logits[(first[:, None] + j).clamp(max=logits.shape[0] - 1)]  # [D, K + 1, V]
        drafts = ids[(first[:, None] + 1 + j[:k]).clamp(max=ids.shape[0] - 1)]  # [D, K]: those verified
        index = self.index[slot]
        greedy_n, greedy_token = accept_greedy(window.argmax(-1), drafts, num)
        n, token = greedy_n, greedy_token
        if sampled:
            p = filter_batch(window, self.temperature[slot], self.top_k[slot], self.top_p[slot], cut_k=cut_k,
                             cut_p=cut_p)
            q = self.proposer.target_probs(slot, p.shape[-1]) if k else p[:, :0]
            seed = self.seed[slot]
            u_accept = uniform(seed[:, None], index[:, None] + j[:k], SALT_ACCEPT)
            s_n, s_token = accept_sampled(p, q, drafts, num, u_accept,
                                          lambda taken: uniform(seed, index + taken, SALT_TARGET))
            greedy = self.temperature[slot] < GREEDY_BELOW
            n, token = torch.where(greedy, greedy_n, s_n), torch.where(greedy, greedy_token, s_token)
        committed = torch.cat([torch.where(j[:k] < n[:, None], drafts, -1), token[:, None]], 1)
        committed = torch.where(j < n[:, None], committed, -1).scatter_(1, n[:, None], token[:, None])
        last = first + n  # the row whose logits drew the new token
        self.last_token[slot] = token
        self.last_position[slot] = positions[last] + 1
        self.index[slot] = index + n + 1
        out[d, 0] = n + 1
        out[d, 1] = torch.where(num > 0, n, -1)
        out[d, 2:3 + k] = committed
        if k:
            out[d, 3 + k:3 + 2 * k] = torch.where(j[:k] < num[:, None], drafts, -1)
            proposed = self.proposer.feed(aux, ids, positions, batch, last, token, self, sampled, cut_k, cut_p)
            self.drafts[slot] = proposed
            out[d, 3 + 2 * k:] = proposed
        return out


def admission_tensors(admissions) -> tuple[torch.Tensor, torch.Tensor]:
    """What a slot keeps of each admitted request (``Scheduler``'s ``Admission``), as it travels: ``floats [A, 2]``
    (temperature, top-p) and ``ints [A, 4]`` (slot, top-k, seed as int64 (its low 64 bits), output index of the next
    draw)."""
    floats = torch.tensor([(a.params.temperature, a.params.top_p) for a in admissions], dtype=torch.float32)
    ints = torch.tensor([(a.slot, a.params.top_k, _int64(a.seed), a.index) for a in admissions], dtype=torch.long)
    return floats.view(-1, 2), ints.view(-1, 4)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on ``device`` without waiting for the device (pinned memory, then an async copy)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _int64(seed: int) -> int:
    seed &= _U64
    return seed - (1 << 64) if seed >= 1 << 63 else seed
