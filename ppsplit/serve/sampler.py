"""Serving: the last stage's work after the logits, for every request of a step at once, on the device.

Per drawing request: its window's logits (the last known token and its drafts) give the drafts it accepts (greedy:
the longest prefix equal to the target's argmax; sampling: the rejection rule, lossless) and one more token; then the
drafter (``ppsplit.serve.speculative``) proposes the next window's drafts. What the host reads back is one tensor per
step, ``[R, 3 + 3K]`` int64, a row per request in plan order::

    0          tokens committed (0: a prefill chunk that draws nothing)
    1          drafts accepted (-1: nothing verified)
    2 .. K+2   the committed tokens (accepted drafts, then the drawn one; -1 after them)
    K+3 ..     the drafts this window verified (K columns), then the next window's drafts (K columns; -1 past those
               a trimming drafter, DSpark, keeps: the next window verifies only the kept ones)
    3K+3 ..    when a request of the step wants logprobs (``L`` alternatives at most), per committed token (K + 1):
               its logprob, the ``L`` most likely ids, their logprobs (logprobs as float32 bits)

When a request of the step wants its prompt's logprobs (``P`` alternatives at most), ``N`` more rows follow, one per
token of the step: the logprob of the token that follows it in its sequence, the ``P`` most likely ids, their
logprobs (``result_shape``).

The sampler also keeps, per sequence slot, what a request's next window needs without the host: its sampling
parameters (written once, at admission), the output index of its next draw (the counter its randomness hashes),
its last token and that token's position, and its drafts (and their distributions when sampling). A request whose
logits are adjusted (``SamplingParams.adjusted``) also keeps, over the vocabulary: its bias, the ids ``min_tokens``
holds back, the tokens of its prompt and the counts of its output's (updated on the device as tokens commit).
"""
from __future__ import annotations

import torch

from ppsplit.serve.sampling import (GREEDY_BELOW, SALT_ACCEPT, SALT_TARGET, accept_greedy, accept_sampled,
                                    filter_batch, uniform)

_U64 = (1 << 64) - 1


PROMPT, OUTPUT, BIAS, STOP = range(4)  # what an admission mark writes into its slot's vocabulary-wide state
FLOATS, INTS = 5, 6  # admission columns (``admission_tensors``)


def result_width(k: int, logprobs: int = -1) -> int:
    return 3 + 3 * k + ((k + 1) * (1 + 2 * logprobs) if logprobs >= 0 else 0)


def result_shape(k: int, rows: int, n: int, logprobs: int = -1, prompt_logprobs: int = -1) -> tuple[int, int]:
    """The results' shape for ``rows`` requests and ``n`` tokens (see the module docstring)."""
    width = result_width(k, logprobs)
    if prompt_logprobs < 0:
        return rows, width
    return rows + n, max(width, 1 + 2 * prompt_logprobs)


