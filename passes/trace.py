"""Pass 1, trace: capture a Hugging Face causal LM as one ATen-level FX graph with ``torch.export``.

The graph takes ``(input_ids [B, T], positions [T])`` and returns the logits ``[B, T, V]``. Batch and token
count are dynamic, so the same graph (and every stage cut from it) serves any ``B`` and ``T``. Parameters and
buffers are ``get_attr`` nodes named by their original FQNs, so later passes can tell which stage needs which
tensor, and the emitted stages keep the names a checkpoint uses.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import sys
import traceback
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.export import Dim

import ppsplit.core.errors
from ppsplit.core.options import CacheConfig
from ppsplit.core.errors import ConfigError, TraceError
from ppsplit.core.fx_utils import (CACHE_PREFIX, INDEXER_KEYS, conv_buffer, copy_buffer_persistence, set_tensor,
                                   tied_names, tied_parameters)
from ppsplit.passes.tracing.kv_cache import PositionedCache, RecurrentScans, is_cache_part, takes_foreign_cache
from ppsplit.passes.tracing.quantized_modules import traceable_fp8_modules
from ppsplit.core.tensors import module_device

_PREFIX = "m."  # the wrapper holds the model as ``self.m``

# Nodes that only assert facts about the traced example (dtype, device, symbolic ranges). They would fail
# once a stage moves to another device and have no effect on values, so the trace drops them.
_ASSERT_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
}


@dataclass(frozen=True)
class Traced:
    """The trace pass's result: the graph ``(input_ids, positions) -> logits`` and the facts later passes need."""

    gm: fx.GraphModule
    model_class: str
    cache: CacheConfig | None  # the paged cache the stages will own (the graph holds a dense stand-in, below)
    batch_symbol: str  # sympy name of the batch dimension, e.g. "s0" ("" when export fixed it: see fixed_batch)
    tokens_symbol: str
    tied: tuple[tuple[str, str], ...]  # (alias, canonical) pairs of parameters that share storage
    hidden_size: int = 0  # the config's, when it names one: tells the residual stream from values beside it
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # The dense cache the model is traced with, one row of ``max_len`` positions: what the attention pass proves its
    # rewrites against, and what the paged pass replaces with the stages' block pools.
    stand_in: CacheConfig | None = None
    # The traced module itself, so a split that cannot page its cache can be traced again with a lockstep one.
    source: torch.nn.Module | None = field(default=None, compare=False, repr=False)
    retraced: dict = field(default_factory=dict, compare=False, repr=False)  # that lockstep trace, made once
    fixed_batch: int = 0  # the batch export fixed (a paged trace's one row, a cache's rows), 0 when it is dynamic


# transformers renamed `past_key_values` (`cache_params` in Mamba models) to `cache` in 5.24.
CACHE_KEYWORDS = ("cache", "past_key_values", "cache_params")


