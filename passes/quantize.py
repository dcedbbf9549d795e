"""Stage pass (compile, after emit): linears on FP8 weights run ``ppsplit::fp8_linear`` on the weight and scale
as the checkpoint stores them.

Input: a stage ``GraphModule`` (meta tensors) and ``{weight name: QuantizedWeight}``. A weight whose every reader is
a projection (``aten.linear``, or ``mm`` / ``addmm`` over its transpose: ``match_projection``) becomes an FP8
parameter, its scale a new parameter beside it, and each projection ``fp8_linear(x, weight, scale, bias,
block_n, block_k)``. A weight read by anything else (a tied embedding) is left in the model dtype and reported:
the compile dequantises it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

import ppsplit.triton_kernels.fp8  # noqa: F401  (registers torch.ops.ppsplit.fp8_linear)
from ppsplit.core.fx_utils import get_tensor, set_tensor
from ppsplit.passes.rewrites.projections import match_projection
from ppsplit.triton_kernels.fp8 import FP8_DTYPE


@dataclass(frozen=True)
class QuantizedWeight:
    scale: str                 # the scale's tensor name in the stage
    scale_shape: tuple[int, ...]
    scale_dtype: torch.dtype
    block: tuple[int, int]     # (block_n, block_k)


@dataclass(frozen=True)
class Quantized:
    """What the pass did to one stage: the weights that run as FP8, and those left in the model dtype."""

    fp8: tuple[str, ...]
    left: tuple[str, ...]


def quantize_linears(stage: fx.GraphModule, weights: dict[str, QuantizedWeight]) -> Quantized:
    """Rewrite ``stage``'s projections over the weights in ``weights`` in place. Returns what it did.

    Example::

        scale = QuantizedWeight("model.layers.0.mlp.up_proj.weight_scale_inv", (3, 2), torch.float32, (128, 128))
        quantize_linears(stage, {"model.layers.0.mlp.up_proj.weight": scale})
    """
    graph = stage.graph
    fp8, left = [], []
    for node in list(graph.find_nodes(op="get_attr")):
        q = weights.get(node.target)
        if q is None:
            continue
        matches = [match_projection(user) for user in node.users]
        if not matches or any(m is None or m.weight is not node or m.out_dim != 0 for m in matches):
            left.append(node.target)
            continue
        w = get_tensor(stage, node.target)
        set_tensor(stage, node.target, torch.empty(w.shape, dtype=FP8_DTYPE, device="meta"), parameter=True,
                   persistent=True)
        set_tensor(stage, q.scale, torch.empty(q.scale_shape, dtype=q.scale_dtype, device="meta"), parameter=True,
                   persistent=True)
        with graph.inserting_after(node):
            scale = graph.get_attr(q.scale)
        for m in matches:
            with graph.inserting_before(m.node):
                new = graph.call_function(torch.ops.ppsplit.fp8_linear.default, (m.x, node, scale, m.bias, *q.block))
            new.meta.update({k: v for k, v in m.node.meta.items() if k in ("val", "tensor_meta", "nn_module_stack",
                                                                           "ppsplit.layer")})
            m.node.replace_all_uses_with(new)
            graph.erase_node(m.node)
            if m.transpose is not None and not m.transpose.users:
                graph.erase_node(m.transpose)
        fp8.append(node.target)
    graph.lint()
    stage.recompile()
    return Quantized(tuple(fp8), tuple(left))
