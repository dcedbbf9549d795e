"""Stage pass (after emit and ``fuse_projections``), GEMV: a stage's projections go through ``ppsplit::linear``.

``ppsplit::linear`` is ``torch.nn.functional.linear`` except for a one-row input on CUDA with at least
``MIN_OUT`` outputs (decode at batch 1), where it runs ppsplit's Triton GEMV (``triton_kernels/gemv.py``): one
kernel that reads the weight once, where cuBLAS picks a split-K kernel plus a reduction for some of these
shapes. Every other call (more rows, the CPU) makes the same ATen call as the traced graph, so CPU results and
batched steps are unchanged bit for bit.

Routed: ``aten.linear(x, W[, b])``, ``aten.mm(x, W.t())`` and ``aten.addmm(b, x, W.t())`` whose weight (and bias)
the stage holds, with ``W`` stored ``[out, in]`` and at least ``MIN_OUT`` outputs (the same recognition as
``passes.projections``). Then a gated MLP's ``silu_mul`` of the two halves of a routed gate/up projection (the
pointwise pass's op; ``passes.rewrites.pointwise.gated_halves``) folds into it, ``ppsplit::linear_silu_mul``: at one
row the GEMV's epilogue multiplies (bit-equal to the GEMV and ``silu_mul``'s kernel), elsewhere the two ops. And a
paged stage's ``rope_write`` of a routed fused q/k/v projection's heads folds into it, ``ppsplit::linear_rope_write``
(``passes.rewrites.pointwise.fold_qkv_rotation``): at one row the GEMV's epilogue rotates the query and keys and
writes the keys and values. Last, the first bytes of each projection's weight are prefetched into L2 while the
kernels before it run (``passes.rewrites.prefetch``; one-row steps on sm_90 and later). Runs in ``split_model`` and
``load_stage`` unless ``gemv=False``.
"""
from __future__ import annotations

import torch
from torch import fx

import ppsplit.triton_kernels.gemv  # noqa: F401  (registers torch.ops.ppsplit.linear)
from ppsplit.core.fx_utils import get_tensor, replace_call
from ppsplit.passes.rewrites.pointwise import fold_qkv_rotation, gated_halves
from ppsplit.passes.rewrites.prefetch import insert_prefetches
from ppsplit.passes.rewrites.projections import match_projection, plain_float
from ppsplit.triton_kernels.gemv import MIN_OUT


def route_gemv(stage: fx.GraphModule) -> int:
    """Route ``stage``'s projections through ``ppsplit::linear`` in place; returns how many were routed.

    Example::

        split = split_model(model, pp=2, gemv=False)
        route_gemv(split.stages[1])   # what split_model does by default
    """
    graph = stage.graph
    routed = 0
    for node in list(graph.nodes):
        m = match_projection(node)
        if m is None or m.out_dim != 0:
            continue
        weight = get_tensor(stage, m.weight.target)
        if not plain_float(weight) or weight.dim() != 2 or weight.shape[0] < MIN_OUT:
            continue
        replace_call(node, torch.ops.ppsplit.linear.default, (m.x, m.weight, m.bias))
        if m.transpose is not None and not m.transpose.users:
            graph.erase_node(m.transpose)
        routed += 1
    folded = 0
    for node in list(graph.nodes):
        halves = gated_halves(node, torch.ops.ppsplit.linear.default)
        if halves is None:
            continue
        y, gate, up, width = halves
        parts = node.args
        replace_call(node, torch.ops.ppsplit.linear_silu_mul.default, (*y.args, gate, up, width))
        for dead in (*parts, y):  # users first
            graph.erase_node(dead)
        folded += 1
    for node in list(graph.nodes):
        folded += fold_qkv_rotation(node, torch.ops.ppsplit.linear.default)
    if routed or folded:
        graph.lint()
        stage.recompile()
    insert_prefetches(stage)
    return routed