def cache_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot have ppsplit's cache (what ``trace_model(model, cache=...)`` would refuse, checked
    without tracing), or ``None`` when it can."""
    scans = RecurrentScans(model)
    if not any(k in inspect.signature(model.forward).parameters for k in CACHE_KEYWORDS) and not scans.mixers:
        return f"{type(model).__name__}.forward takes no cache"
    try:
        refuse_uncached_state(model, scans)
    except ConfigError as e:
        return str(e)
    return None


class _Traceable(torch.nn.Module):
    """Fixes the call convention: ``(input_ids, positions) -> logits``, and owns the static KV cache, if any."""

    def __init__(self, model: torch.nn.Module, cache: CacheConfig | None = None, num_layers: int = 0,
                 paged: bool = False, layers: str | None = None):
        super().__init__()
        self.paged = paged
        self.m = model
        self.layers = layers
        accepted = inspect.signature(model.forward).parameters
        self._pass_positions = "position_ids" in accepted
        self._pass_use_cache = "use_cache" in accepted
        self._pass_mask = "attention_mask" in accepted
        self._cache_kw = next((k for k in CACHE_KEYWORDS if k in accepted), None)
        if takes_foreign_cache(model):  # its routed mixers read ppsplit's cache; the model is handed none
            self._cache_kw = None
        self.kv = None
        self.scans = RecurrentScans(model)
        if cache is not None:
            refuse_uncached_state(model, self.scans)
            if self._cache_kw is None and not self.scans.mixers:
                raise ConfigError(f"{type(model).__name__}.forward takes no cache, so ppsplit cannot give its stages "
                                  "a KV cache; split it without cache=")
            self.max_len = cache.max_len
            self.kv = PositionedCache.for_model(model, num_layers, cache.max_len)
            self.add_module(CACHE_PREFIX, torch.nn.Module())
            self.kv_cache = getattr(self, CACHE_PREFIX)
            device = module_device(model)
            recorded = self._record_kv_shapes(device)
            # A model without attention (Mamba) sizes its padding mask by the tokens, not the cache: give none.
            self._pass_mask = self._pass_mask and any(layer.shapes is not None for layer in recorded.values())
            for i, cache_layer in recorded.items():
                layer = torch.nn.Module()
                if cache_layer.shapes is not None:
                    k_shape, v_shape, dtype = cache_layer.shapes
                    layer.register_buffer("keys", torch.zeros(cache.batch_size, k_shape[0], cache.max_len,
                                                              *k_shape[1:], dtype=dtype, device=device), persistent=False)
                    layer.register_buffer("values", torch.zeros(cache.batch_size, v_shape[0], cache.max_len,
                                                                *v_shape[1:], dtype=dtype, device=device),
                                          persistent=False)
                for index, (channels, _, dtype) in cache_layer.conv_shapes.items():
                    layer.register_buffer(conv_buffer(index), torch.zeros(cache.batch_size, channels, cache.max_len,
                                                                          dtype=dtype, device=device), persistent=False)
                if cache_layer.state_shape is not None:  # a recurrent layer's ring of states (float32)
                    layer.register_buffer("states", torch.zeros(cache.batch_size, cache.state_slots, *cache_layer.state_shape,
                                                                device=device), persistent=False)
                if cache_layer.indexer_shape is not None:  # a sparse-attention indexer's keys: [batch, max_len, dim]
                    shape, dtype = cache_layer.indexer_shape
                    layer.register_buffer(INDEXER_KEYS, torch.zeros(cache.batch_size, cache.max_len, *shape,
                                                                  dtype=dtype, device=device), persistent=False)
                self.kv_cache.add_module(str(i), layer)

    def _record_kv_shapes(self, device) -> dict:
        """Run one token through the model with a recording cache to learn each layer's K/V heads, dims, dtype (or
        its short convolution's channels): the cache layers that recorded something, by layer index."""
        self.kv.recording = True
        self.kv.positions = torch.zeros(1, dtype=torch.long, device=device)
        kwargs = {"position_ids": self.kv.positions[None]} if self._pass_positions else {}
        calls: dict[int, int] = {}
        try:
            with torch.no_grad(), _unread_values(device), self.scans.routed(self.kv, self.kv.positions), \
                    _layer_calls(self.m, self.layers, calls):
                self.m(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=bool(self._cache_kw),
                       **self._cache_kwargs(), **kwargs)
        except Exception:
            refuse_looped_layers(type(self.m).__name__, self.layers, calls)  # a looped section trips up the cache
            raise
        finally:
            self.kv.recording = False
        refuse_looped_layers(type(self.m).__name__, self.layers, calls)
        missed = sorted(i for i in self.scans.mixers if self.kv.layers[i].state_shape is None)
        if missed:
            raise ConfigError(f"{type(self.m).__name__}'s recurrent layers {missed} did not run the scan ppsplit routes "
                              "to its state cache (this transformers release computes them another way); split it "
                              "without cache=")
        shapes = {i: layer for i, layer in enumerate(self.kv.layers)
                  if layer.shapes is not None or layer.conv_shapes or layer.state_shape is not None}
        if not shapes:
            raise ConfigError(f"{type(self.m).__name__} wrote nothing into the cache it was given, so ppsplit cannot "
                              "give its stages a KV cache; split it without cache=")
        return shapes

    def _cache_kwargs(self) -> dict:
        """The cache the model is handed. A model whose forward takes none (RWKV keeps its state in a list it makes
        when ``use_cache``) runs without one, ``use_cache=False``: its routed mixers read ppsplit's cache."""
        return {self._cache_kw: self.kv} if self._cache_kw else {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kwargs = {}
        if self._pass_positions:
            kwargs["position_ids"] = positions.unsqueeze(0)
        if self._pass_use_cache:
            kwargs["use_cache"] = self.kv is not None and self._cache_kw is not None
        if self.kv is not None:
            # Bind the buffers on every call: export swaps module buffers for traced stand-ins.
            self.kv.bind({int(i): dict(layer.named_buffers()) for i, layer in self.kv_cache.named_children()})
            self.kv.positions = positions
            kwargs.update(self._cache_kwargs())
            if self._pass_mask:
                # A mask over the whole cache, all visible: models that would otherwise size their padding mask
                # from the cache length (a data-dependent .item()) take its width instead; the causal part still
                # comes from `positions`.
                kwargs["attention_mask"] = torch.ones(input_ids.shape[0], self.max_len, dtype=torch.long,
                                                      device=input_ids.device)
        with self.scans.routed(self.kv, positions), _no_padding_masks(self.m, self.paged), \
                _constants_with_values(input_ids.device), _config_use_cache(self.m, self.kv is not None):
            out = self.m(input_ids=input_ids, **kwargs)
        return out.logits if hasattr(out, "logits") else out[0]


@contextlib.contextmanager
def _layer_calls(model: torch.nn.Module, layers: str | None, calls: dict[int, int]):
    """Counts into ``calls`` (``{index: calls}``) the calls of each decoder layer in ``model.<layers>`` in the block."""
    stack = model.get_submodule(layers) if layers else []
    hooks = [layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls.get(i, 0) + 1))
             for i, layer in enumerate(stack)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def refuse_looped_layers(model_class: str, layers: str | None, calls: dict[int, int]) -> None:
    """A forward that calls a decoder layer more than once (a looped section, as in recurrent-depth models) has no
    stage boundary along the layer list that each layer crosses once: refused, naming the layers."""
    looped = {i: n for i, n in calls.items() if n > 1}
    if looped:
        raise TraceError(f"{model_class} runs decoder layers {min(looped)}..{max(looped)} of {layers} up to "
                         f"{max(looped.values())} times per forward (a looped section); ppsplit cuts the pipeline along "
                         "the layer list and needs each layer to run once, in index order. Splitting it would need the "
                         "looped layers kept on one stage and the taps defined per loop, which ppsplit does not do; "
                         "report the model")


