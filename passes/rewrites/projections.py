"""Stage pass (after emit), fuse projections: sibling linears that read one input become one linear.

Attention's q, k and v projections, a gated MLP's gate and up, a MoE's router and shared expert: each group reads
the same normed hidden state. At decode batch 1 each is a GEMV bound by its weight bytes, and one GEMV over the
concatenated weight gets closer to the copy bandwidth than three small ones (and launches one kernel, not three).
The fused result is sliced along its last dimension, so every former output is a view of it (no copy).

Runs on one stage ``GraphModule`` at a time, after ``emit`` in ``split_model`` or after ``load_stage`` builds a
stage from a compiled folder: the folder keeps the Hugging Face tensors under their original names, and the
fused weight is built once, when the stage is built. The stage then holds the concatenated weight (and bias)
under a derived name, ``<common prefix>.fused_<q_proj>_<k_proj>_<v_proj>.weight``, and no longer holds the
separate ones; those (which ``split_model``'s source model still holds) become views of the concatenation, so
fusing does not grow the process's memory.

Fused: ``aten.linear(x, W[, b])``, ``aten.mm(x, W.t())`` and ``aten.addmm(b, x, W.t())`` (also with ``W`` stored
``[in, out]`` as GPT-2's Conv1D does), grouped by input, form, dtype, device, input size and whether they have a
bias. Left alone, and reported: a weight or bias the stage reads anywhere else or holds under a second name (tied
or shared), one that is not a plain float tensor (quantised, or a tensor subclass), fewer than ``MIN_WIDTH``
outputs, and a group of one. Two linears on two different views of one tensor (Qwen2-MoE's router beside its
shared expert) are not recognised as siblings.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ppsplit.core.fx_utils import get_tensor, set_tensor

aten = torch.ops.aten
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_VIEWS = (aten.view.default, aten._unsafe_view.default)
# Narrower outputs (a MoE's scalar shared-expert gate) gain nothing from fusing, and BLAS computes a lone column
# with another kernel (a dot product, not a GEMM), so fusing them would change their last bits.
MIN_WIDTH = 16


@dataclass(frozen=True)
class FusedProjection:
    """One fused group: the new weight's name, the weights it replaced (in output order) and their widths."""

    weight: str
    members: tuple[str, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Projections:
    """The pass's result for one stage: what was fused, and siblings left alone with the reason."""

    fused: tuple[FusedProjection, ...]
    skipped: tuple[tuple[str, str], ...]  # (weight name, why it was not fused)


@dataclass
class _Member:
    node: fx.Node  # the linear / mm / addmm
    x: fx.Node
    weight: fx.Node  # get_attr
    bias: fx.Node | None  # get_attr
    transpose: fx.Node | None  # the aten.t between the weight and an mm / addmm
    out_dim: int  # the weight's dimension that holds the outputs (0 for [out, in], 1 for [in, out])
    scale: fx.Node | None = None  # ppsplit::fp8_linear: the weight's block scales (get_attr) ...
    block: tuple[int, int] | None = None  # ... and the block (block_n, block_k)


def fuse_projections(stage: fx.GraphModule) -> Projections:
    """Fuse sibling projections of ``stage`` in place (graph and tensors); returns what it did.

    Example::

        split = split_model(model, pp=2)
        report = fuse_projections(split.stages[0])   # what split_model(..., fuse_projections=True) does
        report.fused[0].members   # ('model.layers.0.self_attn.q_proj.weight', '...k_proj.weight', '...v_proj.weight')
    """
    graph = stage.graph
    shared = _shared_names(stage)
    attr_nodes: dict[str, int] = {}
    for n in graph.find_nodes(op="get_attr"):
        attr_nodes[n.target] = attr_nodes.get(n.target, 0) + 1

    groups: dict[tuple, list[_Member]] = {}
    rejected: dict[tuple, list[tuple[str, str]]] = {}
    for node in list(graph.nodes):
        m = match_projection(node)
        if m is None:
            continue
        w = get_tensor(stage, m.weight.target)
        key = (m.x, node.target, m.out_dim, m.bias is not None, w.dtype, w.device, w.shape[1 - m.out_dim], m.block)
        why = _why_not(stage, m, shared, attr_nodes)
        if why:
            rejected.setdefault(key, []).append((m.weight.target, why))
        else:
            groups.setdefault(key, []).append(m)

    fused, skipped = [], []
    for key, members in groups.items():
        if len(members) >= 2:
            fused.append(_fuse(stage, members))
        elif key in rejected:
            skipped.append((members[0].weight.target, "its siblings cannot be fused"))
    for key, items in rejected.items():
        if len(groups.get(key, ())) + len(items) >= 2:  # only siblings are worth reporting
            skipped.extend(items)
    graph.lint()
    stage.recompile()
    return Projections(fused=tuple(fused), skipped=tuple(skipped))


def match_projection(node: fx.Node) -> _Member | None:
    """``node`` as a projection whose weight (and bias) the stage holds, or ``None``."""
    if node.op != "call_function":
        return None
    bias = transpose = None
    if node.target is _fp8_linear():
        x, w, scale, bias, bn, bk = node.args
        if not isinstance(x, fx.Node) or not _is_attr(w) or not _is_attr(scale) or (bias is not None and not _is_attr(bias)):
            return None
        return _Member(node, x, w, bias, None, 0, scale, (bn, bk))
    if node.target is aten.linear.default:
        x, w, *rest = node.args
        bias = rest[0] if rest else node.kwargs.get("bias")
        out_dim = 0
    elif node.target is aten.mm.default and not node.kwargs:
        x, w = node.args
    elif node.target is aten.addmm.default and not node.kwargs and len(node.args) == 3:
        bias, x, w = node.args  # beta = alpha = 1
    else:
        return None
    if node.target is not aten.linear.default:
        if isinstance(w, fx.Node) and w.op == "call_function" and w.target is aten.t.default:
            transpose, w, out_dim = w, w.args[0], 0
        else:
            out_dim = 1
    if not isinstance(x, fx.Node) or not _is_attr(w) or (bias is not None and not _is_attr(bias)):
        return None
    return _Member(node, x, w, bias, transpose, out_dim)


def _fp8_linear():
    import ppsplit.triton_kernels.fp8  # noqa: F401  (registers torch.ops.ppsplit.fp8_linear)

    return torch.ops.ppsplit.fp8_linear.default


def plain_float(t) -> bool:
    """Whether ``t`` is a plain float tensor or parameter (not quantised, not a tensor subclass)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype in _FLOATS


def _is_attr(n) -> bool:
    return isinstance(n, fx.Node) and n.op == "get_attr"


def _owner(stage: fx.GraphModule, name: str) -> tuple[torch.nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (stage.get_submodule(path) if path else stage), leaf


def _shared_names(stage: fx.GraphModule) -> set[str]:
    """Names of tensors that the stage holds under more than one name, or whose bytes overlap another's (views of
    disjoint parts of one storage, as an earlier fusing leaves the source model's tensors, are not shared)."""
    by_id: dict = {}
    by_storage: dict = {}
    for name, t in [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]:
        by_id.setdefault(id(t), []).append(name)
        if t.device.type != "meta" and t.untyped_storage().data_ptr():
            span = (t.storage_offset(), t.storage_offset() + _extent(t))
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((span, name))
    shared = {name for names in by_id.values() if len(names) > 1 for name in names}
    for spans in by_storage.values():
        spans.sort()
        reach, reacher = -1, None  # the furthest end so far, and whose
        for (start, end), name in spans:
            if start < reach:
                shared |= {name, reacher}
            if end > reach:
                reach, reacher = end, name
    return shared


def _extent(t: torch.Tensor) -> int:
    """How many elements from ``t``'s storage offset its view spans (1 past its last element)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0


def _why_not(stage: fx.GraphModule, m: _Member, shared: set, attr_nodes: dict) -> str | None:
    for attr, what in ((m.weight, "weight"), (m.bias, "bias")):
        if attr is None:
            continue
        t = get_tensor(stage, attr.target)
        if attr.target in shared:
            return f"its {what} is tied or shared with another tensor"
        if attr_nodes[attr.target] > 1 or len(attr.users) > 1:
            return f"its {what} is read elsewhere in the stage"
        fp8 = m.scale is not None and what == "weight" and type(t) in (torch.Tensor, torch.nn.Parameter)
        if not plain_float(t) and not fp8:
            return f"its {what} is {type(t).__name__} of {t.dtype} (quantised or a tensor subclass)"
        if fp8 and t.dim() == 2 and t.shape[0] % m.block[0]:
            return f"its {t.shape[0]} FP8 rows end in a partial block of {m.block[0]} (the scales would not line up)"
        if fp8 and (attr_nodes[m.scale.target] > 1 or len(m.scale.users) > 1 or m.scale.target in shared):
            return "its scale is read elsewhere in the stage"
        if t.dim() != (2 if what == "weight" else 1):
            return f"its {what} has shape {tuple(t.shape)}"
    width = get_tensor(stage, m.weight.target).shape[m.out_dim]
    if width < MIN_WIDTH:
        return f"its {width} outputs are too few to gain from fusing (fewer than {MIN_WIDTH})"
    if m.transpose is not None and len(m.transpose.users) > 1:
        return "its transposed weight is read elsewhere in the stage"
    return None


def _fuse(stage: fx.GraphModule, members: list[_Member]) -> FusedProjection:
    graph = stage.graph
    first = members[0].node
    out_dim = members[0].out_dim
    weights = [get_tensor(stage, m.weight.target) for m in members]
    sizes = tuple(int(w.shape[out_dim]) for w in weights)
    weight_name = _fused_name(stage, [m.weight.target for m in members])
    with torch.no_grad():
        _register(stage, weight_name, _stack(weights, out_dim), like=members[0].weight.target)
        if members[0].scale is not None:  # one scale row per block of rows: the grids stack like the weights
            scale_name = weight_name + "_scale"
            k = weights[0].shape[1]
            grids = [(get_tensor(stage, m.scale.target), (w.shape[0] // m.block[0], -(-k // m.block[1])))
                     for m, w in zip(members, weights)]
            _register(stage, scale_name, _stack([s for s, _ in grids], 0, [g for _, g in grids]),
                      like=members[0].scale.target)
        if members[0].bias is not None:
            bias_name = weight_name.rpartition(".")[0] + ".bias"
            _register(stage, bias_name, _stack([get_tensor(stage, m.bias.target) for m in members], 0),
                      like=members[0].bias.target)
    with graph.inserting_before(first):
        w = graph.get_attr(weight_name)
        b = graph.get_attr(bias_name) if members[0].bias is not None else None
        if members[0].scale is not None:
            args = (members[0].x, w, graph.get_attr(scale_name), b, *members[0].block)
        elif first.target is aten.linear.default:
            args = (members[0].x, w) if b is None else (members[0].x, w, b)
        else:
            wt = graph.call_function(aten.t.default, (w,)) if members[0].transpose is not None else w
            args = (members[0].x, wt) if b is None else (b, members[0].x, wt)
        out = graph.call_function(first.target, args)
        _copy_meta(out, first)
        start = 0
        for m, size in zip(members, sizes):
            piece = graph.call_function(aten.slice.Tensor, (out, -1, start, start + size))
            _copy_meta(piece, m.node)
            start += size
            for user in list(m.node.users):
                if user.op == "call_function" and user.target in _VIEWS:
                    user.target = aten.reshape.default  # a slice of the last dim may not be viewable as every shape
            m.node.replace_all_uses_with(piece)
    for m in members:
        graph.erase_node(m.node)
        for n in (m.transpose, m.weight, m.bias, m.scale):
            if n is not None and not n.users:
                graph.erase_node(n)
        for attr in (m.weight, m.bias, m.scale):
            if attr is not None:
                _drop(stage, attr.target)
    return FusedProjection(weight=weight_name, members=tuple(m.weight.target for m in members), sizes=sizes)


def _stack(parts: list[torch.Tensor], dim: int, shapes: list[tuple[int, ...]] | None = None) -> torch.Tensor:
    """``parts`` (each seen as its ``shapes`` entry) concatenated along ``dim``; each part then becomes a view of its
    slice of the result. The parts are the stage's former tensors, which ``split_model``'s source model still
    holds: as views they cost no memory, so fusing does not grow what the process holds."""
    shapes = shapes or [tuple(p.shape) for p in parts]
    whole = torch.cat([p.reshape(shape) for p, shape in zip(parts, shapes)], dim=dim)
    start = 0
    for part, shape in zip(parts, shapes):
        part.data = whole.narrow(dim, start, shape[dim]).view(part.shape)
        start += shape[dim]
    return whole


def _fused_name(stage: fx.GraphModule, names: list[str]) -> str:
    """``a.b.q_proj.weight, a.b.k_proj.weight`` -> ``a.b.fused_q_proj_k_proj.weight`` (unique in the stage)."""
    parts = [n.split(".") for n in names]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    leaf = parts[0][-1] if len({p[-1] for p in parts}) == 1 else "weight"
    tails = ["_".join(p[common:-1] if p[-1] == leaf else p[common:]) for p in parts]
    base = ".".join(parts[0][:common] + ["fused_" + "_".join(tails)])
    name, i = f"{base}.{leaf}", 1
    while _exists(stage, name):
        name, i = f"{base}_{i}.{leaf}", i + 1
    return name


def _exists(stage: fx.GraphModule, name: str) -> bool:
    try:
        get_tensor(stage, name)
        return True
    except AttributeError:
        return False


def _register(stage: fx.GraphModule, name: str, tensor: torch.Tensor, like: str) -> None:
    mod, leaf = _owner(stage, like)
    if leaf in mod._parameters:
        set_tensor(stage, name, tensor, parameter=True, persistent=True)
    else:
        set_tensor(stage, name, tensor, parameter=False, persistent=leaf not in mod._non_persistent_buffers_set)


def _drop(stage: fx.GraphModule, name: str) -> None:
    """Remove ``name`` from the stage, and the submodules it leaves empty (the model keeps its own tensors)."""
    path = name.split(".")
    mod, leaf = _owner(stage, name)
    delattr(mod, leaf)
    mod._non_persistent_buffers_set.discard(leaf)
    for depth in range(len(path) - 1, 0, -1):
        parent = stage.get_submodule(".".join(path[:depth - 1])) if depth > 1 else stage
        child = getattr(parent, path[depth - 1])
        if child._parameters or child._buffers or child._modules:
            break
        delattr(parent, path[depth - 1])


def _copy_meta(new: fx.Node, like: fx.Node) -> None:
    for key in ("ppsplit.layer", "ppsplit.stage", "nn_module_stack"):
        if key in like.meta:
            new.meta[key] = like.meta[key]
