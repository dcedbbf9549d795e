"""Pass 7, paged: the traced one-row cache becomes the stages' paged cache, and the stages take ragged steps.

The model is traced over a dense stand-in cache of one row (``Traced.stand_in``), which the attention pass can
prove its rewrites against. This pass swaps every use of it for the paged form (``ppsplit/triton_kernels/paged.py``)
and adds the step's metadata inputs (``ppsplit.core.ragged.STEP_INPUTS``) after ``aux``:

- a write of keys or values at ``positions`` becomes ``paged_write`` into the layer's pool
  ``[num_blocks, block_size, kv_heads, head_dim]`` at the step's slot mapping (a layer's keys and values one
  ``paged_write_pair``), and the ``cache_attention`` that read them a ``paged_attention`` over the pools (same
  scale, window, soft-cap, ALiBi, sinks); MLA's ``latent_attention`` (its keys hold latents, its values rotary
  keys, one head each) a ``paged_latent_attention``;
- a short convolution's inputs go to a pool ``[num_blocks, block_size, channels]`` the same way, and the
  depthwise ``conv1d`` over the window the model built becomes ``paged_conv1d``, same output layout;
- a recurrent scan's ring becomes one ring per sequence slot ``[slots, R, *state]`` (``ragged_*_scan``).

Every token's own math (norms, MLPs, MoE routing, rotary from per-token position ids) runs as traced. Anything the
paged cache cannot serve (an attention left as traced, a layer that reads another layer's cache, a sparse
indexer's keys, a conv or scan in another form, a read of the first position standing for all tokens) raises
``Unpageable`` naming it; the driver then keeps a lockstep cache for the split and records why.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

import ppsplit.triton_kernels.paged  # noqa: F401  (registers the paged ops)
import ppsplit.triton_kernels.recurrent  # noqa: F401
from ppsplit.core.errors import ConfigError
from ppsplit.core.fx_utils import CACHE_PREFIX, CONV_INPUTS, INDEXER_KEYS, fresh_copy, get_tensor, set_tensor
from ppsplit.core.options import CacheConfig
from ppsplit.core.plan import SplitPlan
from ppsplit.core.ragged import STEP_INPUTS
from ppsplit.passes.annotate import mutated_bases
from ppsplit.passes.attention import Attended
from ppsplit.passes.evaluate import SHAPE_OPS, SubgraphEvaluator
from ppsplit.passes.partition import Partitioned, carry_forward

aten = torch.ops.aten
ops = torch.ops.ppsplit
# Each scan's ragged form takes the same arguments with the pool for the ring and the step's seq_start, seq_count
# after positions.
_SCANS = {ops.ssm_scan.default: ops.ragged_ssm_scan.default,
          ops.gated_delta_scan.default: ops.ragged_gated_delta_scan.default,
          ops.linear_attention_scan.default: ops.ragged_linear_attention_scan.default,
          ops.linear_recurrence.default: ops.ragged_linear_recurrence.default,
          ops.wkv_scan.default: ops.ragged_wkv_scan.default,
          ops.mlstm_scan.default: ops.ragged_mlstm_scan.default}
_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout}
_ATTENTIONS = {ops.cache_attention.default, ops.latent_attention.default}  # the readers of cached keys it pages


class Unpageable(ConfigError):
    """The stages cannot take ragged steps over a paged cache; the message says which layer and why."""


@dataclass(frozen=True)
class Paged(Partitioned):
    """The paged pass's result: a rewritten copy of the graph whose cache is paged and whose inputs are
    ``input_ids, positions, aux`` and the step metadata."""


def paged(result: Attended, plan: SplitPlan, cache: CacheConfig, stand_in: CacheConfig) -> Paged:
    """Rewrite the stand-in cache's writes and readers into paged ops (see the module docstring)."""
    gm = fresh_copy(result.gm)
    graph = gm.graph
    rewrite = _Rewrite(gm, cache, stand_in, {site.layer: site for site in result.sites})
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.index_copy_.default and _cache_name(node.args[0]):
            rewrite.write(node)
    rewrite.pair_writes()
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _SCANS:
            rewrite.scan(node)
    rewrite.sweep()
    rewrite.positions_per_token(result.annotated.traced)
    rewrite.sweep()
    rewrite.check()
    graph.lint()
    gm.recompile()
    return carry_forward(result, Paged, gm=gm)


