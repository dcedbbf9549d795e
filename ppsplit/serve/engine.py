"""Serving: the engine. One scheduler, one sampler and one draft loop over a runner of stages (continuous batching,
per-request sampling and speculative decoding).

Requests join and leave at any step. The ``Scheduler`` (host) packs each step; a runner runs it through the stages
(in this process: ``ppsplit.serve.runner.LocalRunner``; one rank per stage: ``ppsplit.distributed.engine``); the
``Sampler`` (device, where the logits are) draws every request's tokens at once, accepts its drafts, and the drafter
proposes its next ones; one tensor of results comes back per step. The engine keeps the runner's ``depth`` steps in
flight, so the host schedules while the devices run. No request waits for another, and a request's randomness is a
function of its seed and the index of the token being drawn, so the same seed gives the same tokens whatever the
batch companions, preemption included.

Example::

    engine = Engine(ppsplit.load("demo-pp4"))
    outs = engine.generate([[1, 5, 9], [1, 7]], SamplingParams(max_tokens=32))
    for out in engine.stream([[1, 2, 3]], SamplingParams(max_tokens=8)): print(out.new_token_ids)
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ppsplit.core.errors import ConfigError
from ppsplit.serve.sampling import SamplingParams
from ppsplit.serve.scheduler import DEFAULT_BUDGET, Request, Scheduler

log = logging.getLogger("ppsplit")


@dataclass
class RequestOutput:
    """What a request produced: ``new_token_ids`` in this step, ``token_ids`` so far; ``finish_reason`` is
    ``"stop"`` (an end-of-sequence or stop token, kept in the output), ``"length"`` (``max_tokens``) or
    ``"abort"``. ``accepted`` / ``drafts``: per verify pass, the drafts accepted and proposed. ``logprobs`` (with
    ``SamplingParams.logprobs``): per output token so far, ``(logprob, [(id, logprob)] of the most likely)``."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    accepted: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)  # with SamplingParams.prompt_logprobs: None, then per token

    @property
    def new_logprobs(self) -> list:
        return self.logprobs[len(self.logprobs) - len(self.new_token_ids):] if self.logprobs else []

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + sum(self.accepted) / max(1, len(self.accepted))


