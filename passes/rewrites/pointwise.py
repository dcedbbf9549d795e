"""Stage pass, pointwise: elementwise chains of the traced graph become one ppsplit op each.

    add(mul(x, cos), mul(cat([neg(x[..., h:]), x[..., :h]], -1), sin))   ->  ppsplit::rope(x, cos, sin)
    mul(silu(a), b)                                                        ->  ppsplit::silu_mul(a, b)

and then, in a paged stage, a layer's query and key rotations and its key and value writes::

    q2 = rope(q, cos, sin); paged_write_pair(K, V, rope(k, cos, sin)[0].transpose(0, 1), v, slots)
                                    ->  q2 = ppsplit::rope_write(q, k, cos, sin, K, V, v, slots)

where the rotated keys go nowhere but the write, and the rotated query nowhere before it; and in an FP8 stage, a
gated MLP's activation into its fused gate/up projection (``passes.rewrites.projections``), which it alone reads::

    silu_mul(y[..., g:g + w], y[..., u:u + w]), y = fp8_linear(x, W, ...)
                                    ->  ppsplit::fp8_linear_silu_mul(x, W, ..., g, u, w)

(at decode batch 1 one GEMV whose epilogue multiplies, not a GEMV and a kernel; bit-equal: ``triton_kernels/fp8.py``),
and a ``rope_write`` whose query, keys and values are the head views of one fused q/k/v FP8 projection into it::

    rope_write(q, k, cos, sin, K, V, v, slots), q | k | v = fp8_linear(x, W_qkv, ...)
                                    ->  ppsplit::linear_rope_write(x, W_qkv, ..., cos, sin, K, V, slots, ...)

(one GEMV whose epilogue rotates and writes: ``triton_kernels/qkv.py``; ``gemv`` folds routed projections alike).

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

# registers rope / silu_mul / rope_write and the paged ops, fp8_linear_silu_mul and linear_rope_write
from ppsplit.triton_kernels import fp8, pointwise, qkv  # noqa: F401
from ppsplit.core.fx_utils import SHAPE, VALUE_META, get_tensor, replace_call, static_shape
from ppsplit.passes.rewrites.projections import match_projection

aten = torch.ops.aten
ops = torch.ops.ppsplit
_COUNTED = ("rope", "silu_mul", "rope_write", "fp8_linear_silu_mul", "linear_rope_write")  # reported


def fuse_pointwise(stage: fx.GraphModule) -> dict:
    """Rewrite ``stage``'s rotary embeddings and SiLU-and-multiply in place; returns how many of each op the stage
    then holds (``rope_write`` and ``fp8_linear_silu_mul`` only where there are some: paged and FP8 stages).

    Example::

        split = split_model(model, pp=2, fuse_pointwise=False)
        fuse_pointwise(split.stages[0])   # {"rope": 32, "silu_mul": 16}; a paged stage: {"rope": 0, "silu_mul": 16,
                                          #  "rope_write": 16}
    """
    graph = stage.graph
    changed = False
    for matches in ((_match_rope, _match_silu_mul), (_fold_silu_mul,)):  # the second round folds the first's ops
        for node in list(graph.nodes):
            for match in matches:
                found = match(node)
                if found is None:
                    continue
                op, args, dead = found
                replace_call(node, op, args)
                for old in dead:  # users first
                    if not old.users:
                        graph.erase_node(old)
                changed = True
                break
    order = {n: i for i, n in enumerate(graph.nodes)}  # the folds insert and erase, but keep this order
    for node in list(graph.nodes):
        if _call(node, ops.paged_write_pair.default) and _fuse_rope_write(node, order):
            changed = True
    for node in list(graph.nodes):
        changed |= fold_qkv_rotation(node, ops.fp8_linear.default)
    if changed:
        graph.lint()
        stage.recompile()
    held = [n.target for n in graph.nodes if n.op == "call_function"]
    counts = {name: held.count(getattr(ops, name).default) for name in _COUNTED}
    return {name: count for name, count in counts.items() if count or name in ("rope", "silu_mul")}


def _call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


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
    rank = len(static_shape(x))
    return (dim in (-1, rank - 1) and (lo or 0) == start and step in (None, 1)
            and (hi is None or hi >= end_at_least))


def gated_halves(node, projection):
    """``(y, gate, up, width)`` for ``silu_mul(y[..., gate:gate + width], y[..., up:up + width])`` where ``y`` is a
    ``projection`` call (``ppsplit::fp8_linear``, ``ppsplit::linear``: the weight is the second argument, a tensor
    the stage holds, and the halves lie in its rows) and nothing else reads ``y`` or the two slices (a fused gate/up
    projection, ``passes.rewrites.projections``), else None. The rewrites that fold the multiply into the
    projection's kernel (here for FP8, ``gemv`` for routed ones) match it."""
    if not _call(node, ops.silu_mul.default) or node.kwargs:
        return None
    spans = [_column_span(part) for part in node.args]
    if None in spans or spans[0][0] is not spans[1][0]:
        return None
    (y, gate, gate_end), (_, up, up_end) = spans
    if not _call(y, projection) or set(y.users) != set(node.args) or any(len(p.users) != 1 for p in node.args) \
            or gate_end - gate != up_end - up:
        return None
    weight = y.args[1]
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr"
            and max(gate_end, up_end) <= get_tensor(node.graph.owning_module, weight.target).shape[0]):
        return None
    return y, gate, up, gate_end - gate


