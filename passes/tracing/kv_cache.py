"""The static KV cache the trace pass hands the model: ``CacheConfig(batch_size, max_len)`` made concrete.

Each decoder layer's keys and values live in two buffers ``kv_cache.<layer>.keys`` / ``.values`` of shape
``[batch_size, kv_heads, max_len, head_dim]`` (an MLA layer's hold its latent and its rotary key, one head each, as
it hands them to ``cache.update``); a sparse-attention indexer (DeepSeek-V3.2's DSA) keeps its keys in a third,
``kv_cache.<layer>.indexer_keys`` of ``[batch_size, max_len, index_head_dim]``. A step writes its ``T`` new
keys and values at ``positions`` (the cache positions of the new tokens) and attends over the whole buffer under a
causal mask on those positions. Nothing else is remembered between steps: there is no length counter. A rejected
draft token leaves stale entries beyond the accepted position; the mask hides them, and the next step's
``positions`` overwrite them.

A short convolution (LFM2's ``conv`` layers) keeps its inputs the same way, ``kv_cache.<layer>.conv_inputs`` of
``[batch_size, channels, max_len]`` (a layer's further ones, as Inkling's four, in ``conv_inputs_1`` ...), written
at ``positions``; each step reads back the window the convolution needs
(the ``kernel - 1`` inputs before its first token, zeros before position 0). Its state is therefore addressed by
position too: a verify pass's rejected drafts are overwritten like their keys, and prefill, decode and verify are
one graph.

A recurrent layer (Mamba-1, Mamba-2 / SSD, Gated DeltaNet, lightning attention, RG-LRU) keeps a ring ``kv_cache.<layer>.states`` of
``[batch_size, S, *state]`` float32 states (``S = CacheConfig.state_slots``), the state after position ``p`` in
slot ``p % S``
(``ppsplit/triton_kernels/recurrent.py``): a step starts from the state before its first position and keeps the
state after each of its last tokens, so a verify pass of up to ``S`` tokens leaves behind the state
after every one of them and the next step picks the one after the last accepted token. The layer's scan (the
model file's ``mamba_selective_scan``, ``mamba2_chunk_scan`` or ``torch_chunk_gated_delta_rule``, RG-LRU's
``_rnn_scan`` method) is routed to ppsplit's op while tracing (``RecurrentScans``); the rest of the layer runs as the
model wrote it, its short convolution through the conv inputs above. MiniMax's lightning attention (its recurrence
inline in its forward) has its forward routed whole, as xLSTM's mLSTM backend; RWKV's token mixing runs its one
form for every token count, its token shifts reading the token before from conv inputs; ZAYA's attention
projection reads its q/k convolution windows and the token before from conv inputs (the model keeps only the last
window and the last token's value, which a verify pass could not take back).

The layer classes plug into Hugging Face's ``Cache`` interface (``update``, ``get_mask_sizes``,
``get_query_offset``, ``get_conv_state`` / ``update_conv_state``), so the model's own code runs unchanged.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import sys
import typing

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, StaticLayer

import ppsplit.triton_kernels.recurrent  # noqa: F401  (registers torch.ops.ppsplit.gated_delta_scan / ssm_scan)
from ppsplit.core.errors import ConfigError
from ppsplit.core.fx_utils import CONV_INPUTS, INDEXER_KEYS, conv_index



class _PositionedLayer(StaticLayer):
    """One layer's static cache, written at the cache's current ``positions``."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: "PositionedCache", max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.owner = owner
        self.shapes: tuple | None = None  # ((kv_heads, k_dim), (kv_heads, v_dim), dtype) seen by a recording run
        # Per short convolution of the layer (its state index), (channels, kernel, dtype) seen the same way.
        self.conv_shapes: dict[int, tuple] = {}
        self.conv_inputs: dict[int, torch.Tensor] = {}
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

    def update_conv_state(self, conv_states: torch.Tensor, kernel: int, index: int = 0) -> torch.Tensor:
        """Write a short convolution's new inputs ``[B, C, T]`` at ``positions`` and return the window
        ``[B, C, kernel - 1 + T]`` it convolves: the inputs at the ``kernel - 1`` positions before the first new
        token (zeros before position 0), then the new ones. ``index``: which of the layer's convolutions."""
        if self.owner.recording:
            self.conv_shapes[index] = (conv_states.shape[1], kernel, conv_states.dtype)
            return F.pad(conv_states, (kernel - 1, 0))  # the window's shape, a history of zeros
        positions = self.owner.positions
        inputs = self.conv_inputs[index][:conv_states.shape[0]].index_copy_(2, positions, conv_states)
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

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_layers: int, max_len: int) -> "PositionedCache":
        """A cache for ``model``: also an instance of the model's own cache class where its code insists on one
        (MiniMax refuses any cache but a ``MiniMaxCache``). That class's own methods are shadowed by this one's: the
        state they would keep lives in the rings that ppsplit's routed mixers read instead."""
        cache = cls(num_layers, max_len)
        own = _own_cache_class(model)
        if own is not None and issubclass(own, Cache):
            names = {k for c in own.__mro__ if c not in cls.__mro__ for k in vars(c)} - _CLASS_ATTRS
            shadows = {k: inspect.getattr_static(cls, k) for k in names if hasattr(cls, k)}
            cache.__class__ = type(f"Positioned{own.__name__}", (cls, own), shadows)
        return cache

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

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0  # transformers >= 5.25: no per-token states beside the scan's (the ring keeps each position's)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        if conv_kernel_size is None:
            raise NotImplementedError("ppsplit's cache holds short-convolution inputs of a known kernel")
        return self.layers[layer_idx].update_conv_state(conv_states, conv_kernel_size, state_idx)

    def bind(self, tensors: dict[int, dict[str, torch.Tensor]]) -> None:
        """Point each layer at its buffers (``keys`` and ``values``, ``indexer_keys``, ``conv_inputs``, ``states``) by
        layer index."""
        for i, named in tensors.items():
            layer = self.layers[i]
            layer.conv_inputs = {conv_index(n): t for n, t in named.items() if n.startswith(CONV_INPUTS)}
            layer.states = named.get("states")
            layer.indexer_keys = named.get(INDEXER_KEYS)
            if "keys" not in named:
                continue
            keys, values = named["keys"], named["values"]
            layer.keys, layer.values = keys, values
            layer.is_initialized = True
            layer.device = keys.device
            layer.batch_size, layer.num_heads = keys.shape[:2]
            layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]


