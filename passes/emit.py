"""Pass 7, emit: one ``fx.GraphModule`` per stage, ``y, aux = stage(x, positions, aux)``.

A stage's graph is everything its outputs and side effects need, walking back from them and stopping at the
stage inputs: its home nodes, plus recomputed copies of the token-independent values it reads (positions,
rotary cos/sin, masks). Every shape read from ``input_ids`` is re-read from the stage's own inputs, and every
device constant becomes the device of ``positions``, so a stage runs wherever it is moved. It holds only the
tensors its nodes read, under their original names.
"""
from __future__ import annotations

import torch
from torch import fx
from torch.fx.node import map_aggregate

from ppsplit.errors import CrossingError
from ppsplit.fx_utils import copy_buffer_persistence
from ppsplit.passes.annotate import SHAPE_OPS, mutated_bases
from ppsplit.passes.fuse import Fused
from ppsplit.passes.taps import Tapped
from ppsplit.plan import SplitPlan


def emit(rewritten: Tapped | Fused, plan: SplitPlan) -> list[fx.GraphModule]:
    """One ``fx.GraphModule`` per stage, from the graph the taps (and, optionally, fuse) pass left."""
    gm = rewritten.gm
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    input_ids = graph.find_nodes(op="placeholder", target="input_ids")[0]
    positions = graph.find_nodes(op="placeholder", target="positions")[0]
    aux = graph.find_nodes(op="placeholder", target="aux")[0]
    output = next(n for n in reversed(nodes) if n.op == "output")
    boundaries = {s: by_name[name] for s, name in rewritten.boundaries.items()}
    info = rewritten.annotated.traced
    symbols = {info.batch_symbol: "batch", info.tokens_symbol: "tokens"}

    stages = []
    for s in range(plan.pp):
        x_src = input_ids if s == 0 else boundaries[s]
        y_src = output.args[0] if s == plan.pp - 1 else boundaries[s + 1]
        inputs = {x_src, positions, aux}
        effects = [n for n in nodes if n.meta.get("ppsplit.stage") == s and _has_effect(n)]
        needed = _closure([y_src, *effects], inputs, symbols)
        # A write into a recomputed tensor (a mask filled in place, say) must come along with the tensor.
        while True:
            extra = [n for n in nodes if n not in needed and _has_effect(n) and n.meta.get("ppsplit.stage", s) == s
                     and any(b in needed for b in mutated_bases(n))]
            if not extra:
                break
            needed |= _closure(extra, inputs, symbols)
        for n in needed:
            if n.meta.get("ppsplit.token") and n not in inputs and n.meta.get("ppsplit.stage") != s:
                raise CrossingError(f"stage {s} needs {n.format_node()} from stage {n.meta.get('ppsplit.stage')}; only "
                                    "the residual stream may cross a stage boundary")
        stage_graph = _build(sorted(needed - inputs, key=order.get), x_src, positions, aux, y_src, symbols)
        stage = fx.GraphModule(gm, stage_graph, class_name=f"Stage{s}")
        copy_buffer_persistence(stage, gm)
        stage.meta["ppsplit.stage"] = s
        stage.meta["ppsplit.plan"] = plan
        stages.append(stage)
    return stages


def _has_effect(node: fx.Node) -> bool:
    return node.op == "call_function" and bool(mutated_bases(node))


def _symbol_of(node: fx.Node, symbols: dict) -> str | None:
    """'batch' or 'tokens' when ``node`` reads that dynamic size off some tensor's shape."""
    if node.op != "call_function" or node.target not in SHAPE_OPS:
        return None
    val = node.meta.get("val")
    return symbols.get(str(val.node.expr)) if isinstance(val, torch.SymInt) else None


def _closure(roots: list, stop: set, symbols: dict) -> set:
    seen = set()
    todo = [r for r in roots if isinstance(r, fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in stop or _symbol_of(n, symbols):
            continue  # stage inputs, and sizes the stage re-reads from its own inputs
        todo.extend(n.all_input_nodes)
    return seen


def _build(body: list, x_src, positions, aux, y_src, symbols: dict) -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("x")
    pos = g.placeholder("positions")
    buf = g.placeholder("aux")
    for new, old in ((x, x_src), (pos, positions), (buf, aux)):
        new.meta["val"] = old.meta.get("val")
    batch = g.call_function(torch.ops.aten.sym_size.int, (x, 0))
    tokens = g.call_function(torch.ops.aten.sym_size.int, (pos, 0))
    device = g.call_function(getattr, (pos, "device"))
    sizes = {"batch": batch, "tokens": tokens}
    env = {x_src: x, positions: pos, aux: buf}

    def devices(a):
        return device if isinstance(a, torch.device) else a

    for n in body:
        sym = _symbol_of(n, symbols)
        if sym:
            env[n] = sizes[sym]
            continue
        new = g.node_copy(n, lambda a: env[a])
        new.args = map_aggregate(new.args, devices)
        new.kwargs = map_aggregate(new.kwargs, devices)
        env[n] = new
    g.output((env[y_src], buf))
    for n in (device, tokens, batch):
        if not n.users:
            g.erase_node(n)
    g.lint()
    return g
