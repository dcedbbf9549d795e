"""Plan helper: count each region's matmul flops from the traced graph's shapes, for a ``CostModel`` workload.

The ATen nodes carry ``meta["val"]`` fake tensors whose batch and token sizes are symbols, so one walk over the
graph gives every matmul's flops as an expression in the batch ``B``, the tokens per step ``T`` and the keys each
query attends to ``K``; a workload then only substitutes numbers. Counted (2 flops per multiply-add):

- products with a weight (``linear``, ``mm``, ``addmm``, ``grouped_mm`` of MoE experts, ``convolution``):
  ``2 * numel(out) * reduced``; an MoE layer's grouped matmul has ``top_k * B * T`` rows, so only the experts a
  token is routed to count;
- attention (``scaled_dot_product_attention``, or a matmul of two token-dependent values): the key length, the
  token count or a static cache's ``max_len`` in the graph, is replaced by ``K``, the keys a query really sees:
  ``context + (T + 1) / 2`` on average under a causal mask (``(P + 1) / 2`` for a prefill of ``P`` tokens).

Not counted: element-wise ops, norms, softmax, the embedding lookup (a gather), windows of sliding-window
attention. Matmuls that depend on no token (rotary tables from positions) run on every stage: they are the
per-stage cost. The ``flops`` balance policy and the ``time`` policy's workload are both ``CostModel``s.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import sympy
import torch
from torch import fx

from ppsplit.core.options import CostModel
from ppsplit.passes.annotate import Annotated
from ppsplit.core.plan import RegionCosts

log = logging.getLogger("ppsplit")

B, T, K = sympy.symbols("B T K", positive=True)

aten = torch.ops.aten
_WEIGHT_LAST = {aten.linear.default, aten.mm.default, aten.addmm.default}  # reduce over the input's last dim
_PRODUCTS = {aten.bmm.default, aten.matmul.default, aten.baddbmm.default}
_SDPA = {aten.scaled_dot_product_attention.default}
for _name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
    if hasattr(aten, _name):
        _SDPA.add(getattr(aten, _name).default)


@dataclass(frozen=True)
class FlopCounts:
    """Flops of the embedding, each decoder layer, the head, and the per-stage work, as sympy expressions in
    ``B`` (batch), ``T`` (tokens per step) and ``K`` (keys per query). ``uncounted`` names matmuls whose sizes
    depend on token values (left out)."""

    embed: sympy.Expr
    layers: tuple[sympy.Expr, ...]
    head: sympy.Expr
    stage: sympy.Expr
    uncounted: tuple[str, ...] = ()
    attention: tuple[sympy.Expr, ...] = ()  # per layer, the part of ``layers`` in its attention half (halves.py)

    def step(self, batch: int, tokens: int, context: int, halves: bool = False) -> RegionCosts:
        """Flops of one step of ``tokens`` new tokens for ``batch`` sequences holding ``context`` tokens; with
        ``halves``, also each layer's attention half."""
        values = {B: batch, T: tokens, K: context + sympy.Rational(tokens + 1, 2)}

        def ev(e) -> float:
            return float(e.subs(values)) if isinstance(e, sympy.Expr) else float(e)

        return RegionCosts(layers=tuple(ev(e) for e in self.layers), embed=ev(self.embed), head=ev(self.head),
                           stage=ev(self.stage), unit="FLOP",
                           attention=tuple(ev(e) for e in self.attention) if halves else ())

    def workload(self, model: CostModel, halves: bool = False) -> RegionCosts:
        """The ``CostModel``'s weighted sum of a decode step and a prefill step, per region."""
        parts = []
        if model.decode_weight:
            parts.append((model.decode_weight, self.step(model.batch, model.tokens, model.context, halves)))
        if model.prefill_weight:
            parts.append((model.prefill_weight, self.step(model.batch, model.prefill, 0, halves)))
        return weighted(parts)


def weighted(parts: list[tuple[float, RegionCosts]]) -> RegionCosts:
    """``sum(w * costs)`` region by region."""
    first = parts[0][1]
    return RegionCosts(layers=tuple(sum(w * c.layers[i] for w, c in parts) for i in range(len(first.layers))),
                       embed=sum(w * c.embed for w, c in parts), head=sum(w * c.head for w, c in parts),
                       stage=sum(w * c.stage for w, c in parts), unit=first.unit,
                       attention=tuple(sum(w * c.attention[i] for w, c in parts) for i in range(len(first.attention))))