_CLASS_ATTRS = {"__module__", "__doc__", "__dict__", "__weakref__", "__qualname__"}


def _own_cache_class(model: torch.nn.Module) -> type | None:
    """A cache class of the model's own (not transformers' generic ones) that a forward of it takes."""
    for module in model.modules():
        try:
            params = inspect.signature(type(module).forward).parameters
        except (TypeError, ValueError):
            continue
        for name in ("cache", "past_key_values"):
            annotation = params[name].annotation if name in params else None
            for kind in typing.get_args(annotation) or (annotation,):
                if isinstance(kind, type) and kind.__module__ not in (Cache.__module__, "builtins") \
                        and kind.__name__.endswith("Cache"):
                    return kind
    return None


def takes_foreign_cache(model: torch.nn.Module) -> bool:
    """Whether ``model`` keeps its state in a cache class of its own that is no ``Cache`` (xLSTM's ``xLSTMCache``
    holds its recurrent states itself): ppsplit's cache cannot stand in for it."""
    own = _own_cache_class(model)
    return own is not None and not issubclass(own, Cache)


def is_cache_part(obj) -> bool:
    """Whether ``obj`` is ppsplit's cache or one of its layers (what a model reading a missing attribute read it on)."""
    return isinstance(obj, (PositionedCache, _PositionedLayer))


# The scans of recurrent layers in transformers' model files, by function name: what ppsplit routes to its ops.
_SCANS = {"torch_chunk_gated_delta_rule": "gated_delta", "torch_recurrent_gated_delta_rule": "gated_delta",
          "chunk_kimi_delta_attention": "gated_delta", "recurrent_kimi_delta_attention": "gated_delta",
          "mamba2_chunk_scan": "ssd", "mamba_selective_scan": "mamba", "rwkv_linear_attention": "wkv"}
# Scans a mixer runs as a method of its own (RecurrentGemma's RG-LRU: ``self._rnn_scan``), by method name.
_METHOD_SCANS = {"_rnn_scan": "lru"}


def _source(cls) -> str:
    """``cls.forward``'s source, then that of each function of its model file it calls by name: transformers 5.25
    moved the mixers' scans and convolutions into such functions (``mamba2_scan_forward``, ``causal_conv1d_forward``,
    which ``kernels`` wraps in modules, so they are read from the file's text)."""
    try:
        code = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""
    helpers = _file_functions(cls.__module__)
    return "\n".join([code, *(source for name, source in helpers.items() if name + "(" in code)])


