"""Pass 6, attention: the model's attention over its static KV cache becomes one ``ppsplit::cache_attention``.

With ``CacheConfig``, each layer writes its new keys and values into ``kv_cache.<layer>.keys/values`` with
``index_copy_`` and then attends over the whole buffer: Hugging Face expands K and V to every query head
(``repeat_kv``) and masks all ``max_len`` slots, in ``scaled_dot_product_attention`` or eager
``matmul / softmax / matmul``. The replacement reads each KV head once and only the live prefix.

Recognition is by running, not by op patterns (as the fuse pass recognises norms):

1. The attention of a layer is the subgraph between its cache writes ``K``, ``V`` and the first node that
   depends on both (the SDPA or the probabilities-times-V product), extended through views to
   ``[B, Hq, T, Dv]``; its one other token-dependent input, seen through views as ``[B, Hq, T, D]``, is ``q``.
   Its remaining inputs must depend only on ``positions`` and sizes (the mask, ALiBi biases) or be
   parameters (sinks). Nothing inside may be read from outside.
2. Candidate parameters come from the subgraph's constants: the scale (SDPA's ``scale``, a multiplier or
   divisor, ``1/sqrt(D)``), a soft-cap (only with a ``tanh``), a sliding window and, for a paged cache, a chunk
   size (integer constants of the mask), ALiBi slopes (read off a position-only bias input), sinks (a ``[Hq]``
   parameter input).
3. The subgraph, with the mask computed from ``positions`` as the graph computes it, is evaluated on random
   ``q, K, V`` (fp32, several batch sizes, token counts and start positions, stale random values past the live
   length) and must equal ``cache_attention`` with one candidate set to 1e-4; else it stays as traced.

Contiguous positions are what the probes use and what ppsplit's steps pass (prefill, decode, verify): the
traced masks take query ``i`` at ``positions[0] + i``, ``cache_attention`` at ``positions[i]``.

MLA (in a paged trace only; a lockstep split keeps it as traced): when one cached tensor is read through a projection
whose weight the graph holds and split per head into a key part and a value, the layer is a candidate for
``ppsplit::latent_attention`` (``triton_kernels/attention.py`` has the math). Its subgraph is every node reading the
cached latents or rotary keys up to the first ``[B, H, T, dv]`` node that reads both (the expansion, the keys'
assembly, the attention), checked as in 1. and evaluated as in 3. on random latents, rotary keys, queries and
projection weights against ``latent_attention_reference``.

Result: ``Attended``, the rewritten copy of the graph and one ``AttentionSite`` per layer (replaced, or why not);
``SplitPlan.attention_lines(stage)`` formats what the plan prints per stage.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

import ppsplit.triton_kernels.attention  # noqa: F401  (registers torch.ops.ppsplit.cache_attention)
from ppsplit.core.fx_utils import CACHE_PREFIX, INDEXER_KEYS, fresh_copy, get_tensor, set_tensor
from ppsplit.passes.annotate import mutated_bases
from ppsplit.passes.evaluate import (COPY_OPS, SHAPE_OPS, VIEW_OPS, EvaluationError, SubgraphEvaluator,
                                     upcast)
from ppsplit.passes.partition import Partitioned, carry_forward
from ppsplit.passes.taps import Tapped
from ppsplit.core.plan import AttentionSite, SplitPlan
from ppsplit.passes.rewrites.projections import match_projection
from ppsplit.triton_kernels.attention import attention_reference, indexer_scores, latent_attention_reference
from ppsplit.triton_kernels.fp8 import FP8_DTYPE, dequantize

aten = torch.ops.aten
_VIEWS = VIEW_OPS | COPY_OPS
_BUDGET = 1 << 27  # largest tensor (elements) the check may build: Hq * max_len * head_dim
_TOL = dict(atol=1e-4, rtol=1e-4)
_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout}


@dataclass(frozen=True)
class Attended(Partitioned):
    """The attention pass's result: a rewritten copy of the graph, and one ``AttentionSite`` per layer that
    attends over the cache (replaced, or why not)."""

    sites: tuple[AttentionSite, ...] = ()


class _NoMatch(Exception):
    pass


def attention(tapped: Tapped, plan: SplitPlan) -> Attended:
    """Replace every provably equal attention over the static cache with ``cache_attention``, in a copy of the
    graph of ``tapped`` (which fuse then takes).

    Example::

        attended = attention(tapped, plan)     # after the taps pass, before fuse
        attended.sites                         # describe(): "attention: 4 of 4 -> ..."
    """
    gm = fresh_copy(tapped.gm)
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    info = tapped.annotated.traced
    writes: dict[int, dict[str, fx.Node]] = {}
    for node in graph.nodes:
        if node.target is aten.index_copy_.default:
            where = _cache_buffer(node.args[0])
            if where is not None:
                writes.setdefault(where[0], {})[where[1]] = node
    verified: dict[tuple, tuple | _NoMatch] = {}
    # MLA's absorbed form is what a paged cache of latents needs; a lockstep split keeps MLA as traced.
    latent = info.stand_in is not None
    sites = []
    for layer, kv in sorted(writes.items()):
        k, v = kv.get("keys"), kv.get("values")
        stage = (k or v).meta.get("ppsplit.stage", 0)
        mla = None
        try:
            if k is None or v is None:
                raise _NoMatch("the layer writes only one of keys/values")
            mla = _latent_projection(k, v) if latent else None
            if mla is not None:
                detail = _rewrite_latent(gm, mla, kv.get(INDEXER_KEYS), order, info, verified)
            else:
                detail = _rewrite_or_join(gm, k, v, order, info, verified)
            sites.append(AttentionSite(layer, stage, True, detail))
        except _NoMatch as e:
            sites.append(AttentionSite(layer, stage, False, str(e)))
        if k is not None and v is not None and mla is None:
            sites += _shared(gm, k, v, layer, order, info, verified)
    sites.sort(key=lambda site: site.layer)
    graph.lint()
    gm.recompile()
    return carry_forward(tapped, Attended, gm=gm, sites=tuple(sites))


def _rewrite_or_join(gm, k: fx.Node, v: fx.Node, order: dict, info, verified: dict) -> str:
    """``_rewrite``, or where it finds no attention, ``_rewrite_joined`` or ``_rewrite_key_bias`` (a paged cache only:
    they change what the cache holds); the first refusal's reason when none fits."""
    try:
        return _rewrite(gm, k, v, order, info, verified)
    except _NoMatch as e:
        if info.stand_in is None:
            raise
        for fallback in (_rewrite_joined, _rewrite_key_bias):
            try:
                return fallback(gm, k, v, order, info, verified)
            except _NoMatch:
                pass
        raise e from None


def _shared(gm, k: fx.Node, v: fx.Node, owner: int, order: dict, info, verified: dict) -> list[AttentionSite]:
    """The sites of the layers that attend over layer ``owner``'s cached ``k``, ``v`` (Gemma 3n's and Gemma 4's KV
    sharing: a layer reuses the keys and values of the last earlier layer of its kind), each rewritten as that layer's
    own attention would be."""
    readers = {}
    for u in list(k.users) + list(v.users):
        layer = u.meta.get("ppsplit.layer")
        if isinstance(layer, int) and layer != owner:
            readers.setdefault(layer, u.meta.get("ppsplit.stage", 0))
    sites = []
    for layer, stage in sorted(readers.items()):
        try:
            detail = _rewrite(gm, k, v, order, info, verified, layer=layer)
            sites.append(AttentionSite(layer, stage, True, f"{detail}, over the keys and values of layer {owner}"))
        except _NoMatch as e:
            sites.append(AttentionSite(layer, stage, False, f"over the keys and values of layer {owner}: {e}"))
    return sites


