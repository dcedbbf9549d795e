"""The EAGLE-3 drafter on the last stage: the ``Eagle3Drafter`` module (``ppsplit.eagle3.formats`` reads checkpoints).

An EAGLE-3 checkpoint is a one-layer Llama (SafeAILab/EAGLE ``cnets.py``, SpecForge, speculators, vLLM and SGLang
``llama_eagle3.py``). Its forward, for a token at position ``i``; the bracketed steps are per-checkpoint variants::

    a   = aux taps of position i, ascending tap id        # [input_norm(cat(a))] or [fc_norm_k(a_k) per tap]
    x   = fc(cat(a))                 # skipped for the drafter's own H-wide output
    res = x                          (or hidden_norm(x) with norm_before_residual)
    h   = cat(input_layernorm(embed(token i+1)), hidden_norm(x))            # width 2H, embedding first
    h   = res + o_proj(attention(q/k/v_proj(h), rotary at position i))     # causal [within a sliding window],
                                                                           # [q_norm/k_norm per head: Qwen3]
    out = h + mlp(post_attention_layernorm(h))        # pre-norm ``out`` feeds the next draft step
    logits = lm_head(norm(out))      # draft vocabulary; target id = draft id + d2t[draft id]
                                     # [no norm: SpecForge norm_output false; norm(out) fed back: Eagle 3.1]

On the last stage the drafter keeps a paged KV cache over the target's block tables (``allocate_paged``): a call
with a ``RaggedStep`` writes K/V at the step's positions and attends to its sequence's keys up to each position,
so rejected drafts are overwritten by the next call at the same positions; nothing is rolled back. Given plain
positions instead (training, scoring) it attends within the call. The engine's draft loop lives in
``ppsplit.serve.speculative``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppsplit.core.ragged import RaggedStep


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def fused_kernels(x: torch.Tensor):
    """``torch.ops.ppsplit`` (the stages' Triton kernels, registered on first import) where they serve ``x``: CUDA
    inference (they have no backward); ``None`` elsewhere, where the drafter runs the ATen ops they equal. A draft
    layer's norms, rotations and gated activation are then one kernel each instead of five to seven (about 40 fewer
    kernels a DFlash layer, each a few microseconds of a captured block step at batch 1)."""
    if not x.is_cuda or torch.is_grad_enabled():
        return None
    import ppsplit.triton_kernels.fused_norm  # noqa: F401
    import ppsplit.triton_kernels.pointwise  # noqa: F401

    return torch.ops.ppsplit


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in fp32, cast back, scale."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_kernels(x)
        if ops is not None:
            return ops.norm(x, self.weight, None, self.eps, "rms")
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, qk_norm: bool = False,
                 eps: float = 1e-6):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        if qk_norm:  # Qwen3's per-head RMSNorm of q and k, before the rotary embedding
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = _ACTIVATIONS[act]

    def forward(self, x):
        ops = fused_kernels(x) if self.act is F.silu else None
        if ops is not None:
            return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.hidden_norm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.self_attn = _Attention(h, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                                    cfg["attention_bias"], bool(cfg.get("qk_norm")), eps)
        self.mlp = MLP(h, cfg["intermediate_size"], cfg["hidden_act"])


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 drafter fed by the packed aux buffer of a split (built by ``load_drafter``).

    ``taps``: the target taps it reads (ppsplit/vLLM numbering, ascending); ``slots``: their slots in the split's
    aux buffer. ``embed_tokens`` is the target's input embedding (a buffer: the drafter's own copy, or a reference
    to the split's tensor on the last stage's device).

    Example::

        drafter = ppsplit.load_drafter("eagle3-llama-3.1-8b", split=split)
        logits, hidden = drafter(aux, next_tokens, positions)      # aux [n_slots, B, T, H], positions [T]
        drafts = drafter.target_ids[logits[:, -1].argmax(-1)]     # the next token's draft, target vocabulary
    """

    family = "eagle3"

    def __init__(self, cfg: dict, taps: tuple[int, ...], slots: tuple[int, ...], embed: torch.Tensor,
                 inv_freq: torch.Tensor, rope_scale: float = 1.0, n_slots: int | None = None):
        super().__init__()
        self.cfg = dict(cfg)
        self.taps, self.slots = tuple(taps), tuple(slots)
        h, th = cfg["hidden_size"], cfg["target_hidden_size"]
        self.hidden_size, self.target_hidden_size = h, th
        self.norm_before_residual = bool(cfg.get("norm_before_residual", False))
        self.final_norm = bool(cfg.get("final_norm", True))  # SpecForge norm_output false: lm_head reads out as is
        self.feed_normed = bool(cfg.get("feed_normed", False))  # Eagle 3.1: the next draft step reads norm(out)
        self.sliding_window = int(cfg.get("sliding_window") or 0)  # keys at positions (p - window, p]; 0: all
        eps = cfg["rms_norm_eps"]
        # speculators norm_before_fc: one RMSNorm over the concatenated taps; fc_norm: one RMSNorm per tap
        self.input_norm = RMSNorm(len(taps) * th, eps) if cfg.get("input_norm") else None
        self.fc_norm = nn.ModuleList(RMSNorm(th, eps) for _ in taps) if cfg.get("fc_norm") else None
        self.fc = nn.Linear(len(taps) * th, h, bias=cfg.get("fc_bias", False))
        self.midlayer = _Layer(cfg)
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)
        self.register_buffer("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
        self.register_buffer("embed_tokens", embed, persistent=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_scale = float(rope_scale)
        self.n_slots = max(self.slots) + 1 if n_slots is None else n_slots  # slots in the split's aux buffer
        for name in ("paged_keys", "paged_values"):
            self.register_buffer(name, None, persistent=False)  # set by allocate_paged

    # -- state ---------------------------------------------------------------------------------------------------
    @property
    def target_ids(self) -> torch.Tensor:
        """Target-vocabulary id of each draft id: ``arange(draft_vocab) + d2t``."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def allocate_paged(self, layout) -> "Eagle3Drafter":
        """Give the drafter a paged cache over the target's block tables (``CacheLayout``): its positions are the
        target's, so a request's blocks serve both; ``forward`` then takes a ``RaggedStep`` for positions."""
        import ppsplit.triton_kernels.paged  # noqa: F401  (registers the paged ops)

        attn = self.midlayer.self_attn
        shape = (layout.num_blocks, layout.block_size, attn.kv_heads, attn.head_dim)
        dev, dtype = self.fc.weight.device, self.fc.weight.dtype
        self.paged_keys = torch.zeros(shape, dtype=dtype, device=dev)
        self.paged_values = torch.zeros(shape, dtype=dtype, device=dev)
        return self

    def save(self, folder: str, format: str = "speculators", verifier: str | None = None) -> str:
        """Write the drafter as a checkpoint the engines load: ``format="speculators"`` (vLLM, speculators) or
        ``"specforge"`` (SGLang, SpecForge), tap ids in the format's numbering (``ppsplit.eagle3.export``);
        ``verifier``: the target's hub id or folder, recorded in the speculators config."""
        from ppsplit.eagle3.export import save_checkpoint

        return save_checkpoint(self, folder, format, verifier)

    # -- forward -------------------------------------------------------------------------------------------------
    def adapt(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc`` over the taps of the slot-major aux ``[n_slots, B, T, Ht]`` -> ``[B, T, H]``, one matmul per tap
        accumulating into one output: the concatenated ``[B, T, 3 * Ht]`` input is never materialised."""
        _, batch, tokens, th = aux.shape
        flat = aux.reshape(aux.shape[0], batch * tokens, th)
        taps = [flat[slot] for slot in self.slots]
        if self.input_norm is not None:  # the RMS of the concatenation, summed per tap; the weight split per tap
            norm = self.input_norm
            square = sum(t.float().pow(2).sum(-1, keepdim=True) for t in taps)
            scale = torch.rsqrt(square / (len(taps) * th) + norm.eps)
            taps = [norm.weight[i * th:(i + 1) * th] * (t.float() * scale).to(t.dtype) for i, t in enumerate(taps)]
        elif self.fc_norm is not None:
            taps = [norm(t) for norm, t in zip(self.fc_norm, taps)]
        weight = self.fc.weight  # [H, n * Ht]; the columns of tap i are weight[:, i*Ht:(i+1)*Ht] (a strided view)
        out = F.linear(taps[0], weight[:, :th], self.fc.bias)
        for i, tap in enumerate(taps[1:], start=1):
            out = torch.addmm(out, tap, weight[:, i * th:(i + 1) * th].t())
        return out.view(batch, tokens, self.hidden_size)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """One drafter pass: ``hidden`` is the aux buffer ``[n_slots, B, T, Ht]`` (goes through ``fc``) or the
        drafter's own previous output ``[B, T, H]``; ``tokens [B, T]`` the target-vocab ids that follow each
        position; ``positions [T]``. Returns ``(draft logits [B, T, draft_vocab], out [B, T, H])``, ``out`` before
        the final norm (after it with ``feed_normed``): the next step's ``hidden``. ``positions`` a ``RaggedStep``
        (``B = 1``): K/V written into the paged cache, attention over each sequence's cache."""
        x = self.adapt(hidden) if hidden.dim() == 4 else hidden
        layer = self.midlayer
        normed = layer.hidden_norm(x)
        residual = normed if self.norm_before_residual else x
        emb = layer.input_layernorm(F.embedding(tokens, self.embed_tokens).to(x.dtype))
        h = residual + self._attention(torch.cat([emb, normed], dim=-1), positions)
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        if self.feed_normed:
            out = self.norm(out)
            return self.lm_head(out), out
        return self.lm_head(self.norm(out) if self.final_norm else out), out

    def _attention(self, h: torch.Tensor, positions) -> torch.Tensor:
        """Attention of ``h [B, T, 2H]`` at ``positions``: a tensor ``[T]`` (within the call) or a ``RaggedStep``
        (``B = 1``, the paged cache of ``allocate_paged``)."""
        attn = self.midlayer.self_attn
        batch, tokens, _ = h.shape
        step = positions if isinstance(positions, RaggedStep) else None
        if step is not None:
            positions = step.positions
        q = attn.q_proj(h).view(batch, tokens, attn.heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(batch, tokens, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(batch, tokens, attn.kv_heads, attn.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = (angles.cos() * self.rope_scale).to(q.dtype), (angles.sin() * self.rope_scale).to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if step is not None:
            ops = torch.ops.ppsplit
            slots = ops.slot_mapping(step.positions, step.seq, step.block_table, self.paged_keys.shape[1])
            ops.paged_write_pair(self.paged_keys, self.paged_values, k[0].transpose(0, 1), v[0].transpose(0, 1),
                                 slots)
            o = ops.paged_attention(q, self.paged_keys, self.paged_values, *step.tensors(), attn.head_dim ** -0.5,
                                    self.sliding_window, 0.0, None, None)
            return attn.o_proj(o.transpose(1, 2).reshape(batch, tokens, attn.heads * attn.head_dim))
        keys, values, key_positions = k, v, positions  # no paged cache (training, scoring): attend within the call
        mask = key_positions[None, :] <= positions[:, None]
        if self.sliding_window:
            mask = mask & (positions[:, None] - key_positions[None, :] < self.sliding_window)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=attn.heads != attn.kv_heads)
        return attn.o_proj(o.transpose(1, 2).reshape(batch, tokens, attn.heads * attn.head_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@torch.no_grad()
def draft_agreement(split, drafter, ids: torch.Tensor, start: int = 1) -> tuple[int, int]:
    """Teacher-forced first-draft agreement on ``ids [B, T]``: how often the drafter, fed the target's taps of
    position ``i`` and token ``i + 1``, predicts the target's own greedy token at ``i + 2`` (for ``i + 1 >= start``).
    Returns ``(agreeing, total)``. A drafter read under the wrong tap numbering scores near zero.

    Example::

        agree, total = draft_agreement(split, drafter, sequences, start=4)
    """
    batch, tokens = ids.shape
    device, last = ids.device, drafter.fc.weight.device
    logits, aux = split(ids, torch.arange(tokens, device=device))
    target_next = logits.argmax(-1).to(last)  # [B, T]: the target's token for position i + 1
    ids = ids.to(last)
    draft_logits, _ = drafter(aux.to(last), torch.cat([ids[:, 1:], target_next[:, -1:]], 1),
                              torch.arange(tokens, device=last))
    drafts = drafter.target_ids[draft_logits.argmax(-1)]  # [B, T]: the drafter's token for position i + 2
    lo = max(start - 1, 0)
    hits = drafts[:, lo:tokens - 1] == target_next[:, lo + 1:]
    return int(hits.sum()), hits.numel()


@torch.no_grad()
def mtp_agreement(split, drafter, ids: torch.Tensor, start: int = 1) -> tuple[int, int]:
    """Teacher-forced first-draft agreement of an MTP layer (``MTPDrafter``) on ``ids [B, T]``, ``draft_agreement``'s
    measure: how often its draft for position ``i + 2``, fed tap ``L`` of position ``i`` and token ``i + 1``, is the
    target's own greedy token there (``i + 1 >= start``). Each row is prefilled alone in sequence slot 0. Returns
    ``(agreeing, total)``."""
    from ppsplit.core.ragged import RaggedStep, Segment

    agree = total = 0
    last = drafter.eh_proj.weight.device
    for row in ids:
        tokens = row.shape[0]
        blocks = list(range(-(-tokens // split.layout.block_size)))
        step = RaggedStep.build([Segment(0, 0, tokens)], {0: blocks}, split.layout)
        logits, aux = split.step(row, step)
        target_next = logits.argmax(-1).to(last)  # [T]: the target's token for position i + 1
        row = row.to(last)
        draft_logits, _ = drafter(aux.to(last)[:, None], torch.cat([row[1:], target_next[-1:]])[None],
                                  step.to(last))
        drafts = draft_logits[0].argmax(-1)  # [T]: the draft for position i + 2
        lo = max(start - 1, 0)
        hits = drafts[lo:tokens - 1] == target_next[lo + 1:]
        agree, total = agree + int(hits.sum()), total + hits.numel()
    return agree, total