@functools.cache
def _file_functions(module: str) -> dict[str, str]:
    """The source of each top-level function of ``module`` (a model file), by name."""
    try:
        text = inspect.getsource(sys.modules[module])
    except (KeyError, OSError, TypeError):
        return {}
    return {node.name: ast.get_source_segment(text, node) or "" for node in ast.parse(text).body
            if isinstance(node, ast.FunctionDef)}


def _scan_called(module: torch.nn.Module) -> str | None:
    """The kind of scan ``module.forward`` calls, if it is a recurrent layer's mixer (its model file defines the
    scan)."""
    file = sys.modules.get(type(module).__module__)
    names = [n for n in _SCANS if file is not None and hasattr(file, n)]
    if not names:
        return None
    code = _source(type(module))
    kinds = {_SCANS[n] for n in names if n + "(" in code}
    return kinds.pop() if len(kinds) == 1 else None


def _method_scan(module: torch.nn.Module) -> tuple[str, str] | None:
    """``(method, kind)`` when ``module.forward`` calls a scan method of its own."""
    code = _source(type(module))
    return next(((m, k) for m, k in _METHOD_SCANS.items() if callable(getattr(type(module), m, None))
                 and f"self.{m}(" in code), None)


def _is_lightning(module: torch.nn.Module) -> bool:
    """MiniMax's lightning attention: linear attention with one fixed decay per head (``slope_rate``), kept through
    the cache's ``get_linear_cache`` / ``set_linear_cache``. Its whole forward is routed (the recurrence is inline:
    a per-token loop when the cache holds a state, a loop over blocks of tokens when not)."""
    parts = ("slope_rate", "qkv_proj", "output_gate", "out_proj", "norm", "act_fn", "num_attention_heads", "head_dim")
    return "get_linear_cache(" in _source(type(module)) and all(hasattr(module, p) for p in parts)


_MLSTM_ARGS = {"query", "key", "value", "igate", "fgate", "c_initial", "n_initial", "m_initial"}