@contextlib.contextmanager
def _config_use_cache(model: torch.nn.Module, use_cache: bool):
    """A model traced without a cache that takes ``use_cache`` only from its config (a forward without that argument,
    GraniteMoeSWA, GraniteMoeHybrid) would build a cache of its own on every call, whose sliding-window or prefill
    code fixes the token count: its configs say ``use_cache=False`` while it runs."""
    if use_cache:
        yield
        return
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "use_cache")}
    saved = [(c, c.use_cache) for c in configs.values()]
    try:
        for c, _ in saved:
            c.use_cache = False
        yield
    finally:
        for c, value in saved:
            c.use_cache = value


class _ConstantsOnCpu(torch.overrides.TorchFunctionMode):
    """A tensor the model's code makes from Python data (``torch.tensor(finfo.min, device=x.device)``, a list index
    ``qkv[..., [-2], :]``) keeps no values on the meta device, and the graph would hold it as a constant that no
    checkpoint can fill. Made on the CPU and then moved, the graph holds the CPU constant and a copy to the device
    (which the emitted stages take from ``positions``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and args and not isinstance(args[0], torch.Tensor) \
                and _is_meta(kwargs.get("device")):
            return func(*args, **{**kwargs, "device": "cpu"}).to("meta")
        if func is torch.Tensor.new_tensor and _is_meta(args[0].device) and not isinstance(args[1], torch.Tensor):
            return torch.tensor(args[1], **{"dtype": args[0].dtype, **kwargs, "device": "cpu"}).to("meta")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _is_meta(args[0].device):
            args = (args[0], _list_indices_moved(args[1]), *args[2:])
        return func(*args, **kwargs)


def _is_meta(device) -> bool:
    return device is not None and torch.device(device).type == "meta"


def _list_indices_moved(index):
    """``index`` with each list of ints (an advanced index) made on the CPU and moved to the meta device."""
    def moved(i):
        if isinstance(i, list) and i and all(isinstance(v, int) and not isinstance(v, bool) for v in i):
            return torch.tensor(i, device="cpu").to("meta")
        return i
    return tuple(moved(i) for i in index) if isinstance(index, tuple) else moved(index)


def _constants_with_values(device: torch.device):
    return _ConstantsOnCpu() if device.type == "meta" else contextlib.nullcontext()


def _unread_values(device: torch.device):
    """The recording run of a model on the meta device runs under fake tensors with a shape environment: a value the
    model's code reads on the host (MoE routing's ``expert_size.tolist()``, HF's padding-token check) has no data on
    meta, and becomes a symbol there, as it does in the export that follows."""
    if device.type != "meta":
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())


@contextlib.contextmanager
def _no_padding_masks(model: torch.nn.Module, active: bool):
    """A paged trace is one row of real tokens: the state-space layers' padding mask (``apply_mask_to_padding_states``
    in their model files, sized from the one-row cache's mask) is the identity there, so route it to one; otherwise
    its length would tie the token count to the stand-in's."""
    files = {sys.modules[type(m).__module__] for m in model.modules()} if active else set()
    saved = [(f, f.apply_mask_to_padding_states) for f in files if hasattr(f, "apply_mask_to_padding_states")]
    try:
        for f, _ in saved:
            f.apply_mask_to_padding_states = lambda hidden_states, attention_mask, *args, **kwargs: hidden_states
        yield
    finally:
        for f, fn in saved:
            f.apply_mask_to_padding_states = fn