def _fold_silu_mul(node):
    """``silu_mul`` of the halves of an FP8 projection (``gated_halves``) -> ``(fp8_linear_silu_mul, (..., gate, up,
    width), replaced nodes)``."""
    halves = gated_halves(node, ops.fp8_linear.default)
    m = match_projection(halves[0]) if halves is not None else None
    if m is None:
        return None
    y, gate, up, width = halves
    return ops.fp8_linear_silu_mul.default, (m.x, m.weight, m.scale, m.bias, *m.block, gate, up, width), [*node.args, y]


def _column_span(node):
    """``(y, start, end)`` for ``y[..., start:end]`` (``slice.Tensor`` of the last dim, step 1, int bounds)."""
    if not _call(node, aten.slice.Tensor) or node.kwargs or len(node.args) not in (4, 5):
        return None
    y, dim, start, end, *step = node.args
    shape = static_shape(node)
    if dim != -1 and (shape is None or dim != len(shape) - 1) or step not in ([], [1]):
        return None
    return (y, start, end) if isinstance(start, int) and isinstance(end, int) and 0 <= start < end else None


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
            shape = static_shape(x)
            if shape is None or len(shape) != 4 or not isinstance(shape[-1], int) or shape[-1] % 2 \
                    or dim not in (-1, 3):
                continue
            half = shape[-1] // 2
            if not (_last_dim_slice(x2, x, half, shape[-1]) and _last_dim_slice(parts[1], x, 0, half)
                    and (parts[1].args + (None,) * 5)[3] == half):
                continue
            cos = m1[1] if m1[0] is x else m1[0] if m1[1] is x else None
            if cos is None or cos is x or sin is x or static_shape(cos) is None or static_shape(sin) is None:
                continue
            if static_shape(node) != shape:
                continue
            dead = [direct, rotated, cat, parts[0], x2, parts[1]]
            return ops.rope.default, (x, cos, sin), dead
    return None


