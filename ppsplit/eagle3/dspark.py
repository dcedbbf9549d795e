"""The DSpark drafter on the last stage (speculators' ``dspark``, DeepSpec's ``Qwen3DSparkModel``): DFlash's block backbone (``ppsplit.eagle3.dflash``),
then two light heads run left to right over the block's rows.

For a request whose bonus token ``b`` sits at position ``P``, the block is ``[b, mask, ...]`` from ``P``; with
``sample_from_anchor`` (DSpark's default) every row drafts (row ``i`` predicts position ``P + i + 1``, so ``K``
drafts take ``K`` rows), without it the bonus row drafts nothing (``K + 1`` rows, as DFlash). For draft ``i``, with
``h_i`` its row after the last layer and ``norm`` and ``prev_i`` the token before it (``b`` for the first, else draft
``i - 1``, as drawn)::

    e_i      = markov_w1[prev_i]                                   (target vocabulary -> rank r)
    bias_i   = markov_w2(e_i)                                      vanilla
               markov_w2(sigmoid(gate_proj([h_i; e_i])) * e_i)     gated
               markov_w2(tanh(o)), s = g * s + (1 - g) * tanh(c),  rnn, [g; c; o] = joint_proj([s; e_i; h_i]),
                                                                   g through a sigmoid, s = 0 before the block
    logits_i = lm_head(h_i) + bias_i                               the draft's distribution (draft vocabulary)
    c_i      = proj([h_i; e_i])  (or proj(h_i))                    confidence logit: will draft i be accepted?

The drafts a request's next verify window carries are the leading ones whose survival ``prod_{j <= i}
sigmoid(c_j)`` reaches ``confidence_threshold`` (vLLM's ``dspark_confidence_threshold``: 0, the default, keeps all
``K``); the count can be 0. ``confidence_rule = "each"`` (the default for DeepSpec's folders, as its evaluator's
``_confident_prefix_length`` trims) keeps instead the leading drafts whose own ``sigmoid(c_i)`` reaches it. Whether draft ``i`` is verified depends only on the drafts before it, which are the
committed tokens when it is reached, so trimming keeps the rejection rule lossless.

DeepSpec's folders (deepseek-ai/DeepSpec ``deepspec/modeling/dspark``) hold the same model under the same tensor
names (its ``VanillaMarkov`` / ``GatedMarkovHead`` / ``RNNHead`` and ``AcceptRatePredictor``), every row drafting,
plus frozen copies of the target's ``embed_tokens`` and ``lm_head``, which are checked and then shared.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppsplit.core.drafter_config import CONFIDENCE_RULES
from ppsplit.core.errors import ConfigError
from ppsplit.eagle3.dflash import DFlashDrafter


class _MarkovHead(nn.Module):
    """speculators' ``MarkovHead`` (the same tensor names)."""

    def __init__(self, vocab: int, draft_vocab: int, rank: int, hidden: int, kind: str):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def bias(self, e: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None):
        """``(bias [D, draft vocab], next state)`` for Markov embeddings ``e [D, r]`` and rows ``h [D, H]``."""
        if self.kind == "vanilla":
            return self.markov_w2(e), state
        if self.kind == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e), state
        state = e.new_zeros(e.shape[0], self.rank) if state is None else state
        gate, cand, out = self.joint_proj(torch.cat([state, e, h], -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), state


class _ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)


def drop_target_copies(tensors: dict, embed: torch.Tensor, head: torch.Tensor) -> dict:
    """``tensors`` without DeepSpec's copies of the target's input embedding and output head (its trainer copies both
    from the target and freezes them), each checked to be the target's ``embed`` / ``head`` at the coarser precision,
    so the drafter shares the target's tables instead of holding second ones."""
    out = dict(tensors)
    for name, table, what in (("embed_tokens.weight", embed, "input embedding"), ("lm_head.weight", head, "lm_head")):
        copy = out.pop(name, None)
        if copy is None:
            raise ConfigError(f"the DeepSpec DSpark drafter lacks {name} (its copy of the target's {what}); this "
                              "folder was not written by DeepSpec's save_pretrained")
        table = table.detach().to(device=copy.device)
        # equal at the coarser of the two precisions (a float32 copy beside a bf16 split, or the other way)
        if tuple(copy.shape) != tuple(table.shape) or not (torch.equal(table.to(copy.dtype), copy)
                                                           or torch.equal(copy.to(table.dtype), table)):
            raise ConfigError(f"the DeepSpec DSpark drafter's {name} {tuple(copy.shape)} is not this target's {what} "
                              f"{tuple(table.shape)} (DeepSpec trains with a frozen copy of it); use a drafter trained "
                              "for this target")
    return out


