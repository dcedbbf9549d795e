"""Pass 4, partition: give every token-dependent node its home stage, and check what crosses each boundary.

Values that do not depend on the tokens (positions, rotary cos/sin, masks, weights) get no home: emit
recomputes them on every stage that needs them. Of the token-dependent values, the residual stream crosses
each boundary into the next stage (token-major, in the one layout ``plan.stream`` records when it holds several
hidden vectors per token); any other value that a later stage reads (Gemma 4's per-layer inputs, a long skip from
the embedding) is *carried*: packed into ``x`` after the hidden state at every boundary between its home and its
last reader, as raw bytes in the model dtype, token-major. It must have one batch and one token axis
(``[B, T, ...]``, keys ``[B, heads, T, dim]``) with a fixed per-token size that fills whole elements of the model
dtype; anything else is a ``CrossingError`` naming it.

The pass works on a fresh copy of the annotated graph (same tensors, same node names and facts), so one trace
serves many splits. Facts written: ``node.meta["ppsplit.stage"]`` on token nodes; the result, ``Partitioned``,
holds the copy, the boundaries (stage index -> name of the residual-stream node it receives) and the carries.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import fx

from ppsplit.core.errors import CrossingError
from ppsplit.core.fx_utils import fresh_copy, is_cache_buffer
from ppsplit.passes.annotate import (Annotated, is_view, mutated_bases, per_token_layout, pooled_bytes,
                                     residual_message, stream_layout)
from ppsplit.core.plan import Carry, SplitPlan
from ppsplit.core.tensors import dtype_name, model_dtype, nbytes


@dataclass(frozen=True)
class Partitioned:
    """The partition pass's result: a graph whose token nodes know their stage, and what crosses each boundary."""

    gm: fx.GraphModule
    annotated: Annotated
    boundaries: dict[int, str]  # stage s > 0 -> the residual-stream node it receives from stage s - 1
    carries: tuple[Carry, ...] = ()  # the other values that cross, in the order x packs them
    replicas: tuple[tuple[int, str, int], ...] = ()  # (stage, cache buffer, bytes) kept on a stage besides its home


def carry_forward(result: Partitioned, cls, **changes):
    """A later pass's result of type ``cls`` (a ``Partitioned`` subclass): ``result``'s partition facts, with
    ``changes`` (its rewritten copy of the graph, renamed boundaries, its report)."""
    base = {f.name: getattr(result, f.name) for f in dataclasses.fields(Partitioned)}
    return cls(**{**base, **changes})


def stage_of_region(plan: SplitPlan, region: int) -> int:
    """Region 0 (embedding) is stage 0; layer ``i`` and the work right after it go with layer ``i``'s stage."""
    if region == 0:
        return 0
    layer = (region - 1) // 2 if region % 2 else region // 2 - 1
    return plan.stage_of_layer(layer)


