"""Annotate helper: the cut point inside each decoder layer, between its attention block and its MLP block.

A pipeline of whole layers cannot balance finer than one layer; the head of an 8B model costs about two layers of
decode time on the last stage, so at pp=4 no whole-layer split comes within 5% of even. Most decoders have a
second point where only the residual stream is live: right after the attention block's residual add, before the
MLP's norm. This helper finds it per layer, from the graph alone (no per-model code):

- walking the layer's token-dependent nodes in graph order, the first floating node ``m`` of the same shape as the
  residual stream entering the layer (``[B, T, H]``) such that, if the layer were cut right after ``m``, exactly one
  value computed in the layer is read after the cut, ``m`` itself; the residual stream entering the layer is not read
  after the cut (values that already cross the layer's own cut, like Gemma 4's per-layer inputs, may: they are
  carried); nothing writes ``m`` in place; and both sides do matrix work (so the cut is not at the layer's end).
- a ``get_attr`` that the layer writes (its KV cache) sits where its first reader in the layer is, so the cache
  lives with the attention half; a layer that reads its cache after the cut gets no mid point.

Layers with no such point (parallel attention and MLP, as GPT-J, phi or GPT-NeoX; several values live) are left
whole. Facts written: ``node.meta["ppsplit.half"]``: ``0`` on the nodes of a cut layer before the point, ``1``
after it (absent elsewhere). ``half_costs`` splits each layer's parameters the same way.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import fx

from ppsplit.core.plan import ModelCosts

aten = torch.ops.aten
_MATMULS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default,
            aten.baddbmm.default, aten.convolution.default, aten.einsum.default}


def find_mids(nodes: list[fx.Node], residuals: dict[int, str | None], num_layers: int) -> dict[int, str]:
    """Layer index -> name of the residual stream after its attention block, for the layers that have a clean
    mid point; writes ``meta["ppsplit.half"]`` on the nodes of those layers.

    Example::

        find_mids(list(gm.graph.nodes), annotated.residuals, 32)[5]   # 'add_31'
    """
    order = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    members: dict[int, list[fx.Node]] = {}
    for n in nodes:
        n.meta.pop("ppsplit.half", None)
        region = n.meta.get("ppsplit.region")
        if n.meta.get("ppsplit.token") and region is not None and region % 2 and region < 2 * num_layers:
            members.setdefault((region - 1) // 2, []).append(n)
    mids = {}
    for layer, own in members.items():
        entry = by_name.get(residuals.get(layer) or "")
        if entry is None:
            continue
        found = _mid(own, order, entry, 2 * layer + 1)
        if found is not None:
            mid, where = found
            mids[layer] = mid.name
            for n in own:
                n.meta["ppsplit.half"] = int(where[n] > order[mid])
    return mids


def _mid(own: list[fx.Node], order: dict, entry: fx.Node, region: int):
    """The mid point of one layer (its node, and each member's position), or ``None``."""
    inside = set(own)
    # A get_attr (the layer's KV cache) has no place of its own in the graph: it sits where the layer first reads it.
    where = {n: order[n] if n.op != "get_attr" else min((order[u] for u in n.users if u in inside), default=order[n])
             for n in own}
    shape = _dims(entry)
    if not shape:
        return None
    matmuls = sorted(where[n] for n in own if _is_matmul(n))
    if len(matmuls) < 2:
        return None
    for m in sorted((n for n in own if n.op == "call_function"), key=order.get):
        o = order[m]
        if not matmuls[0] <= o < matmuls[-1]:
            continue
        val = m.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or _dims(m) != shape:
            continue

        def after(u: fx.Node) -> bool:
            if u.op == "output":
                return True
            if not u.meta.get("ppsplit.token"):
                return False
            return u.meta["ppsplit.region"] > region or (u in inside and where[u] > o)

        live = [n for n in own if where[n] <= o and any(after(u) for u in n.users)]
        if live != [m] or any(after(u) for u in entry.users):
            continue
        if _written_later(m, [n for n in own if where[n] > o]):
            continue
        return m, where
    return None


def _written_later(value: fx.Node, later: list[fx.Node]) -> bool:
    """Whether an op in ``later`` writes ``value`` in place, directly or through a view of it (then the value a
    stage would send is not the value the next stage's reads expect)."""
    aliases = {value}
    for n in later:  # graph order: a view's input comes before it
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not n.args or n.args[0] not in aliases:
            continue
        if schema.is_mutable:
            return True
        ret = schema.returns[0].alias_info if schema.returns else None
        if ret is not None and not ret.is_write:  # a view of the value
            aliases.add(n)
    return False


def _dims(node: fx.Node) -> tuple[str, ...]:
    """A value's shape as text, so that a batch a trace made concrete (``2``) matches the symbol's value ``2``."""
    val = node.meta.get("val")
    return tuple(str(d) for d in val.shape) if isinstance(val, torch.Tensor) else ()


def _is_matmul(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    name = str(node.target)
    return node.target in _MATMULS or "grouped_mm" in name or "scaled_dot_product" in name


def half_costs(annotated) -> ModelCosts:
    """``annotated.costs`` with the half-layer fields filled: the layers with a mid point, and per layer the
    parameters (and bytes) its attention half reads. A weight read on both sides of the cut counts in both halves'
    stages, but once in ``layer_params``; the attention half is then charged for it.

    Example::

        half_costs(ppsplit.trace_model(model)).attn_params[0]   # q, k, v, o and the input norm of layer 0
    """
    costs = annotated.costs
    gm = annotated.gm
    attn = [[0, 0] for _ in range(costs.num_layers)]
    params = dict(gm.named_parameters())
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in params:
            continue
        p = params[node.target]
        layers = {u.meta["ppsplit.region"] // 2 for u in _token_consumers(node)
                  if u.meta.get("ppsplit.half") == 0}
        for layer in layers:
            attn[layer][0] += p.numel()
            attn[layer][1] += p.numel() * p.element_size()
    mids = tuple(sorted(annotated.mids))
    return dataclasses.replace(costs, mid_layers=mids, attn_params=tuple(a[0] for a in attn),
                               attn_bytes=tuple(a[1] for a in attn) if costs.layer_bytes else ())


def _token_consumers(node: fx.Node) -> set[fx.Node]:
    """The first token-dependent nodes reached from ``node`` through token-free ones (a weight's readers)."""
    seen, out, todo = set(), set(), list(node.users)
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.meta.get("ppsplit.token"):
            out.add(u)
        else:
            todo.extend(u.users)
    return out
