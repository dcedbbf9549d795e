"""Pass 6, fuse: fold each tap's store, and the residual add and norm around it, into one Triton kernel.

For every norm module in the graph (found through ``nn_module_stack``, its convention recognised by running
its subgraph, not by its class name) whose input is the residual stream:

- ``s = x + r`` feeding the norm on the same stage, with a tap on ``s``: ``add_norm_store`` (one kernel reads
  ``x, r`` once and writes ``s``, the tap slot and ``y``);
- the same without a tap: ``add_norm``, so a split with taps launches exactly as many kernels as one without;
- no add in front (the embedding output entering layer 0): ``norm_store`` / ``norm``.

A tap whose norm runs on the next stage (a tap on a stage boundary) becomes ``add_store``; a tap no pattern
covers keeps the plain strided ``tap_store``.

Facts written: ``node.meta["ppsplit.fused"]`` (what the node replaced) on each fused op. The result, ``Fused``,
holds the boundaries as they are after the rewrite (a fused op may now produce the residual stream a boundary
carries) and the report: per stage, how each tap is stored and how many other norms were fused.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.node import map_aggregate

import ppsplit.triton_kernels  # noqa: F401  (registers torch.ops.ppsplit.*)
from ppsplit.core.fx_utils import fresh_copy
from ppsplit.passes.evaluate import VIEW_OPS, SubgraphEvaluator
from ppsplit.passes.partition import Partitioned, carry_forward
from ppsplit.passes.trace import module_path
from ppsplit.core.plan import SplitPlan, StageFusion, TapFusion
from ppsplit.triton_kernels import NORM_KINDS, norm_reference

ops = torch.ops.ppsplit



@dataclass(frozen=True)
class Fused(Partitioned):
    """The fuse pass's result: a rewritten copy of the graph, its boundaries and carries under the names of the
    nodes that now compute them, and what was fused on each stage."""

    report: tuple[StageFusion, ...] = ()


@dataclass
class NormMatch:
    """A norm module's subgraph: ``output = kind-norm(input; weight, bias, eps)``, verified by evaluation."""

    path: str
    nodes: list
    input: fx.Node
    output: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    eps: float
    kind: str


