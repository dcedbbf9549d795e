"""The pass pipeline, stated once: the order of the passes, and ``lower``, which runs them after planning.

    trace -> annotate -> plan -> partition -> taps -> attention -> fuse -> emit

``trace`` and ``annotate`` run once per model (``ppsplit.trace_model``), ``plan`` once per split; ``lower`` runs
the rest for ``split_model``, for the ``time`` policy's measurement and for ``ppsplit compile`` alike. Each pass
returns a new result over its own copy of the graph, and the plan is completed once, from their reports. What is
applied to the emitted stages afterwards is a stage rewrite (``ppsplit.passes.rewrites``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import fx

from ppsplit.core.options import Fuse
from ppsplit.core.plan import SplitPlan
from ppsplit.passes.annotate import Annotated
from ppsplit.passes.attention import attention as attention_pass
from ppsplit.passes.emit import emit
from ppsplit.passes.fuse import fuse as fuse_pass
from ppsplit.passes.partition import partition
from ppsplit.passes.taps import taps

ORDER = ("trace", "annotate", "plan", "partition", "taps", "attention", "fuse", "emit")


@dataclass(frozen=True)
class Lowered:
    """``lower``'s result: the plan completed with what the passes did (attention sites, fusion, carries,
    replicas), and one stage per plan stage."""

    plan: SplitPlan
    stages: list[fx.GraphModule]


def lower(annotated: Annotated, plan: SplitPlan, *, attention: bool = True, fuse: Fuse = "all") -> Lowered:
    """Partition, tap, replace the cached attention (``attention``), fuse (``fuse``: "all", "norms" or "none")
    and emit: the stages of ``plan``.

    Example::

        lowered = lower(trace_model(model), plan)
        logits, aux = lowered.stages[0](input_ids, positions, aux)   # ... through every stage
    """
    result = taps(partition(annotated, plan), plan)
    sites = fused = ()
    if attention:
        result = attention_pass(result, plan)
        sites = result.sites
    if fuse != "none":
        result = fuse_pass(result, plan, taps=fuse == "all")
        fused = result.report
    plan = dataclasses.replace(plan, attention=sites, fused=fused, carries=result.carries, replicas=result.replicas)
    return Lowered(plan, emit(result, plan))
