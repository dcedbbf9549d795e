"""Core: one ragged step's metadata, built on the host and checked before any kernel runs.

A step holds ``N`` tokens of many sequences: a prefill chunk, a decode token or a verify window per sequence,
each sequence's tokens contiguous and at consecutive positions, padding tokens (if any) at the end. Besides the
tokens (``x``) and the aux buffer, every stage takes, in this order (``STEP_INPUTS``)::

    positions    [N]      each token's position in its sequence
    seq          [N]      each token's sequence slot, -1 for padding (writes nowhere, reads nothing)
    block_table  [S, M]   the blocks each sequence slot owns (block j holds positions j*bs .. j*bs + bs - 1)
    seq_start    [S]      where slot s's tokens start among the N
    seq_count    [S]      how many tokens of slot s the step holds (0: none)

``S`` is the cache's sequence slots, ``M`` its blocks per slot. Which blocks a sequence owns is the caller's
choice (an engine's block manager); the stages never allocate.

Example::

    layout = CacheLayout.of(split.plan)
    step = RaggedStep.build([Segment(slot=0, position=0, count=7), Segment(slot=1, position=30, count=1)],
                            block_tables={0: [3, 9], 1: [0, 1, 2]}, layout=layout, pad_to=16)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ppsplit.core.errors import ConfigError

STEP_INPUTS = ("positions", "seq", "block_table", "seq_start", "seq_count")


@dataclass(frozen=True)
class CacheLayout:
    """The paged cache's shape: ``slots`` sequences, ``blocks_per_seq`` blocks each in the table, ``block_size``
    positions per block, ``num_blocks`` blocks in each layer's pool."""

    slots: int
    blocks_per_seq: int
    block_size: int
    num_blocks: int

    @classmethod
    def of(cls, plan) -> "CacheLayout":
        if not plan.paged:
            raise ConfigError("this split has no paged cache: split with cache=CacheConfig(batch_size, max_len) (or "
                              "compile with a cache) to run ragged steps")
        return cls(plan.max_batch, plan.blocks_per_seq, plan.block_size, plan.num_blocks)

    @property
    def max_len(self) -> int:
        return self.blocks_per_seq * self.block_size


@dataclass(frozen=True)
class Segment:
    """``count`` consecutive tokens of sequence slot ``slot``, the first at ``position``."""

    slot: int
    position: int
    count: int


@dataclass
class RaggedStep:
    """The metadata tensors of one step (``STEP_INPUTS``), all int64, on one device."""

    positions: torch.Tensor
    seq: torch.Tensor
    block_table: torch.Tensor
    seq_start: torch.Tensor
    seq_count: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """In the stages' argument order (``STEP_INPUTS``)."""
        return tuple(getattr(self, name) for name in STEP_INPUTS)

    def to(self, device, non_blocking: bool = False) -> "RaggedStep":
        return RaggedStep(*(t.to(device, non_blocking=non_blocking) for t in self.tensors()))

    @classmethod
    def build(cls, segments, block_tables, layout: CacheLayout, pad_to: int | None = None) -> "RaggedStep":
        """The step of ``segments`` (``Segment``s, in token order) over ``block_tables`` (slot -> its block ids,
        or an ``[S, M]`` tensor with -1 for unassigned blocks), padded to ``pad_to`` tokens. Every check runs here,
        before a tensor exists: a ``ConfigError`` that names the problem, and nothing is written."""
        table = _table(block_tables, layout)
        check_segments(segments, table, layout, pad_to)
        n = sum(s.count for s in segments)
        total = n if pad_to is None else pad_to
        positions = torch.zeros(total, dtype=torch.long)
        seq = torch.full((total,), -1, dtype=torch.long)
        start = torch.zeros(layout.slots, dtype=torch.long)
        count = torch.zeros(layout.slots, dtype=torch.long)
        at = 0
        for s in segments:
            positions[at:at + s.count] = torch.arange(s.position, s.position + s.count)
            seq[at:at + s.count] = s.slot
            start[s.slot], count[s.slot] = at, s.count
            at += s.count
        return cls(positions, seq, table, start, count)

    @classmethod
    def lockstep(cls, batch: int, tokens: int, position: int, layout: CacheLayout) -> "RaggedStep":
        """A lockstep step as a ragged one: row ``b`` of a ``[batch, tokens]`` call is sequence slot ``b``, which
        owns blocks ``b * M .. (b + 1) * M - 1`` (the split's own allocation for lockstep calls)."""
        if batch * layout.blocks_per_seq > layout.num_blocks:
            raise ConfigError(f"a lockstep batch of {batch} sequences needs {batch * layout.blocks_per_seq} blocks of "
                              f"the pool's {layout.num_blocks}; use a smaller batch or a larger CacheConfig.num_blocks")
        tables = {b: list(range(b * layout.blocks_per_seq, (b + 1) * layout.blocks_per_seq)) for b in range(batch)}
        return cls.build([Segment(b, position, tokens) for b in range(batch)], tables, layout)