def _cache_name(node) -> tuple[int, str] | None:
    """``(layer, kind)`` when ``node`` is a stand-in cache buffer (``kv_cache.<layer>.<kind>``, maybe sliced)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.slice.Tensor:
        node = node.args[0]
    if isinstance(node, fx.Node) and node.op == "get_attr" and node.target.startswith(CACHE_PREFIX + "."):
        _, layer, kind = node.target.split(".")
        return int(layer), kind
    return None


def _base(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target is aten.slice.Tensor:
        node = node.args[0]
    return node


class _Rewrite:
    def __init__(self, gm: fx.GraphModule, cache: CacheConfig, stand_in: CacheConfig, sites: dict):
        self.gm, self.graph, self.cache, self.stand_in = gm, gm.graph, cache, stand_in
        self.sites = sites  # layer -> its AttentionSite: why an attention stayed as traced
        positions = self.graph.find_nodes(op="placeholder", target="positions")[0]
        aux = self.graph.find_nodes(op="placeholder", target="aux")[0]
        self.positions = positions
        val = positions.meta.get("val")
        shapes = {"seq": None, "block_table": (cache.batch_size, cache.blocks_per_seq),
                  "seq_start": (cache.batch_size,), "seq_count": (cache.batch_size,)}
        self.meta = {}
        anchor = aux
        for name in STEP_INPUTS[1:]:
            with self.graph.inserting_after(anchor):
                node = self.graph.placeholder(name)
            node.meta["ppsplit.token"] = False
            if val is not None:
                node.meta["val"] = val.new_empty(val.shape if shapes[name] is None else shapes[name])
            self.meta[name] = anchor = node
        first = next(n for n in self.graph.nodes if n.op != "placeholder")
        with self.graph.inserting_before(first):
            self.slots = self.graph.call_function(ops.slot_mapping.default, (positions, self.meta["seq"],
                                                                            self.meta["block_table"], cache.block_size))
        self.slots.meta.update({"ppsplit.token": False, "val": val.new_empty(val.shape) if val is not None else None})
        self.pools: dict[str, fx.Node] = {}  # buffer name -> its get_attr node, now over the pool
        self.done: set = set()  # nodes this pass made or consumed
        self.writes: dict[int, dict[str, fx.Node]] = {}  # layer -> kind -> its paged_write (keys and values)

    # -- buffers ---------------------------------------------------------------------------------------------
    def pool(self, buffer: fx.Node, kind: str) -> fx.Node:
        """The buffer of ``buffer`` re-registered with the paged shape; its get_attr node."""
        name = buffer.target
        if name not in self.pools:
            t = get_tensor(self.gm, name)
            c = self.cache
            if kind in ("keys", "values"):  # stand-in [1, H, L, D] -> [blocks, block_size, H, D]
                shape = (c.pool_blocks, c.block_size, t.shape[1], *t.shape[3:])
            elif kind.startswith(CONV_INPUTS):  # [1, C, L] -> [blocks, block_size, C]
                shape = (c.pool_blocks, c.block_size, t.shape[1])
            elif kind == INDEXER_KEYS:  # [1, L, D] -> [blocks, block_size, D]
                shape = (c.pool_blocks, c.block_size, t.shape[2])
            elif kind == "states":  # [1, R, *state] -> [slots, R, *state]
                shape = (c.batch_size, *t.shape[1:])
            else:
                raise Unpageable(f"the cache's {kind} ({name}) have no paged form yet (ragged steps need it); "
                                 "split with a lockstep cache instead")
            set_tensor(self.gm, name, torch.zeros(shape, dtype=t.dtype, device=t.device), parameter=False,
                       persistent=False)
            self.pools[name] = buffer
            buffer.meta["val"] = _fake_like(buffer.meta.get("val"), shape, t.dtype)
        return self.pools[name]

    # -- rewrites ------------------------------------------------------------------------------------------
    def write(self, node: fx.Node) -> None:
        """``cache[:1].index_copy_(2, positions, value)`` -> ``paged_write(pool, tokens of value, slots)`` (indexer
        keys ``[1, L, D]``: along dim 1)."""
        view, dim, index, value = node.args
        layer, kind = _cache_name(view)
        token_dim = 1 if kind == INDEXER_KEYS else 2
        if dim != token_dim or index is not self.positions:
            raise Unpageable(f"layer {layer} writes its {kind} along dim {dim} at {index}, not at the step's "
                             "positions along the token dim")
        buffer = _base(view)
        pool = self.pool(buffer, kind)
        g = self.graph
        with g.inserting_before(node):
            tokens = row = g.call_function(aten.select.int, (value, 0, 0))
            if token_dim == 2:
                tokens = g.call_function(aten.transpose.int, (row, 0, 1))
            write = g.call_function(ops.paged_write.default, (pool, tokens, self.slots))
        for n in {tokens, row, write}:
            n.meta.update({k: v for k, v in node.meta.items() if k.startswith("ppsplit.") or k == "nn_module_stack"})
        if kind in ("keys", "values"):
            self.writes.setdefault(layer, {})[kind] = write
        readers = list(node.users)
        if kind in ("keys", "values"):
            for reader in sorted({layer} | {u.meta.get("ppsplit.layer") for u in readers} - {None}):
                site = self.sites.get(reader)  # the layer's own, or one reading this layer's keys (KV sharing)
                if site is not None and not site.replaced:
                    raise Unpageable(f"layer {reader}'s attention stays as traced ({site.detail}); the paged cache "
                                     "serves only the attention ppsplit rewrites")
            for user in readers:
                if user.target not in _ATTENTIONS:
                    raise Unpageable(f"layer {layer}'s cached {kind} are read by {user.format_node()}, not by the "
                                     "cache_attention (or MLA's latent_attention) the paged cache replaces")
        elif kind.startswith(CONV_INPUTS):
            for user in readers:
                self.conv(layer, user, value, pool)
        elif kind == INDEXER_KEYS:
            for user in readers:
                self.indexer(layer, user, pool)
        for user in [u for u in readers if u.target in _ATTENTIONS]:
            self.attention(user)
        node.replace_all_uses_with(pool)
        self.graph.erase_node(node)
        if view is not buffer and not view.users:
            self.graph.erase_node(view)

    def pair_writes(self) -> None:
        """A layer's key and value writes -> one ``paged_write_pair`` where the second write stands (one launch, not
        two), when nothing between them touches the key pool."""
        nodes = list(self.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        for kinds in self.writes.values():
            if set(kinds) != {"keys", "values"}:
                continue
            first, second = sorted(kinds.values(), key=order.__getitem__)
            pool = first.args[0]
            if any(pool in n.all_input_nodes for n in nodes[order[first] + 1:order[second]]):
                continue
            with self.graph.inserting_before(second):
                pair = self.graph.call_function(ops.paged_write_pair.default,
                                                (pool, second.args[0], first.args[1], second.args[1], self.slots))
            pair.meta.update(second.meta)
            self.graph.erase_node(first)
            self.graph.erase_node(second)

    def attention(self, node: fx.Node) -> None:
        if node in self.done:
            return
        m = self.meta
        step = (m["seq"], m["block_table"], m["seq_start"], m["seq_count"])
        if node.target is ops.latent_attention.default:  # MLA: pools of latents and rotary keys
            q, latents, ropes, weight, nope, positions, scale, window, softcap, selected, *fp8 = node.args
            args = (q, self.cached(latents), self.cached(ropes), weight, nope, positions, *step, scale, window,
                    softcap, selected, *fp8)
            target = ops.paged_latent_attention.default
        else:
            q, k, v, positions, scale, window, softcap, alibi, sinks, *chunk = node.args
            args = (q, self.cached(k), self.cached(v), positions, *step, scale, window, softcap, alibi, sinks, *chunk)
            target = ops.paged_attention.default
        with self.graph.inserting_before(node):
            new = self.graph.call_function(target, args)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        self.done.add(new)

    def indexer(self, layer: int, node: fx.Node, pool: fx.Node) -> None:
        """``indexer_topk`` over the stand-in's indexer keys -> ``paged_indexer_topk`` over their pool."""
        if node.target is not ops.indexer_topk.default:
            raise Unpageable(f"layer {layer}'s indexer keys are read by {node.format_node()}, not by the indexer_topk "
                             "the paged cache replaces")
        q, weights, _, positions, scale, topk = node.args
        with self.graph.inserting_before(node):
            new = self.graph.call_function(ops.paged_indexer_topk.default, (
                q, weights, pool, positions, self.meta["seq"], self.meta["block_table"], scale, topk))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)

    def cached(self, read: fx.Node) -> fx.Node:
        """The pool of the cache buffer that ``read`` (its write, or the buffer itself) reads."""
        buffer = _base(read.args[0]) if read.op == "call_function" else read
        return self.pool(buffer, _cache_name(buffer)[1])

    def conv(self, layer: int, reader: fx.Node, value: fx.Node, pool: fx.Node) -> None:
        """The window the model builds from the inputs (``index_select``, a mask, casts) and the depthwise conv1d
        over it -> ``paged_conv1d``: same output, per token from its own sequence."""
        chain, node = [reader], reader
        while len(node.users) == 1 and next(iter(node.users)).target in _CASTS | {aten.mul.Tensor}:
            node = next(iter(node.users))
            chain.append(node)
        convs = [u for u in node.users if u.target is aten.conv1d.default]
        if reader.target is not aten.index_select.default or len(convs) != 1 or len(node.users) != 1:
            raise Unpageable(f"layer {layer}'s short convolution reads its cached inputs through "
                             f"{reader.format_node()}, not the window and depthwise conv1d the paged cache replaces")
        conv = convs[0]
        _, weight, bias, stride, padding, dilation, groups = (list(conv.args) + [None, [1], [0], [1], 1])[:7]
        channels = value.meta["val"].shape[1]
        wval = weight.meta.get("val")
        kernel = wval.shape[-1] if isinstance(wval, torch.Tensor) and wval.dim() == 3 and wval.shape[1] == 1 else None
        if kernel is None or list(stride) != [1] or list(dilation) != [1] or groups != channels \
                or list(padding) != [kernel - 1]:
            raise Unpageable(f"layer {layer}'s convolution {conv.format_node()} is not the depthwise causal conv1d "
                             "the paged cache replaces")
        m = self.meta
        with self.graph.inserting_before(conv):
            new = self.graph.call_function(ops.paged_conv1d.default, (
                value, weight, bias, pool, self.positions, m["seq"], m["block_table"]))
        new.meta.update(conv.meta)
        conv.replace_all_uses_with(new)
        self.graph.erase_node(conv)
        for n in reversed(chain):
            if not n.users:
                self.graph.erase_node(n)

    def scan(self, node: fx.Node) -> None:
        args = list(node.args)
        at = [a.name for a in node.target._schema.arguments].index("ring")
        ring, positions = args[at], args[at + 1]
        name = _cache_name(ring)
        if name is None or positions is not self.positions:
            raise Unpageable(f"the recurrent scan {node.format_node()} does not read a cache ring at the step's "
                             "positions")
        pool = self.pool(_base(ring), name[1])
        m = self.meta
        new_args = args[:at] + [pool, positions, m["seq_start"], m["seq_count"]] + args[at + 2:]
        with self.graph.inserting_before(node):
            new = self.graph.call_function(_SCANS[node.target], tuple(new_args))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        if ring is not pool and not ring.users:
            self.graph.erase_node(ring)

    def positions_per_token(self, info) -> None:
        """A model that numbers a step's tokens as the first one's position plus ``0 .. T-1`` (Llama 4's attention
        temperature adds an ``arange`` to ``cache.get_seq_length()``, the first position) means each token's own
        position, which in a ragged step is ``positions`` itself: a value computed from the first position and the
        token count that equals ``positions`` on contiguous positions (what the stand-in was traced for, and what
        each sequence of a ragged step has) becomes ``positions``."""
        firsts = [n for n in self.graph.nodes if n.op == "call_function" and _reads_first_position(n, self.positions)]
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        for first in firsts:
            todo, seen = [first], set()
            while todo:
                node = todo.pop()
                if node in seen or node.graph is not self.graph:
                    continue
                seen.add(node)
                if node is not first and _equals_positions(self.gm, node, self.positions, info):
                    with self.graph.inserting_before(node):
                        own = self.positions
                        if node.meta["val"].dim() == 2:
                            own = self.graph.call_function(aten.unsqueeze.default, (self.positions, 0))
                            own.meta.update({"val": node.meta["val"], "ppsplit.token": False})
                    node.replace_all_uses_with(own)
                    continue
                todo += sorted((u for u in node.users if u.op == "call_function"
                                and not u.meta.get("ppsplit.token")), key=order.get, reverse=True)

    # -- what is left ----------------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Drop what only the stand-in needed (masks over its length, window index arithmetic)."""
        for node in reversed(list(self.graph.nodes)):
            if node.op in ("call_function", "get_attr") and not node.users and not mutated_bases(node):
                self.graph.erase_node(node)

    def check(self) -> None:
        for node in self.graph.nodes:
            if node.op == "get_attr" and node.target.startswith(CACHE_PREFIX + ".") and node.target not in self.pools:
                raise Unpageable(f"{node.target} is read as a whole ({', '.join(u.name for u in node.users)}), "
                                 "which a paged cache cannot serve")
            if node.op == "call_function" and node.target in (aten.select.int, aten.slice.Tensor) \
                    and node.args[0] is self.positions:
                raise Unpageable(f"the model reads {node.format_node()}: one position standing for every token of a "
                                 "step, which a ragged step does not have")
            if node.op == "call_function" and node.target in _ATTENTIONS | {ops.indexer_topk.default}:
                raise Unpageable(f"{node.format_node()} reads a cache the paged pass did not rewrite")


