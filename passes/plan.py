"""Pass 3, plan: pure data. Choose stage ranges with a balancing policy and place the taps.

A built-in policy gives each region (embedding, every decoder layer, head, and the fixed work of any stage) a
cost; ``passes/balance.py`` then finds the contiguous split whose slowest stage is as cheap as possible, exactly,
optionally under a per-stage cap on weights + KV cache (``max_stage_bytes``). Built in:

- ``"layers"``: every layer costs 1; when the layers do not divide evenly, the first and last stages, which also
  hold the embedding and the head, take the smaller shares.
- ``"params"``: parameter counts, embedding and head included.
- ``"memory"``: bytes of weights plus the static KV cache of each layer.
- ``"flops"``: matmul flops counted from the traced graph's shapes for a ``CostModel`` workload
  (``passes/costs.py``); the embedding, a gather, costs nothing, the head its full matmul.
- ``"time"``: each layer, the embedding and the head timed on the device they run on; the driver
  (``ppsplit.compile.measure``) measures and passes the result in as ``measured``.

A callable ``f(costs, pp) -> layer counts``, or an explicit list of counts, plugs in the same way. The plan records
every stage's cost under the policy (``StagePlan.cost``) and the regions it summed (``SplitPlan.region_costs``).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from ppsplit.core.options import COUNTED_POLICIES, Balance, CostModel
from ppsplit.core.errors import ConfigError, CrossingError
from ppsplit.core.fx_utils import state_slots
from ppsplit.passes.annotate import Annotated, residual_message, stream_layout
from ppsplit.passes.planning.balance import best_split, given_sizes, no_split_under_cap, smallest_cap
from ppsplit.passes.planning.costs import flops_costs
from ppsplit.passes.planning.half_plan import make_half_plan
from ppsplit.passes.planning.halves import half_costs
from ppsplit.core.plan import ModelCosts, ModelFacts, RegionCosts, SplitPlan, StagePlan, fmt_bytes
from ppsplit.core.tensors import dtype_name

BalancePolicy = Callable[[ModelCosts, int], Sequence[int]]


def layer_costs(costs: ModelCosts) -> RegionCosts:
    return RegionCosts(layers=(1.0,) * costs.num_layers, unit="layers")


def param_costs(costs: ModelCosts) -> RegionCosts:
    return RegionCosts(layers=tuple(float(p) for p in costs.layer_params), embed=float(costs.embed_params),
                       head=float(costs.head_params), unit="params")


def memory_costs(costs: ModelCosts) -> RegionCosts:
    """Bytes each part holds: weights, plus each layer's static KV cache when the split has one."""
    weights = costs.layer_bytes or (0,) * costs.num_layers
    cache = costs.layer_cache_bytes or (0,) * costs.num_layers
    return RegionCosts(layers=tuple(float(w + c) for w, c in zip(weights, cache)), embed=float(costs.embed_bytes),
                       head=float(costs.head_bytes), unit="bytes")


def balance_layers(costs: ModelCosts, pp: int) -> list[int]:
    # Whole layers dominate; the embedding and head only break ties, so uneven counts leave the end stages lighter.
    return best_split(RegionCosts(layers=(1000.0,) * costs.num_layers, embed=1.0, head=1.0), pp)


def balance_params(costs: ModelCosts, pp: int) -> list[int]:
    return best_split(param_costs(costs), pp)


POLICIES: dict[str, BalancePolicy] = {"layers": balance_layers, "params": balance_params,
                                      "memory": lambda costs, pp: best_split(memory_costs(costs), pp)}