# Layer kinds whose decoding state is not keys and values at positions (transformers' ``layer_types`` names):
# recurrent / state-space / linear-attention state. A sparse-attention indexer's keys ("indexed_attention") are
# per position like K/V: the static cache holds them (passes/kv_cache.py).
_STATE_KINDS = {"linear_attention": "a recurrent (state-space or linear-attention) state",
                "hybrid": "a recurrent (state-space) state beside attention",
                "recurrent": "a recurrent state",
                "heavily_compressed_attention": "a compressed KV state (token windows pooled into entries)",
                "compressed_sparse_attention": "a compressed KV state (token windows pooled into entries)"}
_STATE_MODELS = {"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"}


def refuse_uncached_state(model: torch.nn.Module, scans: RecurrentScans | None = None) -> None:
    """Raise a ``ConfigError`` before any work when ``model`` has layers whose decoding state ppsplit's static
    cache cannot hold: recurrent, linear-attention or compressed layers other than the scans ``scans`` routes to
    the cache's ring of states (Mamba-1, Mamba-2, Gated DeltaNet)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    if config is None:
        return
    scans = scans or RecurrentScans(model)
    kinds = set()
    for attr in ("layer_types", "block_types", "layers_block_type"):
        value = getattr(config, attr, None)
        if isinstance(value, (list, tuple)):
            kinds |= {str(v) for i, v in enumerate(value)
                      if str(v) in _STATE_KINDS and i not in scans.mixers and i not in scans.convs}
    model_type = getattr(config, "model_type", "")
    if model_type in _STATE_MODELS and (scans.unsupported or not scans.mixers):
        kinds.add("recurrent")
    if scans.unsupported:
        raise ConfigError(f"{type(model).__name__} ({model_type}) cannot decode through ppsplit's static cache: its "
                          f"recurrent layers ({scans.unsupported[0]}{', ...' if len(scans.unsupported) > 1 else ''}) "
                          "keep a state ppsplit does not route to its state cache yet (supported: Mamba-1, Mamba-2, "
                          "Gated DeltaNet, Kimi delta attention, MiniMax lightning attention, RG-LRU, RWKV-4, xLSTM's "
                          "mLSTM, ZAYA's CCA, short convolutions); split it without cache=")
    if kinds:
        what = "; ".join(f"{kind} layers keep {_STATE_KINDS[kind]}" for kind in sorted(kinds))
        raise ConfigError(f"{type(model).__name__} ({model_type}) cannot decode through ppsplit's static KV cache: "
                          f"its {what}, which the cache does not carry yet; split it without cache= (every call "
                          "then runs the whole sequence, which ppsplit splits exactly)")


def trace(model: torch.nn.Module, *, cache: CacheConfig | None = None, num_layers: int = 0,
          example_tokens: int = 8, paged: bool = True, layers: str | None = None) -> Traced:
    """Export ``model`` (real or on the meta device) into an FX graph ``(input_ids, positions) -> logits``.

    With ``cache``, the graph owns a cache (``kv_cache.<layer>.keys/values`` buffers, one per layer of the
    ``num_layers``) that each call writes at ``positions``: with ``paged`` (the default) a one-row stand-in that the
    paged pass turns into block pools, else the lockstep ``batch_size x max_len`` cache itself.

    Example::

        traced = trace(AutoModelForCausalLM.from_config(cfg))
        logits = traced.gm(input_ids, torch.arange(input_ids.shape[1]))
    """
    device = module_device(model)
    vocab = _vocab_size(model)
    max_tokens = getattr(model.config, "max_position_embeddings", None)
    max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else None  # XLNet's -1: no limit
    max_batch = None
    stand_in = None
    if cache is not None:
        max_tokens = cache.max_len if not max_tokens else min(max_tokens, cache.max_len)
        if paged:
            stand_in = stand_in_cache(model, cache)
            max_batch = 1  # a ragged step is one row of tokens
        else:
            max_batch = cache.batch_size
    example_tokens = min(example_tokens, max_tokens) if max_tokens else example_tokens
    example_batch = min(2, max_batch) if max_batch else 2
    ids = (torch.arange(example_batch * example_tokens, device=device) % max(vocab, 1)).view(example_batch, example_tokens)
    positions = torch.arange(example_tokens, device=device)
    tokens = _dim("tokens", max_tokens)
    batch = _dim("batch", max_batch)

    was_training = model.training
    model.eval()
    try:
        with _traceable_experts(model, device), traceable_fp8_modules(model):
            wrapper = _Traceable(model, stand_in or cache, num_layers, paged=stand_in is not None, layers=layers)
            ep, length_error = _export_dynamic(model, wrapper, ids, positions, batch, tokens)
    except (ConfigError, TraceError):
        raise
    except AttributeError as e:
        if is_cache_part(getattr(e, "obj", None)):
            raise ConfigError(f"{type(model).__name__} reads {e.name!r} from its cache, which ppsplit's cache does not "
                              "have (the model needs cache layers of a kind of its own); split it without cache=") from e
        raise TraceError(_describe_export_failure(model, e)) from e
    except Exception as e:  # export raises many types; all mean "this model cannot be captured as is"
        raise TraceError(_describe_export_failure(model, e)) from e
    finally:
        model.train(was_training)

    gm = _unlift(ep, model)
    if length_error is not None and not _drop_dead_length_reads(gm):
        raise TraceError(_describe_export_failure(model, length_error)) from length_error
    tied = tied_parameters(model)
    _untie(gm, tied)
    in_ids = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
    # A size export specialised (a Python loop over the token count, say) is a SymInt whose expression is a number.
    b_size, t_size = in_ids.meta["val"].shape
    b_sym = str(b_size.node.expr) if isinstance(b_size, torch.SymInt) else ""
    t_sym = str(t_size.node.expr) if isinstance(t_size, torch.SymInt) and not t_size.node.expr.is_number else ""
    for name, dim, sym in (("batch", batch, b_sym), ("token count", tokens, t_sym)):
        if dim is not Dim.STATIC and not sym:
            raise TraceError(f"torch.export fixed the {name} of {type(model).__name__} to the traced example instead of "
                             "keeping it dynamic; the stages would only accept that size. Report the model")
    if cache is not None:
        _mask_rows_at_positions(gm, (stand_in or cache).max_len, t_size)
    return Traced(
        gm=gm,
        model_class=type(model).__name__,
        cache=cache,
        batch_symbol=b_sym,
        tokens_symbol=t_sym,
        tied=tied,
        hidden_size=_hidden_size(model),
        stand_in=stand_in,
        source=model,
        fixed_batch=0 if b_sym else int(b_size),
        **_generation_ids(model),
    )


@contextlib.contextmanager
def _traceable_experts(model: torch.nn.Module, device: torch.device):
    """transformers runs MoE experts through an implementation a caller may switch (``experts_implementation``):
    "eager" loops over the experts a batch routed to (``for expert_idx in expert_hit``), which no graph can hold for
    every batch; "grouped_mm" traces on the meta device only in bf16. While tracing, the experts run "grouped_mm" where
    it traces, else "batched_mm" (the same products, each token's experts gathered)."""
    can_switch = getattr(model, "_can_set_experts_implementation", None)
    if can_switch is None or not can_switch():
        yield
        return
    dtype = next((p.dtype for p in model.parameters()), None)
    grouped = "grouped_mm" if device.type != "meta" or dtype in (None, torch.bfloat16) else "batched_mm"
    saved = model.get_experts_implementation()
    wanted = {key: grouped if impl in ("eager", "grouped_mm") else impl for key, impl in saved.items()}
    if wanted == saved:
        yield
        return
    model.set_experts_implementation(wanted)
    try:
        yield
    finally:
        model.set_experts_implementation(saved)


def _mask_rows_at_positions(gm: fx.GraphModule, keys: int, tokens) -> None:
    """A model that reads its own mask table by the key count minus the query count (GPT-Neo's window mask
    ``bias[:, :, key_length - query_length : key_length]``) takes its queries for the last of its keys. The cache
    holds ``keys`` slots addressed by position, so the rows the queries need are their positions: such a slice of a
    constant becomes an ``index_select`` at ``positions``."""
    if not isinstance(tokens, torch.SymInt):
        return
    graph = gm.graph
    positions = graph.find_nodes(op="placeholder", target="positions")[0]
    last_rows = keys - tokens.node.expr
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.slice.Tensor or len(node.args) < 4:
            continue
        table, dim, start, end = node.args[:4]
        start_val = start.meta.get("val") if isinstance(start, fx.Node) else None
        if table.op != "get_attr" or table.target.startswith(CACHE_PREFIX) or end != keys \
                or not isinstance(start_val, torch.SymInt) or (start_val.node.expr - last_rows).expand() != 0:
            continue
        with graph.inserting_before(node):
            rows = graph.call_function(torch.ops.aten.index_select.default, (table, dim, positions))
        rows.meta = dict(node.meta)
        node.replace_all_uses_with(rows)
        graph.erase_node(node)
    gm.recompile()


def stand_in_cache(model: torch.nn.Module, cache: CacheConfig) -> CacheConfig:
    """The dense one-row cache a model is traced with: long enough that a sliding window (or attention chunk, or the
    positions a sparse-attention indexer keeps, or Doge's ``keep_window_size``, past which its mask keeps only the
    top keys) of the config shows in the attention the pass checks, short enough to check quickly."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    reach = [getattr(config, name, None) for name in ("sliding_window", "attention_chunk_size", "chunk_size",
                                                      "index_topk", "keep_window_size")]
    reach = max((r for r in reach if isinstance(r, int) and not isinstance(r, bool)), default=0)
    length = min(cache.max_len, max(64, 2 * reach + 64))
    return CacheConfig(batch_size=1, max_len=length, state_slots=cache.state_slots, block_size=cache.block_size)


def _hidden_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(config, "hidden_size", 0)
    return size if isinstance(size, int) else 0


def _export_dynamic(model, wrapper, ids, positions, batch, tokens):
    """Export with dynamic batch and token count: named ranges first, then the fallbacks below. Returns the
    program and, when it took the cache-length fallback, the error that fallback answers (else None)."""
    try:
        try:
            ep = _export(wrapper, ids, positions, batch, tokens)
        except (torch._dynamo.exc.UserError, AssertionError) as e:
            # Older torch (2.11) cannot prove some guards that always hold (`min(16*T, 32*T) == 16*T`) and refuses
            # named ranges; AUTO dims accept them. Newer torch may crash describing a range the model narrowed
            # ("Cannot create Dim with inconsistent min=2, max=2"). The sizes' ranges are checked next.
            if "Constraints violated" not in str(e) and "Cannot create Dim" not in str(e):
                raise
            from ppsplit.passes.tracing import export_blame

            with export_blame.guard_stacks(_is_library_file) as stacks:
                ep = _export(wrapper, ids, positions, _auto(batch), _auto(tokens))
            _refuse_narrowed_sizes(model, batch, tokens, ep, stacks.lines)
        return ep, None
    except Exception as e:
        # A cache length the model does arithmetic on (MPT slices its ALiBi bias by `T + cache.get_seq_length()`)
        # is a data-dependent tensor; as a size known to lie in [0, max_len) export can often prove the
        # arithmetic away. Tried only where export complained about a data-dependent size (`u0`).
        if wrapper.kv is None or not _UNBACKED.search(str(e)):
            raise
        wrapper.kv.length_as_size = True
        try:
            return _export(wrapper, ids, positions, batch, tokens), e
        except Exception:
            raise e from None
        finally:
            wrapper.kv.length_as_size = False


_UNBACKED = re.compile(r"\bu\d+\b")


def _refuse_narrowed_sizes(model, batch, tokens, ep, stacks) -> None:
    """AUTO dims let export narrow a size's range silently; a stage must take every size (decode is 1 token)."""
    from ppsplit.passes.tracing import export_blame

    wanted = {d: (None if dim is Dim.STATIC else dim.max if dim.max < int(1e15) else None)
              for d, dim in ((0, batch), (1, tokens)) if dim is not Dim.STATIC}
    narrowed = export_blame.narrowed_sizes(ep, wanted)
    if not narrowed:
        return
    dim, (lo, hi) = next(iter(narrowed.items()))
    frame = export_blame.blame(ep, stacks, dim, wanted[dim]) if lo != hi else export_blame.blame_fixed(stacks, lo)
    where = (f" at {frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} `{(frame.line or '').strip()}` (the model's own "
             "code, not ppsplit)") if frame else ""
    name = ("batch", "token count")[dim]
    raise TraceError(f"torch.export could not keep the {name} of {type(model).__name__} dynamic: the model's code "
                     f"takes a size-dependent path{where}, so the graph would take only {name}s {lo}..{hi or 'any'}; "
                     "ppsplit needs one graph for every size (prefill, decode, verify). Report the model.")


def _drop_dead_length_reads(gm: fx.GraphModule) -> bool:
    """After the cache-length fallback: erase the size arithmetic export proved away (dead ``positions[0].item()``
    chains). False if a read of the cache length still feeds the graph: a host sync per step, not allowed."""
    graph = gm.graph
    scalars = (torch.SymInt, torch.SymBool, torch.SymFloat, int, float, bool)
    reads = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)
    for node in graph.nodes:
        # Size arithmetic whose value the ranges pin (`max(0, 1 - T - n)` with T >= 1, n >= 0 is 0) is that value.
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.SymInt) and node.users:
            try:
                vr = val.node.shape_env.bound_sympy(val.node.expr)
                lo, hi = int(vr.lower), int(vr.upper)
            except Exception:  # an unbounded range (infinite ends) or no shape env: leave it
                continue
            if lo == hi:
                node.replace_all_uses_with(lo)
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and (
                isinstance(node.meta.get("val"), scalars) or node.target in reads
                or node.target is torch.ops.aten.select.int):
            graph.erase_node(node)
    live = [n for n in graph.nodes if n.op == "call_function" and n.target in reads
            and any(a.op == "placeholder" and a.name == "positions" for a in _inputs_through_views(n))]
    gm.recompile()
    return not live


