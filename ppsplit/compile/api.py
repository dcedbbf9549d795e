"""Driver: ``split_model``, the one public verb, and ``trace_model`` (trace once, split many ways).

Traces and annotates the model, plans the split, lowers it (``ppsplit.passes.pipeline``) and applies the stage
rewrites (``ppsplit.passes.rewrites``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from ppsplit.compile.measure import check_measurable, measure_costs
from ppsplit.core.errors import ConfigError
from ppsplit.core.layers import LayerStack, find_layers
from ppsplit.core.options import Aux, CacheConfig, SplitOptions
from ppsplit.passes.annotate import Annotated, annotate
from ppsplit.passes.paged import Unpageable
from ppsplit.passes.pipeline import lower
from ppsplit.passes.plan import plan as make_split_plan
from ppsplit.passes.rewrites import apply_rewrites
from ppsplit.passes.trace import trace
from ppsplit.passes.tp import check_shards, rank_stage, shard_stage
from ppsplit.core.plan import SplitPlan
from ppsplit.core.tensors import module_device
from ppsplit.serve.runtime import SplitModel

log = logging.getLogger("ppsplit")


def trace_model(model: torch.nn.Module, *, layers: str | None = None, cache: CacheConfig | None = None,
                paged: bool = True) -> Annotated:
    """Trace and annotate ``model`` once; pass the result to ``split_model`` to split it several ways.

    Example::

        traced = trace_model(model)
        for pp in (2, 4):
            split_model(traced, pp)
    """
    if cache is not None and not isinstance(cache, CacheConfig):
        raise ConfigError(f"cache must be a ppsplit.CacheConfig(batch_size, max_len), but got {cache!r}")
    return _trace(model, find_layers(model, layers), cache, paged)


def _trace(model: torch.nn.Module, stack: LayerStack, cache: CacheConfig | None, paged: bool = True) -> Annotated:
    start = time.perf_counter()
    log.info("tracing %s (%d decoder layers) with torch.export", type(model).__name__, stack.num_layers)
    annotated = annotate(trace(model, cache=cache, num_layers=stack.num_layers, paged=paged, layers=stack.fqn), stack)
    log.info("traced %d nodes in %.1fs", len(annotated.gm.graph.nodes), time.perf_counter() - start)
    return annotated


def split_model(model: torch.nn.Module | Annotated, pp: int | None = None, aux: Aux = None, *,
                options: SplitOptions | None = None, **keywords) -> SplitModel:
    """Split a Hugging Face decoder LM into ``pp`` pipeline stages that carry the taps ``aux``.

    ``aux``: ``None`` (no taps), ``"eagle3"`` (``2, L//2, L-3``), or tap ids (``"2,16,29"`` or a list) in vLLM's
    numbering: tap ``j`` is the residual stream entering layer ``j``, tap ``L`` the last layer's output.
    The other options are ``SplitOptions`` fields, as keywords (or all at once: ``options=SplitOptions(...)``):

    - the plan: ``balance`` (``"layers"``, ``"params"``, ``"memory"``, ``"flops"``, ``"time"``, layer counts, or
      ``f(costs, pp) -> counts``; every name minimises the slowest stage exactly), ``cost_model`` (the workload of
      ``flops`` and ``time``), ``max_stage_bytes`` (a cap on each stage's weights + KV cache), ``half_layers``
      (stages may also end between a layer's attention and MLP blocks), ``cache`` (``CacheConfig``: every stage
      owns a static KV cache of its layers; then ``positions`` are cache positions and the same stages serve
      prefill, decode and verification), ``aux_convention``, ``layers``;
    - lowering: ``attention`` (the attention over the cache becomes ``ppsplit::cache_attention`` where provably
      equal), ``fuse`` (``True``/``"all"``: tap stores, residual adds and norms as Triton kernels; ``"norms"``;
      ``False``/``"none"``);
    - built stages (``StageOptions``, the same rewrites ``load`` applies): ``fuse_projections`` (sibling linears
      on one input become one linear over their concatenated weight; default: on CUDA stages), ``fuse_pointwise``
      (the rotary embedding and SiLU-and-multiply as one Triton kernel each; default: on CUDA stages), ``gemv`` (one-row
      projections on CUDA through ppsplit's Triton GEMV), ``compile`` (Inductor at the first call per shape).

    ``model`` may be the result of ``trace_model``. The stages share the model's parameters (no copy).

    ``tp`` > 1 cuts every stage over ``tp`` tensor-parallel ranks (``ppsplit.passes.tp``) and returns a
    ``ShardedSplit`` (``.ranks[r]``: TP rank ``r``'s ``SplitModel``), or with ``tp_rank`` only that rank's
    ``SplitModel``, for a caller that runs it in its own process with its TP group registered
    (``ppsplit.distributed.tensor_parallel.use_group``).

    Example::

        split = split_model(AutoModelForCausalLM.from_config(cfg), pp=4, aux="2,16,29")
        logits, aux = split(input_ids)
    """
    if options is None:
        if pp is None:
            raise ConfigError("split_model needs pp, the number of pipeline stages (or options=SplitOptions(...))")
        options = SplitOptions(pp=pp, aux=aux, **keywords)
    elif keywords or pp is not None or aux is not None:
        raise ConfigError("pass either options=SplitOptions(...) or the options as keywords, not both")
    traced, taps = _traced(model, options)
    plan = plan_split(traced, options, taps)
    try:
        lowered = lower(traced, plan, attention=options.attention, fuse=options.fuse)
    except Unpageable as e:
        # The stages keep a lockstep batch x max_len cache instead: they decode, but take no ragged steps.
        log.warning("%s: the stages keep a lockstep cache (%s)", traced.traced.model_class, e)
        info = traced.traced
        if "lockstep" not in info.retraced:
            info.retraced["lockstep"] = _trace(info.source, find_layers(info.source, traced.layers.fqn), info.cache,
                                               paged=False)
        traced = info.retraced["lockstep"]
        plan = dataclasses.replace(plan_split(traced, options, taps), lockstep_reason=str(e))
        lowered = lower(traced, plan, attention=options.attention, fuse=options.fuse)
    info = traced.traced
    if options.tp > 1:
        return _tensor_parallel(lowered, info, options)
    for stage in lowered.stages:
        apply_rewrites(stage, options.stage)
    return SplitModel(lowered.plan, lowered.stages, eos_token_id=info.eos_token_id, pad_token_id=info.pad_token_id)


@dataclass
class ShardedSplit:
    """A split whose stages are each cut over ``plan.tp`` tensor-parallel ranks: ``ranks[r]`` is TP rank ``r``'s
    ``SplitModel`` (its stage ``k`` holds rank ``r``'s pieces of stage ``k``). Every rank's stages call the
    collectives of the process group registered as ``ppsplit_tp``
    (``ppsplit.distributed.tensor_parallel.use_group``), so each rank runs in a process of its own.

    Example (4 processes, TP groups of 2 registered)::

        split = split_model(model, pp=2, tp=2, tp_rank=tp_group.rank())   # one rank's SplitModel
    """

    plan: SplitPlan
    ranks: list


def _tensor_parallel(lowered, info, options: SplitOptions):
    """Each stage of ``lowered`` cut over ``options.tp`` ranks by the TP pass, proven equal to the whole stage by
    running the ranks in lockstep (when the weights are real), then the stage rewrites on every rank's stage."""
    tp_plan = getattr(getattr(info.source, "config", None), "base_model_tp_plan", None)
    sharded = [shard_stage(stage, options.tp, tp_plan) for stage in lowered.stages]
    plan = dataclasses.replace(lowered.plan, tp=options.tp, sharded=tuple(s.report for s in sharded))
    wanted = range(options.tp) if options.tp_rank is None else [options.tp_rank]
    ranks = {r: [rank_stage(stage, s, r) for stage, s in zip(lowered.stages, sharded)] for r in range(options.tp)}
    for k, stage in enumerate(lowered.stages):
        if module_device(stage).type != "meta":
            check_shards(stage, [ranks[r][k] for r in range(options.tp)])
    models = []
    for r in wanted:
        for stage in ranks[r]:
            stage.meta["ppsplit.plan"] = plan
            apply_rewrites(stage, options.stage)
        models.append(SplitModel(plan, ranks[r], eos_token_id=info.eos_token_id, pad_token_id=info.pad_token_id))
    if options.tp_rank is not None:
        return models[0]
    return ShardedSplit(plan, models)


def _traced(model: torch.nn.Module | Annotated, options: SplitOptions) -> tuple[Annotated, tuple[int, ...]]:
    """The annotated trace of ``model`` (traced now unless it is one already) and the taps, checked first."""
    if isinstance(model, Annotated):
        taps = options.taps(model.layers.num_layers)
        if options.cache is not None and model.traced.cache != options.cache:
            raise ConfigError(f"the traced graph was made with cache={model.traced.cache}, not {options.cache}; "
                              "pass cache= to trace_model instead")
        return model, taps
    stack = find_layers(model, options.layers)
    taps = options.taps(stack.num_layers)  # bad options fail here, before the slow trace
    if options.balance == "time":
        check_measurable(model)
    return _trace(model, stack, options.cache), taps


def plan_split(traced: Annotated, options: SplitOptions, taps: tuple[int, ...]):
    """The plan of ``options`` for ``traced`` (with the ``time`` policy, measured on the model's device first)."""
    measured = measure_costs(traced, options) if options.balance == "time" else None
    if options.half_layers and not traced.mids:
        log.warning("half_layers: no decoder layer of %s has a point between its attention and MLP blocks where only "
                    "the residual stream crosses; planning whole layers", traced.traced.model_class)
    return make_split_plan(traced, options.pp, taps, balance=options.balance, cost_model=options.cost_model,
                           max_stage_bytes=options.max_stage_bytes, measured=measured,
                           half_layers=options.half_layers)