def _rewrite(gm, k: fx.Node, v: fx.Node, order: dict, info, verified: dict, layer: int | None = None) -> str:
    """The attention over the cached ``k``, ``v`` (in ``layer``: by default the layer that writes them) ->
    ``cache_attention``; its description (else ``_NoMatch``)."""
    found = _match(gm, k, v, order, layer)
    params = _verified(verified, found.signature(), lambda: _verify(gm, found, info))
    if params.sink is not None:
        params = params._replace(sink=_sinks(found)[params.sink])
    _replace(gm, found, params)
    return _describe(params)


class _Params(NamedTuple):
    """What makes ``cache_attention`` equal a traced attention (``attention_reference`` has the math)."""

    scale: float
    window: int = 0
    softcap: float = 0.0
    alibi: torch.Tensor | None = None
    sink: Any = None  # the index among ``_sinks`` while verifying, then its node
    chunk: int = 0
    tiled: bool = False  # query head h reads KV head h % Hkv (JetMoe repeats K and V whole), not h // (Hq // Hkv)


def _verified(verified: dict, key: tuple, verify):
    """``verify()`` once per distinct subgraph (layers built alike share the answer, and a refusal)."""
    if key not in verified:
        try:
            verified[key] = verify()
        except _NoMatch as e:
            verified[key] = e
    if isinstance(verified[key], _NoMatch):
        raise verified[key]
    return verified[key]


def _cache_buffer(node) -> tuple[int, str] | None:
    """``(layer, kind)`` when ``node`` is ``kv_cache.<layer>.<kind>[:batch]`` of keys, values or indexer keys."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.slice.Tensor:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    parts = node.target.split(".")
    if len(parts) == 3 and parts[0] == CACHE_PREFIX and parts[1].isdigit() \
            and parts[2] in ("keys", "values", INDEXER_KEYS):
        return int(parts[1]), parts[2]
    return None


@dataclass
class _Found:
    k: fx.Node
    v: fx.Node
    q: fx.Node
    out: fx.Node
    region: list  # topological order, ends with `out`
    inputs: list  # position-only tensors and sizes the region reads (evaluated from positions)
    params: list  # get_attr nodes the region reads
    heads: int
    selected: fx.Node | None = None  # sparse attention: the positions each token sees, picked by an indexer
    values: Any = None  # joined attentions: what the attention reads of the cached values, as a function of them
    key_bias: Any = None  # a per-key bias [B, Hkv, L] added to the scores, as a function of the cached values and
    # the weights (Doge)
    token_major: bool = False  # its output is laid out [B, T, Hq, Dv] (the joined attentions' concatenation)

    def signature(self) -> tuple:
        index = {n: ("in", i) for i, n in enumerate([self.q, self.k, self.v, self.selected]) if n is not None}
        index.update({n: ("ext", n.name) for n in self.inputs})
        index.update({n: ("param", tuple(n.meta["val"].shape), str(n.meta["val"].dtype)) for n in self.params})
        index.update({n: ("node", i) for i, n in enumerate(self.region)})

        def enc(a):
            if isinstance(a, fx.Node):
                return index.get(a, ("?", a.name))
            if isinstance(a, (list, tuple)):
                return tuple(enc(x) for x in a)
            return repr(a)

        shapes = tuple(str(tuple(n.meta["val"].shape)) for n in (self.q, self.k, self.v))
        return shapes + tuple((str(n.target), enc(n.args), enc(tuple(sorted(n.kwargs.items())))) for n in self.region)


def _shape(node: fx.Node):
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _same(a, b) -> bool:
    """Sizes (or tuples of them) known equal without a guard: ``==`` on a traced symbolic size, made a ``bool``,
    would specialise the symbol to its example value (the step's token count fixed at the trace's) wherever the
    example value happened to match."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) \
            and all(_same(x, y) for x, y in zip(a, b))
    return statically_known_true(a == b)


def _match(gm: fx.GraphModule, k: fx.Node, v: fx.Node, order: dict, layer: int | None = None) -> _Found:
    """The attention over the cached ``k``, ``v``: it ends at the first node reading both (through views to
    ``[B, Hq, T, Dv]``), or, where that one's region is read outside it, at the first later ``[B, Hq, T, Dv]`` node
    whose region is self-contained (Granite-SWA scales the attention's output by its sinks after the product).
    ``layer``: the attention of that layer over them (KV sharing), not of the layer that writes them."""
    from_k, from_v = _downstream(k, layer=layer), _downstream(v, layer=layer)
    both = sorted(from_k & from_v, key=order.get)
    if not both:
        raise _NoMatch("no op reads both the cached keys and values")
    kshape, vshape = _shape(k), _shape(v)
    batch, kv_heads, dv = kshape[0], kshape[1], vshape[3]
    positions = gm.graph.find_nodes(op="placeholder", target="positions")[0]
    tokens = positions.meta["val"].shape[0]

    def is_out(shape):
        return (shape is not None and len(shape) == 4 and _same(shape[0], batch) and _same(shape[2], tokens)
                and _same(shape[3], dv) and isinstance(shape[1], int) and shape[1] % kv_heads == 0)

    first_error = None
    for out in [both[0]] + [n for n in both[1:] if is_out(_shape(n))]:
        try:
            chain = [out]
            while not is_out(_shape(out)):
                users = list(out.users)
                if len(users) != 1 or users[0].target not in _VIEWS:
                    raise _NoMatch(f"its output {out.format_node()} is not [B, Hq, T, Dv]")
                out = users[0]
                chain.append(out)
            region, external = _region(chain, from_k | from_v)
            return _found(gm, k, v, out, region, external, (batch, _shape(out)[1], tokens, kshape[3]), order)
        except _NoMatch as e:
            first_error = first_error or e
    raise first_error


def _region(chain: list, inside: set) -> tuple[set, list]:
    """Everything between the cache reads (``inside``: the nodes reading them) and the output ``chain``, and the
    nodes from elsewhere that it reads."""
    region, external, todo = set(chain), [], list(chain)
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a in region or a in external:
                continue
            if a in inside:
                region.add(a)
                todo.append(a)
            else:
                external.append(a)
    return region, external


def _found(gm, k: fx.Node, v: fx.Node, out: fx.Node, region: set, external: list, qshape: tuple,
           order: dict, selected: fx.Node | None = None) -> _Found:
    """The attention whose nodes are ``region`` (ending in ``out``), reading the cached ``k``, ``v`` and the
    ``external`` nodes, checked to be self-contained; its query is the one token-dependent input besides ``selected``
    (sparse attention's picks), seen through views as ``qshape``."""
    _self_contained(region, out)
    tokenish = [a for a in external if a not in (k, v, selected) and a.meta.get("ppsplit.token")
                and isinstance(a.meta.get("val"), torch.Tensor)]
    if len(tokenish) != 1:
        raise _NoMatch(f"expected one query input, found {len(tokenish)} token-dependent inputs "
                       f"({', '.join(a.name for a in tokenish)})")
    q = tokenish[0]
    while _shape(q) != qshape:
        if q.op != "call_function" or q.target not in _VIEWS and q.target is not aten.transpose.int \
                or len(q.users) != 1:
            raise _NoMatch(f"its query {q.format_node()} is not a view of [B, Hq, T, D]")
        region.add(q)
        external.remove(q)
        q = q.args[0]
        external.append(q)
    inputs = [a for a in external if a not in (k, v, q, selected) and a.op != "get_attr"]
    # Learned inputs (sinks, reshaped and expanded outside the region): the check gives them random values.
    params = [a for a in external if a.op == "get_attr"]
    params += [a for a in _closure_nodes(inputs, attrs=True) if a.op == "get_attr" and a not in params
               and isinstance(get_tensor(gm, a.target), torch.nn.Parameter)]
    for a in inputs:
        if a.meta.get("ppsplit.token") and isinstance(a.meta.get("val"), torch.Tensor):
            raise _NoMatch(f"{a.format_node()} feeds the attention and depends on the tokens")
    return _Found(k=k, v=v, q=q, out=out, region=sorted(region, key=order.get), inputs=inputs, params=params,
                  heads=qshape[1], selected=selected)


