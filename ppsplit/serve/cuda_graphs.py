"""Driver: CUDA-graph capture of stages: one graph per ``(batch, tokens)`` bucket, static input and output buffers.

Graphs of one stage share its KV cache (the cache is a buffer of the stage, so every capture writes the same
memory) and, through a common memory pool, their intermediate buffers.

Capture before the cache holds live sequences: warm-up and capture run the stage once each, writing its cache
at the positions in the static buffer.
"""
from __future__ import annotations

import torch

from ppsplit.core.errors import ConfigError
from ppsplit.core.graphs import capture
from ppsplit.core.plan import SplitPlan
from ppsplit.core.ragged import CacheLayout, RaggedStep
from ppsplit.core.tensors import model_dtype, module_device


class CapturedStage:
    """A stage captured for one bucket: ``(batch, tokens)`` for a lockstep stage; for a paged stage (ragged steps)
    ``batch`` is 0 and ``tokens`` the step's ``N`` (a step is padded to its bucket; padding tokens have sequence
    slot -1, write nowhere and read nothing). The step's metadata lives in static buffers too, so a replay needs no
    host synchronisation.

    Zero-copy use: write ``x``, ``positions`` (and ``meta``) and the received prefix of ``aux`` in place, call
    ``replay()``, read ``y`` and this stage's slots of ``aux``. ``__call__`` does the copies for you and keeps the
    stage contract ``y, aux = captured(x, positions, aux, *metadata)``.

    Example::

        decode = ppsplit.cuda_graph(split.stages[1], batch=8, tokens=1)
        y, aux = decode(hidden, positions, aux)
    """

    def __init__(self, stage: torch.nn.Module, batch: int, tokens: int, *, pool=None, warmup: int = 2):
        plan: SplitPlan = stage.meta["ppsplit.plan"]
        self.index = stage.meta["ppsplit.stage"]
        self.plan, self.stage, self.batch, self.tokens = plan, stage, batch, tokens
        device = module_device(stage)
        if device.type != "cuda":
            raise ConfigError(f"CUDA-graph capture needs the stage on a CUDA device, but stage {self.index} is on "
                              f"{device}; move it first (split.place([...]) or load_stage(folder, k, 'cuda:k'))")
        dtype = model_dtype(plan)
        rows = (tokens,) if plan.paged else (batch, tokens)
        if self.index == 0:
            self.x = torch.zeros(*rows, dtype=torch.long, device=device)
        else:
            self.x = torch.zeros(*rows, plan.width(self.index), dtype=dtype, device=device)
        self.aux = torch.zeros(plan.n_slots, *rows, plan.hidden_size, dtype=dtype, device=device)
        if plan.paged:  # every token of the capture is padding: the warm-up and capture write no cache entry
            layout = CacheLayout.of(plan)
            self.meta = [t.to(device) for t in RaggedStep.build([], {}, layout, pad_to=tokens).tensors()]
        else:
            self.meta = [torch.arange(tokens, device=device)]
        self.positions = self.meta[0]
        self.received = plan.filled(self.index - 1) if self.index else 0
        self.own = plan.slots_of(self.index)
        self.graph, (self.y, _) = capture(lambda: stage(self.x, self.meta[0], self.aux, *self.meta[1:]), device,
                                          pool=pool, warmup=warmup)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.y

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, aux: torch.Tensor, *meta: torch.Tensor):
        self.x.copy_(x)
        for static, value in zip(self.meta, (positions, *meta)):
            static.copy_(value)
        if self.received:
            self.aux[: self.received].copy_(aux[: self.received])
        self.graph.replay()
        if len(self.own):
            aux[self.own.start: self.own.stop].copy_(self.aux[self.own.start: self.own.stop])
        return self.y, aux


def cuda_graph(stage: torch.nn.Module, batch: int, tokens: int, *, pool=None) -> CapturedStage:
    """Capture ``stage`` for a fixed bucket: ``(batch, tokens)`` (prefill: T, decode: 1, verify: K+1), or for a
    paged stage ``batch=0`` and ``tokens`` the step's token count."""
    return CapturedStage(stage, batch, tokens, pool=pool)
