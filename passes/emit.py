"""Pass 7, emit: one ``fx.GraphModule`` per stage, ``y, aux = stage(x, positions, aux)``.

When the plan carries values beside the residual stream, stage ``k > 0`` unpacks them from ``x``
(``[B, T, plan.width(k)]``: the hidden state, then each carried value's bytes) and every stage but the last packs
the ones the next stage receives into ``y`` the same way; a value only relayed is copied from ``x`` as it came.

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

from ppsplit.core.errors import CrossingError
from ppsplit.core.fx_utils import copy_buffer_persistence, from_token_rows, token_rows
from ppsplit.passes.annotate import SHAPE_OPS, mutated_bases
from ppsplit.passes.partition import Partitioned
from ppsplit.core.plan import SplitPlan
from ppsplit.core.ragged import STEP_INPUTS
from ppsplit.core.tensors import DTYPES, model_dtype

aten = torch.ops.aten


def emit(rewritten: Partitioned, plan: SplitPlan) -> list[fx.GraphModule]:
    """One ``fx.GraphModule`` per stage, from the graph the last rewrite left (taps, attention or fuse) and the
    plan completed from the passes' reports (its carries are the ones emit packs and unpacks)."""
    gm = rewritten.gm
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    input_ids = graph.find_nodes(op="placeholder", target="input_ids")[0]
    positions = graph.find_nodes(op="placeholder", target="positions")[0]
    aux = graph.find_nodes(op="placeholder", target="aux")[0]
    # A paged split's step metadata (seq, block_table, seq_start, seq_count): inputs of every stage, like positions.
    step = [n for name in STEP_INPUTS[1:] for n in graph.find_nodes(op="placeholder", target=name)]
    output = next(n for n in reversed(nodes) if n.op == "output")
    boundaries = {s: by_name[name] for s, name in rewritten.boundaries.items()}
    info = rewritten.annotated.traced
    symbols = {info.batch_symbol: "batch", info.tokens_symbol: "tokens"}

    carried = {c.name: by_name[c.name] for c in plan.carries}
    stages = []
    for s in range(plan.pp):
        x_src = input_ids if s == 0 else boundaries[s]
        y_src = output.args[0] if s == plan.pp - 1 else boundaries[s + 1]
        unpack = [(carried[c.name], c, offset) for c, offset in plan.carried(s)] if s else []
        pack = [(carried[c.name], c) for c, _ in plan.carried(s + 1)] if s < plan.pp - 1 else []
        inputs = {x_src, positions, aux, *step, *(n for n, _, _ in unpack)}
        effects = [n for n in nodes if _runs_on(n, s) and _has_effect(n)]
        needed = _closure([y_src, *(n for n, _ in pack), *effects], inputs, symbols)
        # A write into a recomputed tensor (a mask filled in place, say) must come along with the tensor.
        while True:
            extra = [n for n in nodes if n not in needed and _has_effect(n) and _runs_on(n, s, default=True)
                     and any(b in needed for b in mutated_bases(n))]
            if not extra:
                break
            needed |= _closure(extra, inputs, symbols)
        for n in needed:
            if n.meta.get("ppsplit.token") and n not in inputs and not _runs_on(n, s):
                raise CrossingError(f"stage {s} needs {n.format_node()} from stage {n.meta.get('ppsplit.stage')}, which "
                                    "neither the residual stream nor a carried value brings")
        streams = (plan.stream if s > 0 else None, plan.stream if s < plan.pp - 1 else None)
        stage_graph = _build(sorted(needed - inputs, key=order.get), x_src, positions, aux, step, y_src, symbols,
                             plan, unpack, pack, streams)
        stage = fx.GraphModule(gm, stage_graph, class_name=f"Stage{s}")
        copy_buffer_persistence(stage, gm)
        stage.meta["ppsplit.stage"] = s
        stage.meta["ppsplit.plan"] = plan
        stages.append(stage)
    return stages


