"""Pass 2, annotate: which decoder layer each node belongs to, and which nodes depend on the tokens.

No per-architecture code: the decoder layers are found as the ``nn.ModuleList`` whose entries are the model's
``_no_split_modules`` classes (or, failing that, the ModuleList with ``num_hidden_layers`` entries), and a
node's layer is read from ``node.meta["nn_module_stack"]``.

Facts written:

- ``node.meta["ppsplit.layer"]``: the decoder-layer index, or ``None`` outside the layers.
- ``node.meta["ppsplit.token"]``: whether the value depends on ``input_ids``. Values that do not (positions,
  rotary cos/sin, masks, weights) can be recomputed on any stage; values that do have exactly one home stage.
- ``node.meta["ppsplit.region"]`` (token nodes only): ``0`` before layer 0, ``2i+1`` inside layer ``i``,
  ``2i+2`` after layer ``i`` and before layer ``i+1``; ``2L`` is the head. A node outside the layers lives in
  the region right after its latest token input, so work between layers stays with the earlier layer.
Facts about the whole graph come back in the typed result, ``Annotated``:

- ``cuts``: for each tap id ``j`` in ``[0, L]``, the names of the token values crossing the cut right before
  layer ``j`` (for ``j = L``: between the last layer and the head). In most decoders exactly one value, the
  residual stream, crosses each cut; some read more (Gemma 4's per-layer inputs, made once from the tokens).
- ``residuals``: for each cut, the residual stream among its values: the only one, else the one shaped
  ``[B, T, hidden_size]`` that the next layer reads, computed last (``None`` when no value or several tie).
- ``costs``: parameter counts and bytes of the embedding, each layer, and the head.
- ``mids``: per layer, the residual stream between its attention and MLP blocks, where a stage may also end when
  the caller asks for half layers (``passes/halves.py``; layers without a clean point are absent).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import fx

from ppsplit.core.errors import TraceError
from ppsplit.core.layers import LayerStack
from ppsplit.core.fx_utils import CACHE_PREFIX
from ppsplit.passes.planning.halves import find_mids
from ppsplit.passes.trace import Traced, module_path, refuse_looped_layers
from ppsplit.core.plan import ModelCosts, Stream

# Ops whose result depends only on the shape of their tensor argument, never its values.
_CACHE_RE = re.compile(r"^" + CACHE_PREFIX + r"\.(\d+)\.")

SHAPE_OPS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int}


@dataclass(frozen=True)
class Annotated:
    """The annotate pass's result: the traced graph with per-node facts in ``node.meta``, and the whole-graph facts.

    This is what ``ppsplit.trace_model`` returns: trace once, then split it many ways."""

    traced: Traced
    layers: LayerStack
    cuts: dict[int, tuple[str, ...]]
    costs: ModelCosts
    residuals: dict[int, str | None]  # cut j -> the residual stream among cuts[j]
    mids: dict[int, str] = field(default_factory=dict)  # layer -> residual stream after its attention (halves.py)

    @property
    def gm(self) -> fx.GraphModule:
        return self.traced.gm


def annotate(traced: Traced, stack: LayerStack) -> Annotated:
    """Write layer indices, token dependence and regions into ``node.meta``; return cut values and costs."""
    gm = traced.gm
    graph = gm.graph
    layer_re = re.compile(r"^" + re.escape(stack.fqn) + r"\.(\d+)(?:\.|$)")
    num_layers = stack.num_layers
    head_region = 2 * num_layers

    def layer_of(node: fx.Node) -> int | None:
        if node.op == "get_attr":
            m = layer_re.match(node.target) or _CACHE_RE.match(node.target)
            return int(m.group(1)) if m else None
        for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
            m = layer_re.match(module_path(path))
            if m:
                return int(m.group(1))
        return None

    nodes = list(graph.nodes)
    _refuse_repeated_layers(nodes, stack, traced.model_class)
    for node in nodes:
        # Size arithmetic (SymInt values) is shared by every layer that needs it: it belongs to none.
        node.meta["ppsplit.layer"] = None if _is_size(node) else layer_of(node)
        node.meta["ppsplit.token"] = False
        node.meta.pop("ppsplit.region", None)

    for node in nodes:
        if node.op == "placeholder":
            if node.name == "input_ids":
                node.meta["ppsplit.token"] = True
                node.meta["ppsplit.region"] = 0
            continue
        if node.op != "call_function" or node.target in SHAPE_OPS:
            continue
        token_inputs = [a for a in node.all_input_nodes if a.meta["ppsplit.token"]]
        if not token_inputs:
            continue
        node.meta["ppsplit.token"] = True
        latest = max(a.meta["ppsplit.region"] for a in token_inputs)
        layer = node.meta["ppsplit.layer"]
        if layer is None and _is_size(node):
            # A size read from token data (``aten.item`` in MoE routing, and the checks on it) is not shared
            # shape arithmetic: it belongs to the layer that computes it.
            layer = node.meta["ppsplit.layer"] = layer_of(node)
        if layer is None:
            region = latest + 1 if latest % 2 else latest
        else:
            region = 2 * layer + 1
            if latest > region:
                src = max(token_inputs, key=lambda a: a.meta["ppsplit.region"])
                raise TraceError(f"{traced.model_class}'s decoder layer {layer} reads {src.name}, which its forward "
                                 f"computes after that layer: it runs the layers of {stack.fqn} out of index order, "
                                 "and ppsplit cuts the pipeline along that order; report the model")
        node.meta["ppsplit.region"] = region
        # An in-place write of token data into an otherwise token-free tensor makes that tensor token data.
        for base in mutated_bases(node):
            if not base.meta["ppsplit.token"]:
                base.meta["ppsplit.token"] = True
                base.meta["ppsplit.region"] = region

    graph.lint()
    cuts = _cuts(nodes, num_layers, head_region)
    by_name = {n.name: n for n in nodes}
    residuals = {j: _residual([by_name[name] for name in names], traced, 2 * j + 1 if j < num_layers else head_region)
                 for j, names in cuts.items()}
    return Annotated(traced=traced, layers=stack, cuts=cuts, costs=_costs(gm, nodes, num_layers, head_region, traced),
                     residuals=residuals, mids=find_mids(nodes, residuals, num_layers))


class Layout(NamedTuple):
    """Where a token value keeps its batch and token axes, and its other (per-token) dims in order."""

    batch_dim: int
    token_dim: int
    shape: tuple


def _refuse_repeated_layers(nodes: list[fx.Node], stack: LayerStack, model_class: str) -> None:
    """Decoder layers the traced forward called more than once are refused (``refuse_looped_layers``). Export names a
    module's ``n``-th call ``<name>@<n-1>`` in ``nn_module_stack``."""
    layer = re.compile(re.escape(stack.fqn) + r"\.(\d+)")
    calls: dict[int, int] = {}
    for node in nodes:
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            m = layer.fullmatch(module_path(path))
            if m and "@" in key:
                i = int(m.group(1))
                calls[i] = max(calls.get(i, 1), int(key.rpartition("@")[2]) + 1)
    refuse_looped_layers(model_class, stack.fqn, calls)


