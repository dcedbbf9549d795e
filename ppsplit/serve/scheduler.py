"""Serving: requests, sequence slots and KV blocks, and what each step feeds (host bookkeeping, numpy only).

Each step packs, up to a token budget: every running request's next window (its last sampled token, plus its ``K``
drafts when speculating), then prefill chunks of requests still reading their prompt (chunked prefill), then new
requests while a sequence slot is free. A request's blocks are taken as its positions grow and returned the moment it
finishes or is aborted; when the pool runs out the newest running request that is not in flight is preempted: its
blocks and slot are freed and it waits to be recomputed from its prompt and the tokens it has produced (its output is
unchanged).

Steps in flight: the engine runs up to ``depth`` steps ahead of the results it has read. With ``lag`` (one device:
async scheduling) a request whose last step is still running is scheduled again: its next prefill chunk, or, after a
step that draws, a window whose ids and positions the device fills in from what that step sampled (``fed``); the
blocks it may need are reserved for the longest outcome. Without ``lag`` (a pipeline of devices or ranks) the steps
in flight hold disjoint requests, and a request waits for its result before it is scheduled again.
"""
from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ppsplit.core.errors import ConfigError
from ppsplit.core.ragged import CacheLayout
from ppsplit.serve.batch import StepBatch
from ppsplit.serve.sampling import SamplingParams


# A step's token budget by default, as vLLM's for online serving: a prompt of up to 2048 tokens is one prefill step
# (8B-shaped on an H100, 64 requests: 1.25x the lower bound at 2048, 1.54x at 256; bench/gpu_serve.py, RESULTS).
DEFAULT_BUDGET = 2048


@dataclass(frozen=True)
class Work:
    """One request's part of a step: ``count`` tokens from ``position`` (``tokens``; a ``fed`` window's ids and
    positions come from the device), the last ``num_drafts`` of them drafts to verify; ``final``: they end what the
    request knows, so the sampler draws; ``next_token``: the prompt token after a chunk that does not draw."""

    slot: int
    generation: int
    position: int
    tokens: tuple[int, ...]
    count: int
    final: bool
    fed: bool
    num_drafts: int
    next_token: int


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    generation: int = 0  # of its slot: results for an earlier holder of the slot are dropped
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose cache entries are written and kept (as far as the results read say)
    flight: list[Work] = field(default_factory=list)  # its works in steps not read yet, oldest first
    drafts: list[int] = field(default_factory=list)  # proposed, to verify in the next window
    accepted: list[int] = field(default_factory=list)
    verified: list[list[int]] = field(default_factory=list)
    finish_reason: str | None = None
    new: list[int] = field(default_factory=list)  # produced in the step just read
    logprobs: list = field(default_factory=list)  # per output token (with params.logprobs): (logprob, top [(id, lp)])
    prompt_logprobs: list = field(default_factory=list)  # the same per prompt token (None for the first)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Admission:
    """A request taking a sequence slot: what the sampler keeps for that slot until the next admission."""

    slot: int
    params: SamplingParams
    seed: int
    index: int  # output index of its next draw (its tokens so far, after a preemption)
    prompt: tuple[int, ...] = ()  # what adjusting the logits needs (only when params.adjusted)
    output: tuple[int, ...] = ()
    stops: tuple[int, ...] = ()  # the ids min_tokens holds back: end-of-sequence (unless ignored) and stop ids


@dataclass
class StepPlan:
    """A scheduled step: ``(request, work)`` in token order, the admissions it carries, and its packed inputs."""

    entries: list[tuple[Request, Work]]
    admissions: list[Admission]
    batch: StepBatch
    sampled: bool  # some drawing request samples (else all are greedy)
    cut_k: bool
    cut_p: bool
    adjusted: bool = False  # some drawing request's logits are adjusted (bias, min_tokens, penalties)
    logprobs: int = -1  # the most alternatives a drawing request asks for, -1: no request wants logprobs
    prompt_logprobs: int = -1  # the same for the prompt tokens this step feeds

    @property
    def fed(self) -> bool:
        return any(w.fed for _, w in self.entries)


