"""The static KV cache the trace pass hands the model: ``CacheConfig(batch_size, max_len)`` made concrete.

Each decoder layer's keys and values live in two buffers ``kv_cache.<layer>.keys`` / ``.values`` of shape
``[batch_size, kv_heads, max_len, head_dim]``; a sparse-attention indexer (DeepSeek-V3.2's DSA) keeps its keys in a
third, ``kv_cache.<layer>.indexer_keys`` of ``[batch_size, max_len, index_head_dim]``. A step writes its ``T`` new
keys and values at ``positions`` (the cache positions of the new tokens) and attends over the whole buffer under a
causal mask on those positions. Nothing else is remembered between steps: there is no length counter. A rejected
draft token leaves stale entries beyond the accepted position; the mask hides them, and the next step's
``positions`` overwrite them.

A short convolution (LFM2's ``conv`` layers) keeps its inputs the same way, ``kv_cache.<layer>.conv_inputs`` of
``[batch_size, channels, max_len]``, written at ``positions``; each step reads back the window the convolution needs
(the ``kernel - 1`` inputs before its first token, zeros before position 0). Its state is therefore addressed by
position too: a verify pass's rejected drafts are overwritten like their keys, and prefill, decode and verify are
one graph.

A recurrent layer (Mamba-1, Mamba-2 / SSD, Gated DeltaNet) keeps a ring ``kv_cache.<layer>.states`` of
``[batch_size, S, *state]`` float32 states (``S = CacheConfig.state_slots``), the state after position ``p`` in
slot ``p % S``
(``ppsplit/triton_kernels/recurrent.py``): a step starts from the state before its first position and keeps the
state after each of its last tokens, so a verify pass of up to ``S`` tokens leaves behind the state
after every one of them and the next step picks the one after the last accepted token. The layer's scan (the
model file's ``mamba_selective_scan``, ``mamba2_chunk_scan`` or ``torch_chunk_gated_delta_rule``) is routed to
ppsplit's op while tracing (``RecurrentScans``); the rest of the layer runs as the model wrote it, its short
convolution through the conv inputs above.

The layer classes plug into Hugging Face's ``Cache`` interface (``update``, ``get_mask_sizes``,
``get_query_offset``, ``get_conv_state`` / ``update_conv_state``), so the model's own code runs unchanged.
"""
from __future__ import annotations

import contextlib
import inspect
import sys

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, StaticLayer

import ppsplit.triton_kernels.recurrent  # noqa: F401  (registers torch.ops.ppsplit.gated_delta_scan / ssm_scan)
from ppsplit.core.errors import ConfigError