def fuse(tapped: Partitioned, plan: SplitPlan, *, taps: bool = True) -> Fused:
    """Rewrite add/norm/tap-store groups into fused ops, in a copy of the graph of ``tapped`` (the taps or the
    attention pass's result); ``taps=False`` fuses the norms but keeps plain stores."""
    gm = fresh_copy(tapped.gm)
    graph = gm.graph
    boundaries = dict(tapped.boundaries)
    carries = list(tapped.carries)
    replaced: dict[fx.Node, fx.Node] = {}  # nodes this pass rewrote -> their replacement
    report: dict[int, list[TapFusion]] = {s: [] for s in range(plan.pp)}
    counts: dict[int, int] = {s: 0 for s in range(plan.pp)}

    def replace(old: fx.Node, new: fx.Node) -> None:
        """Replace ``old`` everywhere, including as the residual stream a stage boundary carries (a post-norm
        decoder's layer output is a norm's output)."""
        old.replace_all_uses_with(new)
        for stage, name in boundaries.items():
            if name == old.name:
                boundaries[stage] = new.name
        carries[:] = [dataclasses.replace(c, name=new.name) if c.name == old.name else c for c in carries]
        replaced[old] = new

    for match in find_norms(gm, plan.vector_size):
        value = replaced.get(match.input, match.input)
        stage = match.output.meta.get("ppsplit.stage")
        add = _producer_add(value)
        if add is not None and add.meta.get("ppsplit.stage") != stage:
            add = None  # the norm runs on the next stage: only the add and the store can fuse here
        store = _store_of(value) if taps else None
        if store is not None and store.meta.get("ppsplit.stage") != stage:
            store = None
        norm_args = (match.weight, match.bias)
        tail = (match.eps, match.kind)
        if add is not None:
            x, r = add.args
            if store is not None:
                op, args = ops.add_norm_store.default, (x, r, *norm_args, store.args[0], store.args[1], *tail)
            else:
                op, args = ops.add_norm.default, (x, r, *norm_args, *tail)
            with graph.inserting_after(add):
                fused = graph.call_function(op, args)
            with graph.inserting_after(fused):
                s = graph.call_function(operator.getitem, (fused, 0))
                y = graph.call_function(operator.getitem, (fused, 1))
            _meta(fused, add, (add.meta.get("val"), add.meta.get("val")))
            _meta(s, add, add.meta.get("val"))
            _meta(y, add, add.meta.get("val"))
            if value is not add:  # the norm read a reshape of the sum (OPT): give y the norm's shape
                with graph.inserting_after(value):
                    y = graph.call_function(torch.ops.aten.view_as.default, (y, value))
                _meta(y, match.output, match.output.meta.get("val"))
        else:
            if store is not None:
                op, args = ops.norm_store.default, (value, *norm_args, store.args[0], store.args[1], *tail)
            else:
                op, args = ops.norm.default, (value, *norm_args, *tail)
            with graph.inserting_before(match.nodes[0]):
                fused = y = graph.call_function(op, args)
            _meta(fused, match.output, match.output.meta.get("val"))
            s = None
        what = ("add+" if add is not None else "") + match.kind + ("+store" if store is not None else "")
        fused.meta["ppsplit.fused"] = what
        replace(match.output, y)
        for node in reversed(match.nodes):
            graph.erase_node(node)
        if store is not None:
            tap = store.meta["ppsplit.tap"]
            fused.meta["ppsplit.tap"] = tap
            report[stage].append(TapFusion(tap, plan.slot(tap), what, match.path))
            graph.erase_node(store)
        else:
            counts[stage] += 1
        if add is not None:
            replace(add, s)
            graph.erase_node(add)

    # Taps whose norm is elsewhere: fuse the residual add that produces them, else keep the plain store.
    for store in [n for n in graph.nodes if n.target is ops.tap_store.default]:
        value = store.args[2]
        stage, tap = store.meta["ppsplit.stage"], store.meta["ppsplit.tap"]
        add = _producer_add(value) if taps else None
        if add is None or add.meta.get("ppsplit.stage") != stage:
            report[stage].append(TapFusion(tap, plan.slot(tap), "store"))
            continue
        with graph.inserting_after(add):
            fused = graph.call_function(ops.add_store.default, (*add.args, store.args[0], store.args[1]))
        _meta(fused, add, add.meta.get("val"))
        fused.meta.update({"ppsplit.fused": "add+store", "ppsplit.tap": tap})
        graph.erase_node(store)
        replace(add, fused)
        graph.erase_node(add)
        report[stage].append(TapFusion(tap, plan.slot(tap), "add+store", "norm on the next stage"))

    graph.lint()
    gm.recompile()
    stages = tuple(StageFusion(taps=tuple(sorted(report[s], key=lambda t: t.tap)), other_norms=counts[s])
                   for s in range(plan.pp))
    return carry_forward(tapped, Fused, gm=gm, boundaries=boundaries, carries=tuple(carries), report=stages)


def _store_of(value: fx.Node) -> fx.Node | None:
    return next((u for u in value.users if u.target is ops.tap_store.default and u.args[2] is value), None)


def _meta(new: fx.Node, like: fx.Node, val) -> None:
    for key in ("nn_module_stack", "stack_trace", "ppsplit.layer", "ppsplit.region", "ppsplit.stage"):
        if key in like.meta:
            new.meta[key] = like.meta[key]
    new.meta["ppsplit.token"] = True
    new.meta["val"] = val


