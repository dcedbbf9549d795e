"""Serving: the engine loop over a split with a paged cache (continuous batching, per-request sampling and EAGLE-3).

Requests join and leave at any step. Each step the scheduler packs, up to a token budget: every running request's
next window (its last sampled token, plus its ``K`` drafts when speculating), then prefill chunks of requests that
are still reading their prompt (chunked prefill), then new requests while a sequence slot is free. A request's
blocks are taken as its positions grow and returned the moment it finishes or is aborted; when the pool runs out a
running request is preempted: its blocks and slot are freed and it waits to be recomputed from its prompt and the
tokens it has produced (nothing is lost, the output is unchanged). One ``RaggedStep`` then runs through all
stages, and each request takes its rows of the logits: its own sample (its own generator), its own acceptance of
its drafts (greedy: the longest prefix equal to the target's argmax; sampling: the rejection rule, lossless), its
own stop conditions. No request waits for another.

Example::

    engine = Engine(ppsplit.load("demo-pp4"))
    outs = engine.generate([[1, 5, 9], [1, 7]], SamplingParams(max_tokens=32))
    for out in engine.stream([[1, 2, 3]], SamplingParams(max_tokens=8)): print(out.new_token_ids)
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from ppsplit.core.errors import ConfigError
from ppsplit.core.ragged import CacheLayout, RaggedStep, Segment
from ppsplit.core.tensors import module_device
from ppsplit.serve.sampling import SamplingParams, filtered_probs, pick


@dataclass
class RequestOutput:
    """What a request produced: ``new_token_ids`` in this step, ``token_ids`` so far; ``finish_reason`` is
    ``"stop"`` (an end-of-sequence or stop token, kept in the output), ``"length"`` (``max_tokens``) or
    ``"abort"``. ``accepted``: drafts accepted per verify pass (speculative decoding)."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    accepted: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # the K drafts of each verify pass

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + sum(self.accepted) / max(1, len(self.accepted))


@dataclass
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    arrival: int
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose cache entries are written (fed through the stages)
    drafts: list[int] = field(default_factory=list)  # proposed, to verify in the next window
    draft_probs: torch.Tensor | None = None
    accepted: list[int] = field(default_factory=list)
    verified: list[list[int]] = field(default_factory=list)  # the drafts of each verify pass
    finish_reason: str | None = None
    new: list[int] = field(default_factory=list)  # produced in the current step

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


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


