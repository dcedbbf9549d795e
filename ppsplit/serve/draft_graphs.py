"""Serving: the drafter's steps captured as CUDA graphs, replayed whenever a step fits a bucket.

Eager, a draft step of an 8B-shaped DFlash drafter launched about 600 kernels one by one: about 10 ms of host time
for 3.6 ms of kernels on an H100. Captured, each part is one launch:

- writing the step's context rows into the drafter's paged cache: one graph per token bucket (the stages' buckets,
  so every step of the engine fits one);
- the drawing requests' blocks: two graphs per count of requests (powers of two up to the cache's slots). For a
  greedy step the head and the picks are captured with the block (DSpark's Markov and confidence heads, DFlash2's
  selector included), so the drafts come out of one replay; eager, the fifteen argmax launches over a 128k
  vocabulary took 0.5 ms of a 3.4 ms draft step at batch 1 (an H100 profile, ``bench/dflash_gpu.py --profile 1``).
  For a step with sampling requests the graph ends at the last layer's rows and the sampling picks run eager (they
  read the requests' parameters).

A chain drafter (EAGLE-3, MTP) is captured as one step over the drawing requests' rows, per count of requests,
replayed for each of its ``K - 1`` chained steps (its first step, over every row of the target's step, and the picks
between steps stay eager).

Steps are padded as the stages' are: a padding row has sequence slot -1, which writes no cache entry and reads none.
The static inputs are one buffer per field at the largest bucket, each graph capturing a prefix of it.
"""
from __future__ import annotations

import logging
import time

import torch

from ppsplit.core.graphs import capture
from ppsplit.core.ragged import RaggedStep
from ppsplit.core.tensors import model_dtype
from ppsplit.serve.runner import buckets_up_to

log = logging.getLogger("ppsplit")


class _StaticStep:
    """A ragged step's metadata in static buffers of ``rows`` rows over the cache of ``layout``: each graph captures
    a prefix (``step(n)``); ``fill`` writes a step of ``n`` rows into it, the rest of ``padded`` rows padding.
    ``spans``: the graph reads the sequences' spans (``seq_start`` / ``seq_count``: attention), so ``fill`` copies
    them (a context write reads only positions, sequences and blocks)."""

    def __init__(self, rows: int, layout, device, spans: bool = True):
        self.spans = spans
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.seq = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.table = torch.zeros(layout.slots, layout.blocks_per_seq, dtype=torch.long, device=device)
        self.seq_start = torch.zeros(layout.slots, dtype=torch.long, device=device)
        self.seq_count = torch.zeros(layout.slots, dtype=torch.long, device=device)

    def step(self, n: int) -> RaggedStep:
        return RaggedStep(self.positions[:n], self.seq[:n], self.table, self.seq_start, self.seq_count)

    def fill(self, step: RaggedStep, n: int, padded: int) -> None:
        self.positions[:n].copy_(step.positions)
        self.seq[:n].copy_(step.seq)
        self.seq[n:padded].fill_(-1)
        self.table.copy_(step.block_table)
        if self.spans:
            self.seq_start.copy_(step.seq_start)
            self.seq_count.copy_(step.seq_count)


def _bucket(buckets, n: int) -> int | None:
    """The smallest of ``buckets`` (ascending) that holds ``n``."""
    return next((b for b in buckets if b >= n), None)


