"""Pass (after emit; in ``ppsplit compile`` after the FP8 rewrite): tensor parallelism inside a stage.

``shard_stage(stage, tp)`` places every value of the stage graph over ``tp`` ranks (``sharding.rules``):
projections from the residual stream column-parallel, the projections back into it row-parallel with one
functional all-reduce (``_c10d_functional.all_reduce`` + ``wait_tensor``, capturable in a CUDA graph) where their
partial sums are first read whole; head counts in reshapes made local; KV heads split, or held by several ranks
when tp exceeds them; the paged pools cut by head with the values written into them (the MLA latent cache stays
whole); MoE experts cut along their intermediate dim (every rank runs every expert on its slice); per-head weights
(``A_log``, sinks) cut with the heads; the embedding vocab-parallel (a masked lookup into each rank's rows, summed
by the all-reduce) and a column-parallel ``lm_head`` all-gathered. Norms, rotary, routing and the residual stream
stay replicated, so every tap is stored from a replicated value and the aux buffer is the same on every rank.
FP8 block scales are cut with their weights; a piece that would split a quantisation block is refused.

Which projections are cut comes from the graph: a weight is an *origin* of a split until a node cannot take it
(a softmax over a router's experts, a norm over a latent), and then it is kept whole and the run repeated
(``_solve``). The model's ``base_model_tp_plan`` (Hugging Face config), where given, is checked: a module it makes
column- or row-parallel that the graph cannot is refused, naming the node.

Every rank runs the same program (``ShardedStage.graph``); only the tensors differ (``ShardedStage.shards``,
``ppsplit.core.shards.Shard``). ``rank_stage`` builds one rank's stage; ``check_shards`` proves the ranks, run in
lockstep in one process, compute what the whole stage computes.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from torch import fx

from ppsplit.core.errors import ConfigError
from ppsplit.core.fx_utils import SHAPE, copy_buffer_persistence, get_tensor, is_cache_buffer, set_tensor
from ppsplit.core.plan import StageSharding
from ppsplit.core.shards import TP_GROUP, Shard
from ppsplit.core.tensors import module_device, nbytes
from ppsplit.passes.sharding.evaluate import run_ranks, run_whole, stage_shapes, static_shapes, step_inputs
from ppsplit.passes.sharding.placements import PARTIAL, Split, refine
from ppsplit.passes.sharding.rules import Propagation

log = logging.getLogger("ppsplit")
aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_TOKENS = 1009  # the fake step the placements are worked out on: a prime no model dim equals


@dataclass
class Choices:
    """The solver's decisions: weights kept whole, and the pieces and segments of the others' outputs."""

    tp: int
    banned: set = field(default_factory=set)
    parts: dict = field(default_factory=dict)
    segments: dict = field(default_factory=dict)

    def parts_of(self, target: str) -> int:
        return self.parts.get(target, self.tp)

    def segments_of(self, target: str, size: int) -> tuple[int, ...]:
        return self.segments.get(target, (size,))

    def may_cut(self, target: str, size: int, parts: int | None = None) -> bool:
        p = parts or self.parts_of(target)
        return target not in self.banned and all(s % p == 0 for s in self.segments_of(target, size))


@dataclass(frozen=True)
class ShardedStage:
    """One stage cut over ``tp`` ranks: the program every rank runs, how each tensor is cut (names not listed
    are held whole), and the report that goes into the plan."""

    tp: int
    graph: fx.Graph
    shards: dict[str, Shard]
    report: StageSharding


def shard_stage(stage: fx.GraphModule, tp: int, tp_plan: dict | None = None) -> ShardedStage:
    """Cut ``stage`` over ``tp`` ranks (see the module docstring). ``tp_plan``: the model config's
    ``base_model_tp_plan``, checked. Raises a one-line ``ConfigError`` naming the node it cannot place."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp must be a positive integer, but got {tp!r}")
    shapes = stage_shapes(stage, _TOKENS)
    prop = _solve(stage, shapes, tp, _required(stage, tp_plan))
    graph = _rewrite(stage, prop)
    shards = dict(prop.shards)
    for node, vocab in prop.vocab.items():
        shards[_start_name(node.args[0].target)] = Shard(0, tp, (vocab,), "start")
    report = _report(stage, prop, shards, tp)
    graph.lint()
    sharded = ShardedStage(tp, graph, shards, report)
    _record_shapes(stage, sharded)
    return sharded


