"""Multi-token prediction (MTP) layers shipped in the target's own checkpoint, run on the last stage as a drafter.

DeepSeek-V3 (report section 2.2: depth ``k`` at position ``i`` combines ``RMSNorm(h_i^{k-1})`` with
``RMSNorm(Emb(t_{i+k}))``; vLLM ``deepseek_mtp.py`` at inference; GLM-4.5's ``glm4_moe_mtp.py`` is the same), for
the row of position ``i``::

    h     = norm(tap L of position i)                   the target's final-normed hidden (what vLLM's model returns)
    e     = embed(t_{i+1}), zero at position 0          (vLLM masks position 0; the report is silent)
    x     = eh_proj(cat(enorm(e), hnorm(h)))            embedding first, as vLLM's deepseek_mtp.py concatenates
    out   = block(x at position i)                      a decoder layer of the target's type (MLA + MoE)
    logits = shared_head.head(shared_head.norm(out))    the draft for position i + 2

``K`` drafts chain the first MTP layer ``K`` times, each later step at the next position, fed the previous step's
``out`` and the previous draft: what vLLM's proposer does (it calls the MTP model without ``spec_step_idx``, so
layer ``L`` drafts every step). DeepSeek-V3 ships one layer; further layers of a checkpoint with
``num_nextn_predict_layers > 1`` are left unused, as vLLM leaves them (each would need its own cache filled by rows
it never sees in a chain). Qwen3-Next (vLLM ``qwen3_next_mtp.py``): the same with its own names, norms scaling by
``1 + weight``, no zeroed embedding, the target's ``lm_head``, and ``out`` after the MTP norm fed to the next step.

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
from ppsplit.core.tensors import model_dtype
from ppsplit.eagle3.drafter import RMSNorm

COUNT_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")  # a config's MTP layers: DeepSeek's, transformers 5's


def is_mtp_target(cfg: dict) -> bool:
    """Whether ``cfg`` (a ``config.json``) is a target's own, declaring MTP layers, rather than a drafter's."""
    drafter = ("speculators_model_type", "eagle_config", "dflash_config", "draft_vocab_size")
    return any(cfg.get(k) for k in (*COUNT_KEYS, "mtp_num_hidden_layers")) and not any(k in cfg for k in drafter)


class OffsetRMSNorm(nn.Module):
    """Qwen3-Next's RMSNorm: normalise in fp32, scale by ``1 + weight`` in fp32, cast back."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class MTPDrafter(nn.Module):
    """The first MTP layer of a target checkpoint, fed the split's tap ``L`` (built by ``ppsplit.load_mtp``).

    ``block``: the MTP layer's decoder block as a traced stage (input ``[N, H]``, output ``(logits [N, V], aux
    [1, N, H])`` with the block's output before ``shared_head.norm`` in the aux slot), owning its paged pools of
    ``layout``.

    Example::

        drafter = ppsplit.load_mtp("DeepSeek-V3", split=split)
        engine = ppsplit.Engine(split, drafter=drafter, num_draft_tokens=2)
    """

    family = "mtp"

    def __init__(self, block, hidden: int, vocab: int, eps: float, tap: int, slot: int, layout: CacheLayout,
                 offset_norms: bool = False, zero_first: bool = True, feed_normed: bool = False):
        super().__init__()
        self.block = block
        self.taps, self.slots = (tap,), (slot,)
        self.hidden_size, self.layout = hidden, layout
        self.zero_first = zero_first  # DeepSeek, GLM (vLLM): position 0's embedding zeroed; Qwen3-Next: not
        norm = OffsetRMSNorm if offset_norms else RMSNorm
        self.target_norm = norm(hidden, eps)  # the target's final norm (model.norm)
        self.enorm, self.hnorm = norm(hidden, eps), norm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # Qwen3-Next feeds the next chain step its output after the MTP norm (the block's own final norm)
        self.norm = norm(hidden, eps) if feed_normed else None
        self.register_buffer("embed_tokens", torch.empty(vocab, hidden), persistent=False)
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.long))  # the full vocabulary: draft id = target id

    def fill(self, tensors: dict) -> None:
        """Copy the drafter's own tensors (``own_tensors``' names) in; a name or shape that differs is refused."""
        own = self.own_tensors()
        if set(tensors) != set(own):
            wrong = sorted(set(tensors) ^ set(own))[0]
            raise ConfigError(f"the MTP layer's own tensors differ from what it holds ({wrong})")
        with torch.no_grad():
            for name, t in tensors.items():
                target = self.get_buffer(name) if name == "embed_tokens" else self.get_parameter(name)
                if tuple(t.shape) != tuple(target.shape):
                    raise ConfigError(f"the MTP tensor for {name} has shape {tuple(t.shape)}, expected "
                                      f"{tuple(target.shape)}")
                target.copy_(t.to(target.dtype))

    def placed(self, device, dtype: torch.dtype) -> "MTPDrafter":
        """On ``device``, its own tensors in ``dtype``; the block is built in the split's dtype already and keeps its
        buffers as traced (the rotary's inv_freq stays float32: its graph multiplies it by float32 positions)."""
        self.to(device=device)
        for child in self.children():
            if child is not self.block:
                child.to(dtype=dtype)
        for t in [*self.parameters(recurse=False), *self.buffers(recurse=False)]:
            if t.is_floating_point():
                t.data = t.data.to(dtype)
        return self.eval()

    def own_tensors(self) -> dict[str, torch.Tensor]:
        """The drafter's tensors outside its block, by name (what a compiled folder stores beside the block)."""
        out = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()
               if not k.startswith("block.") and k != "d2t"}
        out["embed_tokens"] = self.embed_tokens.detach().contiguous().cpu()
        return out

    def settings(self) -> dict:
        """What rebuilding it around a stored block needs (a compiled folder's ``mtp/config.json``)."""
        return {"ppsplit_family": "mtp", "ppsplit_taps": list(self.taps), "hidden_size": self.hidden_size,
                "vocab_size": self.embed_tokens.shape[0], "rms_norm_eps": self.enorm.eps,
                "offset_norms": isinstance(self.enorm, OffsetRMSNorm), "zero_first": self.zero_first,
                "feed_normed": self.norm is not None}

    @property
    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def allocate_paged(self, layout) -> "MTPDrafter":
        """The block owns its pools, traced over the target's layout: ``layout`` must be that one."""
        if layout != self.layout:
            raise ConfigError(f"the MTP layer was built for the cache {self.layout}, but the engine runs {layout}; "
                              "load it with ppsplit.load_mtp(..., split=split) for this split")
        return self

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, step: RaggedStep):
        """One chain step: ``hidden`` is the split's aux buffer ``[n_slots, 1, N, H]`` (the first step: tap ``L``
        through the target's final norm) or the previous step's output ``[1, N, H]``; ``tokens [1, N]`` the token
        after each position; ``step`` the rows' positions and sequences. Returns ``(logits [1, N, V], out [1, N,
        H])``, ``out`` before ``shared_head.norm`` (Qwen3-Next: after its MTP norm): the next step's ``hidden``."""
        if not isinstance(step, RaggedStep) or tokens.shape[0] != 1:
            raise ConfigError("the MTP layer runs over the paged cache only: pass a RaggedStep and one row of tokens")
        if hidden.dim() == 4:
            hidden = self.target_norm(hidden[self.slots[0]])
        n = tokens.shape[1]
        emb = F.embedding(tokens[0], self.embed_tokens)
        if self.zero_first:
            emb = emb.masked_fill((step.positions == 0)[:, None], 0)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden.reshape(n, -1))], dim=-1))
        aux = x.new_empty(1, n, self.hidden_size)
        logits, aux = self.block(x, step.positions, aux, *step.tensors()[1:])
        out = aux[0] if self.norm is None else self.norm(aux[0])
        return logits[None], out[None]