def partition(annotated: Annotated, plan: SplitPlan) -> Partitioned:
    """Assign home stages per ``plan``; raise ``CrossingError`` if a non-residual value would cross."""
    if annotated.layers.num_layers != plan.num_layers:
        raise ValueError(f"the plan is for {plan.num_layers} layers but the graph has {annotated.layers.num_layers}")
    gm = fresh_copy(annotated.gm)
    nodes = list(gm.graph.nodes)
    for node in nodes:
        node.meta.pop("ppsplit.stage", None)
        if node.meta.get("ppsplit.token"):
            node.meta["ppsplit.stage"] = stage_of_region(plan, node.meta["ppsplit.region"])
            if node.meta.get("ppsplit.half") == 0:  # a layer's attention half, on the stage before a mid-layer cut
                node.meta["ppsplit.stage"] = plan.stage_of_layer(node.meta["ppsplit.region"] // 2, attention=True)

    boundaries = {}
    for stage in plan.stages[1:]:
        if plan.starts_mid(stage.index):
            residual = annotated.mids.get(stage.start)
            if residual is None:
                raise CrossingError(f"stage {stage.index} starts in the middle of decoder layer {stage.start}, which "
                                    "has no point where only the residual stream crosses between its attention and "
                                    "its MLP; cut it whole")
        else:
            residual = annotated.residuals[stage.start]
        if residual is None:
            raise CrossingError(residual_message(annotated, stage.start))
        check_stream(nodes, residual, annotated, plan, f"the residual stream into stage {stage.index}")
        boundaries[stage.index] = residual

    replicas = _replicate_shared_caches(gm, nodes, plan, annotated)
    carries = []
    for node in nodes:
        home = node.meta.get("ppsplit.stage")
        if home is None:
            continue
        present = {home, *node.meta.get("ppsplit.replicas", ())}
        last, reader = home, None
        for user in node.users:
            there = _reader_stage(user, home, plan)
            if there < home:
                raise CrossingError(f"{node.format_node()} (stage {home}) is read by {user.name} on the earlier "
                                    f"stage {there}; ppsplit needs layers that run in index order")
            for stage in {there, *user.meta.get("ppsplit.replicas", ())} - present:
                if stage > last:
                    last, reader = stage, user
        into = tuple(s for s in range(home + 1, last + 1) if boundaries[s] != node.name)
        if into:
            carries.append(_carry(node, into, reader, last, annotated, plan))
    gm.graph.lint()
    return Partitioned(gm=gm, annotated=annotated, boundaries=boundaries, carries=tuple(carries), replicas=replicas)


def check_stream(nodes: list[fx.Node], name: str, annotated: Annotated, plan: SplitPlan, what: str) -> None:
    """``CrossingError`` unless node ``name`` (a cut's residual stream) has the layout the plan packs it in."""
    node = next(n for n in nodes if n.name == name)
    found = stream_layout(node, annotated.traced)
    if found != plan.stream:
        seen = f"[{found.dims()}]" if found else f"{list(node.meta['val'].shape)}"
        want = f"[{plan.stream.dims()}]" if plan.stream else f"[B, T, {plan.hidden_size}]"
        raise CrossingError(f"{what}, {node.format_node()}, is laid out {seen}, but the stream entering layer 0 is "
                            f"{want}; ppsplit packs one layout at every cut. Choose other stage boundaries or aux ids")


def _replicate_shared_caches(gm: fx.GraphModule, nodes: list[fx.Node], plan: SplitPlan,
                             annotated: Annotated) -> tuple:
    """A layer that reads another layer's KV cache (Gemma's KV sharing) on a later stage gets a replica of that
    cache on its own stage: the writes into it run on both stages (their new keys and values are then carried,
    a few bytes per token), so the whole cache never crosses. Marks every node that aliases such a cache (the
    buffer, its views, the writes) with ``meta["ppsplit.replicas"]``, the other stages that run it."""
    for node in nodes:
        node.meta.pop("ppsplit.replicas", None)
    calls = [n for n in nodes if n.op == "call_function"]
    writes = {n: mutated_bases(n) for n in calls}  # once per node, not once per cache buffer
    replicas = []
    for base in nodes:
        if base.op != "get_attr" or not is_cache_buffer(base.target) or "ppsplit.stage" not in base.meta:
            continue
        alias = {base}
        for n in calls:  # views of the cache, writes into it, and views of those (graph order: inputs first)
            if (is_view(n) and n.args[0] in alias) or base in writes[n] or (writes[n] and n.args[0] in alias):
                alias.add(n)
        home = base.meta["ppsplit.stage"]
        far = {_reader_stage(user, home, plan) for a in alias for user in a.users if user not in alias} - {home}
        if far:
            for a in alias:
                a.meta["ppsplit.replicas"] = tuple(sorted(far))
            size = pooled_bytes(base.target, gm.get_buffer(base.target), annotated.traced)
            replicas += [(s, base.target, size) for s in sorted(far)]
    return tuple(replicas)


def _reader_stage(user: fx.Node, home: int, plan: SplitPlan) -> int:
    """The stage a user of a value on stage ``home`` runs on (the graph output is read by the last stage)."""
    return user.meta.get("ppsplit.stage", home) if user.op != "output" else plan.pp - 1


def _carry(node: fx.Node, into: tuple[int, ...], reader: fx.Node, last: int, annotated: Annotated,
           plan: SplitPlan) -> Carry:
    """``node`` as a value carried into the stages ``into``, or a ``CrossingError`` saying why it cannot be."""
    layout = per_token_layout(node, annotated.traced)
    val = node.meta.get("val")
    why = None
    if layout is None:
        why = "it is not a tensor with one dimension of batch and one of tokens"
    elif not all(isinstance(d, int) for d in layout.shape):
        why = f"its per-token shape {list(layout.shape)} is not fixed"
    else:
        size = nbytes(layout.shape, val.dtype)
        unit = nbytes((), model_dtype(plan))
        if size % unit:
            why = f"its {size} bytes per token do not fill whole {plan.dtype} elements"
    if why:
        raise CrossingError(f"{node.format_node()} (stage {node.meta['ppsplit.stage']}) is read by {reader.name} on "
                            f"stage {last}, and only the residual stream or a value ppsplit can carry beside it may "
                            f"cross a stage boundary, but {why}. Choose other stage boundaries or report the model")
    return Carry(name=node.name, shape=tuple(int(d) for d in layout.shape), dtype=dtype_name(val.dtype), stages=into,
                 width=size // unit, token_dim=layout.token_dim, batch_dim=layout.batch_dim)