def _solve(stage: fx.GraphModule, shapes: dict, tp: int, required: tuple) -> Propagation:
    """Place the graph, keeping whole (or cutting finer) the weights whose splits a node cannot take, until
    every node is placed."""
    choices = Choices(tp)
    # Every round changes a choice or raises, and fixes can cascade one layer per round (KV heads held by several
    # ranks, layer after layer): the bound grows with the graph.
    for _ in range(64 + len(stage.graph.nodes)):
        prop = Propagation(stage, shapes, tp, choices).run()
        if not prop.failures:
            _check_required(prop, required, tp, choices)
            return prop
        changed = False
        for node, e in prop.failures:
            changed |= _apply_fix(node, e, choices, stage, shapes, tp, required)
        if not changed:
            node, e = prop.failures[0]
            raise ConfigError(f"--tp {tp}: the TP pass cannot place {node.format_node()}: {e.reason}")
    raise ConfigError(f"--tp {tp}: the TP pass did not settle on a placement of {type(stage).__name__}")


def _apply_fix(node: fx.Node, e, choices: Choices, stage, shapes, tp: int, required: tuple) -> bool:
    fix = e.fix
    where = f"{node.name} ({_module_of(node)})"
    if fix.kind == "refuse":
        raise ConfigError(f"--tp {tp}: {where}: {e.reason}; {fix.value}")
    if fix.kind == "heads":
        raise ConfigError(f"--tp {tp}: {where} has {fix.value} heads, and tp must divide them or be a multiple of "
                          f"them (tp in {_divisors_and_multiples(fix.value)})")
    if not e.origins:
        raise ConfigError(f"--tp {tp}: the TP pass cannot place {where}: {e.reason}")
    changed = False
    for o in sorted(e.origins):
        if fix.kind == "parts" and fix.value > 1 and choices.parts_of(o) > fix.value and tp % fix.value == 0:
            choices.parts[o] = fix.value
            changed = True
        elif fix.kind == "segments":
            target, cuts = fix.value
            size = _out_size(stage, target)
            new = refine(choices.segments_of(target, size), cuts)
            if new != choices.segments_of(target, size):
                choices.segments[target] = new
                changed = True
        elif o not in choices.banned:
            if o in required[0]:
                raise ConfigError(f"--tp {tp}: the model's tp plan makes {o.rsplit('.', 1)[0]} column-parallel, but "
                                  f"{where} cannot take its split: {e.reason}")
            log.info("tp: %s kept whole: %s at %s", o, e.reason, where)
            choices.banned.add(o)
            changed = True
    return changed


def _out_size(stage: fx.GraphModule, target: str) -> int:
    """The size of the dim a weight's split is taken along (its rows; an expert stack's second dim)."""
    t = get_tensor(stage, target)
    return t.shape[1] if t.dim() == 3 else t.shape[0]


def _divisors_and_multiples(n: int) -> str:
    return ", ".join(str(t) for t in sorted({d for d in range(1, n + 1) if n % d == 0} | {n * 2, n * 4}))


# -- the model's own tp plan ------------------------------------------------------------------------------------------

def _required(stage: fx.GraphModule, tp_plan: dict | None) -> tuple[set, set]:
    """(weights the plan makes column-parallel, weights it makes row-parallel), among the stage's."""
    col, row = set(), set()
    if not tp_plan:
        return col, row
    names = {n.target for n in stage.graph.find_nodes(op="get_attr")}
    for pattern, style in tp_plan.items():
        if style not in ("colwise", "rowwise"):
            continue
        regex = re.compile(r"(^|\.)" + re.escape(pattern).replace(r"\*", r"\d+") + r"\.weight$")
        for name in names:
            if regex.search(name):
                (col if style == "colwise" else row).add(name)
    return col, row


def _check_required(prop: Propagation, required: tuple, tp: int, choices: Choices) -> None:
    """Every weight the model's plan makes column-parallel is cut along its outputs, every row-parallel one along
    its inputs."""
    for names, dim, style in ((required[0], 0, "column"), (required[1], 1, "row")):
        for name in sorted(names):
            shard = prop.shards.get(name)
            if shard is None or shard.kind != "split" or shard.dim != dim:
                raise ConfigError(f"--tp {tp}: the model's tp plan makes {name.rsplit('.', 1)[0]} {style}-parallel, "
                                  f"but the graph does not let the TP pass cut it so (it is "
                                  f"{'held whole' if shard is None else shard.describe()})")