def _runs_on(node: fx.Node, stage: int, default: bool = False) -> bool:
    """Whether ``node`` runs on ``stage``: its home, or a stage that keeps a replica of the cache it writes."""
    home = node.meta.get("ppsplit.stage")
    if home is None:
        return default
    return home == stage or stage in node.meta.get("ppsplit.replicas", ())


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


def _build(body: list, x_src, positions, aux, step: list, y_src, symbols: dict, plan: SplitPlan, unpack: list,
           pack: list, streams: tuple) -> fx.Graph:
    """A stage's graph. Lockstep: ``(x [B, T, ...], positions [T], aux [n, B, T, H])``. Paged (ragged steps):
    ``(x [N, ...], positions [N], aux [n, N, H], seq, block_table, seq_start, seq_count)``, the traced row of ``N``
    tokens being a batch of one inside. ``streams``: the ``Stream`` layout of the residual stream this stage
    receives and sends (None: ``[B, T, H]`` as it is, or no stream: the tokens in, the logits out)."""
    stream_in, stream_out = streams
    g = fx.Graph()
    x_in = g.placeholder("x")
    pos = g.placeholder("positions")
    aux_in = g.placeholder("aux")
    env = {n: g.placeholder(n.target) for n in step}
    for new, old in ((x_in, x_src), (pos, positions), (aux_in, aux), *((env[n], n) for n in step)):
        new.meta["val"] = old.meta.get("val")
    x, buf = x_in, aux_in
    if step:  # the row of N tokens, and the aux buffer's batch of one, as the traced graph has them
        x = g.call_function(aten.unsqueeze.default, (x_in, 0))
        buf = g.call_function(aten.unsqueeze.default, (aux_in, 1))
    batch = g.call_function(torch.ops.aten.sym_size.int, (x, 0))
    tokens = g.call_function(torch.ops.aten.sym_size.int, (pos, 0))
    device = g.call_function(getattr, (pos, "device"))
    sizes = {"batch": batch, "tokens": tokens}
    env.update({x_src: x, positions: pos, aux: buf})
    packed = {}  # carried value -> its slice of x, as it came
    dtype = model_dtype(plan)
    if unpack or stream_in:
        hidden = _slice(g, x, 0, plan.hidden_size)
        env[x_src] = (from_token_rows(g, hidden, stream_in) if stream_in else
                      g.call_function(aten.clone.default, (hidden,), {"memory_format": torch.contiguous_format}))
        for node, carry, offset in unpack:
            packed[node] = piece = _slice(g, x, offset, offset + carry.width)
            env[node] = from_token_rows(g, piece, carry, _reinterpreted(carry, dtype))

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
    y = env[y_src]
    if stream_out:
        y = token_rows(g, y, stream_out)
    if pack:
        pieces = [y]
        for node, carry in pack:
            piece = packed.get(node)
            if piece is None:
                reinterpret = _reinterpreted(carry, dtype)
                piece = token_rows(g, env[node], carry, dtype if reinterpret is not None else None)
            pieces.append(piece)
        y = g.call_function(aten.cat.default, (pieces, -1))
    if step:
        y = g.call_function(aten.squeeze.dim, (y, 0))
    g.output((y, aux_in))
    for n in reversed(list(g.nodes)):  # unpacked values (and sizes) this stage does not read
        if n.op == "call_function" and not n.users and not _has_effect(n):
            g.erase_node(n)
    g.lint()
    return g


def _reinterpreted(carry, dtype: torch.dtype) -> torch.dtype | None:
    """The carried value's own dtype when its bytes travel as ``dtype`` elements (an int32 index in bfloat16)."""
    return DTYPES[carry.dtype] if DTYPES[carry.dtype] != dtype else None


def _slice(g: fx.Graph, x: fx.Node, start: int, end: int) -> fx.Node:
    return g.call_function(aten.slice.Tensor, (x, -1, start, end))
