"""Core: helpers for building modules that hold tensors under their original dotted names.

Shared by the trace pass (which builds the graph's root module) and the loader (which rebuilds a stage from its
program and safetensors file). Imports torch only.
"""
from __future__ import annotations

import torch

from ppsplit.core.errors import ConfigError

CACHE_PREFIX = "kv_cache"  # a stage's static KV cache lives in buffers kv_cache.<layer>.keys / .values
CONV_INPUTS = "conv_inputs"  # a layer's short convolution's inputs by position; "conv_inputs_2" for its third
INDEXER_KEYS = "indexer_keys"  # a sparse-attention indexer's keys by position


def conv_buffer(index: int) -> str:
    """The cache buffer name of a layer's ``index``-th short convolution's inputs."""
    return CONV_INPUTS if index == 0 else f"{CONV_INPUTS}_{index}"


def conv_index(name: str) -> int:
    return int(name[len(CONV_INPUTS) + 1:] or 0)


def is_cache_buffer(name: str) -> bool:
    """Whether ``name`` is a KV-cache buffer (state allocated at load time, never stored in a file)."""
    return name.startswith(CACHE_PREFIX + ".")


def state_slots(module: torch.nn.Module) -> int:
    """The ring slots of ``module``'s recurrent-state buffers (``kv_cache.<layer>.states [batch, slots, ...]``):
    the longest verify pass its stages can take back; 0 when it has none."""
    return max((b.shape[1] for n, b in module.named_buffers() if is_cache_buffer(n) and n.endswith(".states")),
               default=0)


def get_tensor(root: torch.nn.Module, fqn: str) -> torch.Tensor:
    """The parameter or buffer of ``root`` under the dotted name ``fqn`` (``AttributeError`` if there is none)."""
    path, _, leaf = fqn.rpartition(".")
    return getattr(root.get_submodule(path) if path else root, leaf)


def set_tensor(root: torch.nn.Module, fqn: str, tensor: torch.Tensor, *, parameter: bool, persistent: bool) -> None:
    """Register ``tensor`` on ``root`` under the dotted name ``fqn``, creating empty submodules on the way."""
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    if parameter:
        if not isinstance(tensor, torch.nn.Parameter):
            tensor = torch.nn.Parameter(tensor, requires_grad=False)
        mod.register_parameter(leaf, tensor)
    else:
        mod.register_buffer(leaf, tensor, persistent=persistent)


def fresh_copy(gm: "torch.fx.GraphModule") -> "torch.fx.GraphModule":
    """A new GraphModule over the same tensors, with a copy of the graph (same node names and meta): what a pass
    rewrites, so that the graph an earlier pass's result holds is never edited."""
    from torch import fx

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copy_buffer_persistence(copy, gm)
    return copy


