"""Part of the GEMV rewrite (``gemv.route_gemv`` calls it last): the first bytes of the next projection's weight
are asked of L2 while the kernels before it run.

A decode step at batch 1 is a chain of weight-streaming projections (the q/k/v, o, gate/up and down GEMVs, the
head) with kernels between them that read little from HBM (attention and its combine, the norms). After every
projection that such work separates from the next one, this pass inserts ``l2_prefetch``
(``triton_kernels/prefetch.py``) of the next projections' weights, their first ``budget`` bytes in the order the step
reads them, on a branch beside the step, and ``l2_join`` just before the next projection. The prefetch changes no
bit of the step, and does nothing but at one row on sm_90 or later.

Why only the first bytes: what it hides is each GEMV's slow start, its first wave of loads waiting on HBM. Asking
for more fills L2 sooner but the attention and the norms, which wait on memory, slow down by more than the GEMV
gains (bench/RESULTS.md section 43: on an H100 the FP8 step gains 1.7% at 2-3 MB a point and loses from 8 MB).
Forking before the projection before, or marking the lines evict_last, measured no better.

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
BUDGET = 2 << 20  # bytes asked for at each point


def projection_ops() -> frozenset:
    ops = torch.ops.ppsplit
    return frozenset({ops.linear.default, ops.linear_silu_mul.default, ops.linear_rope_write.default,
                      ops.fp8_linear.default, ops.fp8_linear_silu_mul.default})


def weight_bytes(stage: fx.GraphModule, node: fx.Node) -> int:
    """The bytes of projection ``node``'s weight (0 where argument 1 is not a tensor the stage holds)."""
    w = node.args[1] if len(node.args) > 1 else None
    if not isinstance(w, fx.Node) or w.op != "get_attr":
        return 0
    t = get_tensor(stage, w.target)
    return t.numel() * t.element_size()


def is_work(node: fx.Node) -> bool:
    """A call that launches a kernel (not a view, not a getitem)."""
    return node.op == "call_function" and node.target is not operator.getitem and \
        not getattr(node.target, "is_view", False)


def insert_prefetches(stage: fx.GraphModule, budget: int = BUDGET) -> int:
    """Insert the prefetches and joins into ``stage`` in place (in place of any it holds); returns how many prefetch
    points it placed.

    Example::

        route_gemv(stage)                      # places them at BUDGET
        insert_prefetches(stage, 4 << 20)      # again, at 4 MiB a point
    """
    remove_prefetches(stage)
    graph = stage.graph
    ops = projection_ops()
    order = list(graph.nodes)
    sizes = {i: weight_bytes(stage, n) for i, n in enumerate(order) if n.op == "call_function" and n.target in ops}
    heavy = [i for i, size in sizes.items() if size >= MIN_BYTES]
    placed = 0
    for a, b in zip(heavy, heavy[1:]):
        if not any(is_work(n) for n in order[a + 1: b]):
            continue  # nothing runs between them: no time to fill
        ahead, covered = [], 0
        for i in (i for i in heavy if i >= b):
            if covered >= budget:
                break
            ahead.append(order[i])
            covered += sizes[i]
        with graph.inserting_before(order[a].next):
            weights = [graph.get_attr(n.args[1].target) for n in ahead]
            graph.call_function(l2_prefetch, (order[a].args[0], budget, *weights))
        with graph.inserting_before(order[b]):
            graph.call_function(l2_join, (order[b].args[0],))
        placed += 1
    if placed:
        graph.lint()
        stage.recompile()
    return placed


def remove_prefetches(stage: fx.GraphModule) -> int:
    """Undo ``insert_prefetches``; returns how many prefetch points there were."""
    graph = stage.graph
    calls = [n for n in graph.nodes if n.target in (l2_prefetch, l2_join)]
    if not calls:
        return 0
    points = sum(n.target is l2_prefetch for n in calls)
    weights = {w for n in calls if n.target is l2_prefetch for w in n.args[2:]}
    for node in calls:
        graph.erase_node(node)
    for node in weights:
        if not node.users:
            graph.erase_node(node)
    graph.lint()
    stage.recompile()
    return points
