"""Pass 5, taps: write each tap's value into its slot of the packed aux buffer.

Adds the ``aux`` input ``[n_slots, B, T, H]`` and, right after the node that computes tap ``j`` (the residual
stream entering layer ``j``), a ``ppsplit::tap_store(aux, slot(j), value)`` on the tap's owner stage. A stream of
several vectors per token (``plan.stream``) is stored token-major, ``[B, T, plan.hidden_size]``.

Facts written: ``node.meta["ppsplit.tap"] = j`` on each store. The result, ``Tapped``, holds the rewritten copy of
the graph and the partition's facts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import ppsplit.triton_kernels  # noqa: F401  (registers torch.ops.ppsplit.*)
from ppsplit.core.errors import CrossingError
from ppsplit.core.fx_utils import fresh_copy, token_rows
from ppsplit.passes.annotate import mutated_bases
from ppsplit.passes.partition import Partitioned, carry_forward, check_stream
from ppsplit.core.plan import SplitPlan


@dataclass(frozen=True)
class Tapped(Partitioned):
    """The taps pass's result: a copy of the partitioned graph with an ``aux`` input and one store per tap."""


def taps(partitioned: Partitioned, plan: SplitPlan) -> Tapped:
    gm = fresh_copy(partitioned.gm)
    graph = gm.graph
    positions = graph.find_nodes(op="placeholder", target="positions")[0]
    with graph.inserting_after(positions):
        aux = graph.placeholder("aux")
    aux.meta["ppsplit.token"] = False

    by_name = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for slot, tap in enumerate(plan.taps):
        residual = partitioned.annotated.residuals[tap]
        if residual is None:
            names = partitioned.annotated.cuts[tap]
            where = f"decoder layer {tap}" if tap < plan.num_layers else "the head"
            raise CrossingError(f"tap {tap} is ambiguous: {len(names) or 'no'} token-dependent values enter {where} "
                                f"({', '.join(names) or 'none'}) and none is the residual stream; choose another aux id")
        value = by_name[residual]
        owner = value.meta["ppsplit.stage"]
        if owner != plan.owner(tap):
            raise CrossingError(f"tap {tap} is computed by {value.format_node()} on stage {owner}, but stage "
                                f"{plan.owner(tap)} owns it; choose another aux id")
        check_stream(list(graph.nodes), residual, partitioned.annotated, plan, f"tap {tap}")
        meta = {"ppsplit.token": True, "ppsplit.stage": owner, "ppsplit.layer": value.meta.get("ppsplit.layer"),
                "ppsplit.region": value.meta["ppsplit.region"]}
        # In order, right after the value and any in-place write into it (Gemma 3n adds into a slice of its stack).
        last = max((n for n in graph.nodes if value in mutated_bases(n)), key=order.get, default=value)
        with graph.inserting_before(last.next):
            rows = token_rows(graph, value, plan.stream, meta=meta) if plan.stream else value
            store = graph.call_function(torch.ops.ppsplit.tap_store.default, (aux, slot, rows))
        store.meta.update({**meta, "ppsplit.tap": tap})
    graph.lint()
    return carry_forward(partitioned, Tapped, gm=gm)
