"""Pass 4, partition: give every token-dependent node its home stage, and check what crosses each boundary.

Values that do not depend on the tokens (positions, rotary cos/sin, masks, weights) get no home: emit
recomputes them on every stage that needs them. Of the token-dependent values, only the residual stream may
cross a boundary, and only into the next stage; anything else is a ``CrossingError`` naming the node.

Facts written: ``node.meta["ppsplit.stage"]`` on token nodes, ``gm.meta["ppsplit.boundaries"]`` (stage index
-> name of the residual-stream node it receives).
"""
from __future__ import annotations

from torch import fx

from ppsplit.errors import CrossingError
from ppsplit.plan import SplitPlan


def stage_of_region(plan: SplitPlan, region: int) -> int:
    """Region 0 (embedding) is stage 0; layer ``i`` and the work right after it go with layer ``i``'s stage."""
    if region == 0:
        return 0
    layer = (region - 1) // 2 if region % 2 else region // 2 - 1
    return plan.stage_of_layer(layer)


def partition(gm: fx.GraphModule, plan: SplitPlan) -> fx.GraphModule:
    """Assign home stages per ``plan``; raise ``CrossingError`` if a non-residual value would cross."""
    _check_annotated(gm, plan)
    nodes = list(gm.graph.nodes)
    for node in nodes:
        node.meta.pop("ppsplit.stage", None)
        if node.meta.get("ppsplit.token"):
            node.meta["ppsplit.stage"] = stage_of_region(plan, node.meta["ppsplit.region"])

    cuts = gm.meta["ppsplit.cuts"]
    by_name = {n.name: n for n in nodes}
    boundaries = {}
    for stage in plan.stages[1:]:
        crossing = cuts[stage.start]
        if len(crossing) != 1:
            raise CrossingError(_cut_message(by_name, crossing, stage.start, f"the boundary into stage {stage.index}"))
        boundaries[stage.index] = crossing[0]
    gm.meta["ppsplit.boundaries"] = boundaries

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
    return gm


def _cut_message(by_name: dict, crossing: list[str], layer: int, what: str) -> str:
    if not crossing:
        return (f"no token-dependent value enters decoder layer {layer}, so {what} carries nothing; "
                "the model's layers do not form a residual stream ppsplit can cut")
    detail = "; ".join(by_name[c].format_node() for c in crossing)
    return (f"{len(crossing)} token-dependent values cross {what} before decoder layer {layer}, but only the residual "
            f"stream may: {detail}. Choose other stage boundaries or report the model")


def _check_annotated(gm: fx.GraphModule, plan: SplitPlan) -> None:
    stack = gm.meta.get("ppsplit.layers")
    if stack is None or "ppsplit.cuts" not in gm.meta:
        raise ValueError("partition needs a graph from the trace and annotate passes")
    if stack.num_layers != plan.num_layers:
        raise ValueError(f"the plan is for {plan.num_layers} layers but the graph has {stack.num_layers}")
