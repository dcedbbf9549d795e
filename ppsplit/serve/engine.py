"""Serving: the engine loop over a split with a paged cache (continuous batching, per-request sampling and EAGLE-3).

Requests join and leave at any step. Each step the ``Scheduler`` packs, up to a token budget: every running
request's next window (its last sampled token, plus its ``K`` drafts when speculating), then prefill chunks of
requests still reading their prompt (chunked prefill), then new requests while a sequence slot is free. A request's
blocks are taken as its positions grow and returned the moment it finishes or is aborted; when the pool runs out the
newest running request is preempted: its blocks and slot are freed and it waits to be recomputed from its prompt and
the tokens it has produced (its output is unchanged). One ``RaggedStep`` runs through all stages, and the
``Sampler``, where the logits are, takes each request's rows: its own sample, its own acceptance of its drafts
(greedy: the longest prefix equal to the target's argmax; sampling: the rejection rule, lossless), its next drafts.
No request waits for another. A request's randomness is a function of its seed and the index of the token being
drawn, so the same seed gives the same tokens whatever the batch companions, preemption included.

The multi-process runtime (``ppsplit.distributed``) runs the same ``Scheduler`` on rank 0 and the same ``Sampler`` on
the last rank.

Example::

    engine = Engine(ppsplit.load("demo-pp4"))
    outs = engine.generate([[1, 5, 9], [1, 7]], SamplingParams(max_tokens=32))
    for out in engine.stream([[1, 2, 3]], SamplingParams(max_tokens=8)): print(out.new_token_ids)
"""
from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass, field

import torch

from ppsplit.core.errors import ConfigError
from ppsplit.core.fx_utils import stage_vocab
from ppsplit.core.ragged import CacheLayout, RaggedStep, Segment
from ppsplit.core.tensors import module_device
from ppsplit.serve.sampling import SamplingParams, filtered_probs, sample


@dataclass
class RequestOutput:
    """What a request produced: ``new_token_ids`` in this step, ``token_ids`` so far; ``finish_reason`` is
    ``"stop"`` (an end-of-sequence or stop token, kept in the output), ``"length"`` (``max_tokens``) or
    ``"abort"``. ``accepted`` / ``drafts``: per verify pass, the drafts accepted and proposed."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    accepted: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + sum(self.accepted) / max(1, len(self.accepted))


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
    computed: int = 0  # tokens whose cache entries are written (fed through the stages)
    drafts: list[int] = field(default_factory=list)  # proposed, to verify in the next window
    accepted: list[int] = field(default_factory=list)
    verified: list[list[int]] = field(default_factory=list)
    finish_reason: str | None = None
    new: list[int] = field(default_factory=list)  # produced in the current step
    in_flight: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass(frozen=True)
class Work:
    """One request's part of a step: feed ``tokens`` at positions ``position ..``; ``final``: they end what the
    request knows, so the sampler draws (``next_token`` is the prompt token after a partial chunk, else -1);
    ``drafts``: the window's drafts to verify; ``index``: the output index of the first token to draw."""

    slot: int
    generation: int
    position: int
    tokens: tuple[int, ...]
    final: bool
    next_token: int
    drafts: tuple[int, ...]
    index: int
    seed: int
    params: SamplingParams