def _reads_first_position(node: fx.Node, positions: fx.Node) -> bool:
    """``positions[0]`` or ``positions[:1]``: one position standing for every token of the step."""
    return (node.target in (aten.select.int, aten.slice.Tensor) and node.args[0] is positions
            and tuple(node.args[1:3]) == (0, 0))


def _equals_positions(gm: fx.GraphModule, node: fx.Node, positions: fx.Node, info) -> bool:
    """Whether ``node``, ``[T]`` or ``[1, T]`` of the positions' dtype and computed from ``positions`` and sizes
    alone, equals ``positions`` for steps of contiguous positions (a few token counts and first positions)."""
    val, pval = node.meta.get("val"), positions.meta.get("val")
    # Sizes compared without a guard: making ``!=`` on the traced token count a bool would fix it to the example's
    if not isinstance(val, torch.Tensor) or val.dtype != pval.dtype or val.dim() not in (1, 2) \
            or not statically_known_true(val.shape[-1] == pval.shape[0]) \
            or val.dim() == 2 and not statically_known_true(val.shape[0] == 1):
        return False
    ancestors, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in ancestors:
            continue
        ancestors.add(n)
        if n.op == "placeholder" and n is not positions or n.op not in ("placeholder", "get_attr", "call_function"):
            return False
        if n.target not in SHAPE_OPS:  # a size is computed from the probe's token count, not from its tensor
            todo += n.all_input_nodes
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    needed = sorted(ancestors - {positions}, key=order.get)
    for tokens, start in ((1, 0), (3, 5), (5, 17), (2, 30)):
        want = torch.arange(start, start + tokens)
        evaluator = SubgraphEvaluator(gm, sizes={info.batch_symbol: 1, info.tokens_symbol: tokens})
        try:
            got = evaluator.run_nodes(needed, {positions: want})[node]
        except Exception:  # noqa: BLE001  (a value this evaluation cannot compute is not one it can prove)
            return False
        if not isinstance(got, torch.Tensor) or not torch.equal(got.reshape(-1), want):
            return False
    return True


def _fake_like(val, shape, dtype):
    if isinstance(val, torch.Tensor):
        return val.new_empty(shape, dtype=dtype)
    return None