def load_folder_mtp(folder, device, options) -> MTPDrafter:
    """The MTP layer a compiled folder stores (``ppsplit compile --mtp``), on ``device``: its block built from the
    checked program as a stage is (``options``: the stage rewrites), its own tensors from ``mtp/drafter.safetensors``.
    ``folder``: a ``CompiledFolder``."""
    import os

    from safetensors.torch import load_file

    from ppsplit.artifact.folder import MTP_OWN_WEIGHTS, FolderError, regular_file
    from ppsplit.artifact.loader import build_stage

    cfg, program, _ = folder.check_mtp()
    plan = folder.plan
    block = build_stage(folder, program, device, options)
    layers = plan.num_layers
    drafter = MTPDrafter(block, cfg["hidden_size"], cfg["vocab_size"], cfg["rms_norm_eps"], layers,
                         plan.taps.index(layers), CacheLayout.of(plan), offset_norms=cfg["offset_norms"],
                         zero_first=cfg["zero_first"], feed_normed=cfg["feed_normed"])
    path = os.path.join(folder.mtp, MTP_OWN_WEIGHTS)
    try:
        drafter.fill(load_file(regular_file(path, folder.path)))
    except ConfigError as e:
        raise FolderError(f"{path}: {e}; compile the folder again") from None
    return drafter.placed(device, model_dtype(plan))
