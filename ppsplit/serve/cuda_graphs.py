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
from ppsplit.core.tensors import model_dtype, module_device, new_aux


class CapturedStage:
    """A stage captured for one ``(batch, tokens)`` bucket.

    Zero-copy use: write ``x``, ``positions`` and the received prefix of ``aux`` in place, call ``replay()``,
    read ``y`` and this stage's slots of ``aux``. ``__call__`` does the copies for you and keeps the stage
    contract ``y, aux = captured(x, positions, aux)``.

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
        if self.index == 0:
            self.x = torch.zeros(batch, tokens, dtype=torch.long, device=device)
        else:
            self.x = torch.zeros(batch, tokens, plan.width(self.index), dtype=dtype, device=device)
        self.positions = torch.arange(tokens, device=device)
        self.aux = new_aux(plan, batch, tokens, device, fill=torch.zeros)
        self.received = plan.filled(self.index - 1) if self.index else 0
        self.own = plan.slots_of(self.index)

        self.graph, (self.y, _) = capture(lambda: stage(self.x, self.positions, self.aux), device, pool=pool,
                                          warmup=warmup)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.y

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, aux: torch.Tensor):
        self.x.copy_(x)
        self.positions.copy_(positions)
        if self.received:
            self.aux[: self.received].copy_(aux[: self.received])
        self.graph.replay()
        if len(self.own):
            aux[self.own.start: self.own.stop].copy_(self.aux[self.own.start: self.own.stop])
        return self.y, aux


def cuda_graph(stage: torch.nn.Module, batch: int, tokens: int, *, pool=None) -> CapturedStage:
    """Capture ``stage`` for a fixed ``(batch, tokens)`` bucket (prefill: T, decode: 1, verify: K+1)."""
    return CapturedStage(stage, batch, tokens, pool=pool)