def _inputs_through_views(node: fx.Node) -> list:
    seen, todo = [], list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        seen.append(n)
        if n.op == "call_function" and n.target in (torch.ops.aten.select.int, torch.ops.aten.slice.Tensor):
            todo.extend(n.all_input_nodes)
    return seen


def _export(wrapper, ids, positions, batch, tokens):
    with torch.no_grad(), _quiet_torch_logs():
        return torch.export.export(wrapper, (ids, positions), dynamic_shapes=({0: batch, 1: tokens}, {0: tokens}),
                                   strict=False)


def _auto(dim):
    if dim is Dim.STATIC:
        return dim
    try:
        return Dim.AUTO(min=dim.min, max=dim.max) if dim.max < int(1e15) else Dim.AUTO(min=dim.min)
    except TypeError:  # torch without ranged hints
        return Dim.AUTO


@contextlib.contextmanager
def _quiet_torch_logs():
    """On failure, export prints the partial graph to stderr; ppsplit reports the error in one line instead.
    What export writes on success is passed on."""
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        yield
    sys.stderr.write(captured.getvalue())


def _dim(name: str, maximum: int | None):
    """A dynamic dimension, or a static one when only one size is allowed."""
    if maximum is not None and maximum <= 1:
        return Dim.STATIC
    return Dim(name, min=1, max=maximum) if maximum is not None else Dim(name, min=1)