class Engine:
    """Continuous batching over ``split`` (a ``SplitModel`` with a paged cache, in this process) or over a runner
    (``ppsplit.distributed``), optionally with an EAGLE-3 ``drafter`` proposing ``num_draft_tokens`` drafts per
    request and step. ``max_num_batched_tokens``: the token budget of a step (default: 2048, or the largest captured
    bucket); ``max_num_seqs``: sequences in flight (default: the cache's slots). On CUDA the stages are captured as
    CUDA graphs for the token buckets unless ``enforce_eager``; ``async_scheduling`` (default: on one CUDA device)
    schedules each step while the previous one runs."""

    def __init__(self, split, *, drafter=None, num_draft_tokens: int = 0, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None, enforce_eager: bool = False, async_scheduling: bool | None = None):
        from ppsplit.serve.runner import LocalRunner

        runner = split
        if hasattr(split, "stages"):
            if not split.plan.paged:
                why = split.plan.lockstep_reason or "it has no cache: split with cache=CacheConfig(...)"
                raise ConfigError(f"the engine needs a split with a paged cache, and this one keeps none because {why}")
            proposer = None
            if drafter is not None:
                from ppsplit.serve.speculative import Proposer, check_speculation

                check_speculation(split.plan, num_draft_tokens, drafter)
                proposer = Proposer(drafter, num_draft_tokens, split.layout)
            captured = sorted(n for b, n in split.graphs if b == 0)
            budget = max_num_batched_tokens or (captured[-1] if captured else DEFAULT_BUDGET)
            runner = LocalRunner(split, proposer=proposer, budget=budget, cuda_graphs=not enforce_eager,
                                 lag=async_scheduling)
        self.runner = runner
        budget = max_num_batched_tokens or (runner.buckets[-1] if runner.buckets else DEFAULT_BUDGET)
        # Recurrent layers keep a prompt's state per slot, outside the blocks: their choices prefill on their own.
        plan = getattr(runner, "plan", None) or getattr(getattr(runner, "split", None), "plan", None)
        self.scheduler = Scheduler(runner.layout, vocab=runner.vocab, eos=runner.eos, k=runner.k, budget=budget,
                                   max_seqs=max_num_seqs, buckets=runner.buckets, lag=runner.lag,
                                   lookahead=getattr(runner, "lookahead", runner.k),
                                   share_prompts=not getattr(plan, "state_slots", 0))
        self.flight: deque = deque()  # (plan, pending) of the steps launched and not read yet, oldest first
        self.steps = 0

    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None, *,
                    parent: str | None = None) -> str:
        """Queue a request (``Scheduler.add``); ``parent``: a request with the same prompt (another choice of the
        same ``n``) whose prompt blocks this one shares, copy-on-write, instead of prefilling its own."""
        if params is not None and params.grammar is not None and not getattr(self.runner, "structured", False):
            raise ConfigError("structured output (a grammar) runs with the stages in one process; this engine runs "
                              "them on ranks, which do not take grammars yet")
        return self.scheduler.add(prompt_ids, params, request_id, parent=parent)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.flight)

    @property
    def blocks_in_use(self) -> int:
        return self.scheduler.blocks_in_use

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Launch steps until ``depth`` are in flight, then read the oldest; an output for every request that
        produced tokens or finished in it."""
        sched, depth = self.scheduler, self.runner.depth
        while len(self.flight) < depth:
            share = None if sched.lag or depth == 1 else -(-(len(sched.running) + len(sched.waiting)) // depth)
            plan = sched.schedule(max_seqs=share)
            if plan is None:
                break
            self.flight.append((plan, self.runner.launch(plan)))
        if not self.flight:
            if sched.waiting:
                raise ConfigError("no request fits the cache: every waiting request needs more blocks than the pool has")
            return []
        plan, pending = self.flight.popleft()
        changed = sched.apply(plan, pending.wait())
        self.steps += 1
        outputs = []
        for request in changed:
            if request.new or request.finish_reason:
                outputs.append(output_of(request))
                if request.finish_reason is not None:
                    sched.release(request)
        return outputs

    def close(self) -> None:
        """Abort what is still running and read the steps in flight (a multi-process runner then ends the job)."""
        for request in list(self.scheduler.requests.values()):
            self.scheduler.abort(request.id)
        while self.flight:
            self.flight.popleft()[1].wait()
        self.runner.close()

    def stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None):
        """Add ``prompts`` and run to the end, yielding each step's ``RequestOutput``s as they come."""
        add_all(self, prompts, params)
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, *,
                 progress: float | None = None) -> list[RequestOutput]:
        """Add ``prompts``, run to the end, and return their final outputs in order. ``progress``: log a line (the
        ``ppsplit`` logger) every that many seconds while it runs (the commands pass 10)."""
        ids = add_all(self, prompts, params)
        final, tokens, start = {}, 0, time.perf_counter()
        shown = start
        while self.has_unfinished():
            for out in self.step():
                tokens += len(out.new_token_ids)
                if out.finished:
                    final[out.request_id] = out
            if progress is not None and time.perf_counter() - shown >= progress:
                shown = time.perf_counter()
                log.info("generating: %d tokens, %d of %d requests done, %.0fs", tokens, len(final), len(ids),
                         shown - start)
        return [final[i] for i in ids]


def output_of(request: Request) -> RequestOutput:
    return RequestOutput(request.id, list(request.prompt), list(request.new), list(request.output),
                         request.finish_reason is not None, request.finish_reason, list(request.accepted),
                         [list(d) for d in request.verified], list(request.logprobs),
                         list(request.prompt_logprobs))


def add_all(engine, prompts, params) -> list[str]:
    prompts = list(prompts)
    params = params if isinstance(params, list) else [params] * len(prompts)
    if len(params) != len(prompts):
        raise ConfigError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
    return [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
