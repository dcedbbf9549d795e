"""The DFlash2 drafter on the last stage (z-lab's ``DFlash2DraftModel``, speculators' ``dflash2``): DFlash's block
backbone with a grouped dynamic causal convolution around each draft layer's attention and MLP
(``ppsplit.eagle3.dflash.GroupedCausalConv``), then a candidate selector that reranks the head's top-k left to
right (the library's ``CandidateSelector.select``, ``DFlash2DraftModel.propose``). For draft ``i`` with ``h_i`` its
row after the last layer and ``norm``, and ``prev_i`` the token before it (the bonus token, then draft ``i - 1``)::

    logits_i             = lm_head(h_i)                          (output_multiplier, soft-cap as DFlash)
    unary, candidates    = top-k of logits_i                     (selector_top_k)
    score_c              = unary_c + <pred[prev_i] * (W h_i), succ[c]>     for each candidate c
    draft_i              = the best-scoring candidate (greedy), or drawn from the scores' distribution

Outside the candidates a draft's distribution is 0 (the scores are its logits there, -inf elsewhere), which is what
the rejection rule is given.
"""
from __future__ import annotations

import torch
from torch import nn

from ppsplit.eagle3.dflash import DFlashDrafter


class _CandidateSelector(nn.Module):
    """speculators' ``CandidateSelector`` (the same tensor names; z-lab's codebooks carry ``.weight``)."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)


class DFlash2Drafter(DFlashDrafter):
    """A DFlash2 drafter (see the module docstring), built by ``ppsplit.load_drafter``."""

    family = "dflash2"
    architecture = "DFlash2DraftModel"

    def __init__(self, cfg: dict, taps: tuple[int, ...], slots: tuple[int, ...], n_slots: int | None = None):
        super().__init__(cfg, taps, slots, n_slots)
        self.candidate_selector = _CandidateSelector(cfg["vocab_size"], cfg["hidden_size"], cfg["selector_rank"],
                                                     cfg["selector_top_k"])

    def layout_keys(self) -> dict:
        return {key: self.cfg[key] for key in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                               "selector_top_k")}

    def heads(self, rows: torch.Tensor, prev: torch.Tensor, pick):
        """The drafting rows ``rows [D, K, H]`` through the selector, left to right: ``prev [D]`` the token before the
        first draft, ``pick(logits [D, V], i)`` chooses draft ``i`` from its logits (the candidates' scores, -inf
        elsewhere). Returns ``(drafts [D, K], logits [D, K, V], None)`` (no confidence)."""
        selector = self.candidate_selector
        unary, candidates = self.logits(rows).topk(selector.top_k, dim=-1)
        context = selector.hidden_projection(self.norm(rows))
        token, drafts, out = prev, [], []
        for i in range(rows.shape[1]):
            pair = selector.predecessor_codebook[token] * context[:, i]
            scores = unary[:, i] + (pair[:, None] * selector.successor_codebook[candidates[:, i]]).sum(-1)
            logits = torch.full((rows.shape[0], self.d2t.shape[0]), float("-inf"), dtype=scores.dtype,
                                device=scores.device).scatter(1, candidates[:, i], scores)
            token = pick(logits, i)
            drafts.append(token)
            out.append(logits)
        return torch.stack(drafts, 1), torch.stack(out, 1), None