def _unlift(ep: torch.export.ExportedProgram, model: torch.nn.Module) -> fx.GraphModule:
    """Turn the lifted parameter/buffer placeholders into ``get_attr`` nodes named by their FQNs."""
    from torch.export.graph_signature import InputKind, OutputKind

    graph = ep.graph_module.graph
    root = torch.nn.Module()
    sig = ep.graph_signature
    non_persistent = set(sig.non_persistent_buffers)
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for spec in sig.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            continue
        fqn = spec.target
        if spec.kind == InputKind.PARAMETER:
            tensor = ep.state_dict[fqn]
        elif spec.kind == InputKind.BUFFER:
            tensor = ep.constants[fqn] if fqn in non_persistent else ep.state_dict[fqn]
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            tensor = ep.constants[fqn]
        else:
            raise TraceError(f"torch.export produced an input of kind {spec.kind} ({spec.arg.name}), which ppsplit does not handle")
        name = _strip(fqn)
        set_tensor(root, name, tensor, parameter=spec.kind == InputKind.PARAMETER,
                    persistent=spec.kind == InputKind.BUFFER and fqn not in non_persistent)
        node = placeholders[spec.arg.name]
        with graph.inserting_before(first_op):
            attr = graph.create_node("get_attr", name)  # get_attr() would warn: the tensor lives in `root`
        attr.meta = dict(node.meta)
        node.replace_all_uses_with(attr)
        graph.erase_node(node)

    # Buffer mutations (a KV cache) come back as extra outputs of the functional graph: write them back
    # in place, so the graph itself carries the side effect.
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    user_outs = []
    for spec, value in zip(sig.output_specs, outs):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            with graph.inserting_before(output):
                buf = graph.create_node("get_attr", _strip(spec.target))
                graph.call_function(torch.ops.aten.copy_.default, (buf, value))
        elif spec.kind == OutputKind.USER_OUTPUT:
            user_outs.append(value)
        else:
            raise TraceError(f"torch.export produced an output of kind {spec.kind}, which ppsplit does not handle")
    output.args = (user_outs[0],)

    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERT_OPS and not node.users:
            graph.erase_node(node)
        elif node.op == "call_function" and node.target is torch.ops.aten.histc.default:
            _portable_histc(graph, node)
        elif _is_identity_cast(node) or _is_identity_arith(node):
            # `x.to(x.dtype)` returns x itself, so export may route later uses of x through the cast
            # (an fp32 model's residual read through the norm's upcast). Use x directly.
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    gm = fx.GraphModule(root, graph, class_name=type(model).__name__ + "Graph")
    copy_buffer_persistence(gm, root)
    gm.graph.lint()
    return gm