class BlockGraphs:
    """``drafter``'s ``write_context`` captured per token count in ``token_buckets`` and ``draft_block`` per count of
    requests (``buckets_up_to``) of ``width`` rows each, over ``plan``'s aux layout and the drafter's cache of
    ``layout``. ``capture_fn``: ``ppsplit.core.graphs.capture`` (tests pass an eager stand-in)."""

    def __init__(self, drafter, width: int, plan, layout, token_buckets, *, capture_fn=capture):
        dev = drafter.fc.weight.device
        self.drafter, self.width = drafter, width
        n, d = max(token_buckets), layout.slots
        self.aux = torch.zeros(plan.n_slots, n, plan.hidden_size, dtype=model_dtype(plan), device=dev)
        self.context_step = _StaticStep(n, layout, dev, spans=False)
        self.tokens = torch.zeros(d * width, dtype=torch.long, device=dev)
        self.block_step = _StaticStep(d * width, layout, dev)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        self.context = {t: capture_fn(lambda t=t: drafter.write_context(self.aux[:, :t], self.context_step.step(t)),
                                      dev, pool=pool)[0] for t in sorted(token_buckets)}
        self.blocks = {r: capture_fn(lambda r=r: drafter.draft_block(self.tokens[:r * width],
                                                                     self.block_step.step(r * width), width),
                                     dev, pool=pool)
                       for r in buckets_up_to(d)}
        self.greedy = {r: capture_fn(lambda r=r: self._greedy(r), dev, pool=pool) for r in buckets_up_to(d)}
        log.info("captured the block drafter for %d token buckets and %d request buckets in %.1fs",
                 len(self.context), len(self.blocks), time.perf_counter() - start)

    def _greedy(self, r: int):
        """The greedy drafts of ``r`` requests' blocks from the static buffers: ``drafts [r, K]``, with DSpark's
        confidence logits ``[r, K]`` as a pair."""
        drafter, n = self.drafter, r * self.width
        rows = drafter.draft_block(self.tokens[:n], self.block_step.step(n), self.width)
        drafts, confidence = drafter.block_drafts(rows.view(r, self.width, -1)[:, drafter.first_draft_row:],
                                                  self.tokens[:n:self.width])
        return drafts if confidence is None else (drafts, confidence)

    def write_context(self, aux: torch.Tensor, step: RaggedStep) -> None:
        """``drafter.write_context(aux, step)``, replayed when the step's token count is a bucket."""
        t = aux.shape[1]
        graph = self.context.get(t)
        if graph is None:
            return self.drafter.write_context(aux, step)
        self.aux[:, :t].copy_(aux)
        self.context_step.fill(step, t, t)
        graph.replay()

    def draft_block(self, tokens: torch.Tensor, step: RaggedStep, width: int) -> torch.Tensor:
        """``drafter.draft_block(tokens, step, width)`` for ``tokens [D * width]`` (``width`` the captured one),
        replayed in the smallest request bucket that holds ``D`` (the padding rows write and read nothing)."""
        rows = tokens.shape[0]
        bucket = _bucket(self.blocks, rows // self.width)
        if bucket is None:
            return self.drafter.draft_block(tokens, step, width)
        graph, out = self.blocks[bucket]
        self.tokens[:rows].copy_(tokens)
        self.block_step.fill(step, rows, bucket * self.width)
        graph.replay()
        return out[:rows]

    def greedy_drafts(self, tokens: torch.Tensor, step: RaggedStep, width: int):
        """``drafter.block_drafts`` of the blocks ``tokens [D * width]`` at ``step`` with argmax picks: ``(drafts
        [D, K], confidence logits [D, K] or None)``, replayed in the smallest request bucket that holds ``D``."""
        d = tokens.shape[0] // self.width
        bucket = _bucket(self.greedy, d)
        if bucket is None:
            rows = self.draft_block(tokens, step, width).view(d, width, -1)[:, self.drafter.first_draft_row:]
            return self.drafter.block_drafts(rows, tokens[::width])
        graph, out = self.greedy[bucket]
        self.tokens[:tokens.shape[0]].copy_(tokens)
        self.block_step.fill(step, tokens.shape[0], bucket * self.width)
        graph.replay()
        drafts, confidence = out if isinstance(out, tuple) else (out, None)
        return drafts[:d], None if confidence is None else confidence[:d]


class ChainGraphs:
    """One chained step of ``drafter`` (``drafter(hidden [1, D, H], tokens [1, D], step) -> (logits, hidden)``)
    captured per count of requests (``buckets_up_to`` of the cache's slots); ``__call__`` takes the same arguments
    and replays the smallest bucket that holds ``D`` (the padding rows write and read nothing)."""

    def __init__(self, drafter, layout, *, capture_fn=capture):
        table = drafter.embed_tokens
        dev, d = table.device, layout.slots
        self.drafter = drafter
        self.hidden = torch.zeros(d, drafter.hidden_size, dtype=table.dtype, device=dev)
        self.tokens = torch.zeros(d, dtype=torch.long, device=dev)
        self.static = _StaticStep(d, layout, dev)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        self.steps = {r: capture_fn(lambda r=r: drafter(self.hidden[None, :r], self.tokens[None, :r],
                                                        self.static.step(r)), dev, pool=pool)
                      for r in buckets_up_to(d)}
        log.info("captured the chain drafter for %d request buckets in %.1fs", len(self.steps),
                 time.perf_counter() - start)

    def __call__(self, hidden: torch.Tensor, tokens: torch.Tensor, step: RaggedStep):
        d = tokens.shape[1]
        bucket = _bucket(self.steps, d)
        if bucket is None:
            return self.drafter(hidden, tokens, step)
        graph, (logits, out) = self.steps[bucket]
        self.hidden[:d].copy_(hidden[0])
        self.tokens[:d].copy_(tokens[0])
        self.static.fill(step, d, bucket)
        graph.replay()
        return logits[:, :d], out[:, :d]
