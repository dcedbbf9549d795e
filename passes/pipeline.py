"""The pass pipeline, stated once: the order of the passes, and ``lower``, which runs them after planning.

    trace -> annotate -> plan -> partition -> taps -> attention -> paged -> fuse -> emit

``trace`` and ``annotate`` run once per model (``ppsplit.trace_model``), ``plan`` once per split; ``lower`` runs
the rest for ``split_model``, for the ``time`` policy's measurement and for ``ppsplit compile`` alike. Each pass
returns a new result over its own copy of the graph, and the plan is completed once, from their reports. What is
applied to the emitted stages afterwards is a stage rewrite (``ppsplit.passes.rewrites``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import fx

from ppsplit.core.errors import ConfigError
from ppsplit.core.options import Fuse
from ppsplit.core.plan import SplitPlan
from ppsplit.passes.annotate import Annotated
from ppsplit.passes.attention import attention as attention_pass
from ppsplit.passes.emit import emit
from ppsplit.passes.fuse import fuse as fuse_pass
from ppsplit.passes.paged import paged
from ppsplit.passes.partition import partition
from ppsplit.passes.taps import taps

ORDER = ("trace", "annotate", "plan", "partition", "taps", "attention", "paged", "fuse", "emit")


@dataclass(frozen=True)
class Lowered:
    """``lower``'s result: the plan completed with what the passes did (attention sites, fusion, carries,
    replicas), and one stage per plan stage."""

    plan: SplitPlan
    stages: list[fx.GraphModule]


def lower(annotated: Annotated, plan: SplitPlan, *, attention: bool = True, fuse: Fuse = "all") -> Lowered:
    """Partition, tap, replace the cached attention (``attention``), page the cache (when the trace has a paged
    cache's stand-in; ``Unpageable`` says why it cannot), fuse (``fuse``: "all", "norms" or "none") and emit: the
    stages of ``plan``.

    Example::

        lowered = lower(trace_model(model), plan)
        logits, aux = lowered.stages[0](input_ids, positions, aux)   # ... through every stage
    """
    result = taps(partition(annotated, plan), plan)
    sites = fused = ()
    info = annotated.traced
    if info.stand_in is not None and not attention:
        raise ConfigError("a paged cache needs the attention pass (attention=True): the traced attention reads the "
                          "stand-in cache it replaces")
    if attention:
        result = attention_pass(result, plan)
        sites = result.sites
    if info.stand_in is not None:
        result = paged(result, plan, info.cache, info.stand_in)
    if fuse != "none":
        result = fuse_pass(result, plan, taps=fuse == "all")
        fused = result.report
    plan = dataclasses.replace(plan, attention=sites, fused=fused, carries=result.carries, replicas=result.replicas)
    return Lowered(plan, emit(result, plan))