def _self_contained(region: set, out: fx.Node, what: str = "the attention") -> None:
    """Check that ``region`` (extended by the unused halves of its tuple results) is read outside only through
    ``out`` and writes nothing outside itself."""
    for n in list(region):  # an unused half of a tuple result (max's indices) goes with it
        region.update(u for u in n.users if u.target is operator.getitem and not u.users)
    for n in region:
        if n is not out and any(u not in region for u in n.users):
            raise _NoMatch(f"{n.format_node()} inside {what} is also read outside it")
        if n.op != "call_function":
            raise _NoMatch(f"unexpected {n.op} node {n.name} inside {what}")
        if any(b not in region for b in mutated_bases(n)):
            raise _NoMatch(f"{n.format_node()} inside {what} writes a tensor outside it")


def _downstream(start: fx.Node, writes: bool = False, layer: int | None = None) -> set:
    """Nodes reading ``start``, transitively, within its decoder layer (or ``layer``); with ``writes``, also those
    reading a tensor that one of them writes in place (MLA's keys assembled by ``copy_`` into a ``new_empty``)."""
    layer = start.meta.get("ppsplit.layer") if layer is None else layer
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        written = [b for b in mutated_bases(n) if b.op == "call_function"] if writes and n is not start else []
        for u in list(n.users) + [u for b in written for u in b.users]:
            if u not in seen and u.op == "call_function" and u.meta.get("ppsplit.layer") == layer:
                seen.add(u)
                todo.append(u)
    return seen


# ---- joined attentions: several over the same queries and keys, their values per-position parts of one cache ----

def _rewrite_joined(gm, k: fx.Node, v: fx.Node, order: dict, info, verified: dict) -> str:
    """DiffLlama: attentions over the same query and keys whose values are per-position transforms of the cached values
    (``chunk`` along the heads, ``repeat``), concatenated along the last dim. Attention is linear in its values, so
    that is one attention over the concatenated values: the cache then holds those (the transforms run on each
    step's new values before the write), and one ``cache_attention`` reads them. Proved by evaluation as ``_rewrite``
    proves a plain attention."""
    found, parts, transforms = _match_joined(gm, k, v, order)
    params = _verified(verified, ("joined",) + found.signature(), lambda: _verify(gm, found, info))
    if params.sink is not None:
        params = params._replace(sink=_sinks(found)[params.sink])
    _hold_joined_values(gm, v, parts, transforms)
    _replace(gm, found, params)
    return _describe(params) + f", values joined from {len(parts)} parts"


def _match_joined(gm, k: fx.Node, v: fx.Node, order: dict):
    """``(found, parts, transforms)``: the attention ending at the first ``cat`` along the last dim of attentions over
    ``k`` and ``v``, with ``values`` set to build the concatenated values from cached ones; ``parts`` the value nodes
    each attention reads at the KV heads (``[B, Hkv, L, d]``), ``transforms`` the nodes between ``v`` and them."""
    from_k, from_v = _downstream(k), _downstream(v)
    kshape, vshape = _shape(k), _shape(v)
    batch, kv_heads, length = kshape[0], kshape[1], kshape[2]
    joins = [n for n in sorted(from_k & from_v, key=order.get) if n.target is aten.cat.default
             and (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) in (-1, len(_shape(n) or ()) - 1)]
    if not joins:
        raise _NoMatch("no concatenation of attentions over its keys and values")
    join = joins[0]
    shape = _shape(join)
    positions = gm.graph.find_nodes(op="placeholder", target="positions")[0]
    tokens = positions.meta["val"].shape[0]
    if shape is None or len(shape) != 4 or not _same(shape[:2], (batch, tokens)):
        raise _NoMatch(f"its concatenation {join.format_node()} is not [B, T, Hq, Dv]")
    values_only = from_v - from_k
    parts, transforms = [], set()
    for piece in join.args[0]:
        ancestors = _ancestors(piece, from_k | from_v | {v}) & (values_only | {v})
        kv_shaped = [n for n in ancestors if _shape(n) is not None and len(_shape(n)) == 4
                     and _same(_shape(n)[:3], (batch, kv_heads, length))]
        if not kv_shaped:
            raise _NoMatch(f"{piece.format_node()} reads no values of the cache's heads and positions")
        part = max(kv_shaped, key=order.get)
        parts.append(part)
        transforms |= _ancestors(part, values_only)
    for n in transforms:
        if n.op != "call_function" or any(a == length for a in _flat_args(n)):
            raise _NoMatch(f"its values' transform {n.format_node()} is not one per position")
    region, external = _region([join], from_k | from_v)
    found = _found(gm, k, v, join, region, external, (batch, shape[2], tokens, kshape[3]), order)
    transforms = sorted(transforms, key=order.get)

    def values(cached: torch.Tensor) -> torch.Tensor:
        env = SubgraphEvaluator(gm, upcast=True).run_nodes(transforms, {v: cached})
        return torch.cat([env[p] if p is not v else cached for p in parts], dim=-1)

    return dataclasses.replace(found, values=values, token_major=True), parts, transforms


def _hold_joined_values(gm: fx.GraphModule, v: fx.Node, parts: list, transforms: list) -> None:
    """The cache of ``v`` (an ``index_copy_`` into ``kv_cache.<layer>.values``) holds the concatenated ``parts``:
    the ``transforms`` run on each step's new values, and their concatenation is what is written."""
    graph = gm.graph
    new = v.args[3]
    env = {v: new}
    with graph.inserting_before(v):
        for n in transforms:
            copy = graph.node_copy(n, lambda a: env.get(a, a))
            copy.meta["val"] = _fake_run(copy)
            env[n] = copy
        joined = graph.call_function(aten.cat.default, ([env[p] for p in parts], -1))
    joined.meta.update({key: val for key, val in new.meta.items() if key != "val"})
    joined.meta["val"] = _fake_run(joined)
    _widen_cache(gm, v, joined, sum(_shape(p)[3] for p in parts))


