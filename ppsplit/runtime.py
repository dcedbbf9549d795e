"""In-process runtime: a ``SplitModel`` runs its stages in order, optionally stage ``k`` on device ``k``."""
from __future__ import annotations

from typing import Sequence

import torch

from ppsplit.plan import SplitPlan


def stage_device(stage: torch.nn.Module) -> torch.device:
    for t in stage.parameters():
        return t.device
    for t in stage.buffers():
        return t.device
    return torch.device("cpu")


class SplitModel(torch.nn.Module):
    """The stages of one split, with the plan that made them.

    Example::

        split = split_model(model, pp=4, aux="eagle3")
        logits, aux = split(input_ids)                 # runs stage 0, 1, 2, 3 in order
        features = split.drafter_inputs(aux)           # [B, T, 3 * H], the EAGLE-3 input
    """

    def __init__(self, plan: SplitPlan, stages: Sequence[torch.nn.Module]):
        super().__init__()
        self.plan = plan
        self.stages = torch.nn.ModuleList(stages)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.plan.dtype)

    def place(self, devices: Sequence[torch.device | str]) -> "SplitModel":
        """Move stage ``k`` to ``devices[k]``; ``__call__`` then moves the hidden state and the aux prefix."""
        if len(devices) != self.plan.pp:
            raise ValueError(f"place needs one device per stage ({self.plan.pp}), got {len(devices)}")
        for stage, dev in zip(self.stages, devices):
            stage.to(dev)
        return self

    def new_aux(self, batch: int, tokens: int, device: torch.device | str | None = None) -> torch.Tensor:
        """An uninitialised packed buffer ``[n_slots, batch, tokens, H]``; every slot is written by its owner."""
        device = device if device is not None else stage_device(self.stages[0])
        return torch.empty(self.plan.n_slots, batch, tokens, self.plan.hidden_size, dtype=self.dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None):
        """Run all stages: ``(input_ids [B, T], positions [T]) -> (logits [B, T, V], aux [n_slots, B, T, H])``."""
        batch, tokens = input_ids.shape
        if positions is None:
            positions = torch.arange(tokens, device=input_ids.device)
        x, aux = input_ids, None
        for k, stage in enumerate(self.stages):
            dev = stage_device(stage)
            if aux is None:
                aux = self.new_aux(batch, tokens, dev)
            elif aux.device != dev:
                # The receiver owns a full-size buffer and receives the filled prefix into it.
                moved = self.new_aux(batch, tokens, dev)
                filled = self.plan.filled(k - 1)
                moved[:filled].copy_(aux[:filled])
                aux = moved
            x, aux = stage(x.to(dev), positions.to(dev), aux)
        return x, aux

    def drafter_inputs(self, aux: torch.Tensor) -> torch.Tensor:
        """The EAGLE-3 input ``[B, T, n_slots * H]``: the taps concatenated along hidden, ascending tap id."""
        n, batch, tokens, hidden = aux.shape
        return aux.permute(1, 2, 0, 3).reshape(batch, tokens, n * hidden)
