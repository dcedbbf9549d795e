"""The placement of every value of a stage graph under tensor parallelism, op by op (``Propagation``).

Values derived only from the stage's weights (a weight, its transpose, ``-exp(A_log)``) are *lazy*: their
placement is decided by the first op that reads them, which asks for them whole (``_whole``) or cut a given way
(``_demand``, which walks back to the weights and records their ``Shard``). A projection reading a replicated
input over a weight that may be cut is column-parallel (its output split along its last dim: the weight is an
*origin* of that split); one reading an input split along its contracted dim is row-parallel (its output
``PARTIAL``). A partial value passes through ops linear in it (sums, views, scaling by a replicated value) and is
all-reduced where something else reads it. An op without a rule that reads a sharded value is unplaceable.

A node that cannot be placed is recorded (``failures``) with its inputs' origins and what would help
(``placements.Fix``); the values that depend on it are left out of the rest of the run (``_POISON``), so one run
finds every independent failure. ``ppsplit.passes.tp`` applies the fixes and runs again.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch import fx

import ppsplit.triton_kernels  # noqa: F401  (registers torch.ops.ppsplit.*)
from ppsplit.core.fx_utils import is_cache_buffer
from ppsplit.core.shards import Shard
from ppsplit.passes.sharding.placements import (PARTIAL, REPLICATED, Fix, Split, Unplaceable, prod, refine,
                                                split_pieces, view_split)

aten = torch.ops.aten
ops = torch.ops.ppsplit
_LAZY = object()
_POISON = object()

# Pointwise ops of one tensor; those linear in it keep a partial value partial.
_UNARY = {aten.silu.default, aten.gelu.default, aten.neg.default, aten.exp.default, aten.rsqrt.default,
          aten.sigmoid.default, aten.tanh.default, aten.softplus.default, aten.relu.default, aten.square.default,
          aten.abs.default, aten.sqrt.default, aten.log.default, aten.cos.default, aten.sin.default,
          aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.to.dtype, aten._to_copy.default,
          aten.to.dtype_layout, aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
          aten.pow.Tensor_Scalar, aten.erf.default, aten.reciprocal.default, aten.sign.default, aten.log1p.default,
          aten.bitwise_not.default, aten.logical_not.default, aten.nan_to_num.default, aten.expm1.default,
          aten.lift_fresh_copy.default, aten.gelu_.default if hasattr(aten, "gelu_") else aten.gelu.default,
          aten.silu_.default, aten.mul.Scalar, aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar}
_LINEAR_UNARY = {aten.neg.default, aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.clone.default,
                 aten.contiguous.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
                 aten.mul.Scalar, aten.div.Scalar}
# Pointwise ops of several tensors (broadcast); partial rules in ``_binary``.
_NARY = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.where.self, aten.maximum.default,
         aten.minimum.default, aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor,
         aten.ge.Tensor, aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar,
         aten.ge.Scalar, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.logical_and.default,
         aten.logical_or.default, aten.pow.Tensor_Tensor, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
         aten.div.Tensor_mode, aten.copysign.Tensor, aten.atan2.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# Reductions over ``dims`` (args[1]); ``sum`` of a split dim gives a partial value.
_REDUCE = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "max", aten.amin.default: "max",
           aten.softmax.int: "norm", aten._softmax.default: "norm", aten.log_softmax.int: "norm",
           aten._log_softmax.default: "norm", aten.cumsum.default: "scan", aten.argmax.default: "max",
           aten.topk.default: "topk", aten.sort.default: "sort", aten.max.dim: "max", aten.min.dim: "max",
           aten.var.correction: "norm", aten.any.dim: "max", aten.all.dim: "max",
           aten.linalg_vector_norm.default: "norm", aten.prod.dim_int: "max"}


class Propagation:
    """One run of placement over ``gm`` (see the module docstring). ``shapes``: concrete shapes of every node
    (``evaluate.stage_shapes``); ``choices``: the solver's decisions so far (``tp.Choices``)."""

    def __init__(self, gm: fx.GraphModule, shapes: dict, tp: int, choices):
        self.gm, self.shapes, self.tp, self.choices = gm, shapes, tp, choices
        self.place: dict = {}
        self.origins: dict = {}
        self.shards: dict[str, Shard] = {}  # tensor name -> how it is cut
        self.whole: set[str] = set()  # weights read whole
        self.committed: dict = {}  # lazy node -> the placement its first reader gave it
        self.failures: list = []  # (node, Unplaceable)
        self.reduce_for: dict = defaultdict(set)  # partial node -> readers that need it reduced
        self.rewrites: dict = defaultdict(list)  # node -> [(arg position, index in a list arg or None, new value)]
        self.vocab: dict = {}  # embedding node -> vocabulary size (vocab-parallel)
        self.gather = None  # the output value to all-gather (column-parallel lm_head), or None
        self.column: list = []  # (node, weight) of column-parallel products
        self.row: list = []
        self.pools: dict = {}  # cache buffer -> placement (from the writes)
        self.shard_origins: dict = {}  # tensor name -> the origins its cut follows
        self.pool_origins: dict = {}  # cache buffer -> the origins of what is written into it
        # node -> (origin weight, offset, scale): element i of its split dim is the origin's output offset + i * scale
        # (a list of them for an op with several outputs); what a finer cut of the origin is worked out from
        self.window: dict = {}
        self.lazy = _lazy_nodes(gm)

    # -- the run -------------------------------------------------------------------------------------------------
    def run(self) -> "Propagation":
        for n in self.gm.graph.nodes:
            if n in self.lazy:
                self.place[n] = _LAZY
                continue
            if any(self.place.get(a) is _POISON or a.op == "get_attr" and self.pools.get(a.target) is _POISON
                   for a in n.all_input_nodes):
                self.place[n] = _POISON
                self._poison_writes(n)
                continue
            try:
                self.place[n] = self._rule(n)
            except Unplaceable as e:
                origins = e.origins or frozenset().union(*(self.origins.get(a, frozenset()) for a in n.all_input_nodes
                                                           if isinstance(self.p(a), Split)))
                self.failures.append((n, Unplaceable(e.reason, e.fix, origins)))
                self.place[n] = _POISON
                self._poison_writes(n)
        for name, p in self.pools.items():  # a cache is cut as what is written into it
            if isinstance(p, Split):
                self.shards[name] = Shard(p.dim, p.parts, p.segments)
        return self

    def _poison_writes(self, n: fx.Node) -> None:
        """A cache an unplaced node writes is unplaced too: its readers wait for the next run."""
        if _mutates(n):
            for a in n.all_input_nodes:
                if a.op == "get_attr" and is_cache_buffer(a.target):
                    self.pools[a.target] = _POISON

    def _rule(self, n: fx.Node):
        if n.op == "placeholder":
            return REPLICATED
        if n.op == "get_attr":  # a cache buffer (weights are lazy)
            return REPLICATED
        if n.op == "output":
            return self._output(n)
        t = n.target
        if t is operator.getitem:
            p = self.p(n.args[0])
            self._inherit(n, n.args[0])
            w = self.window.get(n.args[0])
            if isinstance(w, list):
                self.window[n] = w[n.args[1]]
            return p[n.args[1]] if isinstance(p, list) else p
        rule = _RULES.get(t) or _BY_NAME.get(getattr(getattr(t, "_schema", None), "name", None))
        if rule is None and self.shapes.get(n) is None:  # sizes, devices, Python values
            self._all_whole(n)
            return REPLICATED
        if rule is None and t in _UNARY:
            rule = Propagation._unary
        elif rule is None and t in _NARY:
            rule = Propagation._nary
        elif rule is None and t in _REDUCE:
            rule = Propagation._reduce
        if rule is None:
            return self._default(n)
        return rule(self, n)

    # -- reading inputs --------------------------------------------------------------------------------------------
    def p(self, a):
        if not isinstance(a, fx.Node):
            return REPLICATED
        p = self.place[a]
        if p is _LAZY:
            return self.committed.get(a, _LAZY)
        return p

    def r(self, n: fx.Node, a) -> None:
        """``n`` reads ``a`` whole: reduced if partial, committed whole if lazy; a split ``a`` is unplaceable."""
        if not isinstance(a, fx.Node):
            return
        p = self.p(a)
        if p is _LAZY or p is REPLICATED and a in self.lazy:
            self._whole(a)
        elif p is PARTIAL:
            self.reduce_for[a].add(n)
        elif isinstance(p, Split):
            raise Unplaceable(f"it reads {a.name}, which is split over the TP ranks, and has no rule to read it "
                              "split", origins=self.origins.get(a, frozenset()))

    def _all_whole(self, n: fx.Node) -> None:
        for a in n.all_input_nodes:
            self.r(n, a)

    def _default(self, n: fx.Node):
        self._all_whole(n)
        shape = self.shapes.get(n)
        return [REPLICATED] * len(shape) if isinstance(shape, list) else REPLICATED

    def _inherit(self, n: fx.Node, *sources) -> None:
        self.origins[n] = frozenset().union(*(self.origins.get(s, frozenset()) for s in sources
                                              if isinstance(s, fx.Node)))
        window = next((self.window[s] for s in sources if isinstance(s, fx.Node) and s in self.window
                       and isinstance(self.p(s), Split)), None)
        if window is not None and not isinstance(window, list):
            self.window[n] = window

    def shape(self, a) -> tuple:
        return self.shapes[a]

    # -- lazy (weight-derived) values --------------------------------------------------------------------------------
    def _whole(self, a: fx.Node) -> None:
        have = self.committed.get(a)
        if have is REPLICATED:
            return
        if isinstance(have, Split):
            raise Unplaceable(f"{a.name} is read whole and split", origins=self.origins.get(a, frozenset()))
        self.committed[a] = REPLICATED
        if a.op == "get_attr":
            if a.target in self.shards:
                raise Unplaceable(f"{a.target} is read whole and split", origins=self._weight_origins(a.target))
            self.whole.add(a.target)
            return
        for b in a.all_input_nodes:
            if b in self.lazy:
                self._whole(b)

    def _weight_origins(self, target: str) -> frozenset:
        return self.shard_origins.get(target, frozenset())

    def demand(self, a, sp: Split, origins: frozenset) -> None:
        """The lazy value ``a`` cut by ``sp``: recorded on the weights it comes from."""
        if not isinstance(a, fx.Node):
            return
        have = self.committed.get(a)
        if have == sp:
            return
        if have is not None:
            raise Unplaceable(f"{a.name} is read both {_describe(have)} and {_describe(sp)}", origins=origins)
        shape = self.shape(a)
        if shape[sp.dim] == 1:
            return self._whole(a)
        self.committed[a] = sp
        self.origins[a] = origins
        t = a.target
        if a.op == "get_attr":
            if is_cache_buffer(t) or t in self.whole:
                raise Unplaceable(f"{t} is read whole and split", origins=origins)
            shard = Shard(sp.dim, sp.parts, sp.segments)
            if self.shards.get(t, shard) != shard:
                raise Unplaceable(f"{t} is cut two ways ({self.shards[t].describe()}, {shard.describe()})",
                                  origins=origins)
            self.shards[t] = shard
            self.shard_origins[t] = origins
            return
        if t is aten.transpose.int:
            d0, d1 = (d % len(shape) for d in a.args[1:3])
            back = {d0: d1, d1: d0}.get(sp.dim, sp.dim)
            return self.demand(a.args[0], sp.moved(back), origins)
        if t is aten.permute.default:
            return self.demand(a.args[0], sp.moved(a.args[1][sp.dim] % len(shape)), origins)
        if t is aten.t.default:
            return self.demand(a.args[0], sp.moved(1 - sp.dim), origins)
        if t is aten.unsqueeze.default:
            k = a.args[1] % len(shape)
            return self.demand(a.args[0], sp.moved(sp.dim - (sp.dim > k)), origins)
        if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            ins = self.shape(a.args[0])
            kept = [k for k in range(len(ins)) if not (ins[k] == 1 and (t is aten.squeeze.default
                                                                        or k in _dims_arg(a, len(ins))))]
            return self.demand(a.args[0], sp.moved(kept[sp.dim]), origins)
        if t in _VIEWS:
            back = view_split(shape, self.shape(a.args[0]), sp)
            self._view_rewrite(a, sp)
            return self.demand(a.args[0], back, origins)
        if t in _UNARY:
            return self.demand(a.args[0], sp, origins)
        if t in _NARY:
            for b in a.args:
                if isinstance(b, fx.Node):
                    self._demand_aligned(b, sp, len(shape), origins)
            return
        raise Unplaceable(f"{a.name} ({_name(t)}), computed from weights, cannot be cut", origins=origins)

    def _demand_aligned(self, b: fx.Node, sp: Split, rank: int, origins) -> None:
        bs = self.shape(b)
        d = sp.dim - (rank - len(bs))
        if d < 0 or bs[d] == 1:
            return self._whole(b) if b in self.lazy else self.r(b, b)
        if b not in self.lazy:
            raise Unplaceable(f"{b.name} is replicated but must be cut {_describe(sp)}", origins=origins)
        self.demand(b, sp.moved(d), origins)

    # -- rules ---------------------------------------------------------------------------------------------------
    def _unary(self, n: fx.Node):
        x = n.args[0]
        p = self.p(x)
        self._inherit(n, x)
        for a in n.all_input_nodes[1:]:
            self.r(n, a)
        if p is PARTIAL and n.target in _LINEAR_UNARY:
            return PARTIAL
        if isinstance(p, Split):
            return p
        self.r(n, x)
        return REPLICATED

    def _nary(self, n: fx.Node):
        args = [a for a in list(n.args) + list(n.kwargs.values()) if isinstance(a, fx.Node)]
        places = [self.p(a) for a in args]
        out_rank = len(self.shape(n))
        self._inherit(n, *args)
        if PARTIAL in places:
            return self._partial_binary(n, places)
        splits = {a: p for a, p in zip(args, places) if isinstance(p, Split)}
        if not splits:
            self._all_whole(n)
            return REPLICATED
        # every split input must cut the same output dim the same way
        outs = {p.moved(p.dim + out_rank - len(self.shape(a))) for a, p in splits.items()}
        if len(outs) != 1:
            raise Unplaceable(f"its inputs are split differently ({', '.join(map(_describe, outs))})")
        sp = outs.pop()
        for a, p in zip(args, places):
            if a not in splits:
                self._aligned_input(n, a, sp, out_rank)
        return sp

    def _aligned_input(self, n: fx.Node, a: fx.Node, sp: Split, out_rank: int) -> None:
        """A replicated or lazy input of a pointwise op whose output is split by ``sp``."""
        shape = self.shape(a)
        d = sp.dim - (out_rank - len(shape))
        if d < 0 or shape[d] == 1:
            return self.r(n, a)
        if a in self.lazy:
            return self.demand(a, sp.moved(d), self.origins.get(n, frozenset()))
        raise Unplaceable(f"it combines a split value with {a.name}, replicated along the split dim",
                          origins=self.origins.get(n, frozenset()))

    def _partial_binary(self, n: fx.Node, places: list):
        t = n.target
        args = list(n.args)
        if t in (aten.add.Tensor, aten.sub.Tensor) and all(self.p(a) is PARTIAL for a in args[:2]) \
                and len(args) == 2:
            return PARTIAL
        if t in (aten.mul.Tensor, aten.div.Tensor) and len(args) == 2:
            x, y = args
            partial = [a for a in (x, y) if self.p(a) is PARTIAL]
            other = y if partial[0] is x else x
            if len(partial) == 1 and (t is aten.mul.Tensor or partial[0] is x):
                if isinstance(self.p(other), Split):
                    raise Unplaceable("it multiplies a partial value by a split one")
                self.r(n, other)
                return PARTIAL
        self._all_whole(n)
        if any(isinstance(self.p(a), Split) for a in n.all_input_nodes):
            raise Unplaceable("it reads split and partial values")
        return REPLICATED

    def _reduce(self, n: fx.Node):
        x = n.args[0]
        p = self.p(x)
        rank = len(self.shape(x))
        kind = _REDUCE[n.target]
        dims = _reduced_dims(n, rank)
        keep = _keepdim(n)
        self._inherit(n, x)
        multi = isinstance(self.shapes.get(n), list)
        if p is PARTIAL and kind in ("sum", "mean"):
            return PARTIAL
        if not isinstance(p, Split):
            self.r(n, x)
            return [REPLICATED] * len(self.shapes[n]) if multi else REPLICATED
        if p.dim in dims:
            if kind == "sum" and p.parts == self.tp and len(p.segments) == 1:
                return PARTIAL
            raise Unplaceable(f"it reduces ({kind}) over the split dim {p.dim}",
                              origins=self.origins.get(x, frozenset()))
        out = p if keep else p.moved(p.dim - sum(d < p.dim for d in dims))
        return [out] * len(self.shapes[n]) if multi else out

    def _view(self, n: fx.Node):
        x = n.args[0]
        p = self.p(x)
        self._inherit(n, x)
        if p is PARTIAL:
            return PARTIAL
        if not isinstance(p, Split):
            self.r(n, x)
            return REPLICATED
        out = view_split(self.shape(x), self.shape(n), p)
        self._view_rewrite(n, out)
        w = self.window.pop(n, None)
        if w is not None and out.repeat == 1:
            self.window[n] = (w[0], w[1], w[2] * (p.size // out.size))
        return out

    def _view_rewrite(self, n: fx.Node, out: Split) -> None:
        """The size argument of a reshape with a split output dim ``out.dim``: its global size made local."""
        sizes = n.args[1] if n.target in _VIEWS else None
        if sizes is None:
            return
        entry = sizes[out.dim]
        if isinstance(entry, fx.Node):
            raise Unplaceable(f"its size {out.dim} ({entry.name}) is computed, and the split dim must be a number")
        if entry != -1:
            self.rewrites[n].append((1, out.dim, entry // out.parts))

    def _expand(self, n: fx.Node):
        x = n.args[0]
        p = self.p(x)
        self._inherit(n, x)
        if p is PARTIAL or not isinstance(p, Split):
            if p is not PARTIAL:
                self.r(n, x)
            return p if p is PARTIAL else REPLICATED
        d = p.dim + len(n.args[1]) - len(self.shape(x))
        entry = n.args[1][d]
        if isinstance(entry, int) and entry != -1:
            self.rewrites[n].append((1, d, entry // p.parts))
        return p.moved(d)

    def _move(self, n: fx.Node):
        """Transposes, permutes, unsqueezes, squeezes, selects and slices: the split dim moves or stays."""
        x = n.args[0]
        p = self.p(x)
        self._inherit(n, x)
        if p is PARTIAL:
            return PARTIAL
        if not isinstance(p, Split):
            self.r(n, x)
            return REPLICATED
        rank, t = len(self.shape(x)), n.target
        d = p.dim
        if t is aten.transpose.int:
            d0, d1 = (k % rank for k in n.args[1:3])
            d = {d0: d1, d1: d0}.get(d, d)
        elif t is aten.permute.default:
            d = [k % rank for k in n.args[1]].index(d)
        elif t is aten.t.default:
            d = 1 - d
        elif t is aten.movedim.int:
            order = list(range(rank))
            src, dst = n.args[1] % rank, n.args[2] % rank
            order.insert(dst, order.pop(src))
            d = order.index(d)
        elif t is aten.unsqueeze.default:
            k = n.args[1] % (rank + 1)
            d = d + (k <= d)
        elif t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            ins = self.shape(x)
            gone = [k for k in range(rank) if ins[k] == 1 and (t is aten.squeeze.default or k in _dims_arg(n, rank))]
            d = d - sum(k < d for k in gone)
        elif t is aten.select.int:
            k = n.args[1] % rank
            if k == d:
                raise Unplaceable("it selects along the split dim", origins=self.origins.get(x, frozenset()))
            d = d - (k < d)
        elif t is aten.slice.Tensor:
            k = n.args[1] % rank if len(n.args) > 1 else 0
            if k == d and self.shape(n)[k] != self.shape(x)[k]:
                raise Unplaceable("it slices along the split dim", origins=self.origins.get(x, frozenset()))
        return p.moved(d)

    def _cat(self, n: fx.Node):
        pieces = n.args[0]
        dim = n.args[1] if len(n.args) > 1 else 0
        rank = len(self.shape(n))
        dim %= rank
        places = [self.p(a) for a in pieces]
        self._inherit(n, *pieces)
        if all(p is PARTIAL for p in places):
            return PARTIAL
        splits = [p for p in places if isinstance(p, Split)]
        if not splits:
            self._all_whole(n)
            return REPLICATED
        if len(splits) != len(places) and splits[0].dim == dim:
            raise Unplaceable("it concatenates split and replicated values along the split dim")
        if splits[0].dim == dim:
            self.window.pop(n, None)
            if len({(p.dim, p.parts, p.repeat) for p in splits}) != 1 or splits[0].repeat != 1:
                raise Unplaceable("it concatenates values split differently")
            return Split(dim, splits[0].parts, tuple(s for p in splits for s in p.segments))
        if len(set(splits)) != 1:
            raise Unplaceable("it concatenates values split differently")
        for a, p in zip(pieces, places):
            if not isinstance(p, Split):
                self._aligned_input(n, a, splits[0], rank)
        return splits[0]

    def _split(self, n: fx.Node):
        """``split_with_sizes``, ``split``, ``chunk``, ``tensor_split``, ``unbind``: a list of placements."""
        x = n.args[0]
        p = self.p(x)
        self._inherit(n, x)
        outs = self.shapes[n]
        if p is PARTIAL:
            return [PARTIAL] * len(outs)
        if not isinstance(p, Split):
            self.r(n, x)
            return [REPLICATED] * len(outs)
        rank = len(self.shape(x))
        t = n.target
        dim = (n.args[2] if t in (aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default,
                                  aten.tensor_split.indices, aten.tensor_split.sections) and len(n.args) > 2
               else n.args[1] if t is aten.unbind.int and len(n.args) > 1 else 0)
        dim %= rank
        if t is aten.unbind.int and dim == p.dim:
            raise Unplaceable("it unbinds the split dim")
        if dim != p.dim:
            return [p.moved(p.dim - (t is aten.unbind.int and dim < p.dim))] * len(outs)
        sizes = [o[dim] for o in outs]
        pieces = split_pieces(p, sizes)
        w = self.window.pop(n, None)
        cuts = [sum(sizes[:i]) for i in range(len(sizes))]
        if pieces is None:
            if w is None or p.repeat != 1:
                raise Unplaceable(f"it cuts the split dim at {cuts[1:]}, inside a piece",
                                  origins=self.origins.get(x, frozenset()))
            raise Unplaceable(f"it cuts the split dim at {cuts[1:]}, inside a piece",
                              Fix("segments", (w[0], [w[1] + c * w[2] for c in cuts[1:]])), origins=frozenset({w[0]}))
        if w is not None:
            self.window[n] = [(w[0], w[1] + c * w[2], w[2]) for c in cuts]
        if t is aten.split_with_sizes.default:
            for i, s in enumerate(n.args[1]):
                self.rewrites[n].append((1, i, s // p.parts))
        elif t is aten.split.Tensor:
            self.rewrites[n].append((1, None, n.args[1] // p.parts))
        elif t is aten.tensor_split.indices:
            for i, s in enumerate(n.args[1]):
                self.rewrites[n].append((1, i, s // p.parts))
        return pieces

    def _index(self, n: fx.Node):
        """``x[idx]`` along dim 0 (``index.Tensor`` with one index, ``index_select`` on dim 0)."""
        x = n.args[0]
        p = self.p(x)
        if n.target is aten.index.Tensor:
            idx = n.args[1]
            dim = 0
            if len(idx) != 1 or idx[0] is None:
                return self._default(n)
            idx = idx[0]
        else:
            dim, idx = n.args[1] % len(self.shape(x)), n.args[2]
        self.r(n, idx)
        self._inherit(n, x)
        if p is PARTIAL:
            return PARTIAL
        if not isinstance(p, Split):
            self.r(n, x)
            return REPLICATED
        if p.dim == dim:
            raise Unplaceable("it indexes the split dim", origins=self.origins.get(x, frozenset()))
        return p.moved(p.dim + len(self.shape(n)) - len(self.shape(x)))

    def _linear(self, n: fx.Node):
        """``linear(x, w, b)`` and ``fp8_linear(x, w, scale, b, block_n, block_k)``: column- or row-parallel."""
        fp8 = n.target is ops.fp8_linear.default
        x, w = n.args[0], n.args[1]
        bias = n.args[3] if fp8 else (n.args[2] if len(n.args) > 2 else n.kwargs.get("bias"))
        scale = n.args[2] if fp8 else None
        block = tuple(n.args[4:6]) if fp8 else None
        px = self.p(x)
        if px is PARTIAL:
            self.r(n, x)
            px = REPLICATED
        rank = len(self.shape(x))
        if isinstance(px, Split):
            if px.dim != rank - 1 or px.parts != self.tp:
                raise Unplaceable(f"it contracts a value {_describe(px)}", origins=self.origins.get(x, frozenset()))
            origins = self.origins.get(x, frozenset())
            self.demand(w, px.moved(1), origins)
            if scale is not None:
                self._demand_scale(scale, w, px.moved(1), block[1], origins)
            if bias is not None:
                self._first(bias)
            self.origins[n] = origins
            self.row.append((n, w))
            return PARTIAL
        self.r(n, x)
        return self._column(n, w, [b for b in (bias,) if b is not None], out_dim=0, rank=len(self.shape(n)),
                            scale=scale, block=block[0] if block else None)

    def _column(self, n: fx.Node, w, extras: list, out_dim: int, rank: int, scale=None, block=None):
        """A product over a replicated input: column-parallel over ``w``'s ``out_dim`` when its weight may be cut."""
        leaf = weight_leaf(w)
        size = self.shape(w)[out_dim]
        if leaf is None or not self.choices.may_cut(leaf.target, size):
            for a in [w, *extras, scale]:
                if isinstance(a, fx.Node):
                    self.r(n, a)
            return REPLICATED
        sp = Split(out_dim, self.choices.parts_of(leaf.target), self.choices.segments_of(leaf.target, size))
        origins = frozenset({leaf.target})
        self.demand(w, sp, origins)
        for b in extras:
            self.demand(b, sp.moved(0), origins)
        if scale is not None:
            self._demand_scale(scale, w, sp, block, origins)
        self.origins[n] = origins
        self.window[n] = (leaf.target, 0, 1)
        self.column.append((n, w))
        return Split(rank - 1, sp.parts, sp.segments)

    def _demand_scale(self, scale, w, sp: Split, block: int, origins) -> None:
        """FP8 block scales cut with their weight: every piece must hold whole blocks."""
        leaf = weight_leaf(w)
        pieces = [s // sp.parts for s in sp.segments]
        if any(p % block for p in pieces):
            ok = [t for t in range(1, 65) if all(s % t == 0 and (s // t) % block == 0 for s in sp.segments)]
            raise Unplaceable(f"{leaf.target if leaf is not None else w.name} has quantisation blocks of {block} "
                              f"along dim {sp.dim}, and a piece of {pieces[0]} splits one",
                              Fix("refuse", f"the TP sizes whose pieces hold whole blocks: "
                                            f"{', '.join(map(str, ok)) or 'none'}"), origins=origins)
        self.demand(scale, Split(sp.dim, sp.parts, tuple(s // block for s in sp.segments)), origins)

    def _first(self, bias) -> None:
        leaf = bias if isinstance(bias, fx.Node) and bias.op == "get_attr" else None
        if leaf is None:
            raise Unplaceable("a row-parallel projection's bias must be a weight")
        shard = Shard(0, 1, (self.shape(bias)[0],), "first")
        if self.shards.get(leaf.target, shard) != shard or leaf.target in self.whole:
            raise Unplaceable(f"{leaf.target} is read two ways")
        self.shards[leaf.target] = shard
        self.committed[bias] = REPLICATED

    def _grouped(self, n: fx.Node):
        """Experts: ``grouped_mm(x [M, K], w [E, K, N], offs)`` and ``fp8_grouped_mm(x, w [E, N, K], scale, offs,
        block_n, block_k)``: column- or row-parallel in every expert alike."""
        fp8 = n.target is ops.fp8_grouped_mm.default
        x, w = n.args[0], n.args[1]
        scale = n.args[2] if fp8 else None
        block = tuple(n.args[4:6]) if fp8 else None
        n_dim, k_dim = (1, 2) if fp8 else (2, 1)
        for a in n.all_input_nodes:
            if a not in (x, w, scale):
                self.r(n, a)
        px = self.p(x)
        if px is PARTIAL:
            self.r(n, x)
            px = REPLICATED
        if isinstance(px, Split):
            if px.dim != len(self.shape(x)) - 1 or px.parts != self.tp:
                raise Unplaceable(f"it contracts a value {_describe(px)}", origins=self.origins.get(x, frozenset()))
            origins = self.origins.get(x, frozenset())
            self.demand(w, px.moved(k_dim), origins)
            if scale is not None:
                self._demand_scale(scale, w, px.moved(k_dim), block[1], origins)
            self.origins[n] = origins
            self.row.append((n, w))
            return PARTIAL
        self.r(n, x)
        return self._column(n, w, [], out_dim=n_dim, rank=len(self.shape(n)), scale=scale,
                            block=block[0] if block else None)

    def _embedding(self, n: fx.Node):
        w, ids = n.args[0], n.args[1]
        self.r(n, ids)
        vocab = self.shape(w)[0]
        if w.op != "get_attr" or not self.choices.may_cut(w.target, vocab, parts=self.tp):
            self.r(n, w)
            return REPLICATED
        origins = frozenset({w.target})
        self.demand(w, Split(0, self.tp, (vocab,)), origins)
        self.vocab[n] = vocab
        self.origins[n] = origins
        return PARTIAL

    def _attention(self, n: fx.Node):
        """``paged_attention`` / ``cache_attention``: heads split alike in the queries and the cache (GQA: each
        rank's query heads read its own KV heads, a KV head held by several ranks when tp exceeds them)."""
        q, keys, values = n.args[:3]
        pq = self.p(q)
        pools = [self.pools.get(k.target, REPLICATED) if k.op == "get_attr" else self.p(k) for k in (keys, values)]
        heads = self.shape(q)[1]
        for a in n.all_input_nodes:  # per-head inputs (ALiBi slopes, sinks) are cut with the heads
            if a in (q, keys, values):
                continue
            if a in self.lazy and isinstance(pq, Split) and self.shape(a) == (heads,):
                self.demand(a, Split(0, pq.parts, (heads,)), self.origins.get(q, frozenset()))
            else:
                self.r(n, a)
        self._inherit(n, q, keys, values)
        if not isinstance(pq, Split):
            self.r(n, q)
            if any(isinstance(p, Split) for p in pools):
                raise Unplaceable("its cache is split but its queries are not",
                                  origins=frozenset().union(*(self.pool_origins.get(k.target, frozenset())
                                                              for k in (keys, values))))
            return REPLICATED
        kv_dim = 2 if n.target is ops.paged_attention.default else 1
        heads_kv = self.shape(keys)[kv_dim]
        if pq.dim != 1 or pq.parts != self.tp or len(pq.segments) != 1:
            raise _too_few_heads(self.shape(q)[1], heads_kv, self.tp)
        for p in pools:
            if p is REPLICATED and heads_kv == 1:
                continue
            if not isinstance(p, Split) or p.dim != kv_dim or not (p.parts == self.tp or p.parts == heads_kv):
                raise Unplaceable(f"its {heads_kv} KV heads are not split with its query heads",
                                  origins=self.origins.get(q, frozenset()))
        return pq

    def _sdpa(self, n: fx.Node):
        """``scaled_dot_product_attention(q, k, v, mask, ...)`` of a stage without a cache: heads split alike (KV
        heads as in ``_attention``), the mask broadcast over the heads."""
        q, k, v = n.args[:3]
        pq, pk, pv = self.p(q), self.p(k), self.p(v)
        for a in n.all_input_nodes:
            if a not in (q, k, v):
                if isinstance(pq, Split) and self.shape(a)[1 - 4 + len(self.shape(a))] != 1 if len(self.shape(a)) >= 3 \
                        else False:
                    raise Unplaceable("its mask differs by head")
                self.r(n, a)
        self._inherit(n, q, k, v)
        if not isinstance(pq, Split):
            for a in (q, k, v):
                self.r(n, a)
            return REPLICATED
        heads_kv = self.shape(k)[1]
        if pq.dim != 1 or pq.parts != self.tp or len(pq.segments) != 1:
            raise _too_few_heads(self.shape(q)[1], heads_kv, self.tp)
        for p in (pk, pv):
            if p is REPLICATED and heads_kv == 1:
                continue
            if not isinstance(p, Split) or p.dim != 1 or not (p.parts == self.tp or p.parts == heads_kv):
                raise Unplaceable(f"its {heads_kv} KV heads are not split with its query heads",
                                  origins=self.origins.get(q, frozenset()))
        return pq

    def _write_pair(self, n: fx.Node):
        """``paged_write_pair(pool, other_pool, value, other_value, slots)``, ``paged_write(pool, value, slots)``,
        ``cache_write(cache, value, positions, dim)``: a pool takes its value's placement."""
        if n.target is ops.paged_write_pair.default:
            pairs = [(n.args[0], n.args[2], 1), (n.args[1], n.args[3], 1)]
        else:
            pairs = [(n.args[0], n.args[1], 1 if n.target is ops.paged_write.default else 0)]
        for a in n.all_input_nodes:
            if a not in [x for pair in pairs for x in pair[:2]]:
                self.r(n, a)
        for pool, value, offset in pairs:
            pv = self.p(value)
            if pv is PARTIAL:
                self.r(n, value)
                pv = REPLICATED
            if pv is _LAZY:
                self._whole(value)
                pv = REPLICATED
            self._inherit(n, value)
            self._pool(n, pool, pv.moved(pv.dim + offset) if isinstance(pv, Split) else REPLICATED)
        return REPLICATED

    def _latent(self, n: fx.Node):
        """``paged_latent_attention(q, latents, ropes, weight, nope_dim, ...)`` (MLA): query heads split, the
        latent cache replicated, ``kv_b_proj`` (``weight``, ``[H * (dn + dv), r]``) cut by heads with them."""
        q, latents, ropes, weight = n.args[:4]
        scale = n.args[14] if len(n.args) > 14 else None
        block_n = n.args[15] if len(n.args) > 15 else 0
        pq = self.p(q)
        for a in n.all_input_nodes:
            if a not in (q, weight, scale):
                self.r(n, a)
        self._inherit(n, q)
        for pool in (latents, ropes):
            if isinstance(self.pools.get(pool.target, REPLICATED), Split):
                raise Unplaceable("its latent cache is split")
        if not isinstance(pq, Split):
            for a in (q, weight, scale):
                self.r(n, a)
            return REPLICATED
        if pq.dim != 1 or pq.parts != self.tp or len(pq.segments) != 1:
            raise _too_few_heads(self.shape(q)[1], 1, self.tp)
        origins = self.origins.get(q, frozenset())
        rows = self.shape(weight)[0]
        sp = Split(0, self.tp, (rows,))
        self.demand(weight, sp, origins)
        if isinstance(scale, fx.Node):
            self._demand_scale(scale, weight, sp, block_n, origins)
        return pq

    def _pool(self, n: fx.Node, pool: fx.Node, place) -> None:
        """A cache ``n`` reads and writes takes ``place``; one written two ways is unplaceable."""
        if pool.op != "get_attr":
            raise Unplaceable("it writes a cache that is not a buffer")
        self.pool_origins[pool.target] = self.pool_origins.get(pool.target, frozenset()) | self.origins.get(n, frozenset())
        if self.pools.setdefault(pool.target, place) != place:
            raise Unplaceable(f"{pool.target} is used split two ways ({_describe(self.pools[pool.target])}, "
                              f"{_describe(place)})", origins=self.origins.get(n, frozenset()))

    def _heads(self, n: fx.Node, heads: list, ring: fx.Node, per_head: list = ()):
        """A recurrent scan: ``heads`` (token-major ``[1, N, H, ...]`` values) split by heads alike, its state ring
        ``[S, R, H, ...]`` and per-head weights (``A``) cut with them; groups of keys (``B``, ``C``) split too,
        or replicated when there is one group."""
        places = {a: self.p(a) for a in heads if isinstance(a, fx.Node)}
        self._inherit(n, *places)
        for a in n.all_input_nodes:
            if a not in places and a not in per_head and a is not ring:
                self.r(n, a)
        splits = {a: p for a, p in places.items() if isinstance(p, Split)}
        if not splits:
            for a in [*places, *per_head]:
                self.r(n, a)
            self._pool(n, ring, REPLICATED)
            return REPLICATED
        for a, p in places.items():
            if a in splits:
                if p.dim != 2 or p.parts != self.tp or len(p.segments) != 1 or p.repeat != 1:
                    raise Unplaceable(f"{a.name} is split {_describe(p)}, not by heads")
            elif self.shape(a)[2] != 1:
                raise Unplaceable(f"{a.name} is replicated over {self.shape(a)[2]} heads or groups")
            else:
                self.r(n, a)
        origins = self.origins.get(n, frozenset())
        for a in per_head:
            if isinstance(a, fx.Node):
                self.demand(a, Split(0, self.tp, (self.shape(a)[0],)), origins)
        out_heads = self.shape(heads[0])[2] if n.target is ops.ragged_ssm_scan.default else self.shape(heads[2])[2]
        self._pool(n, ring, Split(2, self.tp, (out_heads,)))
        return Split(2, self.tp, (out_heads,))

    def _delta(self, n: fx.Node):
        """``ragged_gated_delta_scan(q, k, v, g, beta, ring, ...)`` and its linear-attention form."""
        if n.target is ops.ragged_gated_delta_scan.default:
            return self._heads(n, list(n.args[:5]), n.args[5])
        return self._heads(n, list(n.args[:4]), n.args[4])

    def _ssm(self, n: fx.Node):
        """``ragged_ssm_scan(x, dt, A, B, C, ring, ...)`` (Mamba-2)."""
        x, dt, a, b, c, ring = n.args[:6]
        return self._heads(n, [x, dt, b, c], ring, per_head=[a])

    def _conv(self, n: fx.Node):
        """``paged_conv1d(x [1, C, N], weight [C, 1, k], bias [C], pool [blocks, bs, C], ...)``: per channel, so the
        channels split as they come (the pool and the weights cut alike)."""
        x, weight, bias, pool = n.args[:4]
        p = self.p(x)
        for a in n.all_input_nodes:
            if a not in (x, weight, bias, pool):
                self.r(n, a)
        self._inherit(n, x)
        if not isinstance(p, Split):
            self.r(n, x)
            for a in (weight, bias):
                self.r(n, a)
            self._pool(n, pool, REPLICATED)
            return REPLICATED
        if p.dim != 1 or p.repeat != 1:
            raise Unplaceable(f"its input is split {_describe(p)}, not by channel")
        origins = self.origins.get(x, frozenset())
        self.demand(weight, p.moved(0), origins)
        if isinstance(bias, fx.Node):
            self.demand(bias, p.moved(0), origins)
        self._pool(n, pool, p.moved(2))
        return p

    def _output(self, n: fx.Node):
        y, aux = n.args[0][:2]
        py = self.p(y)
        if py is PARTIAL:
            self.reduce_for[y].add(n)
        elif isinstance(py, Split):
            if len(py.segments) != 1 or py.parts != self.tp:
                raise Unplaceable(f"the stage's output is split {_describe(py)}; only a whole split can be gathered",
                                  origins=self.origins.get(y, frozenset()))
            self.gather = (y, py)
        else:
            self.r(n, y)
        self.r(n, aux)
        return REPLICATED


def _too_few_heads(heads: int, kv: int, tp: int) -> Unplaceable:
    works = [t for t in range(1, heads + 1) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
    return Unplaceable(f"its {heads} query heads do not cut into {tp} pieces",
                       Fix("refuse", f"tp must divide the query heads: {', '.join(map(str, works))}"))


def _describe(p) -> str:
    if isinstance(p, Split):
        segs = "" if len(p.segments) == 1 else f" in segments {list(p.segments)}"
        return f"split along dim {p.dim} in {p.parts}{segs}"
    return repr(p)


def _name(target) -> str:
    return getattr(target, "__name__", str(target))


def weight_leaf(w) -> fx.Node | None:
    """The weight (``get_attr``) a lazy value is read from through transposes, reshapes and casts."""
    while isinstance(w, fx.Node) and w.op == "call_function" and (w.target in _VIEWS or w.target in (
            aten.transpose.int, aten.t.default, aten.permute.default, aten.to.dtype, aten._to_copy.default,
            aten.alias.default, aten.clone.default, aten.contiguous.default)):
        w = w.args[0]
    return w if isinstance(w, fx.Node) and w.op == "get_attr" and not is_cache_buffer(w.target) else None


def _lazy_nodes(gm: fx.GraphModule) -> set:
    """Nodes computed only from weights (and constants): their placement waits for their first reader."""
    lazy = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            if not is_cache_buffer(n.target):
                lazy.add(n)
        elif n.op == "call_function" and n.all_input_nodes and all(a in lazy for a in n.all_input_nodes) \
                and not _mutates(n):
            lazy.add(n)
    return lazy


def _mutates(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _reduced_dims(n: fx.Node, rank: int) -> list[int]:
    t = n.target
    if t in (aten.topk.default, aten.sort.default):
        dim = n.args[2] if t is aten.topk.default and len(n.args) > 2 else (n.args[1] if t is aten.sort.default
                                                                             and len(n.args) > 1 else -1)
        dim = n.kwargs.get("dim", dim)
        return [dim % rank]
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    if t in (aten.linalg_vector_norm.default, aten.var.correction):
        dims = n.args[2] if t is aten.linalg_vector_norm.default and len(n.args) > 2 else n.kwargs.get("dim", dims)
    if dims is None:
        return list(range(rank))
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return [d % rank for d in dims]


def _keepdim(n: fx.Node) -> bool:
    t = n.target
    if t in (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
             aten.cumsum.default, aten.topk.default, aten.sort.default):
        return True
    keep = n.args[2] if len(n.args) > 2 and isinstance(n.args[2], bool) else n.kwargs.get("keepdim", False)
    return bool(keep)


def _dims_arg(n: fx.Node, rank: int) -> list[int]:
    dims = n.args[1] if len(n.args) > 1 else []
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return [d % rank for d in dims]


_MULTI = {aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default, aten.tensor_split.indices,
          aten.tensor_split.sections, aten.unbind.int, aten.topk.default, aten.sort.default, aten.max.dim,
          aten.min.dim}
_RULES = {aten.linear.default: Propagation._linear, ops.fp8_linear.default: Propagation._linear,
          aten.embedding.default: Propagation._embedding, aten.cat.default: Propagation._cat,
          aten.expand.default: Propagation._expand, aten.index.Tensor: Propagation._index,
          aten.index_select.default: Propagation._index,
          ops.paged_attention.default: Propagation._attention, ops.cache_attention.default: Propagation._attention,
          ops.paged_write_pair.default: Propagation._write_pair, ops.paged_write.default: Propagation._write_pair,
          ops.cache_write.default: Propagation._write_pair,
          ops.paged_latent_attention.default: Propagation._latent,
          aten.scaled_dot_product_attention.default: Propagation._sdpa,
          ops.ragged_gated_delta_scan.default: Propagation._delta,
          ops.ragged_linear_attention_scan.default: Propagation._delta,
          ops.ragged_ssm_scan.default: Propagation._ssm, ops.paged_conv1d.default: Propagation._conv,
          ops.fp8_grouped_mm.default: Propagation._grouped}
for _t in _VIEWS | {aten.flatten.using_ints, aten.unflatten.int}:
    _RULES[_t] = Propagation._view
for _t in (aten.transpose.int, aten.permute.default, aten.t.default, aten.movedim.int, aten.unsqueeze.default,
           aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.select.int, aten.slice.Tensor):
    _RULES[_t] = Propagation._move
for _t in _MULTI - {aten.topk.default, aten.sort.default, aten.max.dim, aten.min.dim}:
    _RULES[_t] = Propagation._split
# Ops registered by other libraries when they are imported, known by name.
_BY_NAME = {"transformers::grouped_mm_fallback": Propagation._grouped, "aten::_grouped_mm": Propagation._grouped}