class DSparkDrafter(DFlashDrafter):
    """A DSpark drafter (see the module docstring), built by ``ppsplit.load_drafter`` from speculators' ``dspark``
    layout or a DeepSpec folder. ``confidence_threshold`` (0 to 1, default 0: no trimming) trims each request's verify
    window to the drafts the confidence head expects to survive.

    Example::

        drafter = ppsplit.load_drafter("path/to/dspark", split=split)
        drafter.confidence_threshold = 0.3
        Engine(split, drafter=drafter, num_draft_tokens=drafter.max_drafts).generate(prompts)
    """

    family = "dspark"
    architecture = "DSparkDraftModel"

    def layout_keys(self) -> dict:
        cfg = self.cfg
        return {"markov_rank": cfg["markov_rank"], "markov_head_type": cfg["markov_head_type"],
                "enable_confidence_head": cfg["confidence_head"],
                "confidence_head_with_markov": cfg["confidence_with_markov"]}

    def __init__(self, cfg: dict, taps: tuple[int, ...], slots: tuple[int, ...], n_slots: int | None = None):
        super().__init__(cfg, taps, slots, n_slots)
        h, rank = cfg["hidden_size"], cfg["markov_rank"]
        self.first_draft_row = 0 if cfg["sample_from_anchor"] else 1
        self.markov_head = _MarkovHead(cfg["vocab_size"], cfg["draft_vocab_size"], rank, h,
                                       cfg["markov_head_type"]) if rank else None
        self.confidence_head = _ConfidenceHead(h + (rank if cfg["confidence_with_markov"] else 0)) \
            if cfg["confidence_head"] else None
        self._threshold = 0.0
        self._rule = cfg.get("confidence_rule", "survival")

    @property
    def confidence_threshold(self) -> float:
        return self._threshold

    @confidence_threshold.setter
    def confidence_threshold(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ConfigError(f"confidence_threshold must be a number from 0 to 1 (0: verify every draft), but got "
                              f"{value!r}")
        if value > 0 and self.confidence_head is None:
            raise ConfigError("confidence_threshold needs the drafter's confidence head, and this DSpark drafter has "
                              "none (enable_confidence_head false); leave it at 0")
        self._threshold = float(value)

    @property
    def confidence_rule(self) -> str:
        """How ``confidence_threshold`` reads the confidences: ``survival`` (vLLM's) or ``each`` (DeepSpec's)."""
        return self._rule

    @confidence_rule.setter
    def confidence_rule(self, value: str) -> None:
        if value not in CONFIDENCE_RULES:
            raise ConfigError(f"confidence_rule must be 'survival' (vLLM: the product of the confidences so far) or "
                              f"'each' (DeepSpec: every confidence so far), but got {value!r}")
        self._rule = value

    def heads(self, rows: torch.Tensor, prev: torch.Tensor, pick=None):
        """The drafting rows ``rows [D, K, H]`` (after the last layer) through the Markov and confidence heads, left to
        right. ``prev [D]``: the token before the first draft (target ids); ``pick(logits [D, V], i)`` chooses draft
        ``i`` (target ids) from its logits, ``None``: the block's tokens are given instead (``prev [D, K]``, teacher
        forcing). Returns ``(drafts [D, K] or None, logits [D, K, draft vocab], confidence logits [D, K] or None)``."""
        hidden = self.norm(rows)
        base = self.logits(rows)
        out_logits, drafts, confidence, state = [], [], [], None
        token = prev if pick is not None else prev[:, 0]
        for i in range(rows.shape[1]):
            h, logits = hidden[:, i], base[:, i]
            e = None
            if self.markov_head is not None:
                e = F.embedding(token, self.markov_head.markov_w1.weight)
                bias, state = self.markov_head.bias(e, h, state)
                logits = logits + bias
            if self.confidence_head is not None:
                features = torch.cat([h, e], -1) if e is not None and self.cfg["confidence_with_markov"] else h
                confidence.append(self.confidence_head.proj(features)[:, 0])
            out_logits.append(logits)
            if pick is not None:
                token = pick(logits, i)
                drafts.append(token)
            elif i + 1 < rows.shape[1]:
                token = prev[:, i + 1]
        return (torch.stack(drafts, 1) if drafts else None, torch.stack(out_logits, 1),
                torch.stack(confidence, 1) if confidence else None)

    def kept(self, confidence: torch.Tensor | None) -> torch.Tensor | None:
        """Per request, the leading drafts ``confidence_rule`` keeps at ``confidence_threshold`` ``[D]`` (``None``:
        all)."""
        if confidence is None or self._threshold <= 0:
            return None
        p = torch.sigmoid(confidence.float())
        reach = p.cumprod(-1) if self._rule == "survival" else p.cummin(-1).values
        return (reach >= self._threshold).sum(-1)

    def forward(self, aux: torch.Tensor, tokens: torch.Tensor, ctx_positions: torch.Tensor,
                block_positions: torch.Tensor, prev: torch.Tensor | None = None):
        """One block without a cache (as ``DFlashDrafter.forward``), every row through the heads, teacher-forced:
        ``prev [B]`` the token before each row's prediction (default: the block's tokens shifted, as speculators
        trains). Returns ``(logits [B, draft vocab], confidence logits [B] or None)``."""
        rows = self.block_rows(aux, tokens, ctx_positions, block_positions)
        if prev is None:
            prev = tokens if self.first_draft_row == 0 else torch.cat([tokens[:1], tokens[:-1]])
        _, logits, confidence = self.heads(rows[None], prev[None])
        return logits[0], None if confidence is None else confidence[0]


def set_confidence_threshold(drafter, value: float) -> None:
    """``drafter.confidence_threshold = value`` (``--confidence-threshold``), refused in one line for a drafter that
    is not DSpark."""
    family = getattr(drafter, "family", None)
    if family != "dspark":
        raise ConfigError(f"--confidence-threshold trims a DSpark drafter's verify windows (the drafter here: "
                          f"{family or 'none'}); pass -k and a DSpark drafter, or leave it out")
    drafter.confidence_threshold = value
