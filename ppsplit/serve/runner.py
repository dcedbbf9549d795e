"""Serving: running a scheduled step through stages in this process, on one device or a device per stage.

A runner is what the engine launches steps on (``launch(plan) -> Pending``); the multi-process one is
``ppsplit.distributed.engine.RankRunner``. This one copies the step's packed inputs to the devices (one copy each),
fills in the windows the device knows (``Sampler.window``), runs every stage (replaying CUDA graphs for the step's
bucket when captured), lets the ``Sampler`` draw and draft where the logits are, and starts one copy of the results
to pinned host memory. Nothing waits on the device until the engine reads a result (``Pending.wait``).

On one CUDA device the engine keeps two steps in flight and schedules a request again while its last step runs
(``lag``: async scheduling), so the host builds step ``t + 1`` while the device runs step ``t``. With a device per
stage it keeps one step per device in flight over disjoint requests (a pipeline). On the CPU it runs one at a time.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ppsplit.core.errors import ConfigError
from ppsplit.core.fx_utils import stage_vocab
from ppsplit.core.tensors import module_device
from ppsplit.serve.sampler import Sampler
from ppsplit.serve.scheduler import DEFAULT_BUDGET

log = logging.getLogger("ppsplit")


class Pending:
    """A launched step's results: ``wait()`` returns them as a numpy array (the step's one read of the device)."""

    def __init__(self, results: torch.Tensor):
        self.event = None
        if results.device.type == "cuda":
            host = torch.empty(results.shape, dtype=results.dtype, pin_memory=True)
            host.copy_(results, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(results.device))
            results = host
        self.results = results

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.results.numpy()


def buckets_up_to(budget: int) -> list[int]:
    """The token counts a step is padded to when stages are captured: powers of two below ``budget``, and
    ``budget``."""
    out, n = [], 1
    while n < budget:
        out.append(n)
        n *= 2
    return out + [budget]


class LocalRunner:
    """The stages of ``split`` (a ``SplitModel`` with a paged cache) in this process; ``proposer``: the drafter's
    loop on the last stage's device, or ``None``. ``cuda_graphs``: capture each stage for ``buckets_up_to(budget)``
    (CUDA only); ``lag``: async scheduling (default: on a single CUDA device)."""

    def __init__(self, split, *, proposer=None, budget: int = DEFAULT_BUDGET, cuda_graphs: bool = True, lag: bool | None = None):
        if not split.plan.paged:
            why = split.plan.lockstep_reason or "it has no cache: split with cache=CacheConfig(...)"
            raise ConfigError(f"the engine needs a split with a paged cache, and this one keeps none because {why}")
        self.split, self.layout = split, split.layout
        devices = [module_device(stage) for stage in split.stages]
        self.device = devices[-1]
        cuda = all(d.type == "cuda" for d in devices)
        spread = len(set(devices)) > 1
        self.lag = (cuda and not spread) if lag is None else lag
        self.depth = 2 if self.lag else (len(set(devices)) if cuda else 1)
        self.vocab = stage_vocab(split.stages[0])
        self.eos = split.eos_token_id
        self.k = proposer.k if proposer is not None else 0
        self.lookahead = proposer.lookahead if proposer is not None else 0
        self.sampler = Sampler(self.layout.slots, self.device, proposer)
        captured = sorted(n for b, n in split.graphs if b == 0)
        if cuda and cuda_graphs and not captured:
            start, buckets = time.perf_counter(), buckets_up_to(budget)
            split.capture(0, buckets)
            log.info("captured CUDA graphs of %d stage%s for %d token buckets (1 to %d) in %.1fs", len(devices),
                     "s" * (len(devices) != 1), len(buckets), buckets[-1], time.perf_counter() - start)
            captured = sorted(n for b, n in split.graphs if b == 0)
        self.buckets = captured
        if cuda and cuda_graphs and proposer is not None and captured:
            proposer.capture(split.plan, captured)

    def launch(self, plan) -> Pending:
        batch = plan.batch.to(self.device, non_blocking=True)
        self.sampler.admit(plan.admissions)
        ids, positions = self.sampler.window(batch) if plan.fed else (batch.tokens, batch.positions)
        logits, aux = self.split.step(ids.to(module_device(self.split.stages[0])), batch.step(positions))
        results = self.sampler.run(logits, aux, ids, positions, batch, sampled=plan.sampled, cut_k=plan.cut_k,
                                   cut_p=plan.cut_p, adjusted=plan.adjusted, logprobs=plan.logprobs,
                                   prompt_logprobs=plan.prompt_logprobs)
        return Pending(results)

    def close(self) -> None:
        pass