def _module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        return list(stack.values())[-1][0] or "model"
    layer = node.meta.get("ppsplit.layer")
    return f"layer {layer}" if layer is not None else "the stage"


# -- the program every rank runs -------------------------------------------------------------------------------------

def _rewrite(stage: fx.GraphModule, prop: Propagation) -> fx.Graph:
    """The stage's graph with local sizes, the vocab-parallel lookups, an all-reduce after each partial value that
    is read whole, and the output's all-gather."""
    g = fx.Graph()
    env, reduced = {}, {}
    for n in stage.graph.nodes:
        def arg(a, n=n):
            return reduced[a] if a in reduced and n in prop.reduce_for.get(a, ()) else env[a]

        if n.op == "output":
            y, aux = n.args[0][:2]
            out_y = arg(y)
            if prop.gather is not None:
                out_y = _gather(g, env[y], prop.gather[1].dim, len(prop.shapes[y]), prop.tp)
            g.output((out_y, arg(aux), *[arg(a) for a in n.args[0][2:]]))
            break
        if n in prop.vocab:
            new = _vocab_lookup(g, n, arg, prop.vocab[n], prop.tp)
        else:
            new = g.node_copy(n, arg)
            for pos, index, value in prop.rewrites.get(n, ()):
                new.args = _replaced(new.args, pos, index, value)
        new.meta = {k: v for k, v in n.meta.items() if k != "val"}
        env[n] = new
        if prop.reduce_for.get(n):
            reduced[n] = _all_reduce(g, new)
    return g


def _replaced(args: tuple, pos: int, index, value) -> tuple:
    args = list(args)
    if index is None:
        args[pos] = value
    else:
        entry = list(args[pos])
        entry[index] = value
        args[pos] = entry
    return tuple(args)


def _all_reduce(g: fx.Graph, value: fx.Node) -> fx.Node:
    reduced = g.call_function(c10d.all_reduce.default, (value, "sum", TP_GROUP))
    return g.call_function(c10d.wait_tensor.default, (reduced,))


def _gather(g: fx.Graph, value: fx.Node, dim: int, rank: int, tp: int) -> fx.Node:
    """The whole value of one split along ``dim`` in ``tp`` pieces: gathered along dim 0, moved back."""
    front = g.call_function(aten.movedim.int, (value, dim, 0)) if dim else value
    front = g.call_function(aten.contiguous.default, (front,))
    whole = g.call_function(c10d.wait_tensor.default,
                            (g.call_function(c10d.all_gather_into_tensor.default, (front, tp, TP_GROUP)),))
    return g.call_function(aten.movedim.int, (whole, 0, dim)) if dim else whole


def _start_name(weight: str) -> str:
    return weight.rsplit(".", 1)[0] + ".vocab_start" if "." in weight else "vocab_start"


def _vocab_lookup(g: fx.Graph, n: fx.Node, arg, vocab: int, tp: int) -> fx.Node:
    """``embedding(w, ids)`` over this rank's rows ``[start, start + vocab / tp)``: ids outside read row 0 and are
    zeroed; the all-reduce that follows sums the ranks' rows into the lookup."""
    weight, ids = arg(n.args[0]), arg(n.args[1])
    start = g.get_attr(_start_name(n.args[0].target))
    rows = vocab // tp
    local = g.call_function(aten.sub.Tensor, (ids, start))
    inside = g.call_function(aten.bitwise_and.Tensor, (g.call_function(aten.ge.Scalar, (local, 0)),
                                                      g.call_function(aten.lt.Scalar, (local, rows))))
    safe = g.call_function(aten.mul.Tensor, (local, inside))
    looked = g.call_function(aten.embedding.default, (weight, safe))
    looked.meta["ppsplit.vocab"] = vocab
    return g.call_function(aten.mul.Tensor, (looked, g.call_function(aten.unsqueeze.default, (inside, -1))))


# -- the report, and what each rank holds ------------------------------------------------------------------------------

