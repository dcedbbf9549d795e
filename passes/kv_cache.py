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

The layer classes plug into Hugging Face's ``Cache`` interface (``update``, ``get_mask_sizes``,
``get_query_offset``, ``get_conv_state`` / ``update_conv_state``), so the model's own code runs unchanged.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer


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

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        if state_idx or conv_kernel_size is None:
            raise NotImplementedError("ppsplit's cache holds one short-convolution state per layer, of a known kernel")
        return self.layers[layer_idx].update_conv_state(conv_states, conv_kernel_size)

    def bind(self, tensors: dict[int, dict[str, torch.Tensor]]) -> None:
        """Point each layer at its buffers (``keys`` and ``values``, ``indexer_keys``, or ``conv_inputs``) by layer
        index."""
        for i, named in tensors.items():
            layer = self.layers[i]
            layer.conv_inputs = named.get("conv_inputs")
            layer.indexer_keys = named.get("indexer_keys")
            if "keys" not in named:
                continue
            keys, values = named["keys"], named["values"]
            layer.keys, layer.values = keys, values
            layer.is_initialized = True
            layer.device = keys.device
            layer.batch_size, layer.num_heads = keys.shape[:2]
            layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
