"""Passes helper: running part of a traced graph on concrete CPU tensors, which is how the attention and fuse
passes prove a rewrite equal before they make it, and the one set of view ops the passes look through.

``SubgraphEvaluator`` is a ``torch.fx.Interpreter`` over the whole graph that runs only the nodes it is given, from
the values it is given: device arguments become the CPU; with ``upcast``, bfloat16/float16 tensors (weights read
by ``get_attr``) and dtype arguments become float32; a size read off a tensor (``aten.sym_size``) is computed from
its symbol's value in ``sizes``, not from the (symbolic) tensor.
"""
from __future__ import annotations

import sympy
import torch
from torch import fx
from torch.fx.node import map_aggregate

from ppsplit.core.fx_utils import get_tensor

aten = torch.ops.aten
# Ops that return their input's values under another shape (the passes look through them).
VIEW_OPS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default})
# ... and those that copy without changing a value (the attention pass looks through these too).
COPY_OPS = frozenset({aten.contiguous.default, aten.clone.default})
# Ops whose result depends only on the shape of their tensor argument, never its values.
SHAPE_OPS = frozenset({aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int})
_LOW = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def upcast(dtype: torch.dtype) -> torch.dtype:
    """The dtype an evaluation with ``upcast`` computes in: float32 for bfloat16 and float16."""
    return _LOW.get(dtype, dtype)


class EvaluationError(Exception):
    """The nodes read something an evaluation cannot supply (a meta tensor, a size of another symbol)."""


class SubgraphEvaluator(fx.Interpreter):
    """Evaluate chosen nodes of ``gm``'s graph (see the module docstring).

    Example::

        values = SubgraphEvaluator(gm, upcast=True).run_nodes(region, {q_node: q, k_node: k, v_node: v})
    """

    def __init__(self, gm: fx.GraphModule, *, upcast: bool = False, sizes: dict | None = None):
        super().__init__(gm, garbage_collect_values=False)
        self.upcast, self.sizes = upcast, sizes or {}

    def run_nodes(self, nodes, env: dict) -> dict:
        """The values of ``nodes`` (in the order given), from ``env`` (node -> value) for everything else."""
        self.env = dict(env)
        for n in nodes:
            self.env[n] = self._size(n) if n.op == "call_function" and n.target in SHAPE_OPS else self.run_node(n)
        return self.env

    def get_attr(self, target, args, kwargs):
        t = get_tensor(self.module, target)
        if t.device.type == "meta":
            raise EvaluationError(f"it reads {target}, which has no value on the meta device")
        return t.detach().to("cpu", self._dtype(t.dtype))

    def call_function(self, target, args, kwargs):
        return target(*map_aggregate(args, self._arg), **map_aggregate(kwargs, self._arg))

    def _arg(self, a):
        if isinstance(a, torch.device):
            return torch.device("cpu")
        if isinstance(a, torch.dtype):
            return self._dtype(a)
        return a

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        return upcast(dtype) if self.upcast else dtype

    def _size(self, node: fx.Node) -> int:
        val = node.meta.get("val")
        expr = val.node.expr if isinstance(val, torch.SymInt) else val
        if isinstance(expr, int):
            return expr
        subs = {s: self.sizes[str(s)] for s in expr.free_symbols if str(s) in self.sizes}
        if len(subs) != len(expr.free_symbols):
            raise EvaluationError(f"size {node.name} = {expr} depends on more than batch and token count")
        return int(expr.subs(subs)) if not isinstance(expr, sympy.Integer) else int(expr)