class _PositionedLayer(StaticLayer):
    """One layer's static cache, written at the cache's current ``positions``."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: "PositionedCache", max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.owner = owner
        self.shapes: tuple | None = None  # ((kv_heads, k_dim), (kv_heads, v_dim), dtype) seen by a recording run
        self.conv_shape: tuple | None = None  # (channels, kernel, dtype) of a short convolution, seen the same way
        self.conv_inputs: torch.Tensor | None = None
        self.indexer_shape: tuple | None = None  # ((index_head_dim,), dtype) of the indexer keys, if the layer has one
        self.indexer_keys: torch.Tensor | None = None
        self.state_shape: tuple | None = None  # a recurrent layer's state shape, seen by a recording run
        self.states: torch.Tensor | None = None

    def __deepcopy__(self, memo):
        # A model that copies cache layers for itself (Dory's per-loop copies) gets an unbound layer of the same cache,
        # not a copy of the owner and its buffers.
        return _PositionedLayer(self.owner, self.max_cache_len)

    def lazy_initialization(self, key_states, value_states):  # buffers are bound by the owner, never allocated here
        raise RuntimeError("ppsplit cache layer used before its buffers were bound")

    def update(self, key_states, value_states, *args, **kwargs):
        if self.owner.recording:
            self.shapes = (tuple(key_states.shape[1:2]) + tuple(key_states.shape[3:]),
                           tuple(value_states.shape[1:2]) + tuple(value_states.shape[3:]), key_states.dtype)
            return key_states, value_states
        positions = self.owner.positions
        batch = key_states.shape[0]
        # Batches smaller than the cache use its leading rows.
        keys = self.keys[:batch].index_copy_(2, positions, key_states)
        values = self.values[:batch].index_copy_(2, positions, value_states)
        return keys, values

    def update_conv_state(self, conv_states: torch.Tensor, kernel: int) -> torch.Tensor:
        """Write a short convolution's new inputs ``[B, C, T]`` at ``positions`` and return the window
        ``[B, C, kernel - 1 + T]`` it convolves: the inputs at the ``kernel - 1`` positions before the first new
        token (zeros before position 0), then the new ones."""
        if self.owner.recording:
            self.conv_shape = (conv_states.shape[1], kernel, conv_states.dtype)
            return conv_states
        positions = self.owner.positions
        inputs = self.conv_inputs[:conv_states.shape[0]].index_copy_(2, positions, conv_states)
        before = positions[:1] - torch.arange(kernel - 1, 0, -1, device=positions.device)
        where = torch.cat([before, positions])
        window = inputs.index_select(2, where.clamp(min=0))
        return window * (where >= 0).to(window.dtype)

    def update_indexer(self, indexer_key_states):
        """Indexer keys ``[B, T, D]`` are per token position like K/V: written at ``positions``, the whole buffer
        returned; the model's mask hides unwritten and stale slots from the indexer's scores, as it does for K/V."""
        if self.owner.recording:
            self.indexer_shape = (tuple(indexer_key_states.shape[2:]), indexer_key_states.dtype)
            return indexer_key_states
        if self.indexer_keys is None:
            raise RuntimeError("ppsplit cache layer has no indexer buffer bound")
        batch = indexer_key_states.shape[0]
        return self.indexer_keys[:batch].index_copy_(1, self.owner.positions, indexer_key_states)

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        if self.owner.recording:
            query_length = args[0] if args and isinstance(args[0], int) else self.owner.positions.shape[0]
            return query_length, 0
        return self.max_cache_len, 0

    def get_seq_length(self, *args, **kwargs):
        # The query offset HF's masks use: the position of the first new token (a tensor, so no host sync).
        return 0 if self.owner.recording else self.owner.positions[0]

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.keys is not None:
            self.keys.zero_()
            self.values.zero_()
        if self.indexer_keys is not None:
            self.indexer_keys.zero_()


class PositionedCache(Cache):
    """The cache object handed to the model while tracing; its tensors are the wrapper's buffers."""

    def __init__(self, num_layers: int, max_len: int):
        super().__init__(layers=[_PositionedLayer(self, max_len) for _ in range(num_layers)])
        self.positions: torch.Tensor | None = None
        self.recording = False
        self.length_as_size = False  # the trace's fallback for models that do arithmetic on the cache length

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx >= len(self.layers):
            raise ConfigError(f"the model writes cache layer {layer_idx} but has {len(self.layers)} decoder layers "
                              "(several attentions per layer, or a cache indexed otherwise); ppsplit's cache holds one "
                              "attention per decoder layer, indexed like them, so it cannot give this model a cache; "
                              "split it without cache=")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0):
        """What the model reads as the cached length: the first new token's position, a tensor (no host sync).
        With ``length_as_size``, an integer known to lie in ``[0, max_len)``, so export can prove size arithmetic
        on it (the trace then checks that no read of it is left in the graph)."""
        if self.length_as_size and not self.recording:
            n = self.positions[0].item()
            torch._check(n >= 0)
            torch._check(n < self.layers[layer_idx].max_cache_len)
            return n
        return super().get_seq_length(layer_idx)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        # Defined here too: transformers releases before the indexed cache layers have no Cache.update_indexer.
        return self.layers[layer_idx].update_indexer(indexer_key_states)

    def get_query_offset(self, layer_idx: int = 0):
        return self.layers[layer_idx].get_seq_length()

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        # No separate decode state: the model then takes the path that asks update_conv_state for its window, the
        # same for one token and for many (HF's one-token branch would make decode a different graph).
        return None

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return False  # what transformers before 5.24 asks instead of get_conv_state, for the same choice

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return None  # the scan reads its start state from the ring itself (RecurrentScans)

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        return recurrent_states  # the scan has written the ring already

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        if state_idx or conv_kernel_size is None:
            raise NotImplementedError("ppsplit's cache holds one short-convolution state per layer, of a known kernel")
        return self.layers[layer_idx].update_conv_state(conv_states, conv_kernel_size)

    def bind(self, tensors: dict[int, dict[str, torch.Tensor]]) -> None:
        """Point each layer at its buffers (``keys`` and ``values``, ``indexer_keys``, ``conv_inputs``, ``states``) by
        layer index."""
        for i, named in tensors.items():
            layer = self.layers[i]
            layer.conv_inputs = named.get("conv_inputs")
            layer.states = named.get("states")
            layer.indexer_keys = named.get("indexer_keys")
            if "keys" not in named:
                continue
            keys, values = named["keys"], named["values"]
            layer.keys, layer.values = keys, values
            layer.is_initialized = True
            layer.device = keys.device
            layer.batch_size, layer.num_heads = keys.shape[:2]
            layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]


