"""Serving: speculative decoding's draft loop, on the last stage, for every request of a step at once.

Each step the drafter is fed every row the stages just ran (the taps of position ``i`` and the token at ``i + 1``; a
row whose next token is not known yet is stale, and is overwritten later at the same position), then, for each
request that drew, drafts a chain of ``K`` tokens from the row of its last committed token: ``K - 1`` more drafter
steps of one row per request, positions and tokens on the device, no host read between them. Drafts are the
drafter's argmax for a greedy request; a sampling request draws them from its filtered draft distribution (kept, so
the next verify's rejection rule can use it: ``ppsplit.serve.sampling.accept_sampled``).

The drafter keeps its own paged cache over the target's block tables (its positions are the target's), so rejected
drafts are overwritten by the next window at the same positions; nothing is rolled back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ppsplit.core.errors import ConfigError
from ppsplit.core.ragged import RaggedStep
from ppsplit.serve.sampling import GREEDY_BELOW, SALT_DRAFT, draw, filter_batch, uniform


@dataclass
class SpeculativeStats:
    """What a speculative ``SplitModel.generate`` did for its first sequence: ``draft_tokens[s]`` the ``K`` drafts of
    verify pass ``s``, ``accepted[s]`` how many of them were accepted (``committed`` is the same list: each sequence
    commits its own), ``verify_passes`` the ``K + 1``-token passes through the stages."""

    num_draft_tokens: int
    draft_tokens: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    committed: list = field(default_factory=list)
    verify_passes: int = 0

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verify pass by the first sequence: ``1 + mean(accepted)``."""
        return 1.0 + sum(self.accepted) / max(1, len(self.accepted))


def check_num_draft_tokens(k) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"num_draft_tokens must be an integer >= 1, but got {k!r}")


def check_speculation(plan, k, drafter=None) -> None:
    """What speculative decoding needs, checked in one place: ``k >= 1`` drafts, a drafter that reads taps the split
    carries, and a verify pass of ``k + 1`` tokens that fits the recurrent layers' ring of states (or rejected
    drafts could not be taken back)."""
    check_num_draft_tokens(k)
    if drafter is not None and (not drafter.taps or any(t not in plan.taps for t in drafter.taps)):
        raise ConfigError(f"the drafter reads taps {list(drafter.taps)} but the split carries {list(plan.taps)}; "
                          "compile or split the target with the drafter's taps (ppsplit compile MODEL --drafter "
                          "DRAFTER, or load_drafter(path, split=split))")
    if plan.state_slots and k + 1 > plan.state_slots:
        raise ConfigError(f"num_draft_tokens={k} needs {k + 1} states per recurrent layer, but its cache keeps "
                          f"{plan.state_slots}; use num_draft_tokens <= {plan.state_slots - 1}")