def _portable_histc(graph: fx.Graph, node: fx.Node) -> None:
    """Count in float32, cast back. transformers' MoE routing calls ``histc`` on integer expert ids except on the
    CPU, which has no integer kernel; the choice follows the device the trace ran on (meta: integer). Float counts
    of ids below 2**24 are exact, and both devices run it, so the stage program stays device-free."""
    from torch._guards import detect_fake_mode

    x = node.args[0]
    x_val, out_val = x.meta.get("val"), node.meta.get("val")
    if not isinstance(x_val, torch.Tensor) or x_val.is_floating_point() or out_val is None:
        return
    to_copy = torch.ops.aten._to_copy.default
    with graph.inserting_before(node):
        as_float = graph.call_function(to_copy, (x,), {"dtype": torch.float32})
    with graph.inserting_after(node):
        back = graph.call_function(to_copy, (node,), {"dtype": out_val.dtype})
    node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    node.args = (as_float,) + tuple(node.args[1:])
    mode = detect_fake_mode([x_val])
    with mode if mode is not None else contextlib.nullcontext():
        as_float.meta = dict(node.meta, val=x_val.to(torch.float32))
        back.meta = dict(node.meta, val=out_val)
        node.meta["val"] = out_val.to(torch.float32)


_CASTS = {torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device,
          torch.ops.aten.type_as.default}


