"""Stage pass (compile, after emit): linears and MoE experts on FP8 weights run ppsplit's FP8 ops on the weight
and scale as the checkpoint stores them.

Input: a stage ``GraphModule`` (meta tensors) and ``{weight name: QuantizedWeight}``. A weight whose every reader is
one the pass rewrites becomes an FP8 parameter, its scale a new parameter beside it:

- a 2-D weight read by projections (``aten.linear``, or ``mm`` / ``addmm`` over its transpose:
  ``match_projection``): each becomes ``fp8_linear(x, weight, scale, bias, block_n, block_k)``; an MLA attention
  reading it (``kv_b_proj``) takes the FP8 weight with its scale and block where its blocks hold whole heads' parts
  (``latent_fp8_views``);
- a stack of experts ``[E, N, K]`` read through its transpose by ``_grouped_mm(x, w.T, offs)`` (transformers'
  ``grouped_mm`` experts, what a bfloat16 trace runs): ``fp8_grouped_mm(x, weight, scale, offs, block_n,
  block_k)``; or indexed by the routed expert ids, ``w[ids]`` (its ``batched_mm`` experts, what a float32 or
  float16 trace runs): ``fp8_expert_weights(weight, scale, ids, block_n, block_k, dtype)``.

A weight read by anything else (a tied embedding) is left in the model dtype and reported: the compile dequantises
it.

``quantize_mxfp4_experts`` does the same for MXFP4 experts (gpt-oss), whose stage parameter ``[E, K, N]`` (the
transformers layout, each expert transposed) is replaced by the stored ``<name>_blocks`` and ``<name>_scales``:
``_grouped_mm(x, w, offs)`` becomes ``mxfp4_grouped_mm(x, blocks, scales, offs)`` and ``w[ids]``
``mxfp4_expert_weights(blocks, scales, ids, dtype)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

import ppsplit.triton_kernels.fp8  # noqa: F401  (registers torch.ops.ppsplit.fp8_linear and the expert ops)
import ppsplit.triton_kernels.mxfp4  # noqa: F401  (registers torch.ops.ppsplit.mxfp4_*)
from ppsplit.core.fx_utils import get_tensor, set_tensor, static_shape
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
    """Rewrite ``stage``'s readers of the weights in ``weights`` in place (see the module docstring). Returns what
    it did.

    Example::

        scale = QuantizedWeight("model.layers.0.mlp.up_proj.weight_scale_inv", (3, 2), torch.float32, (128, 128))
        quantize_linears(stage, {"model.layers.0.mlp.up_proj.weight": scale})
    """
    graph = stage.graph
    found, left = _rewritable(graph, weights, lambda node: _rewrites(node, get_tensor(stage, node.target).dim(),
                                                                     weights[node.target]))
    for node, q, rewrites in found:
        w = get_tensor(stage, node.target)
        set_tensor(stage, node.target, torch.empty(w.shape, dtype=FP8_DTYPE, device="meta"), parameter=True,
                   persistent=True)
        set_tensor(stage, q.scale, torch.empty(q.scale_shape, dtype=q.scale_dtype, device="meta"), parameter=True,
                   persistent=True)
        with graph.inserting_after(node):
            scale = graph.get_attr(q.scale)
        for old, op, args, _ in rewrites:
            _replace(old, op, _filled(args, node, scale, q.block))
        for dead in dict.fromkeys(d for *_, d in rewrites if d is not None):  # a transpose several products read
            if not dead.users:
                graph.erase_node(dead)
    graph.lint()
    stage.recompile()
    return Quantized(tuple(node.target for node, _, _ in found), tuple(left))


def _rewritable(graph: fx.Graph, table: dict, find) -> tuple[list, list]:
    """``([(get_attr node, its entry in table, its rewrites)], [names left])`` over the tensors of ``table``: left
    where ``find`` (the rewrites of every reader) gives None."""
    found, left = [], []
    for node in list(graph.find_nodes(op="get_attr")):
        entry = table.get(node.target)
        if entry is None:
            continue
        rewrites = find(node)
        if rewrites is None:
            left.append(node.target)
        else:
            found.append((node, entry, rewrites))
    return found, left


def runs_fp8(node: fx.Node, dims: int) -> bool:
    """Whether ``quantize_linears`` runs the weight ``node`` reads (``dims`` dimensions) on FP8: every reader is
    one it rewrites. (The compile's plan asks, to count the weight as stored or as dequantised; its trace has no
    MLA attention yet, whose weight blocks are then not checked.)"""
    return _rewrites(node, dims) is not None


@dataclass(frozen=True)
class Mxfp4Experts:
    blocks: str                # the stored blocks' tensor name in the stage, [E, N, K/32, 16] uint8
    blocks_shape: tuple[int, ...]
    scales: str                # ... and the scales', [E, N, K/32] uint8


def quantize_mxfp4_experts(stage: fx.GraphModule, experts: dict[str, Mxfp4Experts]) -> Quantized:
    """Replace each MXFP4 expert stack of ``experts`` (``{parameter name: Mxfp4Experts}``) whose every reader the
    pass rewrites by its stored blocks and scales (see the module docstring), in place. Returns what it did."""
    graph = stage.graph
    found, left = _rewritable(graph, experts, _mxfp4_readers)
    for node, q, rewrites in found:
        for name, shape in ((q.blocks, q.blocks_shape), (q.scales, q.blocks_shape[:-1])):
            set_tensor(stage, name, torch.empty(shape, dtype=torch.uint8, device="meta"), parameter=True,
                       persistent=True)
        with graph.inserting_after(node):
            blocks = graph.get_attr(q.blocks)
        with graph.inserting_after(blocks):
            scales = graph.get_attr(q.scales)
        for old, op, args in rewrites:
            _replace(old, op, _filled(args, blocks, scales, ()))
        graph.erase_node(node)
        path, _, leaf = node.target.rpartition(".")
        delattr(stage.get_submodule(path), leaf)  # the dequantised stack is no tensor of the stage any more
    graph.lint()
    stage.recompile()
    return Quantized(tuple(node.target for node, _, _ in found), tuple(left))


def runs_mxfp4(node: fx.Node) -> bool:
    """Whether ``quantize_mxfp4_experts`` keeps the MXFP4 experts ``node`` reads as stored (the plan asks)."""
    return _mxfp4_readers(node) is not None


def _mxfp4_readers(node: fx.Node) -> list | None:
    """``[(node to replace, op, args)]`` for an ``[E, K, N]`` stack read only by grouped products over it or by
    indexing with the routed ids, else None."""
    rewrites = []
    for user in node.users:
        ids = _routed_ids(user, node)
        if ids is not None:
            rewrites.append((user, torch.ops.ppsplit.mxfp4_expert_weights.default,
                             (_WEIGHT, _SCALE, ids, user.meta["val"].dtype)))
            continue
        mm = _grouped_mm(user, node)
        if mm is None:
            return None
        rewrites.append((user, torch.ops.ppsplit.mxfp4_grouped_mm.default, (mm["x"], _WEIGHT, _SCALE, mm["offs"])))
    return rewrites or None


def _routed_ids(user: fx.Node, stack: fx.Node) -> fx.Node | None:
    """``ids`` where ``user`` is ``stack[ids]`` (the experts of each routed pair), else None."""
    if user.target == torch.ops.aten.index.Tensor and user.args[0] is stack and len(user.args[1]) == 1 \
            and isinstance(user.args[1][0], fx.Node):
        return user.args[1][0]
    return None


def _grouped_mm(user: fx.Node, weight: fx.Node) -> dict | None:
    """The arguments of ``user`` where it is ``torch._grouped_mm(x, weight, offs)`` with no bias or output dtype,
    else None."""
    args = dict(zip(("x", "w", "offs", "bias", "out_dtype"), user.args)) | user.kwargs
    if user.target != torch.ops.aten._grouped_mm.default or args.get("w") is not weight \
            or not isinstance(args.get("offs"), fx.Node) or args.get("bias") is not None \
            or args.get("out_dtype") is not None:
        return None
    return args


def _rewrites(node: fx.Node, dims: int, entry: QuantizedWeight | None = None) -> list | None:
    return _expert_readers(node) if dims == 3 else _linear_readers(node, entry) if dims == 2 else None


# Placeholders in a rewrite's arguments: the stored weight, its scale, and its block sizes (block_n, block_k)
_WEIGHT, _SCALE, _BLOCK = object(), object(), object()


def _filled(args: tuple, weight: fx.Node, scale: fx.Node, block: tuple) -> tuple:
    filled = []
    for a in args:
        filled.extend(block if a is _BLOCK else (weight if a is _WEIGHT else scale if a is _SCALE else a,))
    return tuple(filled)


def _replace(old: fx.Node, op, args: tuple) -> None:
    """``old`` replaced by a call of ``op`` that computes the same value (its metadata kept)."""
    with old.graph.inserting_before(old):
        new = old.graph.call_function(op, args)
    new.meta.update({k: v for k, v in old.meta.items() if k in ("val", "tensor_meta", "nn_module_stack",
                                                                "ppsplit.layer")})
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


def _linear_readers(node: fx.Node, entry: QuantizedWeight | None) -> list | None:
    """``[(node to replace, op, args, node left dead)]`` for a 2-D weight read only by projections and MLA
    attentions whose FP8 path reads it (``_latent_reader``), else None."""
    rewrites = []
    for user in node.users:
        m = match_projection(user)
        if m is not None and m.weight is node and m.out_dim == 0:
            rewrites.append((m.node, torch.ops.ppsplit.fp8_linear.default, (m.x, _WEIGHT, _SCALE, m.bias, _BLOCK),
                             m.transpose))
            continue
        latent = _latent_reader(user, node, entry)
        if latent is None:
            return None
        rewrites.append(latent)
    return rewrites or None


def _latent_reader(user: fx.Node, weight: fx.Node, entry: QuantizedWeight | None):
    """The rewrite of an MLA attention reading ``weight`` (its ``kv_b_proj``) into the same op over the FP8 weight,
    its scales and block (``entry``), where its blocks hold whole heads' parts (``latent_fp8_views``), else None."""
    from ppsplit.triton_kernels.paged import latent_fp8_views

    ops = torch.ops.ppsplit
    if user.target not in (ops.latent_attention.default, ops.paged_latent_attention.default) or entry is None:
        return None
    args = list(user.args)
    shape, q_shape = static_shape(weight), static_shape(args[0])
    if args[3] is not weight or weight in args[4:] or len(args) != len(user.target._schema.arguments) - 3 \
            or shape is None or None in shape or q_shape is None or q_shape[1] is None:
        return None
    meta = torch.empty(shape, dtype=FP8_DTYPE, device="meta")
    scale = torch.empty(entry.scale_shape, device="meta")
    if latent_fp8_views(meta, scale, *entry.block, q_shape[1], args[4]) is None:
        return None
    return user, user.target, (*args[:3], _WEIGHT, *args[4:], _SCALE, _BLOCK), None


def _expert_readers(node: fx.Node) -> list | None:
    """The rewrites of an ``[E, N, K]`` expert stack read only by grouped products over its transpose or by
    indexing with the routed ids (see the module docstring), else None."""
    rewrites = []
    for user in node.users:
        ids = _routed_ids(user, node)
        if ids is not None:
            rewrites.append((user, torch.ops.ppsplit.fp8_expert_weights.default,
                             (_WEIGHT, _SCALE, ids, _BLOCK, user.meta["val"].dtype), None))
            continue
        if user.target != torch.ops.aten.transpose.int or user.args[0] is not node \
                or sorted(d % 3 for d in user.args[1:]) != [1, 2] or not user.users:
            return None
        for product in user.users:
            mm = _grouped_mm(product, user)
            if mm is None:
                return None
            rewrites.append((product, torch.ops.ppsplit.fp8_grouped_mm.default,
                             (mm["x"], _WEIGHT, _SCALE, mm["offs"], _BLOCK), user))
    return rewrites or None

