"""Stage pass, pointwise: elementwise chains of the traced graph become one ppsplit op each.

    add(mul(x, cos), mul(cat([neg(x[..., h:]), x[..., :h]], -1), sin))   ->  ppsplit::rope(x, cos, sin)
    mul(silu(a), b)                                                        ->  ppsplit::silu_mul(a, b)

The first is Hugging Face's rotate-half rotary embedding (``apply_rotary_pos_emb``; a partial rotary applies it
to a slice of the head, and that slice is ``x``), the second the gated MLP. Operands are matched in either order.
Both ops run one Triton kernel for CUDA fp16 / bf16 tensors, which rounds where the replaced ops round, and the
replaced ATen ops everywhere else (``triton_kernels/pointwise.py``), so on the CPU the rewrite never changes a
result. What does not match exactly (an interleaved rotary, a rotary that upcasts, other activations) stays as
traced.

Runs in ``split_model`` and ``load_stage`` on CUDA stages unless ``fuse_pointwise=False``, and not under
``compile=True``, where Inductor fuses these ops together with their neighbours.
"""
from __future__ import annotations

import torch
from torch import fx

import ppsplit.triton_kernels.pointwise  # noqa: F401  (registers torch.ops.ppsplit.rope / silu_mul)
from ppsplit.core.fx_utils import replace_call

aten = torch.ops.aten


def fuse_pointwise(stage: fx.GraphModule) -> dict:
    """Rewrite ``stage``'s rotary embeddings and SiLU-and-multiply in place; returns how many of each.

    Example::

        split = split_model(model, pp=2, fuse_pointwise=False)
        fuse_pointwise(split.stages[0])   # {"rope": 32, "silu_mul": 16}
    """
    graph = stage.graph
    counts = {"rope": 0, "silu_mul": 0}
    for node in list(graph.nodes):
        for name, match in (("rope", _match_rope), ("silu_mul", _match_silu_mul)):
            found = match(node)
            if found is None:
                continue
            op, args, dead = found
            replace_call(node, op, args)
            for old in dead:  # users first
                if not old.users:
                    graph.erase_node(old)
            counts[name] += 1
            break
    if any(counts.values()):
        graph.lint()
        stage.recompile()
    return counts


def _call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _shape(node):
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _binary(node, target):
    """``(a, b)`` of ``target(a, b)`` between two nodes, no other arguments (no ``alpha``)."""
    if not _call(node, target) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    return (a, b) if isinstance(a, fx.Node) and isinstance(b, fx.Node) else None


def _last_dim_slice(node, x, start, end_at_least) -> bool:
    """``node`` is ``x[..., start:end]`` with ``end >= end_at_least`` (slice.Tensor along the last dim, step 1)."""
    if not _call(node, aten.slice.Tensor) or node.kwargs or node.args[0] is not x:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    _, dim, lo, hi, step = args[:5]
    rank = len(_shape(x))
    return (dim in (-1, rank - 1) and (lo or 0) == start and step in (None, 1)
            and (hi is None or hi >= end_at_least))


def _match_rope(node):
    """``add(mul(x, cos), mul(rotate_half(x), sin))`` -> ``(rope, (x, cos, sin), replaced nodes)``."""
    pair = _binary(node, aten.add.Tensor)
    if pair is None:
        return None
    for direct, rotated in (pair, pair[::-1]):
        m1, m2 = _binary(direct, aten.mul.Tensor), _binary(rotated, aten.mul.Tensor)
        if m1 is None or m2 is None:
            continue
        for cat, sin in (m2, m2[::-1]):
            if not _call(cat, aten.cat.default) or len(cat.args) != 2 or cat.kwargs:
                continue
            parts, dim = cat.args
            if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not _call(parts[0], aten.neg.default):
                continue
            x2 = parts[0].args[0] if parts[0].args else None
            x = x2.args[0] if _call(x2, aten.slice.Tensor) else None
            shape = _shape(x)
            if shape is None or len(shape) != 4 or shape[-1] % 2 or dim not in (-1, 3):
                continue
            half = shape[-1] // 2
            if not (_last_dim_slice(x2, x, half, shape[-1]) and _last_dim_slice(parts[1], x, 0, half)
                    and (parts[1].args + (None,) * 5)[3] == half):
                continue
            cos = m1[1] if m1[0] is x else m1[0] if m1[1] is x else None
            if cos is None or cos is x or sin is x or _shape(cos) is None or _shape(sin) is None:
                continue
            if _shape(node) != shape:
                continue
            dead = [direct, rotated, cat, parts[0], x2, parts[1]]
            return torch.ops.ppsplit.rope.default, (x, cos, sin), dead
    return None


def _match_silu_mul(node):
    """``mul(silu(a), b)`` -> ``(silu_mul, (a, b), replaced nodes)`` (operands that do not have one shape take the
    ATen ops inside ``silu_mul``, so no shape check is needed here: after ``fuse_projections`` ``a`` and ``b`` are
    slices without a recorded shape)."""
    pair = _binary(node, aten.mul.Tensor)
    if pair is None:
        return None
    for act, b in (pair, pair[::-1]):
        if _call(act, aten.silu.default) and len(act.args) == 1 and not act.kwargs and len(act.users) == 1:
            return torch.ops.ppsplit.silu_mul.default, (act.args[0], b), [act]
    return None

