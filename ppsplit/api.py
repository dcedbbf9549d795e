"""Driver: ``split_model``, the one public verb, and ``trace_model`` (trace once, split many ways).

Runs the passes in order, each taking the typed result of the one before::

    trace -> annotate -> plan -> partition -> taps -> attention -> fuse -> emit
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ppsplit.config import Aux, Balance, CacheConfig, CostModel, Fuse, SplitOptions
from ppsplit.errors import ConfigError
from ppsplit.measure import check_measurable, measure_costs
from ppsplit.passes.annotate import Annotated, LayerStack, annotate, find_layers
from ppsplit.passes.attention import attention as cache_attention
from ppsplit.passes.emit import emit
from ppsplit.passes.fuse import fuse as fuse_kernels
from ppsplit.passes.partition import partition
from ppsplit.passes.gemv import route_gemv
from ppsplit.passes.plan import plan as make_split_plan
from ppsplit.passes.projections import fuse_projections as fuse_stage_projections
from ppsplit.passes.taps import taps as add_taps
from ppsplit.passes.trace import trace
from ppsplit.runtime import SplitModel

log = logging.getLogger("ppsplit")


def trace_model(model: torch.nn.Module, *, layers: str | None = None, cache: CacheConfig | None = None) -> Annotated:
    """Trace and annotate ``model`` once; pass the result to ``split_model`` to split it several ways.

    Example::

        traced = trace_model(model)
        for pp in (2, 4):
            split_model(traced, pp)
    """
    if cache is not None and not isinstance(cache, CacheConfig):
        raise ConfigError(f"cache must be a ppsplit.CacheConfig(batch_size, max_len), but got {cache!r}")
    return _trace(model, find_layers(model, layers), cache)


def _trace(model: torch.nn.Module, stack: LayerStack, cache: CacheConfig | None) -> Annotated:
    start = time.perf_counter()
    log.info("tracing %s (%d decoder layers) with torch.export", type(model).__name__, stack.num_layers)
    annotated = annotate(trace(model, cache=cache, num_layers=stack.num_layers), stack)
    log.info("traced %d nodes in %.1fs", len(annotated.gm.graph.nodes), time.perf_counter() - start)
    return annotated


def split_model(model: torch.nn.Module | Annotated, pp: int | None = None, aux: Aux = None, *,
                balance: Balance = "layers", aux_convention: str = "vllm", layers: str | None = None,
                cache: CacheConfig | None = None, fuse: Fuse | bool = True, attention: bool = True,
                compile: bool = False, max_stage_bytes: int | None = None, cost_model: CostModel | None = None,
                fuse_projections: bool = False, half_layers: bool = False, gemv: bool = True,
                options: SplitOptions | None = None) -> SplitModel:
    """Split a Hugging Face decoder LM into ``pp`` pipeline stages that carry the taps ``aux``.

    ``aux``: ``None`` (no taps), ``"eagle3"`` (``2, L//2, L-3``), or tap ids (``"2,16,29"`` or a list) in vLLM's
    numbering: tap ``j`` is the residual stream entering layer ``j``, tap ``L`` the last layer's output.
    ``balance``: ``"layers"``, ``"params"``, ``"memory"`` (weights + KV cache), ``"flops"`` (counted from the
    graph's shapes under ``cost_model``), ``"time"`` (each layer timed on the model's device under ``cost_model``),
    a list of layer counts, or ``f(costs, pp) -> counts``; every policy name minimises the slowest stage exactly.
    ``max_stage_bytes``: no stage holds more weights + KV cache than this. ``cost_model``: the workload
    (``CostModel(batch, tokens, context, prefill, decode_weight, prefill_weight)``; default: decode, batch 1).
    ``cache``: ``CacheConfig(batch_size, max_len)`` gives every stage a static KV cache for its layers; then
    ``positions`` are the cache positions of the new tokens and the same stages serve prefill, decode and
    verification. ``fuse``: ``True`` / ``"all"`` folds each tap store, with the residual add and norm around it,
    into one Triton kernel (and fuses the other add+norm pairs the same way); ``"norms"`` keeps a separate store
    per tap; ``False`` / ``"none"`` keeps the traced ops. ``attention``: replace the attention over the static
    cache with ``ppsplit::cache_attention`` where it is provably equal (the plan says per stage). ``compile``:
    compile each stage with Inductor (``torch.compile``, no CUDA graphs inside: ``capture`` adds ppsplit's own).
    ``fuse_projections``: sibling linears reading one input (q/k/v, gate/up) become one linear over their
    concatenated weight per stage (``ppsplit.passes.projections``); those stages then hold the fused weight, a new
    tensor, instead of the model's separate ones.
    ``gemv``: projections with at least 4096 outputs go through ``ppsplit::linear``, which runs ppsplit's Triton
    GEMV for a one-row input on CUDA (decode at batch 1) and the traced ATen call otherwise
    (``ppsplit.passes.gemv``).
    ``half_layers``: stages may also end between a layer's attention block and its MLP block, where only the
    residual stream crosses (layers without such a point stay whole); every policy then costs the halves, and
    an explicit list may count halves (``[8.5, 8, 8, 7.5]``).
    ``options``: all of these as one ``SplitOptions`` (then pass no other option). ``model`` may be the result
    of ``trace_model``. The stages share the model's parameters (no copy).

    Example::

        split = split_model(AutoModelForCausalLM.from_config(cfg), pp=4, aux="2,16,29")
        logits, aux = split(input_ids)
    """
    if options is None:
        if pp is None:
            raise ConfigError("split_model needs pp, the number of pipeline stages (or options=SplitOptions(...))")
        options = SplitOptions(pp=pp, aux=aux, balance=balance, aux_convention=aux_convention, layers=layers,
                               cache=cache, fuse=fuse, attention=attention, compile=compile,
                               max_stage_bytes=max_stage_bytes, cost_model=cost_model or CostModel(),
                               fuse_projections=fuse_projections, half_layers=half_layers, gemv=gemv)
    if isinstance(model, Annotated):
        traced = model
        taps = options.taps(traced.layers.num_layers)
        if options.cache is not None and traced.traced.cache != options.cache:
            raise ConfigError(f"the traced graph was made with cache={traced.traced.cache}, not {options.cache}; "
                              "pass cache= to trace_model instead")
    else:
        stack = find_layers(model, options.layers)
        taps = options.taps(stack.num_layers)  # bad options fail here, before the slow trace
        if options.balance == "time":
            check_measurable(model)
        traced = _trace(model, stack, options.cache)
    measured = None
    if options.balance == "time":
        measured = measure_costs(traced, options.cost_model, fuse=options.fuse, attention=options.attention,
                                 halves=options.half_layers, gemv=options.gemv)
    if options.half_layers and not traced.mids:
        log.warning("half_layers: no decoder layer of %s has a point between its attention and MLP blocks where only "
                    "the residual stream crosses; planning whole layers", traced.traced.model_class)
    plan = make_split_plan(traced, options.pp, taps, balance=options.balance, cost_model=options.cost_model,
                           max_stage_bytes=options.max_stage_bytes, measured=measured, half_layers=options.half_layers)
    rewritten = add_taps(partition(traced, plan), plan)
    if options.attention:
        plan = dataclasses.replace(plan, attention=cache_attention(rewritten, plan).sites)
    if options.fuse != "none":
        rewritten = fuse_kernels(rewritten, plan, taps=options.fuse == "all")
        plan = dataclasses.replace(plan, fused=rewritten.report)
    info = traced.traced
    plan = dataclasses.replace(plan, carries=rewritten.carries, replicas=rewritten.replicas)
    stages = emit(rewritten, plan)
    if options.fuse_projections:
        for stage in stages:
            stage.meta["ppsplit.projections"] = fuse_stage_projections(stage)
    if options.gemv:
        for stage in stages:
            stage.meta["ppsplit.gemv"] = route_gemv(stage)
    if options.compile:
        from ppsplit.inductor import compile_stages
        compile_stages(stages)
    return SplitModel(plan, stages, eos_token_id=info.eos_token_id, pad_token_id=info.pad_token_id)