def _is_mlstm(module: torch.nn.Module) -> bool:
    """xLSTM's mLSTM backend: a module whose forward takes the mLSTM's gates and its initial states (``C, n, m``)."""
    try:
        return _MLSTM_ARGS <= set(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return False


def _is_cca(module: torch.nn.Module) -> bool:
    """ZAYA's compressed convolutional attention projection: q/k mixed by causal convolutions, half of each value
    head from the token before (``v_proj_delayed``), both kept through the cache."""
    parts = ("conv_qk_depthwise", "conv_qk_grouped", "v_proj_current", "v_proj_delayed", "q_proj", "k_proj",
             "conv_kernel_size", "head_dim", "num_key_value_groups", "layer_idx")
    return all(hasattr(module, p) for p in parts) and "get_conv_state(" in _source(type(module))


def _is_token_shift(module: torch.nn.Module) -> bool:
    """``nn.ZeroPad2d((0, 0, 1, -1))`` over ``[B, T, C]``: each token gets the one before it (RWKV's time shift)."""
    return isinstance(module, torch.nn.ZeroPad2d) and tuple(module.padding) == (0, 0, 1, -1)


def _is_token_mix(module: torch.nn.Module) -> bool:
    """RWKV's token mixing: inputs interpolated between each token and the one before it (``time_shift``), with
    learned ratios (``time_mix_*``), before the projections."""
    return (_is_token_shift(getattr(module, "time_shift", None))
            and all(hasattr(module, p) for p in ("time_mix_key", "time_mix_receptance", "key", "receptance", "value")))


def _is_short_conv(module: torch.nn.Module) -> bool:
    """A depthwise causal ``nn.Conv1d`` (padding ``kernel - 1``): the short convolution of a recurrent block."""
    return (isinstance(module, torch.nn.Conv1d) and module.groups == module.in_channels == module.out_channels
            and module.stride == (1,) and module.dilation == (1,) and module.padding == (module.kernel_size[0] - 1,))


class RecurrentScans:
    """Routes a model's recurrent scans to ppsplit's ring-state ops while it runs (and is traced).

    The mixers are the modules with a ``layer_idx`` whose ``forward`` calls one of the scans above, defined in its
    model file; the modules whose ``forward`` calls a scan method of their own (``_METHOD_SCANS``; their layer from
    their place in the model); and MiniMax-style lightning attention (``_is_lightning``), whose forward is routed
    whole. A mixer that keeps its decoding state on its block (RecurrentGemma's recurrent block holds its
    convolution window and RG-LRU state itself when ``use_cache``) runs its block's whole-sequence form
    (``use_cache=False``), with the block's short causal convolutions reading their window from the cache's inputs
    by position. ``unsupported`` lists the modules with an ``A_log`` (a recurrence's decay) outside every mixer:
    another recurrence, which the cache cannot hold. Without a cache the scans are routed too, each call starting
    from zeros: Mamba-1's reference loop would fix the token count, and exporting the chunked forms takes a minute per
    model for the same function."""

    def __init__(self, model: torch.nn.Module):
        self.mixers: dict[int, str] = {}  # layer index -> kind of scan
        self.convs: set[int] = set()  # layers with short convolutions that keep their inputs by position
        self.unsupported: list[str] = []
        self._files: dict[str, object] = {}
        self._hooks_on: list[tuple[torch.nn.Module, int]] = []  # (mixer, its layer): sets the active ring
        self._patches: list[tuple[torch.nn.Module, str, object]] = []  # (module, attribute, its ppsplit form)
        self._blocks: list[torch.nn.Module] = []  # blocks called with use_cache=False
        modules = dict(model.named_modules())
        inside: list[str] = []
        shifts: dict[int, int] = {}  # layer -> token shifts routed so far (each keeps its inputs in its own buffer)
        for name, module in modules.items():
            kind = _scan_called(module)
            method = _method_scan(module) if kind is None else None
            if kind is not None:
                self._files[type(module).__module__] = sys.modules[type(module).__module__]
            elif method is not None:
                attr, kind = method
                self._patches.append((module, attr, getattr(self, "_" + kind)))
                self._route_block(modules, name)
            elif _is_lightning(module):
                kind = "lightning"
                self._patches.append((module, "forward", self._lightning(module)))
            elif _is_mlstm(module):
                kind = "mlstm"
                self._patches.append((module, "forward", self._mlstm(module)))
            elif _is_cca(module):  # its state is inputs by position, like a short convolution's
                self._patches.append((module, "forward", self._cca(module)))
                self.convs.add(module.layer_idx)
            elif not any(name.startswith(m) for m in inside):
                self._other_state(name, module)
            if kind is not None:
                layer = _layer_index(name, module)
                self.mixers[layer] = kind
                self._hooks_on.append((module, layer))
                inside.append(name + ".")
            if _is_token_mix(module):
                self._route_token_mix(name, module, shifts)
        self.cache: PositionedCache | None = None
        self.positions: torch.Tensor | None = None
        self.active: int | None = None

    def _other_state(self, name: str, module: torch.nn.Module) -> None:
        """A module outside every mixer: short-convolution inputs kept through the cache are served by position; a
        recurrence's decay (``A_log``) or a recurrent state kept through the cache is not."""
        code = _source(type(module))
        if hasattr(module, "A_log") or "get_recurrent_state(" in code:
            self.unsupported.append(f"{name} ({type(module).__name__})")
        elif "update_conv_state(" in code:
            try:
                self.convs.add(_layer_index(name, module))
            except ConfigError:  # no layer of its own: its layer kind decides (refuse_uncached_state)
                pass

    def _route_token_mix(self, name: str, module: torch.nn.Module, shifts: dict) -> None:
        """RWKV's token mixing, in its one form for every token count (the model's own branches on a one-token step),
        its shift reading the token before each one by position."""
        layer = _layer_index(name, module)
        index = shifts[layer] = shifts.get(layer, -1) + 1
        self._patches.append((module.time_shift, "forward", self._shift(module.time_shift, layer, index)))
        if hasattr(module, "extract_key_value"):  # the time mix before the WKV recurrence
            self._patches.append((module, "extract_key_value", _time_mix(module)))
        else:  # the channel mix
            self._patches.append((module, "forward", _channel_mix(module)))
        self.convs.add(layer)

    def _route_block(self, modules: dict, name: str) -> None:
        """The block around a method mixer: whole-sequence form, short convolutions through the cache."""
        parent = name.rpartition(".")[0]
        block = modules[parent]
        if "use_cache" in inspect.signature(block.forward).parameters:
            self._blocks.append(block)
        for child_name, child in block.named_children():
            if _is_short_conv(child):
                self._patches.append((child, "forward", self._conv(child)))
                self._hooks_on.append((child, _layer_index(f"{parent}.{child_name}", child)))

    @contextlib.contextmanager
    def routed(self, cache: "PositionedCache | None", positions: torch.Tensor):
        """Within the block, the model's scans run ppsplit's ops on ``cache``'s rings (or on a ring of its own per
        call, without a cache), starting at ``positions``."""
        kinds = set(self.mixers.values())
        if not kinds and not self._patches:
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
            for module, attr, routed in self._patches:  # instance attributes over the class's own
                setattr(module, attr, routed)
            for module, layer in self._hooks_on:
                hooks.append(module.register_forward_pre_hook(self._enter(layer)))
            for block in self._blocks:
                hooks.append(block.register_forward_pre_hook(_without_use_cache, with_kwargs=True))
            yield
        finally:
            for file, name, fn in saved:
                setattr(file, name, fn)
            for module, attr, _ in self._patches:
                delattr(module, attr)
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

    def _lru(self, hidden_states, recurrent_gate, reset, recurrent_states=None, acc_dtype=torch.float32):
        """RecurrentGemma's ``_rnn_scan``: ``h_t = a_t h_{t-1} + x_t``, ``a`` zeroed where ``reset`` (position 0).
        Returns ``(h, None)``: the ring holds the state, not the module."""
        ring = self._ring(hidden_states.shape[0], (hidden_states.shape[-1],), hidden_states)
        gate = recurrent_gate * ~reset
        return torch.ops.ppsplit.linear_recurrence(hidden_states, gate, ring, self.positions), None

    def _lightning(self, module: torch.nn.Module):
        """MiniMax's ``MiniMaxLightningAttention.forward``: ``S = exp(-slope) S + k v^T; o = S^T q`` per head (its
        decode step; its block-wise prefill is the same recurrence), then the norm, the output gate and the
        projection as the model file has them."""
        heads, dim = module.num_attention_heads, module.head_dim

        def forward(hidden_states, *args, **kwargs):
            batch, tokens, _ = hidden_states.shape
            qkv = module.act_fn(module.qkv_proj(hidden_states)).reshape(batch, tokens, heads, 3 * dim)
            query, key, value = torch.split(qkv, dim, dim=3)
            decay = -module.slope_rate.reshape(1, 1, heads).expand(batch, tokens, heads)
            ring = self._ring(batch, (heads, dim, dim), value)
            out = torch.ops.ppsplit.linear_attention_scan(query, key, value, decay, ring, self.positions, 1.0)
            out = module.norm(out.reshape(batch, tokens, heads * dim))
            out = torch.sigmoid(module.output_gate(hidden_states)) * out
            return module.out_proj(out), None
        return forward

    def _conv(self, conv: torch.nn.Conv1d):
        """A block's short causal convolution over ``[B, C, T]``: its window of inputs from the cache by position
        (the ``kernel - 1`` before the step, zeros before position 0). Returns what the module returns for the
        step's inputs alone with its padding, ``[B, C, T + kernel - 1]``, whose first ``T`` columns are the tokens'
        outputs (what the model keeps), here over the real window."""
        kernel = conv.kernel_size[0]

        def forward(x):
            if self.cache is None:
                return type(conv).forward(conv, x)
            window = self.cache.layers[self.active].update_conv_state(x, kernel)  # the block's one convolution
            return F.conv1d(window, conv.weight, conv.bias, padding=kernel - 1, groups=conv.groups)[..., kernel - 1:]
        return forward

    def _mlstm(self, module: torch.nn.Module):
        """xLSTM's ``xLSTMBackend.forward`` over ``[B, H, T, D]`` (its chunkwise, sequence and one-step kernels are one
        recurrence): ``(h, None)``, the state in the ring."""
        eps = float(getattr(getattr(module, "config", None), "eps", 1e-6))

        def forward(query, key, value, igate, fgate, *args, **kwargs):
            batch, heads, _, dk = key.shape
            ring = self._ring(batch, (heads, dk, value.shape[-1] + 2), value)
            h = torch.ops.ppsplit.mlstm_scan(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             igate.transpose(1, 2), fgate.transpose(1, 2), ring, self.positions, eps)
            return h.transpose(1, 2), None
        return forward

    def _wkv(self, time_decay, time_first, key, value, state=None, return_state=False):
        """RWKV's ``rwkv_linear_attention``: the WKV recurrence over the ring; ``(out, None)``."""
        ring = self._ring(key.shape[0], (3, key.shape[-1]), key)
        return torch.ops.ppsplit.wkv_scan(time_decay, time_first, key, value, ring, self.positions), None

    def _shift(self, pad: torch.nn.Module, layer: int, index: int):
        """RWKV's ``time_shift`` over ``[B, T, C]``: ``_previous`` (the model's own without a cache)."""
        def forward(x):
            return type(pad).forward(pad, x) if self.cache is None else self._previous(x, layer, index)
        return forward

    def _previous(self, x: torch.Tensor, layer: int, index: int) -> torch.Tensor:
        """Each token's previous one of ``x [B, T, C]`` (zeros before position 0), as a two-tap causal convolution
        ``[1, 0]`` over the inputs kept by position (the layer's ``index``-th), so the token before a step's first
        comes from the cache (and in a ragged step from each token's own sequence)."""
        channels, tokens = x.shape[-1], x.shape[1]
        window = self.cache.layers[layer].update_conv_state(x.transpose(1, 2), 2, index)
        before = torch.cat([x.new_ones(channels, 1, 1), x.new_zeros(channels, 1, 1)], dim=-1)  # y_t = x_(t-1)
        return F.conv1d(window, before, padding=1, groups=channels)[..., 1:1 + tokens].transpose(1, 2)

    def _cca(self, module: torch.nn.Module):
        """ZAYA's ``ZayaCCAProjection.forward``: its q/k convolutions over the window of inputs kept by position
        (the model keeps only the last window, which a verify pass cannot take back), and its delayed values from
        the token before by position (the model keeps only the last token's)."""
        layer, dim, groups = module.layer_idx, module.head_dim, module.num_key_value_groups

        def forward(hidden_states, cache=None, conv_mask=None):
            if self.cache is None:
                return type(module).forward(module, hidden_states, None, conv_mask)
            if conv_mask is not None:
                hidden_states = hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)
            batch, tokens, _ = hidden_states.shape
            shape = (batch, tokens, -1, dim)
            queries, keys = module.q_proj(hidden_states), module.k_proj(hidden_states)
            query_residual = (queries.view(shape) + keys.view(shape).repeat_interleave(groups, dim=2)) * 0.5
            key_residual = query_residual.view(batch, tokens, -1, groups, dim).mean(dim=-2)
            window = self.cache.layers[layer].update_conv_state(torch.cat([queries, keys], dim=-1).transpose(1, 2),
                                                                module.conv_kernel_size + 1, 0)
            qk = module.conv_qk_grouped(module.conv_qk_depthwise(window)).transpose(1, 2)
            split = queries.shape[-1]
            query = qk[..., :split].view(shape) + query_residual
            key = qk[..., split:].view(shape) + key_residual
            delayed = module.v_proj_delayed(self._previous(hidden_states, layer, 1))
            value = torch.cat([module.v_proj_current(hidden_states), delayed], dim=-1).view(shape)
            return query, key, value
        return forward