def _is_identity_cast(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _CASTS or not isinstance(node.args[0], fx.Node):
        return False
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    copy = node.kwargs.get("copy", False) or (node.target is torch.ops.aten.to.dtype and len(node.args) > 3
                                              and node.args[3])
    same = (src.dtype == out.dtype and src.device == out.device and src.shape == out.shape
            and src.stride() == out.stride())
    return same and not copy and "memory_format" not in node.kwargs


def _is_identity_arith(node: fx.Node) -> bool:
    """``x + 0``, ``x - 0``, ``x * 1``, ``x / 1`` that leave dtype and shape alone (rotary's ``cos * 1.0``)."""
    if node.op != "call_function" or len(node.args) != 2 or node.kwargs or not isinstance(node.args[0], fx.Node):
        return False
    neutral = {torch.ops.aten.add.Tensor: 0, torch.ops.aten.sub.Tensor: 0, torch.ops.aten.mul.Tensor: 1,
               torch.ops.aten.div.Tensor: 1}.get(node.target)
    other = node.args[1]
    if neutral is None or isinstance(other, bool) or not isinstance(other, (int, float)) or other != neutral:
        return False
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype
            and src.shape == out.shape and src.stride() == out.stride())


def _untie(gm: fx.GraphModule, tied: tuple[tuple[str, str], ...]) -> None:
    """Export keeps one name for a tensor shared by several parameters (a tied embedding and lm_head). Give each
    use the name of the module that reads it, so the head's stage holds ``lm_head.weight``, not the embedding."""
    groups = tied_names(tied)
    if not groups:
        return
    graph = gm.graph
    attrs = {n.target: n for n in graph.nodes if n.op == "get_attr"}
    for node in list(attrs.values()):
        group = groups.get(node.target)
        if not group:
            continue
        for user in list(node.users):
            paths = [module_path(p) for p, _ in (user.meta.get("nn_module_stack") or {}).values()]
            owners = [a for a in group if a.rpartition(".")[0] in paths]
            name = max(owners, key=lambda a: paths.index(a.rpartition(".")[0])) if owners else node.target
            if name == node.target:
                continue
            if name not in attrs:
                if not hasattr_path(gm, name):
                    set_tensor(gm, name, gm.get_parameter(node.target), parameter=True, persistent=True)
                with graph.inserting_after(node):
                    attrs[name] = graph.create_node("get_attr", name)
                attrs[name].meta = dict(node.meta)
            user.replace_input_with(node, attrs[name])
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    gm.delete_all_unused_submodules()
    gm.recompile()


def hasattr_path(mod: torch.nn.Module, fqn: str) -> bool:
    try:
        mod.get_parameter(fqn)
        return True
    except AttributeError:
        return False


def module_path(path: str) -> str:
    """A module path from ``nn_module_stack`` without the wrapper prefix or a repeated-call suffix (``@1``)."""
    path = path.split("@", 1)[0]
    return _strip(path)


def _strip(fqn: str) -> str:
    return fqn[len(_PREFIX):] if fqn.startswith(_PREFIX) else fqn


def _vocab_size(model: torch.nn.Module) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and hasattr(emb, "num_embeddings"):
        return emb.num_embeddings
    return int(getattr(model.config, "vocab_size", 2))


def _generation_ids(model: torch.nn.Module) -> dict:
    gen = getattr(model, "generation_config", None) or getattr(model, "config", None)
    eos = getattr(gen, "eos_token_id", None)
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    pad = getattr(gen, "pad_token_id", None)
    return {"eos_token_id": eos, "pad_token_id": pad}


def _describe_export_failure(model: torch.nn.Module, e: Exception) -> str:
    """One line: which model, the first line of torch's complaint, and the model-code line that caused it."""
    msg = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    where = ""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if not _is_library_file(frame.filename):
            where = f" at {frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} `{(frame.line or '').strip()}`"
            break
    else:
        # Export errors often quote the user frame inside the message ("File ..., line N").
        for line in str(e).splitlines():
            if "File " in line and "line" in line and not any(d in line for d in _LIBRARY_DIRS):
                where = " at " + line.strip()
                break
    blame = " (the model's own code, not ppsplit)" if where else ""
    return (f"torch.export could not capture {type(model).__name__}: {type(e).__name__}: {msg[:300]}{where}{blame}. "
            "ppsplit needs a model that torch.export traces non-strict with dynamic batch and token sizes; "
            "rewrite that line without data-dependent Python control flow, or report the model.")


# Frames in these folders are torch's or ppsplit's own; the first frame outside them is the model's code. Compared
# as folders, so a user whose checkout or model lives under a path that merely contains "ppsplit" keeps the line.
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (
    torch.__file__, os.path.dirname(ppsplit.core.errors.__file__), sys.modules[__name__.rsplit(".", 1)[0]].__file__))


def _is_library_file(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_LIBRARY_DIRS)