def make_plan(costs: ModelCosts, pp: int, taps: Sequence[int] = (), *, balance: Balance = "layers",
              facts: ModelFacts = ModelFacts(), region_costs: RegionCosts | None = None,
              cost_model: CostModel | None = None, max_stage_bytes: int | None = None,
              half_layers: bool = False) -> SplitPlan:
    """Compute a ``SplitPlan`` for ``pp`` stages and the given tap ids (vLLM numbering, duplicates collapse).
    ``pp`` and ``taps`` are expected valid (``SplitOptions.taps`` checks them against the model). The ``flops``
    and ``time`` policies balance ``region_costs`` (counted by ``plan`` or measured by the driver); with
    ``max_stage_bytes`` no stage holds more weights + KV cache than that. ``facts``: what the plan records about
    the model (sizes, names, cache layout).

    Example::

        make_plan(costs, pp=4, taps=(2, 16, 29), balance="params", max_stage_bytes=20 << 30)

    ``half_layers``: stages may also end between a layer's attention and MLP blocks, where ``costs.mid_layers``
    says the layer has such a point (``passes/half_plan.py``).
    """
    if half_layers and costs.mid_layers:
        if isinstance(balance, str) and balance not in POLICIES and (balance not in COUNTED_POLICIES
                                                                     or region_costs is None):
            return make_plan(costs, pp, taps, balance=balance, region_costs=region_costs)  # the error below
        return make_half_plan(costs, pp, taps, balance=balance, region_costs=region_costs, cost_model=cost_model,
                              max_stage_bytes=max_stage_bytes, facts=facts)
    num_layers = costs.num_layers
    slots = tuple(sorted(set(int(t) for t in taps)))
    memory = memory_costs(costs)
    cap = None if max_stage_bytes is None else float(max_stage_bytes)

    if isinstance(balance, str):
        if balance not in POLICIES and (balance not in COUNTED_POLICIES or region_costs is None):
            extra = (f"; balance={balance!r} needs the costs that ppsplit.passes.plan.plan counts or "
                     "ppsplit.split_model measures" if balance in COUNTED_POLICIES else "")
            raise ConfigError(f"balance must be one of {', '.join(POLICIES)} (or a list of layer counts) when "
                              f"planning from parameter counts alone, but got {balance!r}{extra}")
        name = balance
        if balance in COUNTED_POLICIES:
            reported = region_costs
            sizes = best_split(region_costs, pp, memory=memory, cap=cap)
        else:
            reported = {"layers": layer_costs, "params": param_costs, "memory": memory_costs}[balance](costs)
            sizes = POLICIES[balance](costs, pp) if cap is None else best_split(
                RegionCosts(layers=(1000.0,) * num_layers, embed=1.0, head=1.0) if balance == "layers" else reported,
                pp, memory=memory, cap=cap)
        if sizes is None:
            raise no_split_under_cap(num_layers, pp, max_stage_bytes, smallest_cap(memory, pp))
    else:
        name, sizes = given_sizes(balance, costs, pp)
        reported = region_costs or param_costs(costs)
    sizes = [int(n) for n in sizes]
    if len(sizes) != pp or any(n < 1 for n in sizes) or sum(sizes) != num_layers:
        raise ConfigError(f"balance gave layer counts {sizes}; they must be {pp} positive numbers that add up to "
                          f"the model's {num_layers} decoder layers")
    if cap is not None:
        for k, held in enumerate(memory.stage_costs(sizes)):
            if held > cap:
                raise ConfigError(f"stage {k} of layer counts {sizes} holds {fmt_bytes(held)} of weights + KV cache, "
                                  f"over max_stage_bytes={max_stage_bytes} ({fmt_bytes(max_stage_bytes)}); choose "
                                  "other counts or a policy name, which then fits the cap")

    stage_cost = reported.stage_costs(sizes)
    stages = []
    start = 0
    for i, n in enumerate(sizes):
        end = start + n
        params = sum(costs.layer_params[start:end])
        nbytes = sum(costs.layer_bytes[start:end]) if costs.layer_bytes else 0
        if i == 0:
            params, nbytes = params + costs.embed_params, nbytes + costs.embed_bytes
        if i == pp - 1:
            params, nbytes = params + costs.head_params, nbytes + costs.head_bytes
        if pp == 1:
            params, nbytes = params - costs.tied_params, nbytes - costs.tied_bytes
        cache = sum(costs.layer_cache_bytes[start:end]) if costs.layer_cache_bytes else 0
        stages.append(StagePlan(index=i, start=start, end=end, cost=float(stage_cost[i]), params=params,
                                bytes=nbytes, cache_bytes=cache))
        start = end
    return SplitPlan(num_layers=num_layers, stages=tuple(stages), taps=slots, balance=name, costs=costs,
                     region_costs=reported, cost_model=cost_model if name in COUNTED_POLICIES else None,
                     max_stage_bytes=max_stage_bytes, **facts.fields())


def plan(annotated: Annotated, pp: int, taps: Sequence[int] = (), *, balance: Balance = "layers",
         cost_model: CostModel | None = None, max_stage_bytes: int | None = None,
         measured: RegionCosts | None = None, half_layers: bool = False) -> SplitPlan:
    """``make_plan`` with the costs, sizes and names that the trace and annotate passes found. ``balance="flops"``
    counts the graph's flops under ``cost_model``; ``balance="time"`` needs the driver's ``measured`` times.
    ``half_layers``: stages may also end between a layer's attention and MLP blocks (``annotated.mids``)."""
    gm = annotated.gm
    cut0 = gm.graph.find_nodes(op="placeholder", target="input_ids")[0]
    if annotated.residuals[0] is None:
        raise CrossingError(residual_message(annotated, 0))
    hidden = next(n for n in gm.graph.nodes if n.name == annotated.residuals[0])
    if hidden is cut0:
        raise ConfigError("the traced graph feeds input_ids straight into layer 0; ppsplit needs an embedding")
    val = hidden.meta["val"]
    cache = annotated.traced.cache
    paged = annotated.traced.stand_in is not None
    cost_model = cost_model or CostModel()
    region = None
    costs = annotated.costs
    if half_layers:
        costs = half_costs(annotated)
    if balance == "flops":
        region = flops_costs(annotated, cost_model, halves=half_layers)
    elif balance == "time":
        if measured is None:
            raise ConfigError("balance='time' needs each layer timed on its device; ppsplit.split_model measures "
                              "them (ppsplit.compile.measure.measure_costs), this pass only plans from the result")
        region = measured
    stream = stream_layout(hidden, annotated.traced)
    facts = ModelFacts(hidden_size=math.prod(stream.shape) if stream else int(val.shape[-1]), stream=stream,
                       dtype=dtype_name(val.dtype),
                       model_class=annotated.traced.model_class, layers_fqn=annotated.layers.fqn,
                       max_batch=cache.batch_size if cache else 0, max_len=cache.max_len if cache else 0,
                       block_size=cache.block_size if paged else 0, num_blocks=cache.pool_blocks if paged else 0,
                       state_slots=state_slots(annotated.traced.gm))
    return make_plan(costs, pp, taps, balance=balance, facts=facts, region_costs=region, cost_model=cost_model,
                     max_stage_bytes=max_stage_bytes, half_layers=half_layers)