def _rewrite_key_bias(gm, k: fx.Node, v: fx.Node, order: dict, info, verified: dict) -> str:
    """Doge's dynamic mask: the scores get a bias per KV head and key computed from that key's cached value
    (``exp(A * softplus(dt_proj(v)))``). As ``scale * [q, 1] . [k, bias / scale]`` it is an attention over keys one
    dimension wider: the cache then holds those keys (the bias computed from each step's new values before the
    write), and one ``cache_attention`` reads them with the queries widened by a 1. Proved by evaluation."""
    found = _match(gm, k, v, order)
    kshape = _shape(k)
    batch, kv_heads, length = kshape[0], kshape[1], kshape[2]
    values_only = _downstream(v) - _downstream(k)
    biases = [n for n in found.region if n in values_only and _same(_shape(n), (batch, kv_heads, length))]
    if not biases:
        raise _NoMatch("no per-key bias computed from its values")
    bias = max(biases, key=order.get)
    transforms = sorted(_ancestors(bias, values_only) - {v}, key=order.get)
    _check_per_position(transforms, v, bias, length)
    found = dataclasses.replace(found, key_bias=lambda cached, params: _replay(transforms, v, cached, length,
                                                                              params)[bias])
    params = _verified(verified, ("key bias",) + found.signature(), lambda: _verify(gm, found, info))
    if params.sink is not None or params.tiled or params.alibi is not None:
        raise _NoMatch("a per-key bias beside sinks, ALiBi or a tiled head order")
    graph = gm.graph
    view, dim, index, new_keys = k.args
    new_values = v.args[3]
    if order[new_values] > order[k]:
        raise _NoMatch("its new values are computed after its keys are written")
    env = {v: new_values}
    with graph.inserting_before(k):
        tokens = graph.call_function(aten.sym_size.int, (new_values, 2))
        tokens.meta["val"] = new_values.meta["val"].shape[2]
        for n in transforms:
            copy = graph.node_copy(n, lambda a: env.get(a, a))
            copy.args, copy.kwargs = fx.node.map_aggregate(
                (copy.args, copy.kwargs), lambda a: tokens if isinstance(a, int) and not isinstance(a, bool)
                and a == length else a)
            copy.meta["val"] = _fake_run(copy)
            env[n] = copy
        scaled = graph.call_function(aten.div.Tensor, (env[bias], float(params.scale)))
        column = graph.call_function(aten.unsqueeze.default, (scaled, -1))
        cast = graph.call_function(aten._to_copy.default, (column,), {"dtype": new_keys.meta["val"].dtype})
        wider = graph.call_function(aten.cat.default, ([new_keys, cast], -1))
    for n in (scaled, column, cast, wider):
        n.meta.update({key: val for key, val in new_keys.meta.items() if key != "val"})
        n.meta["val"] = _fake_run(n)
    _widen_cache(gm, k, wider, kshape[3] + 1)
    with graph.inserting_before(found.out):
        q = found.q
        ones = graph.call_function(aten.new_ones.default, (q, [*_sizes(graph, q)[:-1], 1]))
        widened = graph.call_function(aten.cat.default, ([q, ones], -1))
    for n in (ones, widened):
        n.meta.update({key: val for key, val in q.meta.items() if key != "val"})
        n.meta["val"] = _fake_run(n)
    _replace(gm, dataclasses.replace(found, q=widened), params)
    return _describe(params) + ", a per-key bias from its values in the keys"


def _sizes(graph: fx.Graph, node: fx.Node) -> list:
    """The sizes of ``node`` as graph values: ``sym_size`` nodes where they are symbolic."""
    out = []
    for d, size in enumerate(node.meta["val"].shape):
        if isinstance(size, torch.SymInt):
            size_node = graph.call_function(aten.sym_size.int, (node, d))
            size_node.meta["val"] = size
            out.append(size_node)
        else:
            out.append(int(size))
    return out


def _replay(transforms: list, v: fx.Node, cached: torch.Tensor, length: int, params: dict) -> dict:
    """The values of ``transforms`` (nodes reading ``v`` and the weights ``params``) on ``cached`` values of any number
    of positions: integer arguments equal to the traced cache ``length`` take the positions of ``cached``."""
    env = {v: cached, **params}
    positions = cached.shape[2]
    for n in transforms:
        args, kwargs = fx.node.map_aggregate(
            (n.args, n.kwargs), lambda a: env[a] if isinstance(a, fx.Node) else positions
            if isinstance(a, int) and not isinstance(a, bool) and a == length else a)
        env[n] = n.target(*args, **kwargs)
    return env