def _mixes(module: torch.nn.Module, hidden: torch.Tensor, *names: str) -> list[torch.Tensor]:
    """RWKV's inputs: each token interpolated with the one before by the learned ``time_mix_<name>``."""
    shifted = module.time_shift(hidden)
    return [hidden * mix + shifted * (1 - mix) for mix in (getattr(module, f"time_mix_{n}") for n in names)]


def _time_mix(module: torch.nn.Module):
    """RWKV's ``RwkvSelfAttention.extract_key_value`` without its state argument (the cache keeps the shift)."""
    def extract_key_value(hidden, state=None):
        key, value, receptance = _mixes(module, hidden, "key", "value", "receptance")
        return torch.sigmoid(module.receptance(receptance)), module.key(key), module.value(value), state
    return extract_key_value


def _channel_mix(module: torch.nn.Module):
    """RWKV's ``RwkvFeedForward.forward`` without its state argument."""
    def forward(hidden, state=None):
        key, receptance = _mixes(module, hidden, "key", "receptance")
        value = module.value(torch.square(torch.relu(module.key(key))))
        return torch.sigmoid(module.receptance(receptance)) * value, state
    return forward


def _without_use_cache(module, args, kwargs):
    return args, {**kwargs, "use_cache": False}


def _layer_index(name: str, module: torch.nn.Module) -> int:
    """A mixer's decoder layer: its ``layer_idx``, else the index in its dotted name after the layer list
    (``model.layers.3.temporal_block.rg_lru`` -> 3)."""
    if isinstance(getattr(module, "layer_idx", None), int):
        return module.layer_idx
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ConfigError(f"ppsplit cannot tell which decoder layer the recurrent module {name} belongs to")
    return numbers[0]