def _report(stage: fx.GraphModule, prop: Propagation, shards: dict, tp: int) -> StageSharding:
    own = dict(stage.named_parameters(remove_duplicate=False)) | dict(stage.named_buffers(remove_duplicate=False))
    weights = cache = whole = 0
    for name, t in own.items():
        shard = shards.get(name)
        size = nbytes(shard.local_shape(t.shape) if shard else t.shape, t.dtype)
        if is_cache_buffer(name):
            cache += size
        else:
            weights += size
            whole += 0 if shard else size
    start_bytes = sum(8 for s in shards.values() if s.kind == "start")
    reduces = sum(1 for v in prop.reduce_for.values() if v)
    return StageSharding(column=len(prop.column), row=len(prop.row), vocab=len(prop.vocab), all_reduces=reduces,
                         gathers=int(prop.gather is not None), rank_bytes=weights + start_bytes, whole_bytes=whole,
                         rank_cache_bytes=cache)


def rank_stage(stage: fx.GraphModule, sharded: ShardedStage, rank: int) -> fx.GraphModule:
    """TP rank ``rank``'s stage: the shared program over its pieces of ``stage``'s tensors (weights it holds
    whole are shared with ``stage``, not copied; cache buffers fresh zeros)."""
    if not 0 <= rank < sharded.tp:
        raise ConfigError(f"tp_rank must be in [0, {sharded.tp}), but got {rank}")
    root = torch.nn.Module()
    persistent = set(stage.state_dict().keys())
    own = [(n, t, True) for n, t in stage.named_parameters(remove_duplicate=False)] + \
          [(n, t, False) for n, t in stage.named_buffers(remove_duplicate=False)]
    for name, t, is_param in own:
        shard = sharded.shards.get(name)
        if shard is None:
            value = t
        elif is_cache_buffer(name) or t.device.type == "meta":
            value = torch.zeros(shard.local_shape(t.shape), dtype=t.dtype, device=t.device)
        else:
            value = shard.take(t.detach(), rank, sharded.tp)
        set_tensor(root, name, value, parameter=is_param, persistent=is_param or name in persistent)
    device = next((t.device for _, t, _ in own), torch.device("cpu"))
    for name, shard in sharded.shards.items():
        if shard.kind == "start":
            set_tensor(root, name, shard.take(None, rank, sharded.tp).to(device), parameter=False, persistent=True)
    graph = fx.Graph()
    graph.output(graph.graph_copy(sharded.graph, {}))
    out = fx.GraphModule(root, graph, class_name=type(stage).__name__)
    copy_buffer_persistence(out, stage)
    out.meta.update(stage.meta)
    out.meta["ppsplit.tp"] = (rank, sharded.tp)
    return out


def _record_shapes(stage: fx.GraphModule, sharded: ShardedStage) -> None:
    """Each node's local static shape (``SHAPE``), what a stage program stores and the stage rewrites match on;
    also the check that every rank's program is consistent with its tensors."""
    probe = rank_stage(stage, sharded, 0)
    shapes = static_shapes(probe)
    for n, m in zip(probe.graph.nodes, sharded.graph.nodes):
        if isinstance(shapes.get(n), tuple):
            m.meta[SHAPE] = shapes[n]


def check_shards(stage: fx.GraphModule, ranks: list[fx.GraphModule], tokens: int = 5, seed: int = 0) -> float:
    """The proof: ``stage`` and its ``ranks`` (run in lockstep, the collectives done in-process) on a random step
    of ``tokens`` tokens; every rank's output and aux buffer must equal the whole stage's. Returns the largest
    difference; raises ``ConfigError`` when it is not within the tolerance of summing in another order."""
    # The step where the stage's weights are (an H100 run of bench/tp_shard.py failed with CPU inputs to CUDA stages).
    inputs = step_inputs(stage, tokens, fill=torch.randn, seed=seed, device=module_device(stage))
    with torch.no_grad():
        want = run_whole(stage, inputs)
        got = run_ranks(ranks, inputs)
    worst = 0.0
    for r, out in enumerate(got):
        for name, a, b in (("output", want[0], out[0]), ("aux", want[1], out[1])):
            if a.shape != b.shape:
                raise ConfigError(f"tp rank {r}'s {name} has shape {list(b.shape)}, the whole stage's "
                                  f"{list(a.shape)}: the TP pass is wrong here; report the model")
            diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            scale = a.double().abs().max().item() if a.numel() else 0.0
            worst = max(worst, diff)
            tol = (1e-4 if a.dtype == torch.float32 else 5e-2) * max(1.0, scale)
            if not diff <= tol:
                raise ConfigError(f"tp rank {r}'s {name} differs from the whole stage's by {diff:.3g} (scale "
                                  f"{scale:.3g}): the TP pass is wrong here; report the model")
    return worst
