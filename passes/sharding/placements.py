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
    dim: int
    parts: int
    segments: tuple[int, ...]

    @property
    def size(self) -> int:
        return sum(self.segments)

    def moved(self, dim: int, scale: tuple[int, int] = (1, 1)) -> "Split":
        """The same pieces on dim ``dim``, segment sizes times ``scale[0] / scale[1]``."""
        return Split(dim, self.parts, tuple(s * scale[0] // scale[1] for s in self.segments))


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
    """Where a reshape of ``ins`` into ``outs`` takes the pieces of ``sp``: the output dim that holds exactly the
    elements of input dims ``sp.dim:`` behind the same leading elements (so each rank's piece stays one block)."""
    d = sp.dim
    outer, inner = prod(ins[:d]), prod(ins[d:])
    unit = inner // ins[d]  # elements per index of the sharded dim
    near = None
    for e in range(len(outs)):
        if prod(outs[:e]) != outer or prod(outs[e:]) != inner or outs[e] == 1 and inner != 1:
            continue
        out_unit = prod(outs[e + 1:])
        if outs[e] % sp.parts == 0 and all((s * unit) % (out_unit * sp.parts) == 0 for s in sp.segments):
            return sp.moved(e, (unit, out_unit))
        near = near or (e, outs[e])
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
