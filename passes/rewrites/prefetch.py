"""Stage pass (after ``gemv``), L2 prefetch: the next projections' weights are streamed into L2 while the kernels
between two projections run.

A decode step at batch 1 is a chain of weight-streaming projections (the q/k/v, o, gate/up and down GEMVs) with
kernels between them that read little from HBM (attention and its combine, the norms). After every projection that
such work separates from the next one, this pass inserts ``l2_prefetch`` (``triton_kernels/prefetch.py``) of the
next projections' weights, their first ``budget`` bytes in the order the step reads them, on a branch beside the
step; and ``l2_join`` just before the next projection. The prefetch changes no bit of the step.

Projections: the ops the GEMV and FP8 rewrites leave (``ppsplit::linear`` and ``fp8_linear`` with their folds),
whose weight (argument 1) the stage holds and which are at least ``MIN_BYTES``.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

import ppsplit.triton_kernels.fp8  # noqa: F401  (registers the ops matched below)
import ppsplit.triton_kernels.gemv  # noqa: F401
import ppsplit.triton_kernels.qkv  # noqa: F401
from ppsplit.core.fx_utils import get_tensor
from ppsplit.triton_kernels.prefetch import l2_join, l2_prefetch

MIN_BYTES = 4 << 20
BUDGET = 32 << 20  # bytes asked for at each point: under a Hopper L2 (50 MB), beside what the step keeps there


def projection_ops() -> frozenset:
    ops = torch.ops.ppsplit
    return frozenset({ops.linear.default, ops.linear_silu_mul.default, ops.linear_rope_write.default,
                      ops.fp8_linear.default, ops.fp8_linear_silu_mul.default})


def _weight_bytes(stage: fx.GraphModule, node: fx.Node) -> int:
    w = node.args[1] if len(node.args) > 1 else None
    if not isinstance(w, fx.Node) or w.op != "get_attr":
        return 0
    t = get_tensor(stage, w.target)
    return t.numel() * t.element_size()


def _is_work(node: fx.Node) -> bool:
    """A call that launches a kernel (not a view, not a getitem)."""
    return node.op == "call_function" and node.target is not operator.getitem and \
        not getattr(node.target, "is_view", False)


def insert_prefetches(stage: fx.GraphModule, budget: int = BUDGET, *, bulk: bool = True, fork: bool = True,
                      join_at_end: bool = False) -> int:
    """Insert the prefetches and joins into ``stage`` in place; returns how many prefetch points it placed.

    Example::

        split = split_model(model, pp=1)
        insert_prefetches(split.stages[0])   # what split_model does on an sm_90 GPU
    """
    graph = stage.graph
    ops = projection_ops()
    order = list(graph.nodes)
    heavy = [i for i, n in enumerate(order)
             if n.op == "call_function" and n.target in ops and _weight_bytes(stage, n) >= MIN_BYTES]
    placed = 0
    for a, b in zip(heavy, heavy[1:]):
        if not any(_is_work(n) for n in order[a + 1: b]):
            continue  # nothing runs between them: no HBM time to fill
        after, ahead, covered = order[a], [], 0
        for i in (i for i in heavy if i >= b):
            if covered >= budget:
                break
            ahead.append(order[i])
            covered += _weight_bytes(stage, order[i])
        with graph.inserting_before(after.next):
            weights = [graph.get_attr(n.args[1].target) for n in ahead]
            graph.call_function(l2_prefetch, (budget, *weights), {"bulk": bulk, "fork": fork})
        if fork and not join_at_end:
            with graph.inserting_before(order[b]):
                graph.call_function(l2_join, (order[b].args[1],))
        placed += 1
    if placed and fork and join_at_end:
        with graph.inserting_before(next(n for n in order if n.op == "output")):
            graph.call_function(l2_join, (order[heavy[-1]].args[1],))
    if placed:
        graph.lint()
        stage.recompile()
    return placed