def _table(block_tables, layout: CacheLayout) -> torch.Tensor:
    if isinstance(block_tables, torch.Tensor):
        if tuple(block_tables.shape) != (layout.slots, layout.blocks_per_seq):
            raise ConfigError(f"the block table must be [{layout.slots}, {layout.blocks_per_seq}] (sequence slots x "
                              f"blocks per slot), but is {list(block_tables.shape)}")
        return block_tables.to("cpu", torch.long)
    table = torch.full((layout.slots, layout.blocks_per_seq), -1, dtype=torch.long)
    for slot, blocks in block_tables.items():
        if not 0 <= slot < layout.slots:
            raise ConfigError(f"sequence slot {slot} does not exist: the cache has slots 0 to {layout.slots - 1}")
        if len(blocks) > layout.blocks_per_seq:
            raise ConfigError(f"slot {slot} is given {len(blocks)} blocks, more than the {layout.blocks_per_seq} a "
                              f"sequence of up to {layout.max_len} positions uses")
        table[slot, :len(blocks)] = torch.tensor(list(blocks), dtype=torch.long)
    return table


def check_segments(segments, table: torch.Tensor, layout: CacheLayout, pad_to: int | None) -> None:
    """The checks of ``RaggedStep.build`` (see there)."""
    n = sum(s.count for s in segments)
    if pad_to is not None and n > pad_to:
        raise ConfigError(f"the step holds {n} tokens, more than its bucket of {pad_to}; split it into smaller steps "
                          "or capture a larger bucket")
    seen, owner = set(), {}
    for s in segments:
        if not 0 <= s.slot < layout.slots:
            raise ConfigError(f"sequence slot {s.slot} does not exist: the cache has slots 0 to {layout.slots - 1}")
        if s.slot in seen:
            raise ConfigError(f"sequence slot {s.slot} appears twice in one step; give each sequence's tokens as one "
                              "contiguous segment")
        seen.add(s.slot)
        if s.count < 1 or s.position < 0:
            raise ConfigError(f"slot {s.slot}: a segment needs at least one token at a position >= 0, but got "
                              f"{s.count} token(s) at {s.position}")
        end = s.position + s.count  # positions 0 .. end - 1 are read or written
        if end > layout.max_len:
            raise ConfigError(f"slot {s.slot}: positions up to {end - 1} do not fit a sequence of the cache "
                              f"({layout.max_len} positions); compile with a larger --max-len")
        blocks = table[s.slot, : -(-end // layout.block_size)].tolist()
        if any(b < 0 for b in blocks):
            raise ConfigError(f"slot {s.slot}: position {end - 1} lies past the blocks its block table assigns "
                              f"({sum(b >= 0 for b in blocks)}); allocate its blocks first")
        for b in blocks:
            if b >= layout.num_blocks:
                raise ConfigError(f"slot {s.slot}: block {b} does not exist; the pool has blocks 0 to "
                                  f"{layout.num_blocks - 1}")
            if owner.setdefault(b, s.slot) != s.slot:
                raise ConfigError(f"block {b} is owned by sequence slots {owner[b]} and {s.slot} in one step; a block "
                                  "belongs to one sequence")