def _check_per_position(transforms: list, v: fx.Node, out: fx.Node, length: int) -> None:
    """``_NoMatch`` unless ``out`` (``[B, H, L, ...]``, from the cached values ``v`` through ``transforms``) is a
    function of each position alone: computed on a few positions' values it equals those positions of it computed on
    all (random values and weights)."""
    gen = torch.Generator().manual_seed(0)
    cached = torch.randn([int(d) for d in v.meta["val"].shape], generator=gen)
    where = torch.tensor([length - 1, 0, length // 2])
    gm = v.graph.owning_module
    params = {a: _param_value(gm, a, gen) for n in transforms for a in n.all_input_nodes if a.op == "get_attr"}
    try:
        whole = _replay(transforms, v, cached, length, params)[out].index_select(2, where)
        part = _replay(transforms, v, cached.index_select(2, where), length, params)[out]
        ok = torch.allclose(whole, part, **_TOL)
    except Exception as e:  # noqa: BLE001  (a transform this evaluation cannot run on fewer positions)
        raise _NoMatch(f"its values' transform cannot be computed per position ({type(e).__name__})") from None
    if not ok:
        raise _NoMatch("its values' transform is not one per position")


def _widen_cache(gm: fx.GraphModule, write: fx.Node, new: fx.Node, width: int) -> None:
    """The cache ``write`` (an ``index_copy_`` into ``kv_cache.<layer>.<kind>``) holds ``new`` (its last dim
    ``width``): the buffer re-registered that wide, the meta of its views and of the write updated."""
    view = write.args[0]
    base = view
    while base.op == "call_function":
        base = base.args[0]
    old = get_tensor(gm, base.target)
    shape = (*old.shape[:3], width)
    set_tensor(gm, base.target, torch.zeros(shape, dtype=old.dtype, device=old.device), parameter=False,
               persistent=False)
    node = view
    while True:
        node.meta["val"] = node.meta["val"].new_empty((*node.meta["val"].shape[:3], width))
        if node is base:
            break
        node = node.args[0]
    write.args = (view, *write.args[1:3], new)
    write.meta["val"] = view.meta["val"]


def _fake_run(node: fx.Node):
    """``node``'s value computed on its inputs' ``meta["val"]`` (fake tensors)."""
    args = fx.node.map_arg(node.args, lambda a: a.meta["val"])
    kwargs = fx.node.map_arg(node.kwargs, lambda a: a.meta["val"])
    return node.target(*args, **kwargs)


def _ancestors(node: fx.Node, within: set) -> set:
    """``node`` and the nodes of ``within`` it reads, transitively through them."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n is not node and n not in within:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def _flat_args(node: fx.Node) -> list:
    out = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda a: out.append(a) if isinstance(a, int) else None)
    return out


# ---- verification by evaluation ----------------------------------------------------------------------------

def _verify(gm: fx.GraphModule, f: _Found, info) -> tuple:
    kshape, vshape = f.k.meta["val"].shape, f.v.meta["val"].shape
    max_len, head_dim, dv = int(kshape[2]), int(kshape[3]), int(vshape[3])
    if f.heads * max_len * max(head_dim, dv) > _BUDGET:
        raise _NoMatch(f"cache too large to check by evaluation ({f.heads} heads x {max_len} slots x {head_dim})")
    gen = torch.Generator().manual_seed(0)
    params = {p: _param_value(gm, p, gen) for p in f.params}
    cases = _cases(gm, f, info, head_dim, params, gen)
    first = cases[0]
    alibis = [None] + _alibi_candidates(gm, f, info, first[0], first[1].shape[0], max_len)
    sinks = _sinks(f)
    # Chunked attention only where a paged cache will serve it: the lockstep kernels have no chunks.
    chunks = _chunks(gm, f) if info.stand_in is not None else [0]
    orders = [False, True] if f.heads != int(kshape[1]) else [False]
    for tiled, chunk, scale, softcap, window, alibi, sink in itertools.product(
            orders, chunks, _scales(f, head_dim), _softcaps(f), _windows(gm, f), alibis, [None, *sinks]):
        if tiled and (alibi is not None or sink is not None):
            continue  # per-head constants of a tiled order: none of the models built so has them
        sink_value = params[sink] if sink is not None else None
        kv_heads = int(kshape[1])

        def reference(pos, q, k, v):
            q = _tile_heads(q, kv_heads) if tiled else q
            if f.key_bias is not None:
                q, k = _with_key_bias(q, k, f.key_bias(v, params), scale)
            v = f.values(v) if f.values is not None else v
            out = attention_reference(q, k, v, pos, scale, window, softcap, alibi, sink_value, chunk_size=chunk)
            out = _untile_heads(out, kv_heads) if tiled else out
            return out.transpose(1, 2) if f.token_major else out

        if all(_close(reference(pos, q, k, v), got) for pos, q, k, v, got, _ in cases):
            return _Params(scale, window, softcap, alibi, None if sink is None else sinks.index(sink), chunk, tiled)
    raise _NoMatch("no scale/window/chunk/soft-cap/ALiBi/sinks/head order makes cache_attention equal it")


def _with_key_bias(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, scale: float) -> tuple:
    """``q [B, Hq, T, D]``, ``k [B, Hkv, L, D]`` with one more dimension each (1 for the query, ``bias / scale`` for
    the key), so that ``scale * q . k`` becomes ``scale * q . k + bias[kv head, key]``."""
    ones = torch.ones(*q.shape[:-1], 1, dtype=q.dtype)
    return torch.cat([q, ones], dim=-1), torch.cat([k, (bias / scale)[..., None].to(k.dtype)], dim=-1)


def _tile_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Query heads ``r * Hkv + j`` (which read KV head ``j`` when K and V are repeated whole) moved to ``j * G + r``,
    where ``cache_attention`` reads KV head ``j``."""
    return q.unflatten(1, (-1, kv_heads)).transpose(1, 2).flatten(1, 2)


def _untile_heads(out: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``_tile_heads`` undone on the attention's output."""
    return out.unflatten(1, (kv_heads, -1)).transpose(1, 2).flatten(1, 2)


def _cases(gm, f: _Found, info, q_dim: int, params: dict, gen) -> list:
    """``(positions, q, k, v, the subgraph's output, selected)`` on random ``q [b, heads, t, q_dim]``, cached ``k``,
    ``v`` (and, for sparse attention, ``K`` random positions per token) for a few batch sizes, token counts and start
    positions (stale random values past the live length)."""
    kshape, vshape = f.k.meta["val"].shape, f.v.meta["val"].shape
    max_len = int(kshape[2])
    cases = []
    for batch, tokens, start in _probes(info, max_len):
        positions = torch.arange(start, start + tokens)
        q = torch.randn(batch, f.heads, tokens, q_dim, generator=gen)
        k = torch.randn(batch, *(int(d) for d in kshape[1:]), generator=gen)
        v = torch.randn(batch, *(int(d) for d in vshape[1:]), generator=gen)
        env = {f.q: q, f.k: k, f.v: v, **params}
        selected = None
        if f.selected is not None:  # distinct positions as an indexer picks them: visible ones first, then stale
            score = torch.rand(batch, tokens, max_len, generator=gen) + (torch.arange(max_len) <= positions[:, None])
            env[f.selected] = selected = score.argsort(-1, descending=True)[..., :_shape(f.selected)[-1]]
        cases.append((positions, q, k, v, _run(gm, f, info, batch, positions, env), selected))
    return cases


def _probes(info, max_len: int) -> list[tuple[int, int, int]]:
    """``(batch, tokens, first position)`` of the checks: prefill, decode and verify sizes, at the start, middle and
    end of the cache."""
    max_batch = info.stand_in.batch_size if info.stand_in else 2
    probes = [(min(2, max_batch), min(3, max_len), max_len // 2 - 1), (1, 1, max_len - 1),
              (min(2, max_batch), min(2, max_len), 0), (1, min(5, max_len), max(0, max_len - 5))]
    return [(b, t, max(0, min(p, max_len - t))) for b, t, p in probes]


def _run(gm, f: _Found, info, batch: int, positions, env: dict):
    """``_evaluate``, any failure of the evaluation itself a ``_NoMatch``."""
    try:
        return _evaluate(gm, f, info, batch, positions, env)
    except _NoMatch:
        raise
    except Exception as e:  # the subgraph does something our evaluation cannot reproduce
        raise _NoMatch(f"could not evaluate it ({type(e).__name__}: {str(e)[:80]})") from None


def _sinks(f: _Found) -> list:
    return [p for p in f.params if _shape(p) == (f.heads,)]


def _close(a: torch.Tensor, b) -> bool:
    return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b.to(a.dtype), **_TOL)


def _param_value(gm, node: fx.Node, gen) -> torch.Tensor:
    t = get_tensor(gm, node.target)
    if t.device.type == "meta" or isinstance(t, torch.nn.Parameter):
        # A learned input (sinks): any value will do, the same for the subgraph and the candidate.
        return torch.randn(t.shape, generator=gen).to(upcast(t.dtype))
    return t.detach().to("cpu", upcast(t.dtype))


def _evaluate(gm, f: _Found, info, batch: int, positions, env: dict):
    """The value of ``f.out`` from ``env`` (node -> value: the query, the cache, parameters) and ``positions``."""
    env = dict(env)
    tokens = positions.shape[0]
    placeholders = {"input_ids": torch.zeros(batch, tokens, dtype=torch.long), "positions": positions}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    needed = sorted(_closure(f.inputs, env), key=order.get)
    for n in needed:
        if n.op == "placeholder":
            if n.target not in placeholders:
                raise _NoMatch(f"its mask reads the input {n.target}")
            env[n] = placeholders[n.target]
    evaluator = SubgraphEvaluator(gm, upcast=True, sizes={info.batch_symbol: batch, info.tokens_symbol: tokens})
    try:
        return evaluator.run_nodes([n for n in needed if n not in env] + f.region, env)[f.out]
    except EvaluationError as e:
        raise _NoMatch(str(e)) from None


def _closure(roots: list, env: dict) -> set:
    seen, todo = set(), list(roots)
    while todo:
        n = todo.pop()
        if n in seen or n in env:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target in SHAPE_OPS:
            continue  # evaluated from the probe's batch and token count
        if n.meta.get("ppsplit.token") and isinstance(n.meta.get("val"), torch.Tensor):
            raise _NoMatch(f"its mask depends on the tokens through {n.format_node()}")
        todo.extend(n.all_input_nodes)
    return seen


def _floats(f: _Found) -> list[float]:
    seen = []
    for n in f.region:
        for a in list(n.args) + list(n.kwargs.values()):
            if isinstance(a, float) and not isinstance(a, bool) and math.isfinite(a) and a != 0 and abs(a) < 1e6 \
                    and a not in seen:
                seen.append(a)
    return seen


def _scales(f: _Found, head_dim: int) -> list[float]:
    out = []
    for n in f.region:
        if n.target is aten.scaled_dot_product_attention.default:
            scale = n.kwargs.get("scale", n.args[6] if len(n.args) > 6 else None)
            out.append(scale if scale is not None else 1.0 / math.sqrt(head_dim))
    for c in _floats(f):
        out += [c, 1.0 / c]
    out += [1.0 / math.sqrt(head_dim), 1.0]
    return list(dict.fromkeys(out))


def _softcaps(f: _Found) -> list[float]:
    if not any(n.target is aten.tanh.default for n in f.region):
        return [0.0]
    return [c for c in _floats(f) if c > 0]


def _windows(gm, f: _Found) -> list[int]:
    """0 (none) and the integer constants of the mask's computation, give or take one."""
    out = [0]
    for c in sorted(_mask_ints(f)):
        out += [c - 1, c, c + 1]
    return [w for w in dict.fromkeys(out) if w >= 0]


def _mask_ints(f: _Found) -> set[int]:
    ints = set()
    for n in _closure_nodes(f.inputs):
        for a in list(n.args) + list(n.kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and 1 <= abs(a) < (1 << 40):
                ints.add(abs(a))
    return ints


def _chunks(gm, f: _Found) -> list[int]:
    """0 (none) and the integer constants of the mask's computation above 1: the chunk sizes of a chunked attention
    (Llama 4's ``attention_chunk_size``)."""
    return [0] + sorted(c for c in _mask_ints(f) if c > 1)


def _closure_nodes(roots: list, attrs: bool = False) -> list:
    seen, todo = {}, list(roots)
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function" and not (attrs and n.op == "get_attr"):
            continue
        seen[n] = None
        if n.op != "call_function":
            continue
        todo.extend(n.all_input_nodes)
    return list(seen)


def _alibi_candidates(gm, f: _Found, info, positions, batch: int, max_len: int) -> list:
    """Per-head slopes read off a position-only float input that grows linearly along the key axis."""
    found = []
    for node in f.inputs:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or val.dim() == 0 \
                or val.shape[-1] != max_len:
            continue
        try:
            probe = _Found(k=f.k, v=f.v, q=f.q, out=node, region=[], inputs=[node], params=[], heads=f.heads)
            value = _evaluate(gm, probe, info, batch, positions, {})
        except Exception:  # noqa: BLE001  (not a bias we can read)
            continue
        if value.numel() % (batch * f.heads * max_len):
            continue
        rows = value.reshape(batch, f.heads, -1, max_len)[0, :, 0].float()
        slopes = rows[:, 1] - rows[:, 0]
        if torch.allclose(rows, slopes[:, None] * torch.arange(max_len, dtype=torch.float32), atol=1e-4, rtol=1e-5) \
                and slopes.abs().max() > 0:
            found.append(slopes)
    return found


# ---- MLA: a cache of latents, expanded to keys and values every step ----------------------------------------

@dataclass(frozen=True)
class _Latent:
    """An MLA layer's parts (``latent_attention_reference`` has the math): the cache reads of the latents ``[B, 1, L,
    r]`` and of the rotary keys ``[B, 1, L, dr]``, and the projection weight ``[H * (dn + dv), r]`` that expands the
    latents per head into a key part (``dn``) and a value (``dv``)."""

    latent: fx.Node
    rope: fx.Node
    weight: fx.Node
    heads: int
    nope: int
    value: int
    scale: fx.Node | None = None  # an FP8 weight's block scales (a model transformers loaded FP8) ...
    block: tuple[int, int] = (0, 0)  # ... and its (block_n, block_k)

    def weight_args(self) -> tuple:
        """The trailing arguments of ``latent_attention`` for this weight: its scales and block, if FP8."""
        return () if self.scale is None else (self.scale, *self.block)


def _latent_projection(k: fx.Node, v: fx.Node) -> _Latent | None:
    """The layer's MLA parts when its graph has MLA's structure: one cached tensor of one head is read (through
    views) by a projection without bias whose weight the graph holds, and its output, through views and transposes,
    is split along the last dim into ``[B, H, L, dn]`` and ``[B, H, L, dv]``; the other cached tensor is one head
    too. Whether the layer computes MLA is then proved by evaluation (``_verify_latent``)."""
    if any(_shape(x) is None or len(_shape(x)) != 4 or _shape(x)[1] != 1 for x in (k, v)):
        return None
    for latent, rope in ((k, v), (v, k)):
        node = latent
        while len(node.users) == 1 and next(iter(node.users)).target in _VIEWS:
            node = next(iter(node.users))
        proj = next((m for m in map(match_projection, node.users) if m is not None and m.x is node), None)
        if proj is None or proj.bias is not None or proj.out_dim != 0:
            continue
        split = _head_split(proj.node)
        if split is not None and _shape(proj.weight) == (split[0] * (split[1] + split[2]), _shape(latent)[3]):
            return _Latent(latent, rope, proj.weight, *split, proj.scale, proj.block or (0, 0))
    return None


def _head_split(node: fx.Node) -> tuple[int, int, int] | None:
    """``(H, dn, dv)`` when ``node``'s value, through views and transposes, is split in two along its last dim as
    ``[B, H, L, dn + dv]``."""
    for _ in range(8):
        split = next((u for u in node.users if u.target is aten.split_with_sizes.default), None)
        if split is not None:
            shape, sizes = _shape(node), split.args[1]
            dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
            if shape is None or len(shape) != 4 or len(sizes) != 2 or dim not in (-1, 3):
                return None
            return int(shape[1]), int(sizes[0]), int(sizes[1])
        views = [u for u in node.users if u.target in _VIEWS or u.target in (aten.transpose.int, aten.permute.default)]
        if len(views) != 1:
            return None
        node = views[0]
    return None


def _rewrite_latent(gm, mla: _Latent, indexer_keys: fx.Node | None, order: dict, info, verified: dict) -> str:
    """The MLA attention over the cached latents -> ``latent_attention`` (and, for sparse attention, its indexer over
    ``indexer_keys`` -> ``indexer_topk``); its description (else ``_NoMatch``)."""
    found = _match_latent(gm, mla, order)
    key = ("latent", mla.nope) + found.signature()
    scale, window, softcap = _verified(verified, key, lambda: _verify_latent(gm, found, mla, info))
    rdim, dr = _shape(mla.latent)[3], _shape(mla.rope)[3]
    detail = f"MLA: latent {rdim} + rotary {dr} per position, " + _describe(_Params(scale, window, softcap))
    indexer = None
    picks = _picks(found.selected) if found.selected is not None else None
    picker = picks.meta.get("ppsplit.layer") if picks is not None else None
    if picks is not None and picker != found.out.meta.get("ppsplit.layer"):
        if picks.target is not torch.ops.ppsplit.indexer_topk.default:
            raise _NoMatch(f"its sparse attention reads the positions layer {picker}'s indexer picks, which stays as "
                           "traced")
        detail += f"; sparse over {_shape(found.selected)[-1]} positions layer {picker}'s indexer picks"
    elif found.selected is not None:
        if indexer_keys is None:
            raise _NoMatch("its sparse attention's positions are picked by no indexer over this layer's cache")
        indexer = _match_indexer(gm, indexer_keys, picks, order, info.cache.max_len)
        index_scale = _verified(verified, ("indexer",) + indexer.signature(),
                                lambda: _verify_indexer(gm, indexer, info))
        detail += f"; sparse over {_shape(found.selected)[-1]} positions an indexer picks, scale {index_scale:.6g}"
    positions = gm.graph.find_nodes(op="placeholder", target="positions")[0]
    with gm.graph.inserting_before(found.out):
        node = gm.graph.call_function(torch.ops.ppsplit.latent_attention.default, (
            found.q, mla.latent, mla.rope, mla.weight, mla.nope, positions, float(scale), int(window), float(softcap),
            found.selected, *mla.weight_args()))
    _swap(gm, found, node, detail)
    if indexer is not None:
        _replace_indexer(gm, indexer, picks.args[0], index_scale)
    return detail


def _match_latent(gm: fx.GraphModule, mla: _Latent, order: dict) -> _Found:
    """The attention of an MLA layer: every node reading the cached latents or rotary keys up to the first that is
    ``[B, H, T, dv]`` and reads both (the expansion, the keys' assembly and the attention)."""
    from_latent, from_rope = _downstream(mla.latent, writes=True), _downstream(mla.rope, writes=True)
    positions = gm.graph.find_nodes(op="placeholder", target="positions")[0]
    tokens = positions.meta["val"].shape[0]
    batch = _shape(mla.latent)[0]

    def is_out(shape):
        return shape is not None and _same(shape, (batch, mla.heads, tokens, mla.value))

    out = next((n for n in sorted(from_latent & from_rope, key=order.get) if is_out(_shape(n))), None)
    if out is None:
        raise _NoMatch(f"no op reading both its cached latents and rotary keys gives [B, {mla.heads}, T, {mla.value}]")
    region = {n for n in from_latent | from_rope if order[n] <= order[out]}
    selected = _selection(region)
    external = list(dict.fromkeys(a for n in sorted(region, key=order.get) for a in n.all_input_nodes
                                  if a not in region))
    qshape = (batch, mla.heads, tokens, mla.nope + _shape(mla.rope)[3])
    return _found(gm, mla.latent, mla.rope, out, region, external, qshape, order, selected)


def _selection(region: set) -> fx.Node | None:
    """Sparse attention (DeepSeek-V3.2's DSA): the indices of the layer's ``topk`` from which the attention's mask is
    built (scattered, cast, combined with the causal mask). The nodes between them join ``region``; the indices are
    then an input of the attention, its ``selected``. A layer without an indexer of its own (GLM-MoE-DSA's "shared"
    layers) reads those of an earlier layer: its ``topk``'s, or the ``indexer_topk`` they became."""
    layer = next(iter(region)).meta.get("ppsplit.layer")
    todo = [a for n in region for a in n.all_input_nodes if a not in region]
    seen, found = set(), set()
    while todo:
        n = todo.pop()
        if n in seen or n in region or n.op != "call_function" or not n.meta.get("ppsplit.token"):
            continue
        root = _picks(n)
        if root is n or root is not None and any(u.meta.get("ppsplit.layer") != layer for u in [n, *n.users]):
            found.add(n)  # the picks, or as a layer hands them on to later layers (GLM-MoE-DSA: cast to int32)
            continue
        if n.meta.get("ppsplit.layer") != layer:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    if len(found) != 1:
        return None
    selected = found.pop()
    between = seen & _downstream(selected, layer=layer)
    if any(u.meta.get("ppsplit.layer") != layer for n in between for u in n.users):
        raise _NoMatch("the mask its sparse attention builds from its indexer's positions is also read by another "
                       "layer, which the paged cache does not serve")
    region.update(between)
    return selected


def _picks(node: fx.Node) -> fx.Node | None:
    """The positions an indexer picks, when ``node`` is they or a cast of them (GLM-MoE-DSA hands them on as int32):
    ``topk(...)[1]``, or the ``indexer_topk`` that replaced it."""
    while node.target in _CASTS and isinstance(node.args[0], fx.Node) \
            and isinstance(node.args[0].meta.get("val"), torch.Tensor) \
            and not node.args[0].meta["val"].is_floating_point():
        node = node.args[0]
    if node.target is torch.ops.ppsplit.indexer_topk.default:
        return node
    if (node.target is operator.getitem and node.args[1] == 1 and isinstance(node.args[0], fx.Node)
            and node.args[0].target is aten.topk.default):
        return node
    return None


def _verify_latent(gm: fx.GraphModule, f: _Found, mla: _Latent, info) -> tuple:
    """``(scale, window, softcap)`` with which ``latent_attention_reference`` equals the traced subgraph on random
    queries, latents, rotary keys and weights (so it holds for the model's own)."""
    _, _, max_len, rdim = _shape(mla.latent)
    dr = _shape(mla.rope)[3]
    if mla.heads * max_len * (mla.nope + max(dr, mla.value)) > _BUDGET:  # the expanded keys or values
        raise _NoMatch(f"cache too large to check by evaluation ({mla.heads} heads x {max_len} slots)")
    gen = torch.Generator().manual_seed(0)
    params = {p: _param_value(gm, p, gen) for p in f.params}
    if mla.scale is None:
        weight = params[mla.weight] / math.sqrt(rdim)  # keys and values of the size the model's have
        params[mla.weight] = weight
    else:  # FP8 values and positive block scales, which the subgraph's fp8_linear dequantises as the reference does
        params[mla.weight] = torch.randn(_shape(mla.weight), generator=gen).to(FP8_DTYPE)
        params[mla.scale] = (torch.rand(_shape(mla.scale), generator=gen) + 0.5) / math.sqrt(rdim)
        weight = dequantize(params[mla.weight], params[mla.scale], *mla.block, torch.float64)
    cases = _cases(gm, f, info, mla.nope + dr, params, gen)
    for scale in _scales(f, mla.nope + dr):
        for softcap in _softcaps(f):
            for window in _windows(gm, f):
                if all(_close(latent_attention_reference(q, c, kr, weight, mla.nope, pos, scale, window, softcap, sel),
                              got) for pos, q, c, kr, got, sel in cases):
                    return scale, window, softcap
    raise _NoMatch("its cache holds MLA latents, but no scale/window/soft-cap makes latent_attention equal it")


def _match_indexer(gm: fx.GraphModule, keys: fx.Node, selected: fx.Node, order: dict, max_len: int) -> _Found:
    """A sparse-attention indexer (``indexer_scores`` has the math): every node reading the cached indexer keys
    ``[B, L, D]`` up to the scores ``[B, T, L]`` whose ``topk`` indices are ``selected``. Its two token-dependent
    inputs are its queries ``[B, T, H, D]`` (``q``) and their per-head weights (``v``: ``H`` per token, any layout)."""
    topk = selected.args[0]
    scores = topk.args[0]
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    if len(topk.args) > 3 or set(topk.kwargs) - {"dim"} or dim not in (-1, 2) or _shape(scores) is None \
            or len(_shape(scores)) != 3:
        raise _NoMatch(f"its indexer's {topk.format_node()} is not a top-k of the largest [B, T, L] scores")
    length = _shape(keys)[1]
    if topk.args[1] >= length and length < max_len:
        # The model took min(its top-k, the cache length): the stand-in is too short to show its top-k.
        raise _NoMatch(f"its indexer keeps all {length} positions of the traced cache, so how many it keeps of a "
                       f"longer one is unknown; trace with a cache of at most {length} positions")
    region = {n for n in _downstream(keys) if order[n] <= order[scores]}
    if scores not in region:
        raise _NoMatch("its indexer's scores do not read the cached indexer keys")
    _self_contained(region, scores, "the indexer")
    external = list(dict.fromkeys(a for n in sorted(region, key=order.get) for a in n.all_input_nodes
                                  if a not in region and a is not keys))
    tokenish = [a for a in external if a.meta.get("ppsplit.token") and isinstance(a.meta.get("val"), torch.Tensor)]
    queries = [a for a in tokenish if len(_shape(a)) == 4 and _shape(a)[3] == _shape(keys)[2]]
    if len(tokenish) != 2 or len(queries) != 1:
        raise _NoMatch(f"its indexer reads {len(tokenish)} token-dependent inputs, not queries [B, T, H, D] and their "
                       "weights")
    q = queries[0]
    weights = next(a for a in tokenish if a is not q)
    heads = _shape(q)[2]
    if math.prod(_shape(weights)) != math.prod(_shape(q)[:3]):
        raise _NoMatch(f"its indexer's weights {weights.format_node()} are not one per query head and token")
    inputs = [a for a in external if a not in tokenish and a.op != "get_attr"]
    params = [a for a in external if a.op == "get_attr"]
    return _Found(k=keys, v=weights, q=q, out=scores, region=sorted(region, key=order.get), inputs=inputs,
                  params=params, heads=heads)


def _verify_indexer(gm: fx.GraphModule, f: _Found, info) -> float:
    """The scale with which ``indexer_scores`` equals the traced scores on random queries, weights and keys: the
    same ``-inf`` (not visible) and the same values elsewhere."""
    _, max_len, dim = _shape(f.k)
    gen = torch.Generator().manual_seed(0)
    params = {p: _param_value(gm, p, gen) for p in f.params}
    cases = []
    for batch, tokens, start in _probes(info, max_len):
        positions = torch.arange(start, start + tokens)
        q = torch.randn(batch, tokens, f.heads, dim, generator=gen)
        weights = torch.randn(batch, tokens, *_shape(f.v)[2:], generator=gen)
        keys = torch.randn(batch, max_len, dim, generator=gen)
        got = _run(gm, f, info, batch, positions, {f.q: q, f.v: weights, f.k: keys, **params})
        cases.append((positions, q, weights, keys, got))
    for scale in _scales(f, dim):
        if all(_same_scores(indexer_scores(q, w, k[:, None], torch.arange(max_len) <= pos[:, None], scale), got)
               for pos, q, w, k, got in cases):
            return scale
    raise _NoMatch("no scale makes indexer_scores equal its indexer's scores")


def _same_scores(a: torch.Tensor, b) -> bool:
    if not isinstance(b, torch.Tensor) or a.shape != b.shape or not torch.equal(a.isinf(), b.isinf()):
        return False
    finite = ~a.isinf()
    return torch.allclose(a[finite], b[finite].to(a.dtype), **_TOL)


def _replace_indexer(gm: fx.GraphModule, f: _Found, topk: fx.Node, scale: float) -> None:
    """The indexer ``f`` and the ``topk`` of its scores -> ``indexer_topk``."""
    graph = gm.graph
    positions = graph.find_nodes(op="placeholder", target="positions")[0]
    with graph.inserting_before(topk):
        node = graph.call_function(torch.ops.ppsplit.indexer_topk.default,
                                   (f.q, f.v, f.k, positions, float(scale), int(topk.args[1])))
    for key in ("nn_module_stack", "stack_trace", "ppsplit.layer", "ppsplit.region", "ppsplit.stage", "ppsplit.token"):
        if key in topk.meta:
            node.meta[key] = topk.meta[key]
    picks = [u for u in topk.users if u.args[1] == 1]
    node.meta["val"] = picks[0].meta["val"] if picks else None
    for u in picks:
        u.replace_all_uses_with(node)
    for n in reversed([*f.region, topk, *topk.users]):
        if not n.users:
            graph.erase_node(n)


# ---- rewrite --------------------------------------------------------------------------------------------------

def _replace(gm: fx.GraphModule, f: _Found, params: _Params) -> None:
    graph = gm.graph
    positions = graph.find_nodes(op="placeholder", target="positions")[0]
    kv_heads = _shape(f.k)[1]
    with graph.inserting_before(f.out):
        alibi_node = None
        if params.alibi is not None:
            alibi_node = graph.create_node("get_attr", _alibi_buffer(gm, params.alibi))
            alibi_node.meta["val"] = params.alibi
            alibi_node.meta["ppsplit.token"] = False
        q = _reorder_heads(graph, f.q, [-1, kv_heads]) if params.tiled else f.q
        node = graph.call_function(torch.ops.ppsplit.cache_attention.default,
                                   (q, f.k, f.v, positions, float(params.scale), int(params.window),
                                    float(params.softcap), alibi_node, params.sink, int(params.chunk)))
    _swap(gm, f, node, _describe(params))
    users, out = list(node.users), node
    if f.token_major:
        node.meta["val"] = f.out.meta["val"].transpose(1, 2)
    if params.tiled:  # the output's heads back in the model's order, laid out [B, T, Hq, Dv] as the op's output is
        out = _reorder_heads(graph, out, [kv_heads, -1], dim=2)
    if f.token_major:  # the layout the attention had: [B, T, Hq, Dv]
        with graph.inserting_after(out):
            moved = graph.call_function(aten.transpose.int, (out, 1, 2))
        moved.meta.update({key: val for key, val in out.meta.items() if key != "ppsplit.attention"})
        moved.meta["val"] = out.meta["val"].transpose(1, 2)
        out = moved
    for user in users:
        user.replace_input_with(node, out)


def _reorder_heads(graph: fx.Graph, x: fx.Node, sizes: list, dim: int = 1) -> fx.Node:
    """``x [B, H, T, D]`` with its heads split as ``sizes`` and the two parts swapped (``_tile_heads`` and
    ``_untile_heads`` as nodes), with the token facts of ``x``. ``dim=2``: in the layout ``[B, T, H, D]`` (transposed
    there and back)."""
    ops = [(aten.unflatten.int, (dim, sizes)), (aten.transpose.int, (dim, dim + 1)),
           (aten.flatten.using_ints, (dim, dim + 1))]
    if dim == 2:
        ops = [(aten.transpose.int, (1, 2))] + ops + [(aten.transpose.int, (1, 2))]
    last = x
    for op, args in ops:
        with graph.inserting_after(last):
            node = graph.call_function(op, (last, *args))
        node.meta.update({k: v for k, v in x.meta.items() if k in ("ppsplit.layer", "ppsplit.region", "ppsplit.stage",
                                                                    "ppsplit.token", "nn_module_stack")})
        val = last.meta.get("val")
        if isinstance(val, torch.Tensor):
            node.meta["val"] = op(val, *args)
        last = node
    return last


def _swap(gm: fx.GraphModule, f: _Found, node: fx.Node, detail: str) -> None:
    """``node`` in place of the attention ``f``: its uses, its meta; the attention's nodes erased."""
    for key in ("nn_module_stack", "stack_trace", "ppsplit.layer", "ppsplit.region", "ppsplit.stage",
                "ppsplit.token", "val"):
        if key in f.out.meta:
            node.meta[key] = f.out.meta[key]
    node.meta["ppsplit.attention"] = detail
    f.out.replace_all_uses_with(node)
    for n in reversed(f.region):
        if not n.users:
            gm.graph.erase_node(n)


def _alibi_buffer(gm: fx.GraphModule, slopes: torch.Tensor) -> str:
    """One non-persistent buffer per distinct set of slopes (they are constants of the model, not weights)."""
    holder = getattr(gm, "ppsplit_attention", None)
    if holder is None:
        holder = torch.nn.Module()
        gm.add_module("ppsplit_attention", holder)
    for name, buf in holder.named_buffers():
        if buf.shape == slopes.shape and torch.equal(buf.cpu(), slopes):
            return f"ppsplit_attention.{name}"
    name = f"alibi_slopes_{len(list(holder.buffers()))}"
    device = next((t.device for t in gm.parameters()), torch.device("cpu"))
    holder.register_buffer(name, slopes.to(device if device.type != "meta" else "cpu"), persistent=False)
    return f"ppsplit_attention.{name}"


def _describe(params: _Params) -> str:
    parts = [f"scale {params.scale:.6g}"]
    if params.window:
        parts.append(f"window {params.window}")
    if params.chunk:
        parts.append(f"chunks of {params.chunk}")
    if params.softcap:
        parts.append(f"softcap {params.softcap:g}")
    if params.alibi is not None:
        parts.append("ALiBi")
    if params.sink is not None:
        parts.append("sinks")
    if params.tiled:
        parts.append("query head h on KV head h % kv_heads")
    return ", ".join(parts)