class Proposer:
    """The ``drafter``'s loop proposing ``k`` drafts per drawing request (see the module docstring), over a paged
    cache of ``layout`` (the target's ``CacheLayout``): an EAGLE-3 chain of ``k`` steps, or one DFlash block."""

    def __init__(self, drafter, k: int, layout):
        check_num_draft_tokens(k)
        self.block = getattr(drafter, "family", None) in ("dflash", "dspark", "dflash2")
        if self.block and k > drafter.max_drafts:
            raise ConfigError(f"num_draft_tokens={k} exceeds what one block of the {drafter.family} drafter proposes "
                              f"({drafter.max_drafts}: block_size {drafter.block_size}, drafting from block row "
                              f"{drafter.first_draft_row}); use num_draft_tokens <= {drafter.max_drafts}")
        self.drafter, self.k = drafter, k
        # Positions past a window's end the drafter writes: a chain's last draft, or a block's last row.
        self.lookahead = k + drafter.first_draft_row if self.block else k
        self.kept = None  # [D]: the drafts of the last proposal each drawing request verifies (DSpark), None: all K
        drafter.allocate_paged(layout)
        self.layout, self.slots = layout, layout.slots
        self.graphs = None  # the drafter's CUDA graphs (``capture``)
        self.q = None  # [S, K, draft vocab]: each slot's draft distributions, once a request samples

    def capture(self, plan, token_buckets) -> None:
        """Capture the drafter as CUDA graphs (``ppsplit.serve.draft_graphs``): a block drafter's parts for
        ``token_buckets`` (the stages' buckets) and every count of drawing requests; a chain drafter's chained step
        for every count of drawing requests (with ``K`` = 1 there is none)."""
        from ppsplit.serve.draft_graphs import BlockGraphs, ChainGraphs

        with torch.no_grad():
            if self.block:
                self.graphs = BlockGraphs(self.drafter, self.k + self.drafter.first_draft_row, plan, self.layout,
                                          token_buckets)
            elif self.k > 1:
                self.graphs = ChainGraphs(self.drafter, self.layout)

    @torch.no_grad()
    def feed(self, aux, ids, positions, batch, last, token, sampler, sampled: bool, cut_k: bool = False,
             cut_p: bool = False):
        """Feed the step's rows; with ``last`` (the row of each drawing request's last committed token) and
        ``token`` (that token), draft ``[D, K]`` target-vocabulary ids for the drawing requests."""
        drafter = self.drafter
        if self.block:
            return self._feed_block(aux, positions, batch, last, token, sampler, sampled, cut_k, cut_p)
        follow = batch.follow
        nxt = torch.where(follow >= 0, ids[follow.clamp_min(0)], batch.follow_token)
        if last is not None:
            nxt = nxt.index_put((last,), token)
        logits, hidden = drafter(aux[:, None], nxt[None], batch.step(positions))
        if last is None:
            return None
        logits, hidden, position = logits[0, last], hidden[0, last], positions[last]
        slot = batch.slot[batch.drawing]
        params = self._params(slot, sampler, sampled, logits.device)
        drafts = []
        for j in range(self.k):
            drafts.append(self._pick(logits, j, slot, params, cut_k, cut_p))
            if j == self.k - 1:
                break
            step = RaggedStep(position + j + 1, slot, batch.block_table, batch.chain_start, batch.chain_count)
            logits, hidden = (self.graphs or drafter)(hidden[None], drafts[-1][None], step)
            logits, hidden = logits[0], hidden[0]
        return torch.stack(drafts, 1)

    def _feed_block(self, aux, positions, batch, last, token, sampler, sampled: bool, cut_k: bool, cut_p: bool):
        """DFlash / DSpark: write every row's context, then one forward over each drawing request's block ``[token,
        mask, ...]`` at the positions after its last committed token; the K drafts are the block's rows 1 .. K
        (DSpark's anchor layout: 0 .. K - 1, through its heads, which also set ``kept``)."""
        drafter, k = self.drafter, self.k
        run = self.graphs or drafter
        run.write_context(aux, batch.step(positions))
        if last is None:
            return None
        slot = batch.slot[batch.drawing]
        skip = drafter.first_draft_row  # 1: the bonus token's row drafts nothing; 0: DSpark's anchor row drafts
        width = k + skip
        j = torch.arange(width, device=slot.device)
        tokens = torch.where(j == 0, token[:, None], drafter.mask_token_id).reshape(-1)
        start = positions[last] + 1
        step = RaggedStep((start[:, None] + j).reshape(-1), slot[:, None].expand(-1, width).reshape(-1),
                          batch.block_table, batch.chain_start * width, batch.chain_count * width)
        params = self._params(slot, sampler, sampled, token.device)
        if params is None and self.graphs is not None:  # greedy: the picks are captured with the block
            drafts, confidence = self.graphs.greedy_drafts(tokens, step, width)
        else:
            rows = run.draft_block(tokens, step, width).view(slot.shape[0], width, -1)[:, skip:]
            pick = None if params is None else lambda x, i: self._pick(x, i, slot, params, cut_k, cut_p)
            drafts, confidence = drafter.block_drafts(rows, token, pick)
        self.kept = drafter.kept(confidence) if confidence is not None else None
        return drafts

    def _params(self, slot, sampler, sampled: bool, device):
        """The drawing requests' sampling parameters (``None`` for a greedy step)."""
        if not sampled:
            return None
        if self.q is None:
            self.q = torch.zeros(self.slots, self.k, self.drafter.d2t.shape[0], device=device)
        return (sampler.temperature[slot], sampler.top_k[slot], sampler.top_p[slot], sampler.seed[slot],
                sampler.index[slot])

    def _pick(self, logits, j: int, slot, params, cut_k: bool, cut_p: bool) -> torch.Tensor:
        """Draft ``j`` of each drawing request (target-vocabulary ids)."""
        target_ids = self.drafter.target_ids
        greedy = target_ids[logits.argmax(-1)]
        if params is None:
            return greedy
        temperature, top_k, top_p, seed, index = params
        probs = filter_batch(logits[:, None], temperature, top_k, top_p, cut_k=cut_k, cut_p=cut_p)[:, 0]
        self.q[slot, j] = probs
        sampled = target_ids[draw(probs, uniform(seed, index + j, SALT_DRAFT))]
        return torch.where(temperature < GREEDY_BELOW, greedy, sampled)

    def target_probs(self, slot: torch.Tensor, vocab: int) -> torch.Tensor:
        """The draft distributions of ``slot``'s current drafts over the target vocabulary ``[D, K, vocab]``."""
        q = self.q[slot] if self.q is not None else torch.zeros(len(slot), self.k, self.drafter.d2t.shape[0],
                                                                 device=slot.device)
        full = q.new_zeros(q.shape[0], self.k, vocab)
        return full.index_copy_(2, self.drafter.target_ids, q)  # d2t is one-to-one