def per_token_shape(node: fx.Node, traced: Traced) -> tuple | None:
    """``shape[2:]`` when ``node``'s value is a tensor shaped ``[B, T, ...]`` (the traced batch and token
    count), else ``None``."""
    layout = per_token_layout(node, traced)
    return layout.shape if layout is not None and layout[:2] == (0, 1) else None


def per_token_layout(node: fx.Node, traced: Traced) -> Layout | None:
    """Where ``node``'s value keeps the batch and the token count: ``[B, T, ...]``, ``[B, heads, T, dim]`` as
    attention keeps keys and values, ``[n, B, T, H]`` as Gemma 3n stacks its streams (the batch first when it can
    be); ``None`` when it is not a tensor with one axis of each."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    batch = [d for d in range(val.dim()) if _is_symbol(val.shape[d], traced.batch_symbol, traced.fixed_batch)]
    for b in batch[:2]:  # a fixed batch of 1 may also match a later axis of size 1
        dims = [d for d in range(val.dim()) if d != b and _is_symbol(val.shape[d], traced.tokens_symbol)]
        if len(dims) == 1:
            return Layout(b, dims[0], tuple(s for d, s in enumerate(val.shape) if d not in (b, dims[0])))
    return None


def stream_layout(node: fx.Node, traced: Traced) -> Stream | None:
    """The ``Stream`` of a residual-stream node holding several hidden vectors per token (None: ``[B, T, H]``)."""
    layout = per_token_layout(node, traced)
    if layout is None or (layout[:2] == (0, 1) and len(layout.shape) == 1):
        return None
    return Stream(shape=tuple(int(d) for d in layout.shape), batch_dim=layout.batch_dim, token_dim=layout.token_dim)


def _is_symbol(dim, symbol: str, fixed: int = 0) -> bool:
    if isinstance(dim, int):  # a static size; or a size export fixed to the example (a batch of the cache's rows)
        return (not symbol and (not fixed or dim == fixed)) or symbol == str(dim)
    return isinstance(dim, torch.SymInt) and str(dim.node.expr) == symbol


def residual_message(annotated: "Annotated", j: int) -> str:
    """Why cut ``j`` has no residual stream ppsplit can tell apart (for a ``CrossingError``)."""
    names = annotated.cuts[j]
    where = f"decoder layer {j}" if j < annotated.layers.num_layers else "the head"
    if not names:
        return (f"no token-dependent value enters {where}; the model's layers do not form a residual stream "
                "ppsplit can cut")
    by_name = {n.name: n for n in annotated.gm.graph.nodes}
    detail = "; ".join(by_name[n].format_node() for n in names)
    hidden = annotated.traced.hidden_size
    rule = (f"the one value shaped [batch, tokens, {hidden}], or holding a fixed number of {hidden}-wide vectors per "
            "token, that the layer reads, computed last" if hidden else
            "the model's config names no hidden_size to tell it by")
    return (f"{len(names)} token-dependent values enter {where} and ppsplit cannot tell which is the residual "
            f"stream ({rule}): {detail}. Choose other stage boundaries or aux ids, or report the model")


def _residual(values: list[fx.Node], traced: Traced, reader: int) -> str | None:
    """The residual stream among the values crossing one cut (see ``Annotated.residuals``): the only value, else
    of those shaped ``[B, T, hidden_size]``, the ones that the next layer (region ``reader``) reads, and of those
    the one computed last; when no such value is read, the same among the values holding a fixed number of
    hidden-size vectors per token (a stream of several, ``[n, B, T, H]`` or ``[B, T, n, H]``)."""
    if len(values) == 1:
        return values[0].name
    for wide in (False, True):
        hidden = [v for v in values if v.meta["val"].is_floating_point() and _holds_hidden(v, traced, wide)]
        read = [v for v in hidden if any(u.meta.get("ppsplit.region") == reader for u in v.users)]
        if read:
            latest = max(v.meta["ppsplit.region"] for v in read)
            last = [v for v in read if v.meta["ppsplit.region"] == latest]
            return last[0].name if len(last) == 1 else None
    return None


def _holds_hidden(node: fx.Node, traced: Traced, several: bool) -> bool:
    """Whether ``node`` is ``[B, T, hidden_size]`` (``several``: a fixed number > 1 of hidden-size vectors per
    token, in any axis order)."""
    if not traced.hidden_size:
        return False
    if not several:
        return per_token_shape(node, traced) == (traced.hidden_size,)
    layout = per_token_layout(node, traced)
    return (layout is not None and len(layout.shape) > 1 and layout.shape[-1] == traced.hidden_size
            and all(isinstance(d, int) for d in layout.shape) and math.prod(layout.shape) > traced.hidden_size)


def _is_size(node: fx.Node) -> bool:
    """Size arithmetic (SymInt / SymBool values): shared by every layer that needs it, so it belongs to none."""
    return node.op == "call_function" and isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, int, bool))


def _cuts(nodes: list[fx.Node], num_layers: int, head_region: int) -> dict[int, tuple[str, ...]]:
    cuts: dict[int, list[str]] = {j: [] for j in range(num_layers + 1)}
    for node in nodes:
        if not node.meta.get("ppsplit.token"):
            continue
        region = node.meta["ppsplit.region"]
        latest_use = max((u.meta["ppsplit.region"] if u.op != "output" else head_region + 1
                          for u in node.users if u.op == "output" or u.meta.get("ppsplit.token")), default=region)
        for j in range(num_layers + 1):
            # Cut j (j < L) sits between region 2j and layer j (2j+1); cut L between the last layer and the head.
            before, after = (2 * j, 2 * j + 1) if j < num_layers else (head_region - 1, head_region)
            if region <= before and latest_use >= after:
                cuts[j].append(node.name)
    return {j: tuple(names) for j, names in cuts.items()}


def _costs(gm: fx.GraphModule, nodes: list[fx.Node], num_layers: int, head_region: int, traced: Traced) -> ModelCosts:
    """Parameter counts per part, attributed through the first token-dependent consumers of each weight; each
    layer's cache as the stages will hold it (the traced stand-in scaled to the paged pool)."""
    consumers: dict[fx.Node, set[int]] = {}
    for node in reversed(nodes):
        regions: set[int] = set()
        for user in node.users:
            if user.meta.get("ppsplit.token"):
                regions.add(user.meta["ppsplit.region"])
            else:
                regions |= consumers.get(user, set())
        consumers[node] = regions

    cache = [0] * num_layers
    for name, buf in gm.named_buffers():
        m = _CACHE_RE.match(name)
        if m:
            cache[int(m.group(1))] += pooled_bytes(name, buf, traced)
    params = dict(gm.named_parameters(remove_duplicate=False))  # a tied lm_head counts on the last stage too
    embed = [0, 0]
    head = [0, 0]
    tied = [0, 0]
    layers = [[0, 0] for _ in range(num_layers)]
    held: dict[int, tuple[tuple[int, int], set]] = {}  # per tensor (a tied table has two names): its parts
    for node in nodes:
        if node.op != "get_attr" or node.target not in params:
            continue
        p = params[node.target]
        _, parts = held.setdefault(id(p), ((p.numel(), p.numel() * p.element_size()), set()))
        for region in consumers[node]:
            if region == 0:
                parts.add(("embed", 0))
            elif region >= head_region:
                parts.add(("head", 0))
            else:
                parts.add(("layer", (region - 1) // 2))  # a between-layer region counts with the layer before
    for cost, parts in held.values():
        if ("embed", 0) in parts and ("head", 0) in parts:
            parts.add(("tied", 0))
        for kind, i in parts:
            bucket = {"embed": embed, "head": head, "tied": tied}.get(kind) or layers[i]
            bucket[0] += cost[0]
            bucket[1] += cost[1]
    return ModelCosts(
        embed_params=embed[0], embed_bytes=embed[1], head_params=head[0], head_bytes=head[1], tied_params=tied[0],
        tied_bytes=tied[1],
        layer_params=tuple(c[0] for c in layers), layer_bytes=tuple(c[1] for c in layers),
        layer_cache_bytes=tuple(cache) if any(cache) else (),
    )


def pooled_bytes(name: str, buf: torch.Tensor, traced: Traced) -> int:
    """Bytes of a cache buffer as the stages hold it: per-position entries (keys, values, convolution inputs,
    indexer keys) over the whole block pool, recurrent states for every sequence slot."""
    size = buf.numel() * buf.element_size()
    cache, stand_in = traced.cache, traced.stand_in
    if stand_in is None:
        return size
    if name.endswith(".states"):
        return size * cache.batch_size
    return size // stand_in.max_len * cache.pool_blocks * cache.block_size


def mutated_bases(node: fx.Node) -> list[fx.Node]:
    """The nodes whose storage ``node`` writes in place (through any chain of views)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return []
    bases = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, fx.Node):
            bases.append(view_base(value))
    return bases


def view_base(node: fx.Node) -> fx.Node:
    """Follow view ops (select, slice, view, transpose, ...) back to the tensor that owns the storage."""
    while node.op == "call_function" and is_view(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` returns a view of its first argument (select, slice, view, transpose, ...)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    ret, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return ret is not None and not ret.is_write and first is not None and not first.is_write
