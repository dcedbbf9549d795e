"""Pass 4, partition: give every token-dependent node its home stage, and check what crosses each boundary.

Values that do not depend on the tokens (positions, rotary cos/sin, masks, weights) get no home: emit
recomputes them on every stage that needs them. Of the token-dependent values, only the residual stream may
cross a boundary, and only into the next stage; anything else is a ``CrossingError`` naming the node.

The pass works on a fresh copy of the annotated graph (same tensors, same node names and facts), so one trace
serves many splits. Facts written: ``node.meta["ppsplit.stage"]`` on token nodes; the result, ``Partitioned``,
holds the copy and the boundaries (stage index -> name of the residual-stream node it receives).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from ppsplit.errors import CrossingError
from ppsplit.fx_utils import copy_buffer_persistence
from ppsplit.passes.annotate import Annotated
from ppsplit.plan import SplitPlan


@dataclass(frozen=True)
class Partitioned:
    """The partition pass's result: a graph whose token nodes know their stage, and what crosses each boundary."""

    gm: fx.GraphModule
    annotated: Annotated
    boundaries: dict[int, str]  # stage s > 0 -> the residual-stream node it receives from stage s - 1


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
    gm = _fresh_copy(annotated.gm)
    nodes = list(gm.graph.nodes)
    for node in nodes:
        node.meta.pop("ppsplit.stage", None)
        if node.meta.get("ppsplit.token"):
            node.meta["ppsplit.stage"] = stage_of_region(plan, node.meta["ppsplit.region"])

    cuts = annotated.cuts
    by_name = {n.name: n for n in nodes}
    boundaries = {}
    for stage in plan.stages[1:]:
        crossing = cuts[stage.start]
        if len(crossing) != 1:
            raise CrossingError(_cut_message(by_name, crossing, stage.start, f"the boundary into stage {stage.index}"))
        boundaries[stage.index] = crossing[0]

    for node in nodes:
        home = node.meta.get("ppsplit.stage")
        if home is None:
            continue
        for user in node.users:
            there = user.meta.get("ppsplit.stage", home) if user.op != "output" else plan.pp - 1
            if there == home:
                continue
            if there == home + 1 and boundaries.get(there) == node.name:
                continue
            raise CrossingError(
                f"{node.format_node()} (stage {home}) is read by {user.name} on stage {there}; only the residual "
                "stream may cross a stage boundary, into the next stage. Choose other stage boundaries or report "
                "the model")
    gm.graph.lint()
    return Partitioned(gm=gm, annotated=annotated, boundaries=boundaries)


def _fresh_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph over the same tensors, with the same node names and meta."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copy_buffer_persistence(copy, gm)
    return copy


def _cut_message(by_name: dict, crossing: list[str], layer: int, what: str) -> str:
    if not crossing:
        return (f"no token-dependent value enters decoder layer {layer}, so {what} carries nothing; "
                "the model's layers do not form a residual stream ppsplit can cut")
    detail = "; ".join(by_name[c].format_node() for c in crossing)
    return (f"{len(crossing)} token-dependent values cross {what} before decoder layer {layer}, but only the residual "
            f"stream may: {detail}. Choose other stage boundaries or report the model")