def _fuse_rope_write(pair: fx.Node, order: dict) -> bool:
    """Fold the rotations of the keys ``pair`` writes, and of the query that reads them, into one ``rope_write``
    in ``pair``'s place; False (nothing changed) where the graph is not that pattern. ``order``: each node's place
    in the graph (the query's readers must all come after the write). The rotations may run on
    ``[1, H, N, D]`` (Llama) or on ``[1, N, H, D]`` before the heads move forward (Gemma-4): rotation is elementwise,
    so the second is rotated as a ``[1, H, N, D]`` view of the same values."""
    pool, other_pool, keys, value, slots = pair.args
    head_major = keys if _transposed(keys, 0, 1) else None
    row = head_major.args[0] if head_major is not None else None
    if not (_call(row, aten.select.int) and tuple(row.args[1:]) == (0, 0)):
        return False
    rotated_k, k_moved = _rotated(row.args[0])
    if rotated_k is None or any(len(n.users) != 1 for n in (rotated_k, k_moved, row, head_major) if n is not None):
        return False  # the rotated keys are read elsewhere too (a replica, a carried value): keep them
    for reader in pool.users:
        if reader is pair or not _call(reader, ops.paged_attention.default):
            continue
        rotated_q, q_moved = _rotated(reader.args[0])
        if (rotated_q is not None and (q_moved is None) == (k_moved is None)
                and all(_same(a, b) for a, b in zip(rotated_q.args[1:], rotated_k.args[1:]))
                and all(order[user] > order[pair] for user in (q_moved or rotated_q).users)
                and (q_moved is None or len(rotated_q.users) == 1)):
            break
    else:
        return False
    graph = pair.graph
    with graph.inserting_before(pair):
        q, k, cos, sin = (rotated_q.args[0], *rotated_k.args)
        if k_moved is not None:  # [1, N, H, D] -> [1, H, N, D] views, as the attention reads the query
            q, k, cos, sin = (_transpose(graph, t) for t in (q, k, cos, sin))
        fused = graph.call_function(ops.rope_write.default, (q, k, cos, sin, pool, other_pool, value,
                                                                           slots))
    query = q_moved or rotated_q
    fused.meta.update({key: v for key, v in query.meta.items() if key in VALUE_META})
    query.replace_all_uses_with(fused)
    for dead in (pair, head_major, row, k_moved, rotated_k, q_moved, rotated_q):
        if dead is not None:
            graph.erase_node(dead)
    return True


def _transposed(node, a: int, b: int) -> bool:
    return _call(node, aten.transpose.int) and tuple(node.args[1:]) in ((a, b), (b, a)) and not node.kwargs


def _rotated(node):
    """``(rope node, None)`` for ``rope(...)``, ``(rope node, transpose)`` for ``rope(...).transpose(1, 2)``."""
    rope = ops.rope.default
    if _call(node, rope):
        return node, None
    if _transposed(node, 1, 2) and _call(node.args[0], rope):
        return node.args[0], node
    return None, None


def _same(a, b) -> bool:
    """One value: one node, or two calls of one op on the same arguments (two ``unsqueeze`` of one ``cos``)."""
    calls = all(isinstance(n, fx.Node) and n.op == "call_function" for n in (a, b))
    return a is b or (calls and a.target == b.target and a.args == b.args and a.kwargs == b.kwargs)


def _transpose(graph: fx.Graph, node: fx.Node) -> fx.Node:
    moved = graph.call_function(aten.transpose.int, (node, 1, 2))
    val, shape = node.meta.get("val"), node.meta.get(SHAPE)
    if isinstance(val, torch.Tensor):
        moved.meta["val"] = val.transpose(1, 2)
    elif shape is not None:
        moved.meta[SHAPE] = (shape[0], shape[2], shape[1], *shape[3:])
    return moved