def count_flops(annotated: Annotated) -> FlopCounts:
    """Walk the annotated graph once and sum each matmul's flops into its region.

    Example::

        counts = count_flops(ppsplit.trace_model(model))
        counts.step(batch=1, tokens=1, context=1024).layers[0]   # flops of layer 0 in one decode step
    """
    info = annotated.traced
    num_layers = annotated.layers.num_layers
    max_len = info.stand_in.max_len if info.stand_in is not None else None
    # A paged trace is one row of tokens: a step of B sequences of T tokens is B * T of them.
    names = {info.batch_symbol: B, info.tokens_symbol: T} if info.stand_in is None else {info.tokens_symbol: B * T}
    embed, head, stage = sympy.Integer(0), sympy.Integer(0), sympy.Integer(0)
    layers = [sympy.Integer(0)] * num_layers
    attention = [sympy.Integer(0)] * num_layers
    uncounted = []

    def dim(d) -> sympy.Expr:
        if isinstance(d, torch.SymInt):
            e = sympy.sympify(d.node.expr)
            return e.subs({s: names[s.name] for s in e.free_symbols if s.name in names})
        return sympy.Integer(int(d))

    def shape(node) -> list[sympy.Expr] | None:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        return [dim(d) for d in val.shape] if isinstance(val, torch.Tensor) else None

    def is_keys(e: sympy.Expr) -> bool:
        return T in e.free_symbols or (max_len is not None and e == max_len)

    for node in annotated.gm.graph.nodes:
        if node.op != "call_function":
            continue
        flops = _flops(node, shape, is_keys)
        if flops is None:
            continue
        if flops.free_symbols - {B, T, K}:
            uncounted.append(node.name)
            continue
        if not node.meta.get("ppsplit.token"):
            stage += flops
            continue
        region = node.meta["ppsplit.region"]
        if region == 0:
            embed += flops
        elif region >= 2 * num_layers:
            head += flops
        else:
            layers[(region - 1) // 2] += flops  # a between-layer region counts with the layer before
            if node.meta.get("ppsplit.half") == 0:
                attention[(region - 1) // 2] += flops
    if uncounted:
        log.warning("flops: %d matmuls have sizes that depend on token values and are not counted (%s)",
                    len(uncounted), ", ".join(uncounted[:5]))
    return FlopCounts(embed=embed, layers=tuple(layers), head=head, stage=stage, uncounted=tuple(uncounted),
                      attention=tuple(attention))


def flops_costs(annotated: Annotated, model: CostModel, halves: bool = False) -> RegionCosts:
    """Each region's flops under the workload ``model`` (what the ``flops`` balance policy minimises); with
    ``halves``, also each layer's attention half."""
    return count_flops(annotated).workload(model, halves)


def _flops(node: fx.Node, shape, is_keys) -> sympy.Expr | None:
    target = node.target
    args = node.args
    out = shape(node)
    if target in _SDPA:
        q, k, v = (shape(a) for a in args[:3])
        if q is None or k is None or v is None:
            return None
        return 2 * sympy.Mul(*q[:-1]) * K * (q[-1] + v[-1])
    if out is None:
        return None
    if target in _WEIGHT_LAST or "grouped_mm" in str(target):
        a = shape(args[1] if target is aten.addmm.default else args[0])
        return 2 * sympy.Mul(*out) * a[-1] if a else None
    if target is aten.convolution.default:
        w = shape(args[1])
        return 2 * sympy.Mul(*out) * sympy.Mul(*w[1:]) if w else None
    if target in _PRODUCTS:
        a, b = (args[1], args[2]) if target is aten.baddbmm.default else (args[0], args[1])
        sa, sb = shape(a), shape(b)
        if sa is None or sb is None or len(sa) < 2 or len(sb) < 2:
            return None
        reduced, cols = sa[-1], out[-1]
        if all(x.meta.get("ppsplit.token") for x in (a, b)):
            # Attention: scores (q @ k^T, keys in the columns) or output (p @ v, keys reduced).
            if is_keys(reduced):
                reduced = K
            elif is_keys(cols):
                cols = K
        return 2 * sympy.Mul(*out[:-1]) * cols * reduced
    return None
