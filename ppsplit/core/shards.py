"""Core: how a tensor-parallel rank holds one tensor of a stage (``Shard``), pure data, and the one function that
cuts a tensor by it (``take``). The TP pass (``ppsplit.passes.tp``) decides the shards; ``split_model`` and
``ppsplit compile`` (streaming from the checkpoint) both cut with ``take``, so the two cannot disagree.

Every rank of a TP group runs the same stage program; only the tensors differ.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TP_GROUP = "ppsplit_tp"  # the process group name the stage programs' collectives use (registered by the runtime)
KINDS = ("split", "first", "start")


@dataclass(frozen=True)
class Shard:
    """What rank ``r`` of ``tp`` holds of a tensor.

    ``split``: dim ``dim`` is made of ``segments`` (their sizes along it, in order), each cut into ``parts`` equal
    pieces; rank ``r`` holds piece ``r * parts // tp`` of every segment, concatenated. ``parts < tp``: a piece is held
    by ``tp / parts`` ranks (KV heads replicated when tp exceeds them). ``first``: rank 0 holds the tensor, the others
    zeros (a row-parallel projection's bias, added once by the all-reduce). ``start``: a generated ``int64 [1]``, the
    first row of the piece of a vocabulary of ``segments[0]`` rows cut into ``parts`` (vocab-parallel embedding).

    Example::

        Shard(0, 2, (1024, 1024)).take(gate_up, rank=1, tp=2)   # rows 512:1024 and 1536:2048
    """

    dim: int
    parts: int
    segments: tuple[int, ...]
    kind: str = "split"

    def __post_init__(self):
        if self.kind not in KINDS or self.parts < 1 or any(s % self.parts for s in self.segments):
            raise ValueError(f"bad shard {self}: kind one of {KINDS}, every segment divisible by parts")

    def piece(self, rank: int, tp: int) -> int:
        return rank * self.parts // tp

    def local_shape(self, shape) -> tuple[int, ...]:
        """The shape a rank holds of a tensor of ``shape``."""
        shape = tuple(shape)
        if self.kind == "first":
            return shape
        if self.kind == "start":
            return (1,)
        return shape[:self.dim] + (shape[self.dim] // self.parts,) + shape[self.dim + 1:]

    def ranges(self, rank: int, tp: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` ranges along ``dim`` that rank ``rank`` holds, in order."""
        out, base, piece = [], 0, self.piece(rank, tp)
        for size in self.segments:
            step = size // self.parts
            out.append((base + piece * step, base + (piece + 1) * step))
            base += size
        return out

    def take(self, tensor: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """Rank ``rank``'s part of ``tensor`` (a new contiguous tensor; ``tensor`` may be a safetensors slice)."""
        if self.kind == "start":
            return torch.tensor([self.piece(rank, tp) * (self.segments[0] // self.parts)], dtype=torch.long)
        if self.kind == "first":
            t = tensor[...] if not isinstance(tensor, torch.Tensor) else tensor
            return t.clone() if rank == 0 else torch.zeros_like(t)
        pieces = [_narrow(tensor, self.dim, a, b) for a, b in self.ranges(rank, tp)]
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.dim)).contiguous()

    def describe(self) -> str:
        if self.kind != "split":
            return self.kind
        segs = "" if len(self.segments) == 1 else f" in {len(self.segments)} segments"
        return f"dim {self.dim} / {self.parts}{segs}"


def _narrow(tensor, dim: int, start: int, end: int) -> torch.Tensor:
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(dim, start, end - start)
    index = (slice(None),) * dim + (slice(start, end),)  # a safetensors slice: reads only these rows
    return tensor[index]