def copy_buffer_persistence(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """``fx.GraphModule`` copies every buffer as persistent; keep the source's non-persistent set."""
    for name, mod in src.named_modules():
        if not mod._non_persistent_buffers_set:
            continue
        try:
            target = dst.get_submodule(name)
        except AttributeError:
            continue
        target._non_persistent_buffers_set |= {b for b in mod._non_persistent_buffers_set if b in target._buffers}


def tied_parameters(model: torch.nn.Module) -> tuple[tuple[str, str], ...]:
    """``(alias, canonical)`` pairs of parameter names that share one tensor (a tied embedding and ``lm_head``)."""
    first: dict[int, str] = {}
    tied = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return tuple(tied)


def token_rows(graph: "torch.fx.Graph", value: "torch.fx.Node", layout, as_dtype: torch.dtype | None = None,
               meta: dict | None = None) -> "torch.fx.Node":
    """Nodes, at ``graph``'s insertion point, that lay ``value`` out token-major as ``[B, T, elements]`` (a
    ``core.plan.PerToken`` layout says where its batch and token axes are), its bytes read as ``as_dtype`` when
    given: how ``x`` and the aux slots hold a stream or carried value. ``meta`` goes on every new node."""
    aten = torch.ops.aten
    order = layout.order()
    if order != sorted(order):
        value = _call(graph, aten.permute.default, (value, order), meta)
    value = _call(graph, aten.clone.default, (value,), meta, memory_format=torch.contiguous_format)
    if layout.shape:
        value = _call(graph, aten.flatten.using_ints, (value, 2, -1), meta)
    else:
        value = _call(graph, aten.unsqueeze.default, (value, -1), meta)
    if as_dtype is not None:
        value = _call(graph, aten.view.dtype, (value, as_dtype), meta)
    return value


def from_token_rows(graph: "torch.fx.Graph", rows: "torch.fx.Node", layout, as_dtype: torch.dtype | None = None,
                    meta: dict | None = None) -> "torch.fx.Node":
    """The inverse of ``token_rows``: ``rows [B, T, width]`` (a slice of ``x``) as the model's own contiguous
    tensor."""
    aten = torch.ops.aten
    value = _call(graph, aten.clone.default, (rows,), meta, memory_format=torch.contiguous_format)
    if as_dtype is not None:
        value = _call(graph, aten.view.dtype, (value, as_dtype), meta)
    if layout.shape:
        value = _call(graph, aten.unflatten.int, (value, -1, list(layout.shape)), meta)
    else:
        value = _call(graph, aten.squeeze.dim, (value, -1), meta)
    order = layout.order(inverse=True)
    if order != sorted(order):
        value = _call(graph, aten.permute.default, (value, order), meta)
        value = _call(graph, aten.clone.default, (value,), meta, memory_format=torch.contiguous_format)
    return value


SHAPE = "ppsplit.shape"  # a node's static shape where its fake value is gone: a compiled folder's program stores it
VALUE_META = ("val", "tensor_meta", SHAPE, "stack_trace", "nn_module_stack")  # what a replacement node inherits


def static_shape(node) -> tuple | None:
    """The shape of ``node``'s value, sizes that vary with the step as ``None``: from its fake value (a traced
    graph), else from ``SHAPE`` (a graph rebuilt from a compiled folder); ``None`` if neither is known."""
    meta = getattr(node, "meta", None)
    if not isinstance(meta, dict):
        return None
    val = meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(d if isinstance(d, int) else None for d in val.shape)
    return meta.get(SHAPE)


def replace_call(node: "torch.fx.Node", target, args: tuple) -> "torch.fx.Node":
    """``target(*args)`` in ``node``'s place: inserted before it, with its value and source metadata, used by its
    users; ``node`` is erased. What a stage rewrite does when one call takes over from another."""
    graph = node.graph
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta.update({k: v for k, v in node.meta.items() if k in VALUE_META})
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def _call(graph, target, args, meta, **kwargs):
    """A new node, with ``meta`` and, where its inputs have one, its (fake) value."""
    node = graph.call_function(target, args, kwargs)
    if meta is not None:
        node.meta.update(meta)
        vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in args]
        if isinstance(vals[0], torch.Tensor):
            node.meta["val"] = target(*vals, **kwargs)
    return node


def stage_vocab(stage) -> int:
    """The vocabulary size: the rows of stage 0's embedding table (all ranks' rows, when it is vocab-parallel)."""
    for node in stage.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.embedding.default \
                and getattr(node.args[0], "op", None) == "get_attr":
            return node.meta.get("ppsplit.vocab") or get_tensor(stage, node.args[0].target).shape[0]
    raise ConfigError("stage 0 has no embedding lookup to tell the vocabulary size from")


def tied_names(tied: tuple[tuple[str, str], ...]) -> dict[str, tuple[str, ...]]:
    """Each name of ``tied_parameters``' pairs -> every name that shares its tensor, itself first. Which of them a
    checkpoint stores depends on the model (its ``_tied_weights_keys``), not on the order modules register."""
    groups: dict[str, list[str]] = {}
    for alias, canonical in tied:
        group = groups.setdefault(canonical, [canonical])
        group.append(alias)
        groups[alias] = group
    return {name: (name, *(n for n in group if n != name)) for name, group in groups.items()}