def is_cache_part(obj) -> bool:
    """Whether ``obj`` is ppsplit's cache or one of its layers (what a model reading a missing attribute read it on)."""
    return isinstance(obj, (PositionedCache, _PositionedLayer))


# The scans of recurrent layers in transformers' model files, by function name: what ppsplit routes to its ops.
_SCANS = {"torch_chunk_gated_delta_rule": "gated_delta", "torch_recurrent_gated_delta_rule": "gated_delta",
          "chunk_kimi_delta_attention": "gated_delta", "recurrent_kimi_delta_attention": "gated_delta",
          "mamba2_chunk_scan": "ssd", "mamba_selective_scan": "mamba"}


def _scan_called(module: torch.nn.Module) -> str | None:
    """The kind of scan ``module.forward`` calls, if it is a recurrent layer's mixer (it has a ``layer_idx`` and its
    model file defines the scan)."""
    if not isinstance(getattr(module, "layer_idx", None), int):
        return None
    file = sys.modules.get(type(module).__module__)
    names = [n for n in _SCANS if file is not None and hasattr(file, n)]
    if not names:
        return None
    try:
        code = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None
    kinds = {_SCANS[n] for n in names if n + "(" in code}
    return kinds.pop() if len(kinds) == 1 else None


class RecurrentScans:
    """Routes a model's recurrent scans to ppsplit's ring-state ops while it runs (and is traced).

    The mixers are the modules with a ``layer_idx`` whose ``forward`` calls one of the scans above, defined in its
    model file; ``unsupported`` lists the modules with an ``A_log`` (a recurrence's decay) outside every mixer:
    another recurrence, which the cache cannot hold. Without a cache the scans are routed too, each call starting
    from zeros: Mamba-1's reference loop would fix the token count, and exporting the chunked forms takes a minute per
    model for the same function."""

    def __init__(self, model: torch.nn.Module):
        self.mixers: dict[int, str] = {}  # layer index -> kind of scan
        self.unsupported: list[str] = []
        self._files: dict[str, object] = {}
        self._hooks_on: list[torch.nn.Module] = []
        inside: list[str] = []
        for name, module in model.named_modules():
            kind = _scan_called(module)
            if kind is not None:
                self.mixers[module.layer_idx] = kind
                self._files[type(module).__module__] = sys.modules[type(module).__module__]
                self._hooks_on.append(module)
                inside.append(name + ".")
            elif hasattr(module, "A_log") and not any(name.startswith(m) for m in inside):
                self.unsupported.append(f"{name} ({type(module).__name__})")
        self.cache: PositionedCache | None = None
        self.positions: torch.Tensor | None = None
        self.active: int | None = None

    @contextlib.contextmanager
    def routed(self, cache: "PositionedCache | None", positions: torch.Tensor):
        """Within the block, the model's scans run ppsplit's ops on ``cache``'s rings (or on a ring of its own per
        call, without a cache), starting at ``positions``."""
        kinds = set(self.mixers.values())
        if not kinds:
            yield
            return
        self.cache, self.positions = cache, positions
        saved, hooks = [], []
        try:
            for file in self._files.values():
                for name, kind in _SCANS.items():
                    if kind in kinds and hasattr(file, name):
                        saved.append((file, name, getattr(file, name)))
                        setattr(file, name, getattr(self, "_" + kind))
            for module in self._hooks_on:
                hooks.append(module.register_forward_pre_hook(self._enter(module.layer_idx)))
            yield
        finally:
            for file, name, fn in saved:
                setattr(file, name, fn)
            for hook in hooks:
                hook.remove()
            self.cache = self.positions = self.active = None

    def _enter(self, layer_idx: int):
        def hook(module, args):
            self.active = layer_idx
        return hook

    def _ring(self, batch: int, state: tuple, like: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        if cache is None or cache.recording:
            if cache is not None:
                cache.layers[self.active].state_shape = tuple(int(s) for s in state)
            return torch.zeros(batch, 1, *state, dtype=torch.float32, device=like.device)  # this call's alone
        ring = cache.layers[self.active].states
        if ring is None:
            raise RuntimeError(f"ppsplit cache layer {self.active} has no recurrent state buffer bound")
        return ring

    def _gated_delta(self, query, key, value, g, beta, *args, **kwargs):
        ring = self._ring(key.shape[0], (value.shape[2], key.shape[3], value.shape[3]), value)
        out = torch.ops.ppsplit.gated_delta_scan(query, key, value, g, beta, ring, self.positions,
                                                 bool(kwargs.get("use_qk_l2norm_in_kernel", False)))
        return out, (ring if kwargs.get("output_final_state") else None)

    def _ssd(self, hidden_states, dt, A, B, C, *args, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        """Mamba-2's ``mamba2_chunk_scan``: ``hidden_states [B, T, H, P]``, ``dt [B, T, H]``, ``A [H]``,
        ``B, C [B, T, G, N]``; the output in float32 like the model's."""
        if z is not None:
            raise NotImplementedError("ppsplit's Mamba-2 scan takes no gate z (the models gate after the norm)")
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            dt = F.softplus(dt)
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
        batch, _, heads, head_dim = hidden_states.shape
        ring = self._ring(batch, (heads, head_dim, B.shape[-1]), hidden_states)
        y = torch.ops.ppsplit.ssm_scan(hidden_states, dt, A, B, C, ring, self.positions)
        if D is not None:
            y = y + D[..., None] * hidden_states.float()
        return (y, ring) if return_final_states else y

    def _mamba(self, hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
               return_last_state=False, **kwargs):
        """Mamba-1's ``mamba_selective_scan``: ``hidden_states, dt [B, D, T]``, ``A [D, N]``, ``B, C [B, N, T]``;
        each channel is a head of one element."""
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = F.softplus(dt)
        batch, channels, _ = hidden_states.shape
        ring = self._ring(batch, (channels, 1, A.shape[-1]), hidden_states)
        y = torch.ops.ppsplit.ssm_scan(hidden_states.transpose(1, 2)[..., None], dt.transpose(1, 2), A,
                                       B.transpose(1, 2)[:, :, None], C.transpose(1, 2)[:, :, None], ring,
                                       self.positions)
        y = y[..., 0].transpose(1, 2)
        if D is not None:
            y = y + hidden_states * D[None, :, None]
        if z is not None:
            y = y * F.silu(z)
        return (y, ring) if return_last_state else y
