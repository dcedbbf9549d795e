"""Running a stage without running it, and a TP group's ranks in one process.

``stage_shapes`` runs a stage graph on fake tensors at a chosen token count (every size concrete, no kernel runs);
``static_shapes`` runs it at two and keeps the sizes that do not change (``None`` where the step sets them), what
a stage program records. ``step_inputs`` builds a stage's inputs for ``n`` tokens of one sequence. ``run_ranks``
runs the ranks' graphs in lockstep, summing or gathering across them at each collective: the TP pass's proof
that the shards compute what the whole stage computes (``ppsplit.passes.tp.check_shards``).
"""
from __future__ import annotations

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_aggregate

from ppsplit.core.fx_utils import get_tensor, is_cache_buffer
from ppsplit.core.ragged import CacheLayout, RaggedStep, Segment
from ppsplit.core.tensors import model_dtype

c10d = torch.ops._c10d_functional
COLLECTIVES = (c10d.all_reduce.default, c10d.all_gather_into_tensor.default, c10d.wait_tensor.default)


def step_inputs(stage: fx.GraphModule, tokens: int, *, fill=torch.zeros, device="cpu", seed: int = 0) -> tuple:
    """The inputs of ``stage`` for ``tokens`` tokens of sequence slot 0 at positions ``0 .. tokens - 1`` (paged), or
    a ``[1, tokens]`` call (lockstep); token ids (stage 0) or hidden states from ``fill`` (``torch.zeros`` or
    ``torch.randn``, seeded)."""
    plan, k = stage.meta["ppsplit.plan"], stage.meta["ppsplit.stage"]
    dtype = model_dtype(plan)
    g = torch.Generator().manual_seed(seed)
    paged = plan.paged
    lead = (tokens,) if paged else (1, tokens)
    if k == 0:
        x = torch.randint(0, 2 ** 31 - 1, lead, generator=g) % _vocab(stage) if fill is torch.randn else \
            torch.zeros(lead, dtype=torch.long)
    else:
        x = (torch.randn(*lead, plan.width(k), generator=g) if fill is torch.randn else
             torch.zeros(*lead, plan.width(k))).to(dtype)
    aux = torch.zeros(plan.n_slots, *lead, plan.hidden_size, dtype=dtype)
    positions = torch.arange(tokens)
    if not paged:
        return tuple(t.to(device) for t in (x, positions, aux))
    layout = CacheLayout.of(plan)
    if tokens <= layout.max_len:
        step = RaggedStep.build([Segment(0, 0, tokens)], {0: list(range(layout.blocks_per_seq))}, layout)
    else:  # a fake step (shapes only): more tokens than a sequence holds, their values never read
        table = torch.zeros(layout.slots, layout.blocks_per_seq, dtype=torch.long)
        start, count = torch.zeros(layout.slots, dtype=torch.long), torch.zeros(layout.slots, dtype=torch.long)
        step = RaggedStep(positions % layout.max_len, torch.zeros(tokens, dtype=torch.long), table, start, count)
    return tuple(t.to(device) for t in (x, step.positions, aux, *step.tensors()[1:]))


def _vocab(stage: fx.GraphModule) -> int:
    for node in stage.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.embedding.default:
            return node.meta.get("ppsplit.vocab") or get_tensor(stage, node.args[0].target).shape[0]
    return 2


def stage_shapes(stage: fx.GraphModule, tokens: int) -> dict:
    """``{node: shape}`` (a tuple of ints, a list of them for an op with several outputs, ``None`` for a size or
    a device) of every node of ``stage`` on a fake step of ``tokens`` tokens."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [mode.from_tensor(t.to("meta")) for t in step_inputs(stage, tokens)]  # one device: weights may be meta
    shapes = {}

    class Shapes(fx.Interpreter):
        def get_attr(self, target, args, kwargs):
            return mode.from_tensor(get_tensor(self.module, target).to("meta"))

        def run_node(self, n):
            out = super().run_node(n)
            shapes[n] = _shape_of(out)
            return out

    with mode:
        Shapes(stage).run(*inputs)
    return shapes


def _shape_of(value):
    if isinstance(value, torch.Tensor):
        return tuple(int(d) for d in value.shape)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return [_shape_of(v) for v in value]
    return None


def static_shapes(stage: fx.GraphModule) -> dict:
    """``{node: shape}`` with ``None`` for each size the step sets (it differs between two token counts)."""
    a, b = stage_shapes(stage, 61), stage_shapes(stage, 67)

    def merge(x, y):
        if isinstance(x, list):
            return [merge(p, q) for p, q in zip(x, y)]
        if x is None or y is None:
            return None
        return tuple(p if p == q else None for p, q in zip(x, y))

    return {n: merge(a[n], b[n]) for n in a}


class _Rank(fx.Interpreter):
    """One rank's interpreter; its cache buffers are copies, so a check leaves the stage's own cache untouched."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        self.copies: dict = {}

    def get_attr(self, target, args, kwargs):
        t = get_tensor(self.module, target)
        if is_cache_buffer(target):
            return self.copies.setdefault(target, t.clone())
        return t


def run_ranks(ranks: list[fx.GraphModule], inputs: tuple) -> list:
    """Each rank's output for ``inputs``, the ranks run node by node together: ``all_reduce`` sums the ranks'
    values, ``all_gather_into_tensor`` concatenates them along dim 0, ``wait_tensor`` passes its value on."""
    interps = [_Rank(gm) for gm in ranks]
    for it in interps:
        it.env = {}
        it.args_iter = iter(inputs)
    node_lists = [list(gm.graph.nodes) for gm in ranks]
    for nodes in zip(*node_lists):
        n0 = nodes[0]
        if n0.op == "call_function" and n0.target in COLLECTIVES[:2]:
            values = [it.env[n.args[0]] for it, n in zip(interps, nodes)]
            total = torch.stack(values).sum(0) if n0.target is COLLECTIVES[0] else torch.cat(values, 0)
            for it, n in zip(interps, nodes):
                it.env[n] = total.clone()
            continue
        if n0.op == "output":
            return [map_aggregate(n.args[0], lambda a, it=it: it.env[a] if isinstance(a, fx.Node) else a)
                    for it, n in zip(interps, nodes)]
        for it, n in zip(interps, nodes):
            it.env[n] = it.run_node(n)
    raise AssertionError("a graph without an output")


def run_whole(stage: fx.GraphModule, inputs: tuple):
    """``stage``'s output on ``inputs``, its cache left untouched."""
    return run_ranks([stage], inputs)[0]
