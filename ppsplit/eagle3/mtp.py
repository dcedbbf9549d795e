"""Multi-token prediction (MTP) layers shipped in the target's own checkpoint, run on the last stage as a drafter.

DeepSeek-V3 (report section 2.2; vLLM ``deepseek_mtp.py``): MTP layer ``k`` at position ``i`` reads the hidden
state ``h_i`` of depth ``k - 1`` and the embedding of the token at ``i + 1``::

    h_i^0 = norm(tap L of position i)                   the target's final-normed hidden (what vLLM's model returns)
    e     = embed(t_{i+1}), zero at position 0          (vLLM masks position 0; the report is silent)
    x     = eh_proj(cat(enorm(e), hnorm(h_i^{k-1})))    embedding first, as vLLM's deepseek_mtp.py concatenates
    h_i^k = block(x at position i)                      one decoder layer of the target's own type (MLA + MoE)
    logits = shared_head.head(shared_head.norm(h_i^k))  the draft for position i + k + 1

A checkpoint with ``n`` such layers (``num_nextn_predict_layers``) drafts ``K`` tokens by chaining them, layer
``j % n`` for draft ``j`` (vLLM's ``spec_step_idx % num_mtp_layers``; DeepSeek-V3 ships one layer, reused
``K`` times), each later step fed the previous step's ``h^k`` before ``shared_head.norm``.

The block is the target's decoder layer traced and paged by ppsplit's own passes (``ppsplit.compile.mtp`` builds
it: the last stage of a two-layer copy of the target, its pools over the target's block tables), so MLA latents
and MoE come as they do for the target. The engine's chain loop (``ppsplit.serve.speculative.Proposer``) runs it as
it runs an EAGLE-3 drafter: the same ``forward(hidden, tokens, positions)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppsplit.core.errors import ConfigError
from ppsplit.core.ragged import CacheLayout, RaggedStep
from ppsplit.eagle3.drafter import RMSNorm

COUNT_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")  # a target config's MTP layers: DeepSeek's, transformers 5's


def is_mtp_target(cfg: dict) -> bool:
    """Whether ``cfg`` (a ``config.json``) is a target's own, declaring MTP layers, rather than a drafter's."""
    drafter = ("speculators_model_type", "eagle_config", "dflash_config", "draft_vocab_size")
    return any(cfg.get(k) for k in COUNT_KEYS) and not any(k in cfg for k in drafter)


class MTPDrafter(nn.Module):
    """The MTP layers of a target checkpoint, fed the split's tap ``L`` (built by ``ppsplit.load_mtp``).

    ``blocks``: one traced stage per MTP layer (input ``[N, H]``, output ``(logits [N, V], aux [1, N, H])`` with the
    block's output before ``shared_head.norm`` in the aux slot), each owning its paged pools of ``layout``.

    Example::

        drafter = ppsplit.load_mtp("DeepSeek-V3", split=split)
        engine = ppsplit.Engine(split, drafter=drafter, num_draft_tokens=2)
    """

    family = "mtp"

    def __init__(self, blocks: list, hidden: int, vocab: int, eps: float, tap: int, slot: int, layout: CacheLayout):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.taps, self.slots = (tap,), (slot,)
        self.hidden_size, self.layout = hidden, layout
        self.target_norm = RMSNorm(hidden, eps)  # the target's final norm (model.norm)
        self.enorm = nn.ModuleList(RMSNorm(hidden, eps) for _ in blocks)
        self.hnorm = nn.ModuleList(RMSNorm(hidden, eps) for _ in blocks)
        self.eh_proj = nn.ModuleList(nn.Linear(2 * hidden, hidden, bias=False) for _ in blocks)
        self.register_buffer("embed_tokens", torch.empty(vocab, hidden), persistent=False)
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.long))  # the full vocabulary: draft id = target id
        self.depth = 0  # the chain step the next call computes (layer depth % len(blocks))

    @property
    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def allocate_paged(self, layout) -> "MTPDrafter":
        """The blocks own their pools, traced over the target's layout: ``layout`` must be that one."""
        if layout != self.layout:
            raise ConfigError(f"the MTP layers were built for the cache {self.layout}, but the engine runs {layout}; "
                              "load them with ppsplit.load_mtp(..., split=split) for this split")
        return self

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, step: RaggedStep):
        """One chain step: ``hidden`` is the split's aux buffer ``[n_slots, 1, N, H]`` (the first step: tap ``L``
        through the target's final norm) or the previous step's output ``[1, N, H]``; ``tokens [1, N]`` the token
        after each position; ``step`` the rows' positions and sequences. Returns ``(logits [1, N, V], out [1, N,
        H])``, ``out`` before ``shared_head.norm``: the next step's ``hidden``."""
        if not isinstance(step, RaggedStep) or tokens.shape[0] != 1:
            raise ConfigError("MTP layers run over the paged cache only: pass a RaggedStep and one row of tokens")
        if hidden.dim() == 4:
            self.depth = 0
            hidden = self.target_norm(hidden[self.slots[0]])
        k = self.depth % len(self.blocks)
        self.depth += 1
        n = tokens.shape[1]
        emb = F.embedding(tokens[0], self.embed_tokens)
        emb = emb.masked_fill((step.positions == 0)[:, None], 0)  # vLLM zeroes position 0's embedding
        x = self.eh_proj[k](torch.cat([self.enorm[k](emb), self.hnorm[k](hidden.reshape(n, -1))], dim=-1))
        aux = x.new_empty(1, n, self.hidden_size)
        logits, aux = self.blocks[k](x, step.positions, aux, *step.tensors()[1:])
        return logits[None], aux[0][None]