class Sampler:
    """Slot state and the per-step draw on ``device`` for a cache of ``slots`` sequence slots; ``proposer``: the
    drafter's loop (``ppsplit.serve.speculative.Proposer``) proposing ``k`` drafts per request, or ``None``."""

    def __init__(self, slots: int, device, proposer=None):
        self.device, self.proposer = torch.device(device), proposer
        self.k = proposer.k if proposer is not None else 0
        zeros = lambda dtype=torch.long: torch.zeros(slots, dtype=dtype, device=self.device)  # noqa: E731
        self.temperature, self.top_p, self.top_k = zeros(torch.float32), zeros(torch.float32), zeros()
        self.seed, self.index = zeros(), zeros()
        self.presence, self.frequency = zeros(torch.float32), zeros(torch.float32)
        self.repetition = zeros(torch.float32)
        self.min_tokens = zeros()
        self.counts = self.seen = self.bias = self.stops = None  # [slots, V], once a request is adjusted
        self.marks: list = []  # admissions' marks not written yet (the vocabulary is known at the next run)
        self.last_token, self.last_position = zeros(), zeros()
        self.drafts = torch.zeros(slots, max(self.k, 1), dtype=torch.long, device=self.device)
        self.kept = None  # [slots]: how many of its drafts each slot's next window verifies (a trimming drafter)

    def admit(self, admissions) -> None:
        """Write each admitted request's parameters into its slot (a few tensor writes, ordered with the steps)."""
        if admissions:
            self.admit_tensors(*(to_device(t, self.device) for t in admission_tensors(admissions)))

    def admit_tensors(self, floats: torch.Tensor, ints: torch.Tensor, marks: torch.Tensor | None = None,
                      values: torch.Tensor | None = None) -> None:
        """``admit`` from ``admission_tensors``."""
        slots = ints[:, 0]
        self.temperature[slots], self.top_p[slots] = floats[:, 0], floats[:, 1]
        self.presence[slots], self.frequency[slots], self.repetition[slots] = floats[:, 2], floats[:, 3], floats[:, 4]
        self.top_k[slots], self.seed[slots], self.index[slots] = ints[:, 1], ints[:, 2], ints[:, 3]
        self.min_tokens[slots] = ints[:, 4]
        if marks is not None or self.counts is not None:  # an admitted slot's old state is cleared, even if unused
            if marks is None:
                marks, values = ints.new_zeros(0, 3), floats.new_zeros(0)
            self.marks.append((slots, marks, values))

    def _write_marks(self, vocab: int) -> None:
        """The pending admissions' vocabulary-wide state: the admitted slots cleared, then their marks written."""
        if self.counts is None:
            size, dev = (len(self.seed), vocab), self.device
            # int32 and float32 so that marks add up with index_put_ (no mask indexing: it would wait for the device)
            self.counts, self.seen, self.stops = (torch.zeros(size, dtype=torch.int32, device=dev) for _ in range(3))
            self.bias = torch.zeros(size, dtype=torch.float32, device=dev)
        for slots, marks, values in self.marks:
            for state in (self.counts, self.seen, self.stops, self.bias):
                state.index_fill_(0, slots, 0)
            slot, kind, token = marks[:, 0], marks[:, 1], marks[:, 2]
            for state, of in ((self.counts, OUTPUT), (self.seen, PROMPT), (self.stops, STOP)):
                state.index_put_((slot, token), (kind == of).int(), accumulate=True)
            self.bias.index_put_((slot, token), torch.where(kind == BIAS, values, 0), accumulate=True)
        self.marks = []

    def adjust(self, window: torch.Tensor, slot: torch.Tensor, drafts: torch.Tensor, num: torch.Tensor,
               index: torch.Tensor) -> torch.Tensor:
        """``sampling.adjusted_logits`` for every drawing request's window ``[D, K + 1, V]``: row ``j`` follows the
        output so far and the window's first ``j`` drafts (``drafts [D, K]``, ``num [D]`` real)."""
        k = drafts.shape[1]
        logits = window.float() + self.bias[slot][:, None]
        j = torch.arange(k + 1, device=logits.device)
        early = (index[:, None] + j) < self.min_tokens[slot][:, None]  # [D, K + 1]
        logits = logits.masked_fill(early[..., None] & (self.stops[slot] > 0)[:, None], float("-inf"))
        counts = self.counts[slot].float()[:, None].expand(-1, k + 1, -1)
        if k:
            valid = (j[:k] < num[:, None]).float()[..., None]
            ahead = torch.zeros(len(slot), k, logits.shape[-1], device=logits.device).scatter_(
                2, drafts.clamp_min(0)[..., None], valid).cumsum(1)
            counts = counts + torch.cat([ahead.new_zeros(len(slot), 1, logits.shape[-1]), ahead], 1)
        seen = (self.seen[slot] > 0)[:, None] | (counts > 0)
        penalty = torch.where(seen, self.repetition[slot][:, None, None], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        return (logits - self.frequency[slot][:, None, None] * counts
                - self.presence[slot][:, None, None] * (counts > 0).float())

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
            sampled: bool, cut_k: bool, cut_p: bool, adjusted: bool = False, logprobs: int = -1,
            prompt_logprobs: int = -1) -> torch.Tensor:
        """The step's results ``[R, result_width(K, logprobs)]`` (see the module docstring) from ``logits [N, V]``
        and ``aux [n_slots, N, H]``; ``ids`` and ``positions``: what the stages ran. ``sampled`` / ``cut_k`` /
        ``cut_p`` / ``adjusted``: whether any drawing request samples, cuts to top-k, to top-p, adjusts its logits;
        ``logprobs`` / ``prompt_logprobs``: the most alternatives one wants (-1: none). Host knowledge, so a plain
        step skips that work."""
        k, dev = self.k, self.device
        rows = batch.num_rows
        if self.marks:
            self._write_marks(logits.shape[-1])
        out = torch.full(result_shape(k, rows, batch.n, logprobs, prompt_logprobs), -1, dtype=torch.long, device=dev)
        if prompt_logprobs >= 0:
            follow = batch.follow
            following = torch.where(follow >= 0, ids[follow.clamp_min(0)], batch.follow_token)
            out[rows:rows + len(logits), :1 + 2 * prompt_logprobs] = logprob_columns(
                logits[:, None], following[:, None], prompt_logprobs)
        out[:rows, 0] = 0
        d = batch.drawing
        if batch.num_drawing == 0:
            if self.proposer is not None:
                self.proposer.feed(aux, ids, positions, batch, None, None, self, False)
            return out
        slot = batch.slot[d]
        num = scheduled = batch.num_drafts[d]
        first = batch.start[d] + batch.count[d] - 1 - num  # the row of each request's last known token
        if self.kept is not None:  # a window the device fed holds all K drafts: verify only those the drafter kept
            num = torch.where(batch.fed[first] >= 0, torch.minimum(num, self.kept[slot]), num)
        j = torch.arange(k + 1, device=dev)
        window = logits[(first[:, None] + j).clamp(max=logits.shape[0] - 1)]  # [D, K + 1, V]
        drafts = ids[(first[:, None] + 1 + j[:k]).clamp(max=ids.shape[0] - 1)]  # [D, K]: those verified
        index = self.index[slot]
        target = self.adjust(window, slot, drafts, num, index) if adjusted else window
        greedy_n, greedy_token = accept_greedy(target.argmax(-1), drafts, num)
        n, token = greedy_n, greedy_token
        if sampled:
            p = filter_batch(target, self.temperature[slot], self.top_k[slot], self.top_p[slot], cut_k=cut_k,
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
        out[d, 1] = torch.where(scheduled > 0, n, -1)
        out[d, 2:3 + k] = committed
        if adjusted:
            rows_of = slot[:, None].expand_as(committed)
            self.counts.index_put_((rows_of, committed.clamp_min(0)), (committed >= 0).int(), accumulate=True)
        if logprobs >= 0:
            out[d, 3 + 3 * k:result_width(k, logprobs)] = logprob_columns(window, committed, logprobs)
        if k:
            out[d, 3 + k:3 + 2 * k] = torch.where(j[:k] < num[:, None], drafts, -1)
            proposed = self.proposer.feed(aux, ids, positions, batch, last, token, self, sampled, cut_k, cut_p)
            self.drafts[slot] = proposed
            kept = getattr(self.proposer, "kept", None)
            if kept is not None:  # drafts past the kept ones come back as -1: the next window leaves them out
                if self.kept is None:
                    self.kept = torch.full_like(self.index, k)
                self.kept[slot] = kept
                proposed = torch.where(j[:k] < kept[:, None], proposed, -1)
            out[d, 3 + 2 * k:3 + 3 * k] = proposed
        return out


def logprob_columns(window: torch.Tensor, committed: torch.Tensor, width: int) -> torch.Tensor:
    """``[D, (K + 1) * (1 + 2 * width)]``: per committed token, its logprob under the model (``log_softmax`` of the
    unadjusted logits), the ``width`` most likely ids and their logprobs (float32 bits)."""
    lp = torch.log_softmax(window.float(), -1)
    chosen = lp.gather(2, committed.clamp_min(0)[..., None])
    top = lp.topk(width, dim=-1)
    bits = lambda x: x.contiguous().view(torch.int32).long()  # noqa: E731
    return torch.cat([bits(chosen), top.indices, bits(top.values)], 2).flatten(1)


def admission_tensors(admissions):
    """What a slot keeps of each admitted request (``Scheduler``'s ``Admission``), as it travels: ``floats [A, 5]``
    (temperature, top-p, presence, frequency and repetition penalties), ``ints [A, 6]`` (slot, top-k, seed as int64
    (its low 64 bits), output index of the next draw, min_tokens, adjusted); with an adjusted request also its marks
    ``[E, 3]`` (slot, ``PROMPT`` / ``OUTPUT`` / ``BIAS`` / ``STOP``, token id) and their values ``float32 [E]``."""
    floats = torch.tensor([(a.params.temperature, a.params.top_p, a.params.presence_penalty,
                            a.params.frequency_penalty, a.params.repetition_penalty) for a in admissions],
                          dtype=torch.float32)
    ints = torch.tensor([(a.slot, a.params.top_k, _int64(a.seed), a.index, a.params.min_tokens,
                          int(a.params.adjusted)) for a in admissions], dtype=torch.long)
    out = (floats.view(-1, FLOATS), ints.view(-1, INTS))
    marks, values = [], []
    for a in admissions:
        if a.params.adjusted:
            for kind, tokens in ((PROMPT, a.prompt), (OUTPUT, a.output), (STOP, a.stops)):
                marks += [(a.slot, kind, t) for t in tokens]
                values += [0.0] * len(tokens)
            marks += [(a.slot, BIAS, t) for t, _ in a.params.logit_bias]
            values += [b for _, b in a.params.logit_bias]
    if any(a.params.adjusted for a in admissions):
        out += (torch.tensor(marks, dtype=torch.long).view(-1, 3), torch.tensor(values, dtype=torch.float32))
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on ``device`` without waiting for the device (pinned memory, then an async copy)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _int64(seed: int) -> int:
    seed &= _U64
    return seed - (1 << 64) if seed >= 1 << 63 else seed
