"""Placements of a value across the ranks of a TP group, and how reshapes move them.

- ``REPLICATED``: every rank holds the whole value.
- ``PARTIAL``: every rank holds an addend; the value is their sum (a row-parallel projection's output), until an
  all-reduce makes it replicated.
- ``Split(dim, parts, segments)``: dim ``dim`` is made of ``segments`` (global sizes), each cut into ``parts``
  pieces; rank ``r`` holds piece ``r * parts // tp`` of each (``ppsplit.core.shards.Shard`` cuts tensors the same
  way).

``Unplaceable`` says why a node cannot take its inputs' placements, and what would let it (``Fix``): fewer parts
(heads fewer than the ranks: replicate them), finer segments (a split of the sharded dim at other points), or no
sharding of the weights the input came from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


class _Mark:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


REPLICATED = _Mark("R")
PARTIAL = _Mark("P")


@dataclass(frozen=True)
class Split:
    """``repeat``: the dim holds ``repeat`` blocks, each made of ``segments`` (a reshape merged the dims before the
    split one into it: ``[T, H, d] -> [T * H, d]`` split by heads has ``repeat = T``)."""

    dim: int
    parts: int
    segments: tuple[int, ...]
    repeat: int = 1

    @property
    def size(self) -> int:
        return sum(self.segments)

    def moved(self, dim: int, scale: tuple[int, int] = (1, 1)) -> "Split":
        """The same pieces on dim ``dim``, segment sizes times ``scale[0] / scale[1]``."""
        return Split(dim, self.parts, tuple(s * scale[0] // scale[1] for s in self.segments), self.repeat)


@dataclass(frozen=True)
class Fix:
    """What would let an unplaceable node be placed: ``kind`` ``"parts"`` (cut the origins' output in ``value``
    pieces), ``"segments"`` (cut each of ``value``'s segments separately), ``"replicate"`` (do not shard them)."""

    kind: str
    value: object = None


class Unplaceable(Exception):
    def __init__(self, reason: str, fix: Fix | None = None, origins: frozenset = frozenset()):
        super().__init__(reason)
        self.reason, self.fix, self.origins = reason, fix or Fix("replicate"), origins


def prod(xs) -> int:
    return math.prod(xs)


def view_split(ins: tuple, outs: tuple, sp: Split) -> Split:
    """Where a reshape of ``ins`` into ``outs`` takes the pieces of ``sp``. The input, flattened, is ``[A, S, U]``:
    ``S`` the split elements (with ``A`` everything before, its repeats included, and ``U`` the unit after). The
    output dim that takes them has units of ``U * m`` elements (``m`` dividing every segment: the heads of a
    ``heads * head_dim`` dim) or ``U / k`` (a head's elements merged into the dim), after ``a`` repeats, the dims
    before it holding ``A / a``."""
    d = sp.dim
    unit = prod(ins[d + 1:])
    size = sp.size
    before = prod(ins[:d]) * sp.repeat
    near, found = None, []
    for e in range(len(outs)):
        after = prod(outs[e + 1:])
        if after >= unit:  # the dims after merge into bigger units: m split elements each
            m = after // unit
            if after % unit or any(s % m for s in sp.segments):
                continue
            segments = tuple(s // m for s in sp.segments)
        else:  # the unit is cut into k smaller ones
            if unit % after:
                continue
            segments = tuple(s * (unit // after) for s in sp.segments)
        new = sum(segments)
        if outs[e] % new or outs[e] == 1 and new != 1 or prod(outs[:e]) * (outs[e] // new) != before:
            continue
        a = outs[e] // new
        if all(s % sp.parts == 0 for s in segments):
            found.append((a, e, Split(e, sp.parts, segments, a)))
        elif a == 1:
            near = near or (e, new)
    if found:
        return min(found, key=lambda f: f[:2])[2]  # the split dim kept whole where it can be
    if near is not None:
        heads = near[1]
        if len(sp.segments) == 1 and sp.parts % heads == 0:
            raise Unplaceable(f"its {heads} heads are fewer than the {sp.parts} pieces", Fix("parts", heads))
        raise Unplaceable(f"dim {near[0]} of size {heads} does not cut into {sp.parts} pieces", Fix("heads", heads))
    raise Unplaceable(f"the reshape {list(ins)} -> {list(outs)} mixes the sharded dim {d} with another")


def refine(segments: tuple[int, ...], cuts: list[int]) -> tuple[int, ...]:
    """``segments`` cut also at the offsets ``cuts`` (global positions along the dim)."""
    bounds = {0}
    at = 0
    for s in segments:
        at += s
        bounds.add(at)
    bounds |= {c for c in cuts if 0 < c < at}
    ordered = sorted(bounds)
    return tuple(b - a for a, b in zip(ordered, ordered[1:]))


def split_pieces(sp: Split, sizes: list[int]) -> list[Split] | None:
    """The placements of ``sizes``-long consecutive pieces of a value split by ``sp`` along its split dim, when
    every cut falls on a segment boundary (else ``None``)."""
    out, at, segs = [], 0, list(sp.segments)
    for size in sizes:
        took, total = [], 0
        while segs and total < size:
            total += segs[0]
            took.append(segs.pop(0))
        if total != size:
            return None
        out.append(Split(sp.dim, sp.parts, tuple(took)))
        at += size
    return out
