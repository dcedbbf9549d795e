"""Serving: one step's inputs as named int64 arrays in one buffer, built on the host with numpy.

The buffer crosses to the device in one copy (and between ranks in one message); on the device each field is a view
of it. Fields by what they index (``N`` tokens, ``S`` sequence slots, ``M`` blocks per slot, ``R`` requests of the
step in plan order, ``D`` of them drawing a token)::

    tokens [N]        ids fed (0 where the id comes from the device: a window of a request whose last step is
                      still in flight)
    positions [N]     each token's position (its offset in the window where it comes from the device)
    seq [N]           the token's sequence slot, -1 for padding
    fed [N]           the offset of the token in its slot's device window, -1 for ids given here
    follow [N]        the row of the token that follows this one in its sequence, -1 at a segment's end
    follow_token [N]  at a segment's end that does not draw, the prompt token that follows (else 0)
    block_table [S*M] seq_start [S] seq_count [S]             the ragged step (``ppsplit.core.ragged``)
    chain_start [S] chain_count [S]                           the drafter's steps: one row per drawing request
    slot [R] start [R] count [R] num_drafts [R] draws [R]     per request: its rows, drafts in its window, draws?
    drawing [D]       the requests that draw, as indices into the R
"""
from __future__ import annotations

import numpy as np
import torch

from ppsplit.core.ragged import RaggedStep

TOKEN_FIELDS = ("tokens", "positions", "seq", "fed", "follow", "follow_token")
SLOT_FIELDS = ("seq_start", "seq_count", "chain_start", "chain_count")
ROW_FIELDS = ("slot", "start", "count", "num_drafts", "draws")


def field_sizes(n: int, rows: int, drawing: int, slots: int, blocks: int) -> list[tuple[str, int]]:
    """The buffer's fields in order, with their lengths."""
    return ([(f, n) for f in TOKEN_FIELDS] + [("block_table", slots * blocks)] + [(f, slots) for f in SLOT_FIELDS]
            + [(f, rows) for f in ROW_FIELDS] + [("drawing", drawing)])


class StepBatch:
    """A step's named int64 fields in one buffer (``buffer``), and their views on a device (``fields``)."""

    def __init__(self, buffer, n: int, rows: int, drawing: int, slots: int, blocks: int):
        self.buffer, self.n, self.num_rows, self.num_drawing = buffer, n, rows, drawing
        self.slots, self.blocks = slots, blocks
        self.fields: dict[str, torch.Tensor] = {}
        at = 0
        tensor = buffer if isinstance(buffer, torch.Tensor) else torch.from_numpy(buffer)
        for name, size in field_sizes(n, rows, drawing, slots, blocks):
            self.fields[name] = tensor[at:at + size]
            at += size
        self.fields["block_table"] = self.fields["block_table"].view(slots, blocks)

    @classmethod
    def pack(cls, arrays: dict[str, np.ndarray], slots: int, blocks: int) -> "StepBatch":
        n, rows, drawing = len(arrays["tokens"]), len(arrays["slot"]), len(arrays["drawing"])
        sizes = field_sizes(n, rows, drawing, slots, blocks)
        return cls(np.concatenate([np.asarray(arrays[name], dtype=np.int64).reshape(-1) for name, _ in sizes]),
                   n, rows, drawing, slots, blocks)

    @classmethod
    def size(cls, n: int, rows: int, drawing: int, slots: int, blocks: int) -> int:
        return sum(size for _, size in field_sizes(n, rows, drawing, slots, blocks))

    def to(self, device, non_blocking: bool = False) -> "StepBatch":
        tensor = self.buffer if isinstance(self.buffer, torch.Tensor) else torch.from_numpy(self.buffer)
        if tensor.device != torch.device(device):
            if non_blocking and torch.device(device).type == "cuda" and tensor.device.type == "cpu":
                tensor = tensor.pin_memory()  # an async copy needs pinned memory, else it waits for the device
            tensor = tensor.to(device, non_blocking=non_blocking)
        return StepBatch(tensor, self.n, self.num_rows, self.num_drawing, self.slots, self.blocks)

    def __getattr__(self, name: str) -> torch.Tensor:
        fields = self.__dict__.get("fields", {})
        if name in fields:
            return fields[name]
        raise AttributeError(name)

    def step(self, positions: torch.Tensor | None = None) -> RaggedStep:
        """The ragged step the stages run (``positions``: when the device filled in some of them)."""
        f = self.fields
        return RaggedStep(f["positions"] if positions is None else positions, f["seq"], f["block_table"],
                          f["seq_start"], f["seq_count"])