class BlockPool:
    """The free blocks of the cache's pool (host bookkeeping; the stages never allocate)."""

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks - 1, -1, -1))
        self.total = num_blocks

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        return [self.free.pop() for _ in range(n)]

    def give(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))

    @property
    def in_use(self) -> int:
        return self.total - len(self.free)


class Scheduler:
    """Requests, sequence slots and blocks, and what each step feeds (see the module docstring)."""

    def __init__(self, layout: CacheLayout, *, vocab: int, eos=(), k: int = 0, budget: int = 256,
                 max_seqs: int | None = None, buckets=(), lag: bool = False, lookahead: int | None = None):
        self.layout, self.vocab, self.eos, self.k = layout, vocab, set(eos), k
        self.lookahead = k if lookahead is None else lookahead  # positions past a window the drafter writes
        self.budget, self.buckets, self.lag = budget, sorted(buckets), lag
        if budget < k + 1:
            raise ConfigError(f"max_num_batched_tokens={budget} cannot hold one verify window of {k + 1} tokens")
        self.max_seqs = min(max_seqs or layout.slots, layout.slots)
        self.pool = BlockPool(layout.num_blocks)
        self.free_slots = list(range(self.max_seqs - 1, -1, -1))
        self.generations = [0] * layout.slots
        self.table = np.full((layout.slots, layout.blocks_per_seq), -1, dtype=np.int64)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    # -- requests ------------------------------------------------------------------------------------------------
    def add(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request; it joins at the next step. Refused with one line before anything is queued: an empty
        prompt, an id outside the vocabulary, a prompt (plus ``max_tokens``) longer than a sequence of the cache."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be a ppsplit SamplingParams, but got {type(params).__name__}")
        prompt = prompt_ids_of(prompt_ids)
        if not prompt:
            raise ConfigError("a request needs a prompt of at least one token id")
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary of {self.vocab} ids (0 to {self.vocab - 1})")
        need = len(prompt) + params.max_tokens + self.lookahead
        if need > self.layout.max_len:
            ahead = f" + {self.lookahead} draft positions" if self.lookahead else ""
            raise ConfigError(f"a prompt of {len(prompt)} tokens + max_tokens {params.max_tokens}{ahead} needs {need} "
                              f"positions, but a sequence of the cache holds {self.layout.max_len}; shorten it or "
                              "compile with a larger --max-len")
        if -(-need // self.layout.block_size) > self.layout.num_blocks:
            raise ConfigError(f"the request needs {-(-need // self.layout.block_size)} blocks, more than the cache's "
                              f"pool of {self.layout.num_blocks}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        biased = [t for t, _ in params.logit_bias if t >= self.vocab] + [t for t in params.stop_token_ids
                                                                        if t >= self.vocab]
        if biased:
            raise ConfigError(f"token id {biased[0]} in logit_bias / stop_token_ids is outside the vocabulary of "
                              f"{self.vocab} ids (0 to {self.vocab - 1})")
        if request_id in self.requests and self.requests[request_id].finish_reason is None:
            raise ConfigError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        request = Request(request_id, prompt, params, seed, arrival=len(self.requests))
        self.requests[request_id] = request
        self.waiting.append(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """End a request now (its blocks return to the pool at once); unknown or finished ids are ignored. Steps in
        flight that still write its blocks run before any later step that reuses them (one order on every device)."""
        request = self.requests.get(str(request_id))
        if request is None or request.finish_reason is not None:
            return
        request.finish_reason = "abort"
        self.release(request)
        if request in self.waiting:
            self.waiting.remove(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- a step --------------------------------------------------------------------------------------------------
    def schedule(self, max_seqs: int | None = None) -> StepPlan | None:
        """The next step (``None`` when nothing can run): running windows first, then prefill chunks, then new
        requests, within the token budget and at most ``max_seqs`` requests; blocks are taken here (preempting the
        newest running request not in flight if the pool runs out)."""
        budget, entries, admissions = self.budget, [], []
        max_seqs = max_seqs or len(self.running) + len(self.waiting)
        for request in list(self.running):
            if len(entries) >= max_seqs:
                break
            if request.finish_reason is not None or request not in self.running:
                continue
            work = self._next_work(request, budget)
            if work is None or not self._reserve(request, self._end(request) + work.count,
                                                 keep=[r for r, _ in entries]):
                continue
            entries.append((request, work))
            budget -= work.count
        while self.waiting and self.free_slots and budget > 0 and len(entries) < max_seqs:
            request = self.waiting[0]
            chunk = request.tokens[request.computed:][:budget]
            request.slot = self.free_slots.pop()
            self.generations[request.slot] += 1
            request.generation = self.generations[request.slot]
            self.running.append(request)
            if not self._reserve(request, len(chunk), keep=None):
                self.release(request)
                break
            self.waiting.popleft()
            admissions.append(self._admission(request))
            entries.append((request, self._chunk(request, request.computed, chunk)))
            budget -= len(chunk)
        if not entries:
            return None
        for request, work in entries:
            request.flight.append(work)
        return self._plan(entries, admissions)

    def _admission(self, request: Request) -> Admission:
        params = request.params
        if not params.adjusted:
            return Admission(request.slot, params, request.seed, len(request.output))
        stops = tuple(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos)))
        return Admission(request.slot, params, request.seed, len(request.output), tuple(request.prompt),
                         tuple(request.output), stops)

    def _next_work(self, request: Request, budget: int) -> Work | None:
        """What ``request`` feeds next, or ``None`` (waiting for a result, or done once its steps in flight end)."""
        if request.flight and (not self.lag or len(request.flight) > 1):
            return None
        end = self._end(request)
        if request.flight and request.flight[-1].final:
            # Its last step draws: the window after it comes from the device, unless that step ends the request.
            if len(request.output) + sum(w.final for w in request.flight) >= request.params.max_tokens:
                return None
            count = 1 + self.k
            if count > budget:
                return None
            return Work(request.slot, request.generation, -1, (), count, True, True, self.k, -1)
        tokens = request.tokens
        pending = tokens[end:]
        if len(pending) == 1 and request.drafts:  # decoding: the last token, and the drafts to verify
            feed = pending + request.drafts
            if len(feed) > budget:
                return None
            return Work(request.slot, request.generation, end, tuple(feed), len(feed), True, False,
                        len(request.drafts), -1)
        chunk = pending[:budget]
        return self._chunk(request, end, chunk) if chunk else None

    def _chunk(self, request: Request, start: int, chunk: list[int]) -> Work:
        tokens = request.tokens
        end = start + len(chunk)
        final = end >= len(tokens)
        return Work(request.slot, request.generation, start, tuple(chunk), len(chunk), final, False, 0,
                    -1 if final else tokens[end])

    @staticmethod
    def _end(request: Request) -> int:
        """The position after the request's last token fed so far (steps in flight counted as fully accepted)."""
        return request.computed + sum(w.count for w in request.flight)

    def _plan(self, entries, admissions) -> StepPlan:
        """Pack ``entries`` into the step's named arrays (``ppsplit.serve.batch``)."""
        layout = self.layout
        n = sum(w.count for _, w in entries)
        total = next((b for b in self.buckets if b >= n), n)
        tokens = np.zeros(total, dtype=np.int64)
        positions = np.zeros(total, dtype=np.int64)
        seq = np.full(total, -1, dtype=np.int64)
        fed = np.full(total, -1, dtype=np.int64)
        follow = np.full(total, -1, dtype=np.int64)
        follow_token = np.zeros(total, dtype=np.int64)
        seq_start = np.zeros(layout.slots, dtype=np.int64)
        seq_count = np.zeros(layout.slots, dtype=np.int64)
        chain_start = np.zeros(layout.slots, dtype=np.int64)
        chain_count = np.zeros(layout.slots, dtype=np.int64)
        rows = np.zeros((5, len(entries)), dtype=np.int64)
        at, drawing = 0, []
        for r, (_, w) in enumerate(entries):
            end = at + w.count
            span = np.arange(w.count)
            seq[at:end] = w.slot
            if w.fed:
                fed[at:end] = span
                positions[at:end] = span
            else:
                tokens[at:end] = w.tokens
                positions[at:end] = w.position + span
            follow[at:end - 1] = np.arange(at + 1, end)
            follow_token[end - 1] = max(w.next_token, 0)
            seq_start[w.slot], seq_count[w.slot] = at, w.count
            rows[:, r] = (w.slot, at, w.count, w.num_drafts, int(w.final))
            if w.final:
                chain_start[w.slot], chain_count[w.slot] = len(drawing), 1
                drawing.append(r)
            at = end
        arrays = dict(tokens=tokens, positions=positions, seq=seq, fed=fed, follow=follow, follow_token=follow_token,
                      block_table=self.table, seq_start=seq_start, seq_count=seq_count, chain_start=chain_start,
                      chain_count=chain_count, slot=rows[0], start=rows[1], count=rows[2], num_drafts=rows[3],
                      draws=rows[4], drawing=np.asarray(drawing, dtype=np.int64))
        draws = [r.params for r, w in entries if w.final]
        sampled = [p for p in draws if not p.greedy]
        return StepPlan(entries, admissions, StepBatch.pack(arrays, layout.slots, layout.blocks_per_seq),
                        bool(sampled), any(p.top_k for p in sampled), any(p.top_p < 1 for p in sampled),
                        any(p.adjusted for p in draws), max((p.logprobs for p in draws if p.logprobs is not None),
                                                            default=-1),
                        max((r.params.prompt_logprobs for r, w in entries if r.params.prompt_logprobs is not None
                             and not w.fed and w.position + 1 < len(r.prompt)), default=-1))

    def apply(self, plan: StepPlan, results: np.ndarray) -> list:
        """Take a step's results (``results [R, W]``, rows in plan order: see ``ppsplit.serve.sampler``); the
        requests that produced tokens or finished in it. A result is dropped when its request has ended since (an
        abort while its step was in flight) or it is for an earlier holder of the slot."""
        k, changed, at = self.k, [], 0
        for r, (request, work) in enumerate(plan.entries):
            at += work.count
            if plan.prompt_logprobs >= 0 and request.params.prompt_logprobs is not None and not work.fed \
                    and request.finish_reason is None and work.generation == request.generation:
                self._prompt_logprobs(request, work, results[len(plan.entries) + at - work.count:], plan)
            if request.flight and request.flight[0] is work:
                request.flight.pop(0)
            if request.finish_reason is not None or work.generation != request.generation:
                continue
            request.new = []
            request.computed += work.count
            if not work.final:
                continue
            row = results[r]
            count, accepted = int(row[0]), int(row[1])
            if accepted >= 0:  # a verify window: the rejected drafts' entries stay behind, overwritten later
                request.accepted.append(accepted)
                request.verified.append([t for t in row[2 + k + 1:2 + k + 1 + work.num_drafts].tolist() if t >= 0])
                request.computed -= work.num_drafts - accepted
            # -1 past the drafts a trimming drafter kept: the next window is the last token and the kept drafts
            request.drafts = [t for t in row[2 + 2 * k + 1:2 + 3 * k + 1].tolist() if t >= 0] if k else []
            logprobs = token_logprobs(row, k, plan.logprobs, request.params.logprobs)
            for i, token in enumerate(row[2:2 + count].tolist()):
                request.output.append(token)
                request.new.append(token)
                if logprobs is not None:
                    request.logprobs.append(logprobs[i])
                if self._stops(request, token):
                    break
            changed.append(request)
        return changed

    @staticmethod
    def _prompt_logprobs(request: Request, work: Work, rows: np.ndarray, plan: StepPlan) -> None:
        """Keep the logprobs of the prompt tokens that ``work``'s rows (its part of the results' token rows) predict
        (recomputed after a preemption: the first reading is kept)."""
        width, wanted = plan.prompt_logprobs, request.params.prompt_logprobs
        if not request.prompt_logprobs:
            request.prompt_logprobs = [None] * len(request.prompt)
        for i in range(work.count):
            position = work.position + i + 1  # the prompt token row i predicts
            if position >= len(request.prompt):
                break
            if request.prompt_logprobs[position] is None:
                row = rows[i, :1 + 2 * width]
                values = row[[0] + list(range(1 + width, 1 + 2 * width))].astype(np.int32).view(np.float32)
                request.prompt_logprobs[position] = (float(values[0]), list(zip(row[1:1 + wanted].tolist(),
                                                                               values[1:1 + wanted].tolist())))

    def _stops(self, request: Request, token: int) -> bool:
        params = request.params
        if (token in self.eos and not params.ignore_eos) or token in params.stop_token_ids:
            request.finish_reason = "stop"
        elif len(request.output) >= params.max_tokens:
            request.finish_reason = "length"
        return request.finish_reason is not None

    # -- blocks and slots ----------------------------------------------------------------------------------------
    def _reserve(self, request: Request, end: int, keep: list | None) -> bool:
        """Blocks for positions ``0 .. end - 1`` (+ the drafts' positions ahead). When the pool is short, running
        requests other than ``keep`` (already in this step) and not in flight are preempted, newest first;
        ``keep=None``: none is."""
        need = -(-(end + self.lookahead) // self.layout.block_size) - len(request.blocks)
        while need > 0:
            got = self.pool.take(need)
            if got is not None:
                self.table[request.slot, len(request.blocks):len(request.blocks) + len(got)] = got
                request.blocks += got
                break
            victims = [r for r in self.running if r is not request and keep is not None and r not in keep
                       and not r.flight]
            if not victims:
                return False
            self.preempt(max(victims, key=lambda r: r.arrival))
        return True

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and slot; it waits (first in line) to be recomputed from its tokens."""
        self.release(request)
        request.computed, request.drafts = 0, []
        self.waiting.appendleft(request)

    def release(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        if request.slot is not None:
            self.pool.give(request.blocks)
            self.table[request.slot] = -1
            self.free_slots.append(request.slot)
        request.slot, request.blocks, request.flight = None, [], []

    @property
    def blocks_in_use(self) -> int:
        return self.pool.in_use


def token_logprobs(row: np.ndarray, k: int, width: int, wanted: int | None):
    """A result row's logprobs (``ppsplit.serve.sampler``) for each committed token: ``(logprob, [(id, logprob)] *
    wanted)``, or ``None`` when the request wants none (``width``: the alternatives the step carries)."""
    if wanted is None or width < 0:
        return None
    per = 1 + 2 * width
    block = row[3 + 3 * k:3 + 3 * k + (k + 1) * per].reshape(k + 1, per)
    values = block[:, [0] + list(range(1 + width, 1 + 2 * width))].astype(np.int32).view(np.float32)
    ids = block[:, 1:1 + wanted]
    return [(float(values[i, 0]), list(zip(ids[i].tolist(), values[i, 1:1 + wanted].tolist())))
            for i in range(k + 1)]


def prompt_ids_of(prompt) -> list[int]:
    """A prompt as a list of ids: a list of ints, or a 1-D (or ``[1, T]``) integer tensor."""
    import torch

    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1 or prompt.dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"a prompt is a 1-D tensor or list of token ids, but got {prompt.dim()}-D {prompt.dtype}")
        return prompt.tolist()
    try:
        return [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise ConfigError(f"a prompt is a list of token ids, but got {str(prompt)[:60]!r}") from None
