"""Plan helper: stage ranges in half layers, when the caller opts in (``split_model(..., half_layers=True)``).

A unit is a layer's attention half or its MLP half wherever ``halves.find_mids`` found a clean cut point between
them (``ModelCosts.mid_layers``), else the whole layer. Boundaries are half-layer positions: ``2j`` is the start of
layer ``j``, ``2j + 1`` its middle. Every policy name costs the halves: ``layers`` half a layer each, ``params`` and
``memory`` what each half reads (the KV cache is the attention half's), ``flops`` and ``time`` their
``RegionCosts.attention``. ``best_bounds`` then finds the exact min-max split over those units; an explicit
list of layer counts may use halves (``[8.5, 8, 8, 7.5]``).
"""
from __future__ import annotations

from typing import Sequence

from ppsplit.core.options import COUNTED_POLICIES, Balance, CostModel
from ppsplit.core.errors import ConfigError
from ppsplit.passes.planning.balance import best_bounds, given_sizes, no_split_under_cap
from ppsplit.core.plan import ModelCosts, ModelFacts, RegionCosts, SplitPlan, StagePlan, fmt_bytes


def half_units(costs: ModelCosts, name: str, region_costs: RegionCosts | None) -> RegionCosts:
    """What each layer and each layer's attention half costs under the policy ``name``."""
    n = costs.num_layers
    attn_params = costs.attn_params or (0,) * n
    if name == "layers":
        return RegionCosts(layers=(1.0,) * n, attention=(0.5,) * n, unit="layers")
    if name == "params":
        return RegionCosts(layers=tuple(float(p) for p in costs.layer_params), embed=float(costs.embed_params),
                           head=float(costs.head_params), attention=tuple(float(p) for p in attn_params), unit="params")
    if name == "memory":
        return half_memory(costs)
    if region_costs is None or len(region_costs.attention) != n:
        raise ConfigError(f"balance={name!r} with half layers needs each layer's attention half costed: "
                          "ppsplit.passes.plan.plan counts it with half_layers=True, ppsplit.split_model measures it")
    return region_costs


def half_memory(costs: ModelCosts) -> RegionCosts:
    """Bytes of weights + KV cache per layer and per attention half (the cache is all there)."""
    n = costs.num_layers
    weights = costs.layer_bytes or (0,) * n
    cache = costs.layer_cache_bytes or (0,) * n
    attn = costs.attn_bytes or (0,) * n
    return RegionCosts(layers=tuple(float(w + c) for w, c in zip(weights, cache)), embed=float(costs.embed_bytes),
                       head=float(costs.head_bytes), attention=tuple(float(a + c) for a, c in zip(attn, cache)),
                       unit="bytes")


def allowed_cuts(costs: ModelCosts) -> list[int]:
    """Half-layer positions where a stage may begin: every layer's start, and the middle of the layers that have
    a clean mid point."""
    return sorted({2 * j for j in range(costs.num_layers + 1)} | {2 * j + 1 for j in costs.mid_layers})


def make_half_plan(costs: ModelCosts, pp: int, taps: Sequence[int], *, balance: Balance,
                   region_costs: RegionCosts | None, cost_model: CostModel | None, max_stage_bytes: int | None,
                   facts: ModelFacts) -> SplitPlan:
    """``make_plan`` in half layers (same arguments)."""
    n = costs.num_layers
    cuts = allowed_cuts(costs)
    memory = half_memory(costs)
    cap = None if max_stage_bytes is None else float(max_stage_bytes)
    if isinstance(balance, str):
        name = balance
        reported = half_units(costs, balance, region_costs)
        # Whole layers dominate the layers policy; the embedding and head only break ties (as make_plan does).
        minimised = (RegionCosts(layers=(1000.0,) * n, attention=(500.0,) * n, embed=1.0, head=1.0)
                     if balance == "layers" else reported)
        bounds = best_bounds(minimised, pp, cuts, memory=memory, cap=cap)
        if bounds is None:
            need = max(memory.span_costs(best_bounds(memory, pp, cuts)))
            raise no_split_under_cap(n, pp, max_stage_bytes, need, unit="layers (in half layers)")
    else:
        name, sizes = given_sizes(balance, costs, pp)
        bounds = _bounds_of(sizes, pp, n, cuts)
        reported = half_units(costs, "params", None) if region_costs is None else region_costs
        if not reported.attention:
            reported = half_units(costs, "params", None)
    if cap is not None:
        for k, held in enumerate(memory.span_costs(bounds)):
            if held > cap:
                raise ConfigError(f"stage {k} of layer counts {list(_sizes(bounds))} holds {fmt_bytes(held)} of "
                                  f"weights + KV cache, over max_stage_bytes={max_stage_bytes} "
                                  f"({fmt_bytes(max_stage_bytes)}); choose other counts or a policy name, which then "
                                  "fits the cap")
    params = half_units(costs, "params", None)
    weights = RegionCosts(layers=tuple(float(b) for b in costs.layer_bytes or (0,) * n), embed=float(costs.embed_bytes),
                          head=float(costs.head_bytes), attention=tuple(float(b) for b in costs.attn_bytes or (0,) * n))
    cache = costs.layer_cache_bytes or (0,) * n
    cache = RegionCosts(layers=tuple(float(c) for c in cache), attention=tuple(float(c) for c in cache))
    stage_cost, held_params, held_bytes, held_cache = (r.span_costs(bounds) for r in (reported, params, weights, cache))
    stages = tuple(StagePlan(index=k, start=p // 2, end=q // 2, cost=float(stage_cost[k]), params=int(held_params[k]),
                             bytes=int(held_bytes[k]), cache_bytes=int(held_cache[k]), half_end=bool(q % 2))
                   for k, (p, q) in enumerate(zip(bounds, bounds[1:])))
    return SplitPlan(num_layers=n, stages=stages, taps=tuple(sorted(set(int(t) for t in taps))), balance=name,
                     costs=costs, region_costs=reported, cost_model=cost_model if name in COUNTED_POLICIES else None,
                     max_stage_bytes=max_stage_bytes, **facts.fields())


def _bounds_of(sizes: list, pp: int, n: int, cuts: list[int]) -> list[int]:
    """Layer counts (multiples of 0.5) -> half-layer boundaries, checked against the model's cut points."""
    halves = [2 * s for s in sizes]
    if (len(sizes) != pp or any(h != int(h) or h < 1 for h in halves) or sum(halves) != 2 * n):
        raise ConfigError(f"balance gave layer counts {sizes}; with half layers they must be {pp} positive multiples "
                          f"of 0.5 that add up to the model's {n} decoder layers")
    bounds = [0]
    for h in halves:
        bounds.append(bounds[-1] + int(h))
    allowed = set(cuts)
    mids = ", ".join(str(c // 2) for c in cuts if c % 2) or "none"
    for b in bounds:
        if b not in allowed:
            raise ConfigError(f"layer counts {sizes} cut decoder layer {b // 2} in the middle, but that layer has no "
                              "point where only the residual stream crosses between its attention and its MLP; "
                              f"cut it whole (layers with a mid point: {mids})")
    return bounds


def _sizes(bounds: list[int]) -> list[float]:
    return [(q - p) / 2 for p, q in zip(bounds, bounds[1:])]
