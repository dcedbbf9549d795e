"""The EAGLE-3 drafter on the last stage: ``load_drafter`` and the ``Eagle3Drafter`` module.

An EAGLE-3 checkpoint is a one-layer Llama (SafeAILab/EAGLE ``cnets.py``, SpecForge, vLLM and SGLang
``llama_eagle3.py``). Its forward, for a token at position ``i``::

    x   = fc(cat(aux taps of position i, ascending tap id))  # skipped for the drafter's own H-wide output
    res = x                          (or hidden_norm(x) with norm_before_residual)
    h   = cat(input_layernorm(embed(token i+1)), hidden_norm(x))            # width 2H, embedding first
    h   = res + o_proj(attention(q/k/v_proj(h), rotary at position i))     # causal, over this drafter's cache
    out = h + mlp(post_attention_layernorm(h))        # pre-norm ``out`` feeds the next draft step
    logits = lm_head(norm(out))                      # draft vocabulary; target id = draft id + d2t[draft id]

The drafter keeps its own static KV cache addressed by positions, like the stages (``ppsplit.cache``): a call
writes K/V at ``positions`` and attends under a causal mask on positions, so rejected drafts are overwritten by
the next call at the same positions; nothing is rolled back. No host synchronisation in ``forward``: a draft
step can be captured in a CUDA graph.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from ppsplit.errors import ConfigError

CONVENTIONS = {"sglang": 1, "specforge": 1, "vllm": 0}  # shift from a config's tap ids to ppsplit's (vLLM) ids
_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
_LAYER = "midlayer."


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in fp32, cast back, scale."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = _ACTIVATIONS[act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.hidden_norm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.self_attn = _Attention(h, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                                    cfg["attention_bias"])
        self.mlp = _MLP(h, cfg["intermediate_size"], cfg["hidden_act"])


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 drafter fed by the packed aux buffer of a split (built by ``load_drafter``).

    ``taps``: the target taps it reads (ppsplit/vLLM numbering, ascending); ``slots``: their slots in the split's
    aux buffer. ``embed_tokens`` is the target's input embedding (a buffer: the drafter's own copy, or a reference
    to the split's tensor on the last stage's device).

    Example::

        drafter = ppsplit.load_drafter("eagle3-llama-3.1-8b", split=split)
        logits, hidden = drafter(aux, next_tokens, positions)      # prefill: aux [n_slots, B, T, H]
        ids, _ = drafter.draft(aux, next_tokens, positions, index=T - 1, k=4)   # [B, 4] target-vocab drafts
    """

    def __init__(self, cfg: dict, taps: tuple[int, ...], slots: tuple[int, ...], embed: torch.Tensor,
                 inv_freq: torch.Tensor, rope_scale: float = 1.0):
        super().__init__()
        self.cfg = dict(cfg)
        self.taps, self.slots = tuple(taps), tuple(slots)
        h, th = cfg["hidden_size"], cfg["target_hidden_size"]
        self.hidden_size, self.target_hidden_size = h, th
        self.norm_before_residual = bool(cfg.get("norm_before_residual", False))
        self.fc = nn.Linear(len(taps) * th, h, bias=cfg.get("fc_bias", False))
        self.midlayer = _Layer(cfg)
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)
        self.register_buffer("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
        self.register_buffer("embed_tokens", embed, persistent=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_scale = float(rope_scale)
        for name in ("cache_keys", "cache_values", "cache_positions"):  # set by allocate_cache
            self.register_buffer(name, None, persistent=False)

    # -- state ---------------------------------------------------------------------------------------------------
    @property
    def target_ids(self) -> torch.Tensor:
        """Target-vocabulary id of each draft id: ``arange(draft_vocab) + d2t``."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def allocate_cache(self, batch: int, max_len: int) -> "Eagle3Drafter":
        """Give the drafter a static KV cache of ``batch`` sequences x ``max_len`` positions (zeros)."""
        attn = self.midlayer.self_attn
        shape = (batch, attn.kv_heads, max_len, attn.head_dim)
        dev, dtype = self.fc.weight.device, self.fc.weight.dtype
        self.cache_keys = torch.zeros(shape, dtype=dtype, device=dev)
        self.cache_values = torch.zeros(shape, dtype=dtype, device=dev)
        self.cache_positions = torch.arange(max_len, device=dev)
        return self

    # -- forward -------------------------------------------------------------------------------------------------
    def adapt(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc`` over the taps of the slot-major aux ``[n_slots, B, T, Ht]`` -> ``[B, T, H]``, one matmul per tap
        accumulating into one output: the concatenated ``[B, T, 3 * Ht]`` input is never materialised."""
        _, batch, tokens, th = aux.shape
        flat = aux.reshape(aux.shape[0], batch * tokens, th)
        weight = self.fc.weight  # [H, n * Ht]; the columns of tap i are weight[:, i*Ht:(i+1)*Ht] (a strided view)
        out = F.linear(flat[self.slots[0]], weight[:, :th], self.fc.bias)
        for i, slot in enumerate(self.slots[1:], start=1):
            out = torch.addmm(out, flat[slot], weight[:, i * th:(i + 1) * th].t())
        return out.view(batch, tokens, self.hidden_size)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """One drafter pass: ``hidden`` is the aux buffer ``[n_slots, B, T, Ht]`` (goes through ``fc``) or the
        drafter's own previous output ``[B, T, H]``; ``tokens [B, T]`` the target-vocab ids that follow each
        position; ``positions [T]``. Returns ``(draft logits [B, T, draft_vocab], out [B, T, H])``, ``out`` before
        the final norm (the next step's ``hidden``). Writes this pass's K/V into the cache at ``positions``."""
        x = self.adapt(hidden) if hidden.dim() == 4 else hidden
        layer = self.midlayer
        normed = layer.hidden_norm(x)
        residual = normed if self.norm_before_residual else x
        emb = layer.input_layernorm(F.embedding(tokens, self.embed_tokens).to(x.dtype))
        h = residual + self._attention(torch.cat([emb, normed], dim=-1), positions)
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(out)), out

    def _attention(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        attn = self.midlayer.self_attn
        batch, tokens, _ = h.shape
        q = attn.q_proj(h).view(batch, tokens, attn.heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(batch, tokens, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(batch, tokens, attn.kv_heads, attn.head_dim).transpose(1, 2)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = (angles.cos() * self.rope_scale).to(q.dtype), (angles.sin() * self.rope_scale).to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if self.cache_keys is None or self.training:  # no cache (training): attend within this call
            keys, values, key_positions = k, v, positions
        else:
            keys = self.cache_keys[:batch].index_copy_(2, positions, k)
            values = self.cache_values[:batch].index_copy_(2, positions, v)
            key_positions = self.cache_positions
        mask = key_positions[None, :] <= positions[:, None]
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=attn.heads != attn.kv_heads)
        return attn.o_proj(o.transpose(1, 2).reshape(batch, tokens, attn.heads * attn.head_dim))

    # -- drafting ------------------------------------------------------------------------------------------------
    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """One greedy draft step, CUDA-graph capturable: ``(hidden [B, 1, H], tokens [B, 1], positions [1]) ->
        (next target-vocab ids [B], out [B, 1, H])``."""
        logits, out = self(hidden, tokens, positions)
        return self.target_ids[logits[:, -1].argmax(-1)], out

    @torch.no_grad()
    def draft(self, aux: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, index, k: int,
              temperature: float = 0.0, generator: torch.Generator | None = None):
        """Feed a window of target features, then draft a chain of ``k`` tokens from its row ``index``.

        ``aux [n_slots, B, T, Ht]`` holds the target's taps at ``positions [T]``, ``tokens [B, T]`` the token that
        follows each position; ``index`` (int or 0-d tensor) is the last committed row: rows after it are stale and
        are overwritten later. Returns ``(ids [B, k], q)``: target-vocab drafts, and for ``temperature > 0`` the
        draft distributions over the target vocabulary ``[B, k, V]`` they were sampled from (else ``None``)."""
        if k < 1:
            raise ConfigError(f"the number of draft tokens must be at least 1, but got {k}")
        index = torch.as_tensor(index, device=positions.device).view(1)
        logits, out = self(aux, tokens, positions)
        logits, out, pos = logits.index_select(1, index), out.index_select(1, index), positions.index_select(0, index)
        ids, dists = [], []
        for j in range(k):
            if j:
                pos = pos + 1
                logits, out = self(out, ids[-1][:, None], pos)
            token, dist = self._pick(logits[:, -1], temperature, generator)
            ids.append(token)
            dists.append(dist)
        return torch.stack(ids, 1), (torch.stack(dists, 1) if temperature > 0 else None)

    def _pick(self, logits: torch.Tensor, temperature: float, generator):
        if temperature <= 0:
            return self.target_ids[logits.argmax(-1)], None
        from ppsplit.speculative import sample

        probs = torch.softmax(logits.float() / temperature, dim=-1)
        draft_id = sample(probs, generator)
        full = probs.new_zeros(probs.shape[0], self.embed_tokens.shape[0])
        full[:, self.target_ids] = probs  # d2t is one-to-one: q over the target vocabulary
        return self.target_ids[draft_id], full


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


# -- loading -----------------------------------------------------------------------------------------------------
def drafter_taps(cfg: dict, num_layers: int, aux_convention: str = "sglang") -> tuple[int, ...]:
    """The taps (ppsplit/vLLM numbering) a drafter config asks for: ``eagle_aux_hidden_state_layer_ids`` read in
    ``aux_convention`` (``"sglang"``/``"specforge"``: layer outputs, +1; ``"vllm"``: as written); absent ids mean
    EAGLE-3's default ``(2, L//2, L-3)``. A compiled folder's drafter stores resolved ids as ``ppsplit_taps``."""
    if "ppsplit_taps" in cfg:
        return tuple(cfg["ppsplit_taps"])
    if aux_convention not in CONVENTIONS:
        raise ConfigError(f"aux_convention must be 'sglang' (alias 'specforge': the config's ids are layer outputs, "
                          f"+1) or 'vllm' (ids used as written), but got {aux_convention!r}")
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return tuple(sorted({2, num_layers // 2, num_layers - 3}))
    shift = CONVENTIONS[aux_convention]
    taps = tuple(int(i) + shift for i in ids)
    for given, tap in zip(ids, taps):
        if not 0 <= tap <= num_layers:
            raise ConfigError(f"drafter tap id {given} is out of range: with aux_convention={aux_convention!r} ids go "
                              f"from {-shift} to {num_layers - shift} for this {num_layers}-layer target; pass the "
                              "other aux_convention or fix eagle_aux_hidden_state_layer_ids")
    if list(taps) != sorted(set(taps)):
        raise ConfigError(f"drafter tap ids {list(ids)} must be distinct and ascending (the order fc was trained on)")
    return taps


def resolve_drafter(path_or_hub_id: str) -> str:
    """A local folder with the drafter's ``config.json`` and weights (a hub id: local HF cache, then network)."""
    if os.path.isdir(path_or_hub_id):
        return path_or_hub_id
    if os.path.exists(path_or_hub_id) or path_or_hub_id.startswith((".", "/", "~")):
        raise ConfigError(f"drafter {path_or_hub_id} is not a folder; pass a folder with config.json and "
                          "model.safetensors or pytorch_model.bin, or a hub id")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.bin"]
    for local in (True, False):
        try:
            return snapshot_download(path_or_hub_id, allow_patterns=patterns, local_files_only=local)
        except Exception as e:
            error = e
    raise ConfigError(f"drafter {path_or_hub_id} is neither a local folder nor a reachable hub id "
                      f"({type(error).__name__}); pass a folder with config.json and weights") from None


def read_drafter(folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, tensors)`` of a drafter folder, tensor names normalised to ``midlayer.``. Reads
    ``model.safetensors`` / ``drafter.safetensors``, or ``pytorch_model.bin`` with ``weights_only=True`` only."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {folder}/config.json ({e}); an EAGLE-3 drafter folder needs one") from None
    for name in ("model.safetensors", "drafter.safetensors"):
        if os.path.isfile(os.path.join(folder, name)):
            from safetensors.torch import load_file

            tensors = load_file(os.path.join(folder, name))
            break
    else:
        path = os.path.join(folder, "pytorch_model.bin")
        if not os.path.isfile(path):
            raise ConfigError(f"{folder} has no model.safetensors or pytorch_model.bin; pass an EAGLE-3 drafter folder")
        try:
            tensors = torch.load(path, map_location="cpu", weights_only=True)  # never unpickle arbitrary objects
        except Exception as e:
            raise ConfigError(f"cannot read {path} as plain tensors ({type(e).__name__}); convert it to "
                              "model.safetensors") from None
    out = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.")
        if name.startswith("layers.0."):  # vLLM's naming of the one layer
            name = _LAYER + name[len("layers.0."):]
        out[name] = t
    return cfg, out


def _normalised_config(cfg: dict, tensors: dict) -> dict:
    h = cfg.get("hidden_size")
    heads = cfg.get("num_attention_heads")
    if not h or not heads:
        raise ConfigError("the drafter config.json needs hidden_size and num_attention_heads (an EAGLE-3 Llama layer)")
    out = dict(cfg)
    out.setdefault("num_key_value_heads", heads)
    out["head_dim"] = cfg.get("head_dim") or h // heads
    out.setdefault("rms_norm_eps", 1e-6)
    out.setdefault("hidden_act", "silu")
    out["target_hidden_size"] = cfg.get("target_hidden_size") or h
    out["draft_vocab_size"] = cfg.get("draft_vocab_size") or cfg.get("vocab_size")
    out["attention_bias"] = f"{_LAYER}self_attn.q_proj.bias" in tensors
    out["fc_bias"] = "fc.bias" in tensors
    if out["hidden_act"] not in _ACTIVATIONS:
        raise ConfigError(f"drafter hidden_act {out['hidden_act']!r} is not supported; use one of {sorted(_ACTIVATIONS)}")
    return out


def _rope(cfg: dict, tensors: dict) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies (and scale) of the drafter config, computed by transformers' own Llama rotary
    code so every rope_scaling type matches; a compiled folder stores them and needs no transformers."""
    if "rotary.inv_freq" in tensors:
        return tensors["rotary.inv_freq"], float(cfg.get("ppsplit_rope_scale", 1.0))
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")
    rotary = LlamaRotaryEmbedding(LlamaConfig(**{k: cfg[k] for k in keys if cfg.get(k) is not None}))
    return rotary.inv_freq.float(), float(getattr(rotary, "attention_scaling", 1.0))


def target_embedding(split) -> torch.Tensor:
    """The target's input-embedding weight: the table read by the ``aten.embedding`` op of stage 0."""
    stage = split.stages[0]
    for node in stage.graph.nodes:
        if node.op == "call_function" and "embedding" in str(node.target) and node.args \
                and getattr(node.args[0], "op", None) == "get_attr":
            return stage.get_parameter(node.args[0].target) if node.args[0].target in dict(stage.named_parameters()) \
                else stage.get_buffer(node.args[0].target)
    raise ConfigError("stage 0 of the split has no embedding lookup; the drafter needs the target's input embedding "
                      "(give the drafter its own embed_tokens)")


def load_drafter(path_or_hub_id: str, split=None, aux_convention: str = "sglang", device=None) -> Eagle3Drafter:
    """Load an EAGLE-3 drafter for ``split`` (which must carry the drafter's taps), on its last stage's device.

    Both file formats (``model.safetensors``; ``pytorch_model.bin`` read with ``weights_only=True``), both
    namings (``midlayer.`` and vLLM's ``layers.0.``), a separate or shared embedding (without ``embed_tokens``
    the drafter references the target's embedding, copied to the last stage's device if stage 0 lives
    elsewhere). Tap ids come from the config in ``aux_convention`` numbering (see ``drafter_taps``).

    Example::

        split = ppsplit.split_model(model, pp=4, aux="eagle3", cache=ppsplit.CacheConfig(1, 4096))
        drafter = ppsplit.load_drafter("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", split=split)
        out, stats = split.generate(ids, 64, drafter=drafter, num_draft_tokens=4, return_stats=True)
    """
    from ppsplit.runtime import stage_device

    if split is None:
        raise ConfigError("load_drafter needs split=: the drafter reads the split's taps and embedding; split the "
                          "target with the drafter's taps first (see drafter_taps)")
    cfg, tensors = read_drafter(resolve_drafter(path_or_hub_id))
    return build_drafter(cfg, tensors, split, aux_convention, device if device is not None else
                         stage_device(split.stages[-1]))


def build_drafter(cfg: dict, tensors: dict, split, aux_convention: str, device) -> Eagle3Drafter:
    plan = split.plan
    cfg = _normalised_config(cfg, tensors)
    for name in ("fc.weight", "lm_head.weight", f"{_LAYER}self_attn.q_proj.weight"):
        if name not in tensors:
            raise ConfigError(f"the drafter has no {name} tensor; it is not an EAGLE-3 checkpoint (its tensors: "
                              f"{sorted(tensors)[:4]} ...)")
    taps = drafter_taps(cfg, plan.num_layers, aux_convention)
    missing = [t for t in taps if t not in plan.taps]
    if missing:
        raise ConfigError(f"the drafter reads taps {list(taps)} but the split carries {list(plan.taps)} (missing "
                          f"{missing}); split the target with aux={','.join(map(str, taps))}")
    th = cfg["target_hidden_size"]
    if th != plan.hidden_size:
        raise ConfigError(f"the drafter expects target hidden size {th} but the target has {plan.hidden_size}; "
                          "use a drafter trained for this target")
    if tuple(tensors["fc.weight"].shape) != (cfg["hidden_size"], len(taps) * th):
        raise ConfigError(f"drafter fc.weight is {tuple(tensors['fc.weight'].shape)}, expected "
                          f"({cfg['hidden_size']}, {len(taps) * th}) for {len(taps)} taps of width {th}")
    own_embed = tensors.get("embed_tokens.weight")
    embed = own_embed if own_embed is not None else target_embedding(split).detach()
    vocab = embed.shape[0]
    if cfg.get("vocab_size", vocab) != vocab or embed.shape[1] != cfg["hidden_size"]:
        raise ConfigError(f"the drafter's vocabulary/embedding ({cfg.get('vocab_size')} x {cfg['hidden_size']}) does "
                          f"not match the target's embedding {tuple(embed.shape)}; use a drafter trained for this target")
    d2t = tensors.get("d2t")
    if d2t is None:
        if cfg["draft_vocab_size"] != vocab:
            raise ConfigError(f"the drafter has no d2t tensor but its draft vocabulary ({cfg['draft_vocab_size']}) is "
                              f"smaller than the target's ({vocab}); d2t maps draft ids to target ids")
        d2t = torch.zeros(vocab, dtype=torch.long)
    targets = torch.arange(d2t.shape[0]) + d2t.long().cpu()
    if d2t.shape[0] != cfg["draft_vocab_size"] or targets.min() < 0 or targets.max() >= vocab \
            or targets.unique().numel() != targets.numel():
        raise ConfigError(f"the drafter's d2t ({d2t.shape[0]} entries) does not map its {cfg['draft_vocab_size']} "
                          f"draft ids one-to-one into the target vocabulary of {vocab}")
    inv_freq, rope_scale = _rope(cfg, tensors)
    slots = tuple(plan.taps.index(t) for t in taps)
    dtype = getattr(torch, plan.dtype)
    with torch.device("meta"):
        drafter = Eagle3Drafter(cfg, taps, slots, torch.empty(0), torch.empty(0))
    state = {k: v for k, v in tensors.items() if k not in ("t2d", "embed_tokens.weight", "rotary.inv_freq")}
    state["d2t"] = d2t.long()
    drafter = drafter.to_empty(device=device)
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ConfigError(f"the drafter's tensors do not fit an EAGLE-3 layer: {str(e).splitlines()[1].strip()}") from None
    drafter = drafter.to(dtype=dtype)
    drafter.d2t = drafter.d2t.long()
    # A shared embedding stays a reference when it already lives on this device in this dtype (one process, one
    # device); otherwise the last stage gets its own copy, so the table never travels per step.
    same = own_embed is None and embed.device == torch.empty(0, device=device).device and embed.dtype == dtype
    drafter.embed_tokens = embed if same else embed.to(device=device, dtype=dtype)
    drafter.inv_freq = inv_freq.float().to(device)
    drafter.rope_scale = rope_scale
    if plan.max_len:
        drafter.allocate_cache(plan.max_batch, plan.max_len)
    return drafter.eval()


def save_drafter(drafter: Eagle3Drafter, folder: str) -> None:
    """Write ``drafter`` as ``folder/config.json`` + ``folder/drafter.safetensors``: resolved taps, the rotary
    frequencies and the embedding it uses, so that loading needs neither transformers nor the target's stage 0."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    cfg = dict(drafter.cfg, ppsplit_taps=list(drafter.taps), ppsplit_rope_scale=drafter.rope_scale)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    tensors["embed_tokens.weight"] = drafter.embed_tokens.detach().contiguous().cpu()
    tensors["rotary.inv_freq"] = drafter.inv_freq.detach().cpu()
    save_file(tensors, os.path.join(folder, "drafter.safetensors"), metadata={"format": "pt"})