@dataclass(frozen=True)
class Result:
    """The sampler's answer for one ``Work``: the tokens it committed (accepted drafts, then the sample), how many
    drafts it accepted (-1: no verify), and the next window's drafts."""

    slot: int
    generation: int
    tokens: tuple[int, ...]
    accepted: int
    drafts: tuple[int, ...]


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
                 max_seqs: int | None = None, buckets=()):
        self.layout, self.vocab, self.eos, self.k = layout, vocab, set(eos), k
        self.budget, self.buckets = budget, sorted(buckets)
        if budget < k + 1:
            raise ConfigError(f"max_num_batched_tokens={budget} cannot hold one verify window of {k + 1} tokens")
        self.max_seqs = min(max_seqs or layout.slots, layout.slots)
        self.pool = BlockPool(layout.num_blocks)
        self.free_slots = list(range(self.max_seqs - 1, -1, -1))
        self.generations = [0] * layout.slots
        self.table = torch.full((layout.slots, layout.blocks_per_seq), -1, dtype=torch.long)
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
        prompt = _ids(prompt_ids)
        if not prompt:
            raise ConfigError("a request needs a prompt of at least one token id")
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary of {self.vocab} ids (0 to {self.vocab - 1})")
        need = len(prompt) + params.max_tokens + self.k
        if need > self.layout.max_len:
            raise ConfigError(f"a prompt of {len(prompt)} tokens + max_tokens {params.max_tokens}"
                              + (f" + {self.k} draft positions" if self.k else "") + f" needs {need} positions, but a "
                              f"sequence of the cache holds {self.layout.max_len}; shorten it or compile with a larger "
                              "--max-len")
        if -(-need // self.layout.block_size) > self.layout.num_blocks:
            raise ConfigError(f"the request needs {-(-need // self.layout.block_size)} blocks, more than the cache's "
                              f"pool of {self.layout.num_blocks}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests and self.requests[request_id].finish_reason is None:
            raise ConfigError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        request = Request(request_id, prompt, params, seed, arrival=len(self.requests))
        self.requests[request_id] = request
        self.waiting.append(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """End a request now (its blocks return to the pool at once); unknown or finished ids are ignored."""
        request = self.requests.get(str(request_id))
        if request is None or request.finish_reason is not None:
            return
        request.finish_reason = "abort"
        self.release(request)
        if request in self.waiting:
            self.waiting.remove(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- a step ----------------------------------------------------------------------------------------------
    def schedule(self, max_seqs: int | None = None) -> list[tuple[Request, Work]]:
        """This step's work, in token order: running windows first, then prefill chunks, then new requests, within
        the token budget and at most ``max_seqs`` requests; blocks are taken here (preempting the newest running
        request if the pool runs out). Requests already in flight (the pipeline's other micro-steps) wait."""
        budget, plan = self.budget, []
        max_seqs = max_seqs or len(self.running) + len(self.waiting)
        for request in list(self.running):
            if len(plan) >= max_seqs:
                break
            if request.finish_reason is not None or request.in_flight or request not in self.running:
                continue
            pending = request.tokens[request.computed:]
            drafts = request.drafts if len(pending) == 1 else []  # decoding: the last token, and drafts to verify
            feed = pending + drafts if drafts else pending[:budget]
            if not feed or len(feed) > budget:
                continue
            if not self._reserve(request, request.computed + len(feed), keep=[r for r, _ in plan]):
                continue
            plan.append((request, self._work(request, feed, drafts)))
            budget -= len(feed)
        while self.waiting and self.free_slots and budget > 0 and len(plan) < max_seqs:
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
            plan.append((request, self._work(request, chunk, [])))
            budget -= len(chunk)
        for request, _ in plan:
            request.in_flight = True
        return plan

    def _work(self, request: Request, feed: list[int], drafts: list[int]) -> Work:
        tokens = request.tokens
        end = request.computed + len(feed) - len(drafts)  # the known tokens this step has fed
        final = end >= len(tokens)
        return Work(request.slot, request.generation, request.computed, tuple(feed), final,
                    -1 if final else tokens[end], tuple(drafts), len(request.output), request.seed, request.params)

    def step_of(self, plan) -> RaggedStep:
        """The metadata of ``plan``, padded to the smallest captured bucket that holds it."""
        segments = [Segment(w.slot, w.position, len(w.tokens)) for _, w in plan]
        n = sum(s.count for s in segments)
        return RaggedStep.build(segments, self.table, self.layout,
                                pad_to=next((b for b in self.buckets if b >= n), None))

    def apply(self, request: Request, work: Work, result: Result) -> bool:
        """Take a sampler's result for ``request``'s ``work``; dropped (``False``) when the request has ended since
        (an abort while its step was in flight) or the result is for an earlier holder of the slot."""
        request.in_flight = False
        if request.finish_reason is not None or result.generation != request.generation \
                or work.generation != request.generation:
            return False
        request.new = []
        request.computed += len(work.tokens)
        if result.accepted >= 0:  # a verify window: the rejected drafts' entries stay behind, overwritten later
            request.accepted.append(result.accepted)
            request.verified.append(list(work.drafts))
            request.computed -= len(work.drafts) - result.accepted
        request.drafts = list(result.drafts)
        for token in result.tokens:
            request.output.append(token)
            request.new.append(token)
            if self._stops(request, token):
                break
        return True

    def advance(self, request: Request, work: Work) -> bool:
        """Count the prefill chunk of ``work`` as written (a chunk that does not finish what the request knows)."""
        request.in_flight = False
        if request.finish_reason is not None or request.generation != work.generation:
            return False
        request.computed += len(work.tokens)
        request.new = []
        return True

    def _stops(self, request: Request, token: int) -> bool:
        params = request.params
        if (token in self.eos and not params.ignore_eos) or token in params.stop_token_ids:
            request.finish_reason = "stop"
        elif len(request.output) >= params.max_tokens:
            request.finish_reason = "length"
        return request.finish_reason is not None

    def output(self, request: Request) -> RequestOutput:
        return RequestOutput(request.id, list(request.prompt), list(request.new), list(request.output),
                             request.finish_reason is not None, request.finish_reason, list(request.accepted),
                             [list(d) for d in request.verified])

    # -- blocks and slots ----------------------------------------------------------------------------------------
    def _reserve(self, request: Request, end: int, keep: list | None) -> bool:
        """Blocks for positions ``0 .. end - 1`` (+ the drafts' positions ahead). When the pool is short, running
        requests other than ``keep`` (already in this step) are preempted, newest first; ``keep=None``: none is."""
        need = -(-(end + self.k) // self.layout.block_size) - len(request.blocks)
        while need > 0:
            got = self.pool.take(need)
            if got is not None:
                self.table[request.slot, len(request.blocks):len(request.blocks) + len(got)] = torch.tensor(got)
                request.blocks += got
                break
            victims = [r for r in self.running if r is not request and keep is not None and r not in keep
                       and not r.in_flight]
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
        request.slot, request.blocks = None, []

    @property
    def blocks_in_use(self) -> int:
        return self.pool.in_use


def draw_generator(seed: int, index: int, device, salt: int = 0) -> torch.Generator:
    """The generator of a request's draw at output index ``index``: a function of the seed and the index only."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + index * 7919 + salt) % (1 << 63))
    return g


class Sampler:
    """Where the logits are: each request's sample or acceptance, and its next drafts (with a drafter)."""

    def __init__(self, drafter=None, k: int = 0, layout: CacheLayout | None = None):
        self.drafter, self.k = drafter, k
        self.draft_probs: dict[int, tuple[int, torch.Tensor]] = {}  # slot -> (generation, q of its drafts)
        if drafter is not None:
            drafter.allocate_paged(layout)

    @torch.no_grad()
    def run(self, works: list[Work], logits: torch.Tensor, aux: torch.Tensor, step: RaggedStep,
            table: torch.Tensor, layout: CacheLayout) -> list[Result | None]:
        """One result per work (``None`` for a prefill chunk that draws nothing)."""
        results, at, rows = [], 0, []
        for w in works:
            rows.append(at)
            results.append(self._commit(w, logits[at:at + len(w.tokens)]) if w.final else None)
            at += len(w.tokens)
        if self.drafter is not None:
            drafts = self.draft(works, rows, results, aux, step, table, layout)
            results = [r if r is None else Result(r.slot, r.generation, r.tokens, r.accepted, drafts.get(i, ()))
                       for i, r in enumerate(results)]
        return results

    def _commit(self, w: Work, logits: torch.Tensor) -> Result:
        params, device = w.params, logits.device
        if w.drafts:
            from ppsplit.eagle3.speculative import accept

            k = len(w.drafts)
            window = logits[-(k + 1):]
            draft = torch.tensor(w.drafts, device=device)[None]
            if params.greedy:
                n, token = accept(draft, window[None])
            else:
                gen, q = draw_generator(w.seed, w.index, device), self.draft_probs.get(w.slot)
                if q is None or q[0] != w.generation:
                    raise ConfigError(f"slot {w.slot}: drafts to verify without their distribution")
                n, token = accept_filtered(draft, filtered_probs(window, params)[None], q[1][None], gen)
            n = int(n[0])
            return Result(w.slot, w.generation, tuple(w.drafts[:n]) + (int(token[0]),), n, ())
        last = logits[-1]
        if params.greedy:
            token = int(last.argmax(-1))
        else:
            token = int(sample(filtered_probs(last, params), draw_generator(w.seed, w.index, device)))
        return Result(w.slot, w.generation, (token,), -1, ())

    def draft(self, works, rows, results, aux, step: RaggedStep, table, layout) -> dict[int, tuple[int, ...]]:
        """Feed the drafter every row the stages just ran (the taps at position i, the token at i + 1; a row whose
        token is not known yet is stale, and overwritten later), then draft ``K`` tokens for each request that drew,
        from its last committed row."""
        drafter = self.drafter
        dev = drafter.fc.weight.device
        nxt = torch.zeros(step.num_tokens, dtype=torch.long)
        chain = []  # (work index, row of its last committed token, position of that row)
        for i, (w, row, r) in enumerate(zip(works, rows, results)):
            known = list(w.tokens[1:]) + [w.next_token]
            if r is not None:  # the row of the last committed token: its next token is the new sample
                last = len(w.tokens) - 1 - len(w.drafts) + len(r.tokens) - 1
                known[last] = r.tokens[-1]
                chain.append((i, row + last, w.position + last))
            nxt[row:row + len(w.tokens)] = torch.tensor(known[:len(w.tokens)]).clamp(min=0)  # stale rows: any id
        meta = step.to(dev)
        logits, out = drafter(aux.to(dev)[:, None], nxt.to(dev)[None], meta)
        if not chain:
            return {}
        index = torch.tensor([row for _, row, _ in chain], device=dev)
        logits, hidden = logits[0, index], out[0, index]
        positions = [p for _, _, p in chain]
        drafts = {i: [] for i, _, _ in chain}
        probs = {i: [] for i, _, _ in chain}
        for j in range(self.k):
            tokens = []
            for c, (i, _, _) in enumerate(chain):
                w = works[i]
                token, q = self._pick(logits[c], w, j)
                drafts[i].append(token)
                probs[i].append(q)
                tokens.append(token)
            if j == self.k - 1:
                break
            positions = [p + 1 for p in positions]
            segments = [Segment(works[i].slot, p, 1) for (i, _, _), p in zip(chain, positions)]
            chain_step = RaggedStep.build(segments, table, layout).to(dev)
            logits, hidden = drafter(hidden[None], torch.tensor(tokens, device=dev)[None], chain_step)
            logits, hidden = logits[0], hidden[0]
        for i, _, _ in chain:
            w = works[i]
            if not w.params.greedy:
                self.draft_probs[w.slot] = (w.generation, torch.stack(probs[i]))
        return {i: tuple(d) for i, d in drafts.items()}

    def _pick(self, logits: torch.Tensor, w: Work, j: int):
        """Draft ``j`` (target vocabulary) and, when sampling, the draft distribution over the target vocabulary."""
        drafter, params = self.drafter, w.params
        if params.greedy:
            return int(drafter.target_ids[logits.argmax(-1)]), None
        probs = filtered_probs(logits, params)
        gen = draw_generator(w.seed, w.index, logits.device, salt=1 + j)
        token = int(drafter.target_ids[sample(probs, gen)])
        full = probs.new_zeros(drafter.embed_tokens.shape[0])
        full[drafter.target_ids] = probs  # d2t is one-to-one: q over the target vocabulary
        return token, full


class Engine:
    """Continuous batching over ``split`` (a ``SplitModel`` with a paged cache), in one process, optionally with an
    EAGLE-3 ``drafter`` proposing ``num_draft_tokens`` drafts per request and step. ``max_num_batched_tokens``: the
    token budget of a step (default: 256, or the largest captured bucket); ``max_num_seqs``: sequences in flight
    (default: the cache's slots)."""

    def __init__(self, split, *, drafter=None, num_draft_tokens: int = 0, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None):
        if not split.plan.paged:
            why = split.plan.lockstep_reason or "it has no cache: split with cache=CacheConfig(...)"
            raise ConfigError(f"the engine needs a split with a paged cache, and this one keeps none because {why}")
        k = num_draft_tokens if drafter is not None else 0
        if drafter is not None:
            from ppsplit.eagle3.speculative import check_speculation

            check_speculation(split.plan, num_draft_tokens, drafter)
        buckets = sorted(n for b, n in split.graphs if b == 0)
        self.split = split
        self.device = module_device(split.stages[0])
        self.scheduler = Scheduler(split.layout, vocab=stage_vocab(split.stages[0]), eos=split.eos_token_id, k=k,
                                   budget=max_num_batched_tokens or (buckets[-1] if buckets else 256),
                                   max_seqs=max_num_seqs, buckets=buckets)
        self.sampler = Sampler(drafter, k, split.layout)
        self.steps = 0

    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        return self.scheduler.add(prompt_ids, params, request_id)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def blocks_in_use(self) -> int:
        return self.scheduler.blocks_in_use

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that produced tokens or finished in it."""
        sched = self.scheduler
        plan = sched.schedule()
        if not plan:
            if sched.waiting:
                raise ConfigError("no request fits the cache: every waiting request needs more blocks than the pool has")
            return []
        step = sched.step_of(plan)
        ids = torch.zeros(step.num_tokens, dtype=torch.long)
        feeds = [t for _, w in plan for t in w.tokens]
        ids[:len(feeds)] = torch.tensor(feeds)
        logits, aux = self.split.step(ids.to(self.device), step.to(self.device))
        self.steps += 1
        results = self.sampler.run([w for _, w in plan], logits, aux, step, sched.table, sched.layout)
        return finish_step(sched, plan, results)

    def stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None):
        """Add ``prompts`` and run to the end, yielding each step's ``RequestOutput``s as they come."""
        add_all(self, prompts, params)
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Add ``prompts``, run to the end, and return their final outputs in order."""
        return run_to_end(self, prompts, params)


def finish_step(sched: Scheduler, plan, results) -> list[RequestOutput]:
    """Apply a step's results (in plan order) and release what finished; the outputs of that step."""
    outputs = []
    for (request, work), result in zip(plan, results):
        applied = sched.advance(request, work) if result is None else sched.apply(request, work, result)
        if applied and (request.new or request.finish_reason):
            outputs.append(sched.output(request))
            if request.finish_reason is not None:
                sched.release(request)
    return outputs


def add_all(engine, prompts, params) -> list[str]:
    prompts = list(prompts)
    params = params if isinstance(params, list) else [params] * len(prompts)
    if len(params) != len(prompts):
        raise ConfigError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
    return [engine.add_request(p, sp) for p, sp in zip(prompts, params)]


def run_to_end(engine, prompts, params) -> list[RequestOutput]:
    ids = add_all(engine, prompts, params)
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


def accept_filtered(draft, p, q, generator):
    """The rejection rule over already filtered target probabilities ``p [B, K + 1, V]`` and draft probabilities
    ``q [B, K, V]``: accept draft ``d`` with probability ``min(1, p(d) / q(d))``; at the first rejection sample from
    ``norm(max(0, p - q))``; after ``K`` acceptances sample the bonus token from ``p``."""
    batch, k = draft.shape
    p_d = p[:, :k].gather(2, draft[..., None])[..., 0]
    q_d = q.gather(2, draft[..., None])[..., 0]
    u = torch.rand(batch, k, device=p.device, generator=generator)
    n = torch.cumprod((u * q_d < p_d).long(), dim=1).sum(1)
    residual = torch.cat([(p[:, :k] - q).clamp_min(0), p[:, k:]], dim=1)
    row = residual.gather(1, n[:, None, None].expand(batch, 1, residual.shape[-1]))[:, 0]
    return n, sample(row, generator)


def _ids(prompt) -> list[int]:
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
