"""The DFlash drafter on the last stage (block diffusion: z-lab's ``dflash`` package, speculators' ``dflash``).

A DFlash drafter proposes a whole block in one forward pass. For a request whose last committed token ``b`` (the
"bonus" token, not yet run through the target) sits at position ``P``::

    ctx_i = hidden_norm(fc(cat(taps of position i)))             for every position i < P (the target's context)
    x     = embed(b, mask, ..., mask) * input_embedding_scale    the block: positions P .. P + B - 1
    per draft layer (Qwen3: q_norm / k_norm, rotary at each key's position):
        keys, values = k/v_proj of ctx_0 .. ctx_{P-1} and of the block's own rows
        x = x + o_proj(attention(q_proj(input_layernorm(x)), keys, values))     # no causal mask inside the block
        x = x + mlp(post_attention_layernorm(x))
    logits of slot j >= 1 = lm_head(norm(x_j)) * output_multiplier [soft-capped]     # the draft for P + j

``lm_head`` is the target's (the last stage holds it), or the drafter's own for a reduced draft vocabulary (``d2t``
maps draft ids to target ids, as for EAGLE-3); ``embed`` is the target's input embedding.

Under the engine each draft layer keeps a paged cache over the target's block tables: every row a step runs writes
its context keys/values at its position (a rejected draft's row is stale until the next step writes that position
again), then the block writes its rows at ``P .. P + B - 1`` and attends to its sequence's keys up to ``P + B - 1``:
the context before ``P``, all of the block.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppsplit.core.drafter_config import dflash_drafter_config, is_deepspec
from ppsplit.core.errors import ConfigError
from ppsplit.core.options import to_taps
from ppsplit.core.ragged import RaggedStep
from ppsplit.core.tensors import model_dtype
from ppsplit.eagle3.drafter import MLP, RMSNorm, fused_kernels
from ppsplit.eagle3.formats import draft_map, drafter_rope


class _Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, hd, bias = cfg["hidden_size"], cfg["head_dim"], cfg["attention_bias"]
        self.heads, self.kv_heads, self.head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        self.q_proj = nn.Linear(h, self.heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=bias)  # DFlash biases o_proj too (unlike Qwen3)
        self.q_norm, self.k_norm = RMSNorm(hd, cfg["rms_norm_eps"]), RMSNorm(hd, cfg["rms_norm_eps"])


class GroupedCausalConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution around a sublayer (z-lab's ``GroupedDynamicCausalConv``, the same
    tensors): over each block's rows, ``y_i = sum_t (base[t] + dyn_i[t]) * x_{i - t}`` (``x_{<0} = 0``), the
    per-row kernel ``dyn`` shared by the channels of a group and projected from the sublayer's input; ``prepare``
    convolves the input (kernel set 0) and returns the output's kernels (set 1), which ``finish`` applies."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, width: int) -> torch.Tensor:
        blocks = x.view(-1, width, self.groups, self.group_size)
        dynamic = dynamic.view(-1, width, self.kernel_size, self.groups, 1)
        out = torch.zeros_like(blocks)
        for t in range(min(self.kernel_size, width)):
            shifted = blocks if t == 0 else F.pad(blocks[:, :-t], (0, 0, 0, 0, t, 0))
            out = out + (base[t].view(self.groups, self.group_size) + dynamic[:, :, t]) * shifted
        return out.view_as(x)

    def prepare(self, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).view(x.shape[0], 2, self.kernel_size, self.groups)
        return self.convolve(x, dynamic[:, 0], self.base_kernel[0], width), dynamic[:, 1]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor, width: int) -> torch.Tensor:
        return self.convolve(x, dynamic, self.base_kernel[1], width)


def _conv_in(conv, x: torch.Tensor, width: int):
    return (x, None) if conv is None else conv.prepare(x, width)


def _conv_out(conv, x: torch.Tensor, kernel, width: int) -> torch.Tensor:
    return x if conv is None else conv.finish(x, kernel, width)


class _Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = _Attention(cfg)
        self.mlp = MLP(h, cfg["intermediate_size"], cfg["hidden_act"])
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        kernel = cfg.get("conv_kernel_size")  # DFlash2: a convolution around attention and around the MLP
        self.attention_conv = GroupedCausalConv(h, kernel, cfg["conv_group_size"]) if kernel else None
        self.mlp_conv = GroupedCausalConv(h, kernel, cfg["conv_group_size"]) if kernel else None


class DFlashDrafter(nn.Module):
    """A DFlash drafter fed by the packed aux buffer of a split (built by ``ppsplit.eagle3.formats.load_drafter``).

    ``taps``: the target taps it reads (ppsplit numbering, ascending); ``slots``: their slots in the split's aux
    buffer. ``embed_tokens`` and ``head`` are the target's input embedding and output projection (buffers that
    reference the split's tensors on the last stage's device, or copies). ``block_size``: the block it was trained
    on; ``K = block_size - 1`` drafts per block.

    Example::

        drafter = ppsplit.load_drafter("z-lab/Qwen3-8B-DFlash-b16", split=split)
        logits = drafter(aux, block_tokens, ctx_positions, block_positions)   # no cache: the whole context given
    """

    family = "dflash"

    def __init__(self, cfg: dict, taps: tuple[int, ...], slots: tuple[int, ...], n_slots: int | None = None):
        super().__init__()
        self.cfg = dict(cfg)
        self.taps, self.slots = tuple(taps), tuple(slots)
        h, th, eps = cfg["hidden_size"], cfg["target_hidden_size"], cfg["rms_norm_eps"]
        self.hidden_size, self.target_hidden_size = h, th
        self.block_size, self.mask_token_id = cfg["block_size"], cfg["mask_token_id"]
        self.embed_scale, self.output_multiplier = cfg["input_embedding_scale"], cfg["output_multiplier"]
        self.softcap = cfg["final_logit_softcapping"]
        self.fc = nn.Linear(len(taps) * th, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(h, eps)
        # A reduced draft vocabulary has its own head (speculators); else the target's lm_head is used.
        own_head = cfg["draft_vocab_size"] != cfg["vocab_size"]
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False) if own_head else None
        self.register_buffer("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
        for name in ("embed_tokens", "head", "inv_freq"):
            self.register_buffer(name, torch.empty(0), persistent=False)
        self.rope_scale = 1.0
        self.n_slots = max(self.slots) + 1 if n_slots is None else n_slots
        self.paged = None  # [(keys, values)] per layer, set by allocate_paged

    @property
    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    # The block row whose output is the first draft: the bonus token's row predicts nothing in plain DFlash (DSpark's
    # anchor layout drafts from it: 0).
    first_draft_row = 1

    @property
    def max_drafts(self) -> int:
        """The drafts one block proposes: one per block row from ``first_draft_row``."""
        return self.block_size - self.first_draft_row

    architecture = "DFlashDraftModel"  # what speculators' save_pretrained writes for the family

    def layout_keys(self) -> dict:
        """The family's own top-level keys of speculators' layout (DSpark's heads)."""
        return {}

    def save(self, folder: str, format: str = "speculators", verifier: str | None = None) -> str:
        """Write the drafter in speculators' ``dflash`` (or ``dspark``) layout (what vLLM loads): ``config.json`` as speculators'
        ``save_pretrained`` writes it, tap ids in vLLM's numbering (ppsplit's), ``model.safetensors`` without the
        target's embedding and head. ``verifier``: the target's hub id or folder, recorded in the config."""
        import json
        import os

        from safetensors.torch import save_file

        if format != "speculators":
            raise ConfigError(f"a DFlash drafter is written in speculators' dflash layout (format speculators), not "
                              f"{format!r}; SGLang's SpecForge format holds EAGLE-3 drafters only")

        plain_values = (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", 0.0))
        for key, plain in plain_values:
            if self.cfg[key] != plain:
                raise ConfigError(f"speculators' dflash layout cannot express {key} = {self.cfg[key]}; this drafter "
                                  "can only be kept in its own folder")
        cfg = self.cfg
        layer = {"model_type": "qwen3", "num_hidden_layers": len(self.layers), "layer_types":
                 ["full_attention"] * len(self.layers), **{k: cfg[k] for k in (
                     "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "hidden_act", "rms_norm_eps", "vocab_size", "attention_bias")}, **cfg["rope"]}
        out = {"architectures": [self.architecture], "speculators_model_type": self.family,
               "speculators_config": {"algorithm": self.family, "default_proposal_method": "greedy",
                                      "proposal_methods": [{"proposal_type": "greedy",
                                                            "speculative_tokens": self.max_drafts,
                                                            "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                      "verifier": {"name_or_path": verifier, "architectures": []}},
               "transformer_layer_config": layer, "draft_vocab_size": cfg["draft_vocab_size"],
               "block_size": self.block_size, "mask_token_id": self.mask_token_id,
               "aux_hidden_state_layer_ids": list(self.taps), "sample_from_anchor": self.first_draft_row == 0,
               "sliding_window_non_causal": False, "tie_word_embeddings": False,
               "target_hidden_size": None if self.target_hidden_size == self.hidden_size else self.target_hidden_size,
               **self.layout_keys()}
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.lm_head is None:  # a full vocabulary: speculators keeps no mapping and reloads the verifier's head
            del tensors["d2t"]
        else:
            t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
            t2d[self.target_ids.cpu()] = True
            tensors["t2d"] = t2d
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(out, f, indent=2)
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return folder

    def allocate_paged(self, layout) -> "DFlashDrafter":
        """Give every draft layer a paged key/value cache over the target's block tables (``CacheLayout``)."""
        import ppsplit.triton_kernels.paged  # noqa: F401  (registers the paged ops)

        attn = self.layers[0].self_attn
        shape = (layout.num_blocks, layout.block_size, attn.kv_heads, attn.head_dim)
        dev, dtype = self.fc.weight.device, self.fc.weight.dtype
        self.paged = [(torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev))
                      for _ in self.layers]
        return self

    # -- pieces ----------------------------------------------------------------------------------------------------
    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(cat(taps)))`` of the aux rows ``[n_slots, N, Ht]`` -> ``[N, H]``, one matmul per tap
        accumulating into one output (the concatenation is never materialised)."""
        th = aux.shape[-1]
        weight = self.fc.weight
        out = F.linear(aux[self.slots[0]], weight[:, :th])
        for i, slot in enumerate(self.slots[1:], start=1):
            out = torch.addmm(out, aux[slot], weight[:, i * th:(i + 1) * th].t())
        return self.hidden_norm(out)

    def _rotary(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * self.rope_scale).to(dtype), (angles.sin() * self.rope_scale).to(dtype)

    def _kv(self, layer: _Layer, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of rows ``x [N, H]``: ``[N, kv_heads, head_dim]`` each."""
        attn = layer.self_attn
        k = attn.k_norm(attn.k_proj(x).view(x.shape[0], attn.kv_heads, attn.head_dim))
        v = attn.v_proj(x).view(x.shape[0], attn.kv_heads, attn.head_dim)
        return _rope(k, cos[:, None], sin[:, None]), v

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Draft logits of the block rows ``x [..., H]`` (after the last layer)."""
        out = self.norm(x)
        out = self.lm_head(out) if self.lm_head is not None else F.linear(out, self.head)
        if self.output_multiplier != 1.0:
            out = out * self.output_multiplier
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def block_drafts(self, rows: torch.Tensor, prev: torch.Tensor, pick=None):
        """The drafts ``[D, K]`` (target ids) of the drafting rows ``rows [D, K, H]`` (after the last layer) and their
        confidence logits ``[D, K]`` (``None``: the family has none). ``prev [D]``: the token before the first draft;
        ``pick(logits [D, V], i)`` chooses draft ``i`` from its logits, ``None``: the argmax. Families with heads
        (DSpark's Markov head, DFlash2's selector) pick left to right, each draft after the one before; plain DFlash
        drafts every row at once. Device-only, so the engine captures the greedy picks with the block."""
        if hasattr(self, "heads"):
            greedy = lambda logits, i: self.target_ids[logits.argmax(-1)]  # noqa: E731
            drafts, _, confidence = self.heads(rows, prev, pick or greedy)
            return drafts, confidence
        logits = self.logits(rows)
        if pick is None:
            return self.target_ids[logits.argmax(-1)], None
        return torch.stack([pick(logits[:, i], i) for i in range(rows.shape[1])], 1), None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embed_tokens)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    # -- no cache: the whole context given (tests, scoring) ----------------------------------------------------------
    def forward(self, aux: torch.Tensor, tokens: torch.Tensor, ctx_positions: torch.Tensor,
                block_positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of one block: ``aux [n_slots, T, Ht]`` the taps of the context rows at
        ``ctx_positions [T]``, ``tokens [B]`` the block (bonus token, then masks) at ``block_positions [B]``."""
        return self.logits(self.block_rows(aux, tokens, ctx_positions, block_positions))

    def block_rows(self, aux: torch.Tensor, tokens: torch.Tensor, ctx_positions: torch.Tensor,
                   block_positions: torch.Tensor) -> torch.Tensor:
        """``forward``'s block rows after the last layer ``[B, H]`` (before ``norm``)."""
        ctx = self.context(aux).to(self.fc.weight.dtype)
        x = self.embed(tokens).to(ctx.dtype)
        cc, cs = self._rotary(ctx_positions, x.dtype)
        bc, bs = self._rotary(block_positions, x.dtype)
        width = x.shape[0]
        for layer in self.layers:
            attn = layer.self_attn
            h, kernel = _conv_in(layer.attention_conv, layer.input_layernorm(x), width)
            ck, cv = self._kv(layer, ctx, cc, cs)
            bk, bv = self._kv(layer, h, bc, bs)
            q = _rope(attn.q_norm(attn.q_proj(h).view(h.shape[0], attn.heads, attn.head_dim)), bc[:, None], bs[:, None])
            k, v = torch.cat([ck, bk]).transpose(0, 1), torch.cat([cv, bv]).transpose(0, 1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                               enable_gqa=attn.heads != attn.kv_heads)
            x = x + _conv_out(layer.attention_conv, attn.o_proj(o[0].transpose(0, 1).reshape(h.shape[0], -1)),
                              kernel, width)
            x = x + self._mlp(layer, x, width)
        return x

    @staticmethod
    def _mlp(layer, x: torch.Tensor, width: int) -> torch.Tensor:
        h, kernel = _conv_in(layer.mlp_conv, layer.post_attention_layernorm(x), width)
        return _conv_out(layer.mlp_conv, layer.mlp(h), kernel, width)

    # -- the paged cache (the engine) --------------------------------------------------------------------------------
    def write_context(self, aux: torch.Tensor, step: RaggedStep) -> None:
        """Write the keys/values of every row of a step (``aux [n_slots, N, Ht]``) at its position."""
        ops = torch.ops.ppsplit
        ctx = self.context(aux)
        cos, sin = self._rotary(step.positions, ctx.dtype)
        slots = ops.slot_mapping(step.positions, step.seq, step.block_table, self.paged[0][0].shape[1])
        for layer, (keys, values) in zip(self.layers, self.paged):
            k, v = self._kv(layer, ctx, cos, sin)
            ops.paged_write_pair(keys, values, k, v, slots)

    def draft_block(self, tokens: torch.Tensor, step: RaggedStep, width: int) -> torch.Tensor:
        """The blocks of ``D`` requests, ``tokens [D * width]`` (each: bonus token, then masks) at ``step``'s
        positions (each request's ``width`` rows consecutive): their rows' keys/values are written, each row attends
        to its sequence's keys up to its block's last position. Returns the rows after the last layer ``[D * width,
        H]``."""
        ops = torch.ops.ppsplit
        x = self.embed(tokens).to(self.fc.weight.dtype)
        n = x.shape[0]
        cos, sin = self._rotary(step.positions, x.dtype)
        slots = ops.slot_mapping(step.positions, step.seq, step.block_table, self.paged[0][0].shape[1])
        count = step.seq_count[step.seq.clamp_min(0)]
        start = step.seq_start[step.seq.clamp_min(0)]
        first = step.positions[start]  # each row's block start
        limit = first + count - 1  # non-causal inside the block: every row sees up to its block's last position
        for layer, (keys, values) in zip(self.layers, self.paged):
            attn = layer.self_attn
            h, kernel = _conv_in(layer.attention_conv, layer.input_layernorm(x), width)
            k, v = self._kv(layer, h, cos, sin)
            ops.paged_write_pair(keys, values, k, v, slots)
            q = _rope(attn.q_norm(attn.q_proj(h).view(n, attn.heads, attn.head_dim)), cos[:, None], sin[:, None])
            o = ops.paged_attention(q.transpose(0, 1)[None], keys, values, limit, step.seq, step.block_table,
                                    step.seq_start, step.seq_count, attn.head_dim ** -0.5, 0, 0.0, None, None)
            x = x + _conv_out(layer.attention_conv, attn.o_proj(o[0].transpose(0, 1).reshape(n, -1)), kernel, width)
            x = x + self._mlp(layer, x, width)
        return x


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [N, heads, D]`` rotated by ``cos`` / ``sin [N, 1, D]``."""
    ops = fused_kernels(x)
    if ops is not None:  # the stages' layout: [1, heads, N, D]
        return ops.rope(x.transpose(0, 1)[None], cos.transpose(0, 1)[None], sin.transpose(0, 1)[None])[0] \
            .transpose(0, 1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


# -- loading ---------------------------------------------------------------------------------------------------------
_VIEWS = ("squeeze", "unsqueeze", "view", "reshape", "alias", "_unsafe_view", "clone", "contiguous")


def output_head(split) -> torch.Tensor:
    """The target's output projection weight ``[V, H]`` on the last stage: the ``aten.linear`` the logits come
    from (through views only). A drafter that borrows it must see plain ``lm_head(x)`` logits."""
    stage = split.stages[-1]
    name = output_head_name(split)
    weight = dict(stage.named_parameters()).get(name)
    return (weight if weight is not None else stage.get_buffer(name)).detach()


def output_head_name(split) -> str:
    """The FQN of the target's output projection weight (see ``output_head``)."""
    stage = split.stages[-1]
    out = next(n for n in stage.graph.nodes if n.op == "output").args[0]
    node = out[0] if isinstance(out, (tuple, list)) else out
    while node.op == "call_function" and any(v in str(node.target) for v in _VIEWS):
        node = node.args[0]
    if node.op != "call_function" or "linear" not in str(node.target) or len(node.args) < 2 \
            or getattr(node.args[1], "op", None) != "get_attr" or (len(node.args) > 2 and node.args[2] is not None):
        raise ConfigError(f"the target's logits are not a plain lm_head projection (they come from {node.target}); a "
                          "DFlash drafter without its own lm_head reads the target's, so this target is not supported")
    return node.args[1].target


def build_dflash(cfg: dict, tensors: dict, plan, embed: torch.Tensor, head: torch.Tensor,
                 aux_convention: str | None, device, cls: type = DFlashDrafter) -> DFlashDrafter:
    """The DFlash drafter of ``(cfg, tensors)`` for a split with ``plan``, sharing the target's ``embed`` table and
    output projection ``head``; checked before any tensor is loaded. ``cls``: the family's module (DSpark's adds
    heads; their tensors are accounted for by its ``state_dict``). A DeepSpec folder's copies of ``embed`` and
    ``head`` are checked equal to them and dropped."""
    if is_deepspec(cfg):
        from ppsplit.eagle3.dspark import drop_target_copies

        tensors = drop_target_copies(tensors, embed, head)
    flat, rope, ids, numbering = dflash_drafter_config(cfg)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"DFlash drafter tap ids must be a list of integers, but got {ids!r}")
    if ids != sorted(set(ids)):
        raise ConfigError(f"DFlash drafter tap ids {ids} must be distinct and ascending (the order fc was trained on)")
    taps = to_taps(ids, aux_convention or numbering, plan.num_layers, what="DFlash drafter tap id")
    if flat.get("num_target_layers") not in (None, plan.num_layers):
        raise ConfigError(f"the DFlash drafter was trained on a {flat['num_target_layers']}-layer target but this one "
                          f"has {plan.num_layers}; use a drafter trained for this target")
    missing = [t for t in taps if t not in plan.taps]
    if missing:
        raise ConfigError(f"the drafter reads taps {list(taps)} but the split carries {list(plan.taps)} (missing "
                          f"{missing}); split the target with aux={','.join(map(str, taps))}")
    if flat["target_hidden_size"] != plan.hidden_size:
        raise ConfigError(f"the DFlash drafter expects target hidden size {flat['target_hidden_size']} but the target "
                          f"has {plan.hidden_size}; use a drafter trained for this target")
    vocab = embed.shape[0]
    flat["vocab_size"] = flat.get("vocab_size") or vocab
    if flat["vocab_size"] != vocab or embed.shape[1] != flat["hidden_size"] or tuple(head.shape) != tuple(embed.shape):
        raise ConfigError(f"the DFlash drafter's vocabulary x hidden ({flat['vocab_size']} x {flat['hidden_size']}) "
                          f"does not match the target's embedding {tuple(embed.shape)} and lm_head "
                          f"{tuple(head.shape)}; use a drafter trained for this target")
    if flat["hidden_act"] not in ("silu", "gelu", "gelu_pytorch_tanh"):
        raise ConfigError(f"drafter hidden_act {flat['hidden_act']!r} is not supported; use silu, gelu or "
                          "gelu_pytorch_tanh")
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ConfigError(f"the drafter's {name} holds NaN or infinite values; it was saved before being trained "
                              "or loaded")
    d2t = draft_map(flat, tensors, vocab)
    inv_freq, rope_scale = drafter_rope(flat, rope, tensors)
    flat["rope"] = rope  # what save() writes back
    dtype = model_dtype(plan)
    device = torch.empty(0, device=device).device
    with torch.device("meta"):
        drafter = cls(flat, taps, tuple(plan.taps.index(t) for t in taps), n_slots=plan.n_slots)
    drafter = drafter.to_empty(device=device)
    state = {k: v for k, v in tensors.items() if k not in ("t2d", "embed_tokens.weight", "rotary.inv_freq")}
    if drafter.lm_head is None:
        state.pop("lm_head.weight", None)  # speculators may store the verifier's head; the target's own is used
    state["d2t"] = d2t.long()
    for name in ("predecessor_codebook", "successor_codebook"):  # z-lab saves DFlash2's codebooks as embeddings
        key = f"candidate_selector.{name}"
        if key + ".weight" in state:
            state[key] = state.pop(key + ".weight")
    expected = set(drafter.state_dict())
    extra, absent = sorted(set(state) - expected), sorted(expected - set(state))
    if extra:
        raise ConfigError(f"the DFlash drafter has tensors its config does not account for: {', '.join(extra[:4])}; "
                          "ppsplit refuses to drop them (a DFlash variant, or a config key missing)")
    if absent:
        raise ConfigError(f"the DFlash drafter's config needs tensors the checkpoint lacks: {', '.join(absent[:4])}")
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as e:
        lines = str(e).splitlines()
        raise ConfigError(f"the DFlash drafter's tensors do not fit its config: {(lines[1:] or lines)[0].strip()}") \
            from None
    drafter = drafter.to(dtype=dtype)
    for name, table in (("embed_tokens", embed), ("head", head)):
        same = table.device == device and table.dtype == dtype  # shared, not copied, when it already lives here
        setattr(drafter, name, table.detach() if same else table.detach().to(device=device, dtype=dtype))
    drafter.inv_freq, drafter.rope_scale = inv_freq.to(device), rope_scale
    return drafter.eval()


@torch.no_grad()
def block_agreement(split, drafter: DFlashDrafter, ids: torch.Tensor, start: int = 1) -> tuple[int, int]:
    """Teacher-forced first-draft agreement on ``ids [B, T]``: how often the block anchored at position ``a`` (the
    context: the target's taps of positions ``< a``; the block: ``ids[a]``, then masks) drafts the target's own
    greedy token ``ids[a + 1]`` first (for ``a >= start``). Returns ``(agreeing, total)``; a drafter read under the
    wrong tap numbering scores near zero."""
    batch, tokens = ids.shape
    last = drafter.fc.weight.device
    _, aux = split(ids, torch.arange(tokens, device=ids.device))
    aux, ids = aux.to(last), ids.to(last)
    width = drafter.block_size
    masks = torch.full((width - 1,), drafter.mask_token_id, dtype=torch.long, device=last)
    agree = total = 0
    for b in range(batch):
        for a in range(max(start, 1), tokens - 1):
            rows = drafter.block_rows(aux[:, b, :a], torch.cat([ids[b, a:a + 1], masks]),
                                      torch.arange(a, device=last), torch.arange(a, a + width, device=last))
            rows = rows[None, drafter.first_draft_row:drafter.first_draft_row + 1]
            if hasattr(drafter, "heads"):  # DSpark, DFlash2: the first draft through their heads
                first = drafter.heads(rows, ids[b, a:a + 1], lambda x, i: drafter.target_ids[x.argmax(-1)])[0]
            else:
                first = drafter.target_ids[drafter.logits(rows).argmax(-1)]
            agree += int(first.flatten()[0] == ids[b, a + 1])
            total += 1
    return agree, total