class Engine:
    """Continuous batching over ``split`` (a ``SplitModel`` with a paged cache), optionally with an EAGLE-3
    ``drafter`` proposing ``num_draft_tokens`` drafts per request and step. ``max_num_batched_tokens``: the token
    budget of a step (default: 256, or the largest captured bucket); ``max_num_seqs``: sequences in flight (default:
    the cache's slots)."""

    def __init__(self, split, *, drafter=None, num_draft_tokens: int = 0, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None):
        if not split.plan.paged:
            why = split.plan.lockstep_reason or "it has no cache: split with cache=CacheConfig(...)"
            raise ConfigError(f"the engine needs a split with a paged cache, and this one keeps none because {why}")
        self.split = split
        self.layout: CacheLayout = split.layout
        self.device = module_device(split.stages[0])
        self.vocab = _vocab(split)
        self.eos = set(split.eos_token_id)
        self.k = num_draft_tokens if drafter is not None else 0
        self.drafter = drafter
        if drafter is not None:
            from ppsplit.eagle3.speculative import check_speculation

            check_speculation(split.plan, num_draft_tokens, drafter)
            drafter.allocate_paged(self.layout)
        buckets = sorted(n for b, n in split.graphs if b == 0)
        self.budget = max_num_batched_tokens or (buckets[-1] if buckets else 256)
        self.buckets = buckets
        if self.budget < self.k + 1:
            raise ConfigError(f"max_num_batched_tokens={self.budget} cannot hold one verify window of "
                              f"{self.k + 1} tokens")
        self.max_seqs = min(max_num_seqs or self.layout.slots, self.layout.slots)
        self.pool = BlockPool(self.layout.num_blocks)
        self.free_slots = list(range(self.max_seqs - 1, -1, -1))
        self.table = torch.full((self.layout.slots, self.layout.blocks_per_seq), -1, dtype=torch.long)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.steps = 0

    # -- requests ------------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
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
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        request = _Request(request_id, prompt, params, generator, arrival=len(self.requests))
        self.requests[request_id] = request
        self.waiting.append(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """End a request now (its blocks return to the pool at once); unknown or finished ids are ignored."""
        request = self.requests.get(str(request_id))
        if request is None or request.finish_reason is not None:
            return
        request.finish_reason = "abort"
        self._release(request)
        if request in self.waiting:
            self.waiting.remove(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def blocks_in_use(self) -> int:
        return self.pool.in_use

    # -- the loop ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that produced tokens or finished in it."""
        plan = self._schedule()
        if not plan:
            if self.waiting:
                raise ConfigError("no request fits the cache: every waiting request needs more blocks than the pool has")
            return []
        segments, feeds = [], []
        for request, tokens in plan:
            segments.append(Segment(request.slot, request.computed, len(tokens)))
            feeds.extend(tokens)
        pad = next((b for b in self.buckets if b >= len(feeds)), None)
        step = RaggedStep.build(segments, self.table, self.layout, pad_to=pad)
        ids = torch.zeros(step.num_tokens, dtype=torch.long)
        ids[:len(feeds)] = torch.tensor(feeds)
        logits, aux = self.split.step(ids.to(self.device), step.to(self.device))
        self.steps += 1
        rows, at = {}, 0
        for request, tokens in plan:
            rows[request.id] = (at, len(tokens))
            at += len(tokens)
        outputs = []
        finished_now = []
        for request, tokens in plan:
            start, count = rows[request.id]
            request.new = []
            fed = request.computed + count
            window = request.drafts
            request.computed = fed
            if fed < len(request.tokens):  # a prefill chunk that does not finish the prompt
                continue
            self._commit(request, logits[start:start + count], window)
        if self.drafter is not None:
            self._draft(plan, rows, logits, aux, step)
        for request, _ in plan:
            if request.new or request.finish_reason:
                outputs.append(self._output(request))
            if request.finish_reason is not None:
                finished_now.append(request)
        for request in finished_now:
            self._release(request)
        return outputs

    def _commit(self, request: _Request, logits: torch.Tensor, drafts: list[int]) -> None:
        """Take the request's new tokens from its rows of the logits: the sample of its last row, or, after a
        verify window, its accepted drafts and the token at the first rejection (or the bonus token)."""
        params = request.params
        if drafts:
            from ppsplit.eagle3.speculative import accept

            k = len(drafts)
            window = logits[-(k + 1):]
            draft = torch.tensor(drafts, device=logits.device)[None]
            if params.greedy:
                n, token = accept(draft, window[None])
            else:
                p = filtered_probs(window, params)
                n, token = accept_filtered(draft, p[None], request.draft_probs[None], request.generator)
            n, token = int(n[0]), int(token[0])
            request.accepted.append(n)
            request.verified.append(list(drafts))
            new = drafts[:n] + [token]
            # The rejected drafts' cache entries stay behind the next window's positions: overwritten, never read.
            request.computed -= k - n
        else:
            new = [int(pick(logits[-1], params, request.generator))]
        request.drafts, request.draft_probs = [], None
        for token in new:
            request.output.append(token)
            request.new.append(token)
            if self._stops(request, token):
                break

    def _stops(self, request: _Request, token: int) -> bool:
        params = request.params
        if (token in self.eos and not params.ignore_eos) or token in params.stop_token_ids:
            request.finish_reason = "stop"
        elif len(request.output) >= params.max_tokens:
            request.finish_reason = "length"
        return request.finish_reason is not None

    def _output(self, request: _Request) -> RequestOutput:
        return RequestOutput(request.id, list(request.prompt), list(request.new), list(request.output),
                             request.finish_reason is not None, request.finish_reason, list(request.accepted),
                             [list(d) for d in request.verified])

    # -- scheduling ----------------------------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[_Request, list[int]]]:
        """This step's (request, tokens to feed): running windows first, then prefill chunks, then new requests,
        within the token budget; blocks are taken here (preempting the newest running request if the pool runs
        out)."""
        budget = self.budget
        plan = []
        for request in list(self.running):
            if request.finish_reason is not None or request not in self.running:
                continue
            pending = request.tokens[request.computed:]
            if len(pending) == 1:  # decoding: the last sampled token, and the drafts to verify
                feed = pending + request.drafts
            else:  # prefilling (or recomputing after a preemption): a chunk of what is left
                feed = pending[:budget]
            if not feed or len(feed) > budget:
                continue
            if not self._reserve(request, request.computed + len(feed), keep=[r for r, _ in plan]):
                continue
            plan.append((request, feed))
            budget -= len(feed)
        while self.waiting and self.free_slots and budget > 0:
            request = self.waiting[0]
            chunk = request.tokens[request.computed:][:budget]
            request.slot = self.free_slots.pop()
            self.running.append(request)
            if not self._reserve(request, len(chunk), keep=None):
                self.running.remove(request)
                self.free_slots.append(request.slot)
                request.slot = None
                break
            self.waiting.popleft()
            plan.append((request, chunk))
            budget -= len(chunk)
        return plan

    def _reserve(self, request: _Request, end: int, keep: list | None) -> bool:
        """Blocks for positions ``0 .. end - 1`` (+ the drafts' positions ahead). When the pool is short, running
        requests other than ``keep`` (already in this step) are preempted, newest first; ``keep=None``: none is."""
        need = -(-(end + self.k) // self.layout.block_size) - len(request.blocks)
        while need > 0:
            got = self.pool.take(need)
            if got is not None:
                self.table[request.slot, len(request.blocks):len(request.blocks) + len(got)] = torch.tensor(got)
                request.blocks += got
                break
            victims = [r for r in self.running if r is not request and keep is not None and r not in keep]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda r: r.arrival))
        return True

    def _preempt(self, request: _Request) -> None:
        """Free a running request's blocks and slot; it waits (first in line) to be recomputed from its tokens."""
        self._release(request)
        request.computed, request.drafts, request.draft_probs = 0, [], None
        self.waiting.appendleft(request)

    def _release(self, request: _Request) -> None:
        if request in self.running:
            self.running.remove(request)
        if request.slot is not None:
            self.pool.give(request.blocks)
            self.table[request.slot] = -1
            self.free_slots.append(request.slot)
        request.slot, request.blocks = None, []

    # -- speculative decoding --------------------------------------------------------------------------------
    def _draft(self, plan, rows, logits, aux, step: RaggedStep) -> None:
        """Feed the drafter every row the stages just ran (the taps at position i, the token at i + 1: a row whose
        token is not known yet is stale and is overwritten later), then draft ``K`` tokens for each request that
        now waits for its next window, each from its own last committed row."""
        drafter, dev = self.drafter, module_device(self.split.stages[-1])
        nxt = torch.zeros(step.num_tokens, dtype=torch.long)
        starts = {}
        for request, _ in plan:
            start, count = rows[request.id]
            first = step.positions[start].item()
            tokens = request.tokens
            for i in range(count):
                p = first + i + 1
                nxt[start + i] = tokens[p] if p < len(tokens) else 0
            if request.finish_reason is None and request.computed == len(tokens) - 1:
                starts[request.id] = (request, start + request.computed - 1 - first)  # its last committed row
        meta = step.to(dev)
        draft_logits, out = drafter(aux.to(dev)[:, None], nxt.to(dev)[None], meta)
        if not starts:
            return
        chain = list(starts.values())
        index = torch.tensor([row for _, row in chain], device=dev)
        logits, hidden = draft_logits[0, index], out[0, index]
        positions = [request.computed - 1 for request, _ in chain]  # the row each draft is read from
        drafts = [[] for _ in chain]
        probs = [[] for _ in chain]
        for j in range(self.k):
            tokens = []
            for i, (request, _) in enumerate(chain):
                token, q = self._draft_pick(logits[i], request)
                drafts[i].append(token)
                probs[i].append(q)
                tokens.append(token)
            if j == self.k - 1:
                break
            positions = [p + 1 for p in positions]
            segments = [Segment(request.slot, p, 1) for (request, _), p in zip(chain, positions)]
            chain_step = RaggedStep.build(segments, self.table, self.layout).to(dev)
            logits, hidden = drafter(hidden[None], torch.tensor(tokens, device=dev)[None], chain_step)
            logits, hidden = logits[0], hidden[0]
        for i, (request, _) in enumerate(chain):
            request.drafts = drafts[i]
            request.draft_probs = None if request.params.greedy else torch.stack(probs[i])

    def _draft_pick(self, logits: torch.Tensor, request: _Request):
        """A draft token (target vocabulary) and, when sampling, the draft distribution over the target vocabulary."""
        drafter, params = self.drafter, request.params
        if params.greedy:
            return int(drafter.target_ids[logits.argmax(-1)]), None
        from ppsplit.serve.sampling import sample

        probs = filtered_probs(logits, params)
        token = int(drafter.target_ids[sample(probs, request.generator)])
        full = probs.new_zeros(drafter.embed_tokens.shape[0])
        full[drafter.target_ids] = probs  # d2t is one-to-one: q over the target vocabulary
        return token, full

    # -- whole runs ------------------------------------------------------------------------------------------
    def stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None):
        """Add ``prompts`` and run to the end, yielding each step's ``RequestOutput``s as they come."""
        self._add_all(prompts, params)
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Add ``prompts``, run to the end, and return their final outputs in order."""
        ids = self._add_all(prompts, params)
        final = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def _add_all(self, prompts, params) -> list[str]:
        prompts = list(prompts)
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        return [self.add_request(p, sp) for p, sp in zip(prompts, params)]


def accept_filtered(draft, p, q, generator):
    """The rejection rule over already filtered target probabilities ``p [B, K + 1, V]`` and draft probabilities
    ``q [B, K, V]``: accept draft ``d`` with probability ``min(1, p(d) / q(d))``; at the first rejection sample from
    ``norm(max(0, p - q))``; after ``K`` acceptances sample the bonus token from ``p``."""
    from ppsplit.serve.sampling import sample

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


def _vocab(split) -> int:
    """The vocabulary size: the rows of stage 0's embedding table."""
    from ppsplit.core.fx_utils import get_tensor

    stage = split.stages[0]
    for node in stage.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.embedding.default \
                and getattr(node.args[0], "op", None) == "get_attr":
            return get_tensor(stage, node.args[0].target).shape[0]
    raise ConfigError("stage 0 has no embedding lookup to tell the vocabulary size from")