def qkv_rotation(node, projection):
    """``(y, q_width, k_width, head_dim)`` for ``rope_write(q, k, cos, sin, K, V, v, slots)`` whose ``q``, ``k`` and
    ``v`` are the head views (``y[..., lo:hi].reshape(1, T, H, D).transpose(1, 2)``; ``v`` then ``[0].transpose(0,
    1)``) of three adjacent column spans that cover a ``projection`` call ``y`` (a fused q/k/v projection,
    ``passes.rewrites.projections``), with ``q`` and ``k`` of one head size, and nothing else reads ``y`` or the
    views; else None. The rewrites that fold the rotation and the writes into the projection's GEMV
    (``fold_qkv_rotation``) match it."""
    if not _call(node, ops.rope_write.default) or node.kwargs:
        return None
    q, k, _, _, _, _, value, _ = node.args
    if not (_transposed(value, 0, 1) and len(value.users) == 1 and _call(value.args[0], aten.select.int)
            and tuple(value.args[0].args[1:]) == (0, 0) and len(value.args[0].users) == 1):
        return None
    views = [_head_view(q), _head_view(k), _head_view(value.args[0].args[0])]
    if None in views or len({y for y, *_ in views}) != 1:
        return None
    (y, q_lo, q_hi, d), (_, k_lo, k_hi, k_d), (_, v_lo, v_hi, _) = views
    weight = y.args[1] if _call(y, projection) else None
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and len(y.users) == 3
            and q_lo == 0 and k_lo == q_hi and v_lo == k_hi and d == k_d
            and v_hi >= get_tensor(node.graph.owning_module, weight.target).shape[0]):
        return None
    return y, q_hi, k_hi - k_lo, d


def _head_view(node):
    """``(y, lo, hi, D)`` for ``y[..., lo:hi].reshape(1, T, H, D).transpose(1, 2)``, each step read once, else None."""
    if not _transposed(node, 1, 2) or len(node.users) != 1:
        return None
    heads = node.args[0]
    if not (_call(heads, aten.reshape.default, aten.view.default) and len(heads.users) == 1):
        return None
    span = _column_span(heads.args[0])
    shape = static_shape(heads)
    if span is None or len(heads.args[0].users) != 1 or shape is None or len(shape) != 4 or shape[0] != 1:
        return None
    y, lo, hi = span
    h, d = shape[2:]
    return (y, lo, hi, d) if isinstance(h, int) and isinstance(d, int) and h * d == hi - lo else None


def fold_qkv_rotation(node, projection) -> bool:
    """Fold ``node``, a ``rope_write`` of a fused q/k/v ``projection``'s head views (``qkv_rotation``), into one
    ``ppsplit::linear_rope_write`` in its place; False (nothing changed) where it is not that pattern. The FP8
    projections are folded here, the routed ``ppsplit::linear`` ones in ``gemv``."""
    found = qkv_rotation(node, projection)
    if found is None:
        return False
    y, q_width, k_width, head_dim = found
    q, k, cos, sin, pool, other_pool, value, slots = node.args
    if projection is ops.fp8_linear.default:
        x, weight, scale, bias, block_n, block_k = y.args
    else:
        (x, weight, bias), scale, block_n, block_k = y.args, None, 0, 0
    dead = [value, value.args[0]]
    for view in (q, k, value.args[0].args[0]):
        dead += [view, view.args[0], view.args[0].args[0]]
    replace_call(node, ops.linear_rope_write.default, (x, weight, bias, scale, block_n, block_k, cos, sin, pool,
                                                       other_pool, slots, q_width, k_width, head_dim))
    for old in (*dead, y):  # users first
        y.graph.erase_node(old)
    return True


def _match_silu_mul(node):
    """``mul(silu(a), b)`` -> ``(silu_mul, (a, b), replaced nodes)`` (operands that do not have one shape take the
    ATen ops inside ``silu_mul``, so no shape check is needed here: after ``fuse_projections`` ``a`` and ``b`` are
    slices without a recorded shape)."""
    pair = _binary(node, aten.mul.Tensor)
    if pair is None:
        return None
    for act, b in (pair, pair[::-1]):
        if _call(act, aten.silu.default) and len(act.args) == 1 and not act.kwargs and len(act.users) == 1:
            return ops.silu_mul.default, (act.args[0], b), [act]
    return None