def _producer_add(value: fx.Node) -> fx.Node | None:
    """The residual ``add(x, r)`` that computes ``value``, looking through reshapes that only it uses."""
    node = value
    while node.op == "call_function" and node.target in VIEW_OPS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        if len(node.users) != 1:
            return None
    if node.op != "call_function" or node.target is not torch.ops.aten.add.Tensor or node.kwargs:
        return None
    x, r = node.args[:2] if len(node.args) == 2 else (None, None)
    if not (isinstance(x, fx.Node) and isinstance(r, fx.Node) and node.meta.get("ppsplit.token")):
        return None
    vals = [n.meta.get("val") for n in (node, x, r)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    out, xv, rv = vals
    if xv.shape != out.shape or rv.shape != out.shape or xv.dtype != out.dtype or rv.dtype != out.dtype:
        return None
    return node


def find_norms(gm: fx.GraphModule, hidden: int) -> list[NormMatch]:
    """Norm modules over the hidden size whose computation equals one of the fused kernel's conventions."""
    groups: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op != "call_function" or not stack:
            continue  # (weight-only nodes such as Gemma's `1 + w` belong to the group too)
        key, (path, cls) = list(stack.items())[-1]
        if "norm" in str(cls).rsplit(".", 1)[-1].lower():
            groups.setdefault(key, []).append(node)
    verified: dict[tuple, tuple | None] = {}
    matches = []
    for key, nodes in groups.items():
        inside = set(nodes)
        inputs = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in inside and a not in inputs:
                    inputs.append(a)
        tensors = [a for a in inputs if a.op != "get_attr"]
        params = [a for a in inputs if a.op == "get_attr"]
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        if len(tensors) != 1 or len(outputs) != 1 or len(params) not in (1, 2) \
                or not outputs[0].meta.get("ppsplit.token"):
            continue
        v = tensors[0].meta.get("val")
        out = outputs[0].meta.get("val")
        if not isinstance(v, torch.Tensor) or not isinstance(out, torch.Tensor) or v.shape[-1] != hidden \
                or out.shape != v.shape or out.dtype != v.dtype:
            continue
        signature = _signature(nodes, [tensors[0], *params])
        if signature not in verified:
            verified[signature] = _recognise(nodes, tensors[0], params, outputs[0])
        found = verified[signature]
        if found is None:
            continue
        kind, eps, weight_index, bias_index = found
        path = stack_path(nodes[-1])
        matches.append(NormMatch(path=path, nodes=nodes, input=tensors[0], output=outputs[0],
                                 weight=params[weight_index], bias=params[bias_index] if bias_index is not None else None,
                                 eps=eps, kind=kind))
    return matches


def stack_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return module_path(list(stack.values())[-1][0]) if stack else ""


def _signature(nodes: list, inputs: list) -> tuple:
    """Structure of a subgraph (ops, constants, input shapes), so identical norms are verified once."""
    index = {n: i for i, n in enumerate(inputs)}
    index.update({n: len(inputs) + i for i, n in enumerate(nodes)})

    def key(a):
        return ("node", index[a]) if isinstance(a, fx.Node) else repr(a)

    shapes = tuple((tuple(i.meta["val"].shape[-1:]), str(i.meta["val"].dtype)) for i in inputs)
    return shapes + tuple((str(n.target), tuple(map_aggregate(n.args, key)), tuple(sorted((k, repr(v)) for k, v in
                          n.kwargs.items()))) for n in nodes)


def _recognise(nodes: list, value: fx.Node, params: list, output: fx.Node):
    """Run the subgraph on random data and find the (kind, eps, weight, bias) that reproduces it exactly."""
    eps_candidates = []
    for n in nodes:
        for a in list(n.args) + list(n.kwargs.values()):
            if isinstance(a, float) and 0 < a < 0.1 and a not in eps_candidates:
                eps_candidates.append(a)
    v_meta = value.meta["val"]
    hidden = v_meta.shape[-1]
    gen = torch.Generator().manual_seed(0)
    trials = []
    for _ in range(2):
        v = torch.randn(2, 3, hidden, generator=gen).to(v_meta.dtype)
        ps = [(torch.randn(p.meta["val"].shape, generator=gen) * 0.3 + 0.7).to(p.meta["val"].dtype) for p in params]
        try:
            got = SubgraphEvaluator(value.graph.owning_module).run_nodes(nodes, {value: v, **dict(zip(params, ps))})[output]
        except Exception:
            return None
        trials.append((v, ps, got))
    layouts = [(0, None)] if len(params) == 1 else [(0, 1), (1, 0)]
    for kind in NORM_KINDS:
        for eps in eps_candidates:
            for w_i, b_i in layouts:
                if b_i is not None and kind != "layer":
                    continue
                if all(torch.equal(norm_reference(kind, v, ps[w_i], ps[b_i] if b_i is not None else None, eps), got)
                       for v, ps, got in trials):
                    return kind, eps, w_i, b_i
    return None
