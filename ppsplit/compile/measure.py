"""Driver: time each decoder layer, the embedding and the head on the device they run on (the ``time`` policy).

The traced model is split one layer per stage (pp = L) and every stage is timed on the model's device with the
``CostModel`` workload: on a GPU each stage is captured as a CUDA graph and replayed (what serving runs), on the
CPU it runs eagerly. Stage 0 is the embedding + layer 0, the last stage layer L-1 + the head. The same model as
one stage (pp = 1) gives the fixed cost a stage pays once however many layers it has (rotary tables and masks
from positions, launch): ``(sum of the L stages - the one stage) / (L - 1)``; it is taken out of every layer and
kept as the per-stage cost, so a stage of ``n`` layers costs ``stage + sum(its layers)``. The embedding and the
head are separated from layers 0 and L-1 by taking those layers to cost the median middle layer (only the
display depends on this: stage 0 always runs both).

With ``halves`` (``split_model(..., half_layers=True)``) the split is one *half layer* per stage instead, wherever a
layer has a cut point between its attention and MLP blocks: each half is timed on its own, the same way, and a
layer's cost is the sum of its two halves (``RegionCosts.attention`` keeps the first). The per-stage cost is then
the mean over those stages, although a stage holding only MLP halves recomputes no rotary tables or masks.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import torch

from ppsplit.core.errors import ConfigError
from ppsplit.core.options import CostModel, SplitOptions
from ppsplit.core.plan import RegionCosts
from ppsplit.passes.annotate import Annotated
from ppsplit.passes.pipeline import lower
from ppsplit.passes.plan import plan as make_split_plan
from ppsplit.passes.planning.costs import weighted
from ppsplit.passes.rewrites import apply_rewrites
from ppsplit.serve.cuda_graphs import CapturedStage
from ppsplit.core.tensors import model_dtype, module_device

log = logging.getLogger("ppsplit")


def measure_costs(annotated: Annotated, options: SplitOptions, *, rounds: int = 7) -> RegionCosts:
    """Milliseconds of the embedding, each layer, the head and the per-stage work under ``options.cost_model``,
    each part lowered and rewritten as ``options`` asks (``compile`` aside: the stages are timed uncompiled).

    Example::

        traced = ppsplit.trace_model(model.cuda(), cache=CacheConfig(8, 4096))
        measure_costs(traced, SplitOptions(pp=4, cost_model=CostModel(batch=8, context=2048))).layers   # ms per layer
    """
    model = options.cost_model
    halves = options.half_layers
    gm = annotated.gm
    check_measurable(gm)
    device = next((t.device for t in gm.parameters()), torch.device("cpu"))
    _check_fits(annotated, model)
    num_layers = annotated.layers.num_layers
    units = [1] * num_layers
    if halves:
        units = [u for j in range(num_layers) for u in ((0.5, 0.5) if j in annotated.mids else (1,))]
    one = _stages(annotated, units, options)
    whole = _stages(annotated, [num_layers], dataclasses.replace(options, half_layers=False)) if len(units) > 1 else None
    start = time.perf_counter()
    parts = []
    for weight, tokens, position in _steps(model):
        position = position if annotated.traced.cache is not None else 0  # no cache: the step is the whole sequence
        stages = one + (whole or [])
        times = _time_stages(stages, model.batch, tokens, position, rounds)
        per_layer = times[:len(units)]
        overhead = 0.0
        if whole is not None:
            overhead = (sum(per_layer) - times[-1]) / (len(units) - 1)
            overhead = min(max(overhead, 0.0), min(per_layer))  # noise must not make a layer negative
        net = [t - overhead for t in per_layer]
        parts.append((weight, _half_regions(net, units, overhead) if halves else _regions(net, overhead)))
    log.info("timed %d layers on %s in %.1fs", num_layers, device, time.perf_counter() - start)
    del one, whole
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return weighted(parts)


def check_measurable(module: torch.nn.Module) -> None:
    """Raise a ``ConfigError`` if ``module``'s weights are on the meta device (nothing to time)."""
    if any(t.device.type == "meta" for t in module.parameters()):
        raise ConfigError("balance='time' times every layer on the device it will run on, but the model's weights are "
                          "on the meta device; load the real weights (or use balance='flops', counted from shapes)")


def _stages(annotated: Annotated, sizes: list, options: SplitOptions) -> list[torch.nn.Module]:
    """The stages of the split with these layer counts, without taps, as ``split_model`` makes them (lowered and
    rewritten alike, Inductor aside): the attention pass too, since the traced attention it replaces can cost
    several times more (at batch 32 an 8B layer's decode step took 890 us traced against 206 us with
    ``cache_attention``)."""
    plan = make_split_plan(annotated, len(sizes), (), balance=sizes, half_layers=options.half_layers)
    stages = lower(annotated, plan, attention=options.attention, fuse=options.fuse).stages
    for stage in stages:
        apply_rewrites(stage, dataclasses.replace(options.stage, compile=False))
    return stages


def _steps(model: CostModel):
    """(weight, tokens, first position) of the decode and prefill steps the workload weighs."""
    if model.decode_weight:
        yield model.decode_weight, model.tokens, model.context
    if model.prefill_weight:
        yield model.prefill_weight, model.prefill, 0


def _check_fits(annotated: Annotated, model: CostModel) -> None:
    cache = annotated.traced.cache
    if cache is None:
        if model.context:
            log.info("balance='time': the traced model has no KV cache, so a step attends to its own tokens only "
                     "(context %d is not timed); trace with cache=CacheConfig(...) to time attention over it",
                     model.context)
        return
    longest = max(p + t for _, t, p in _steps(model))
    if model.batch > cache.batch_size or longest > cache.max_len:
        raise ConfigError(f"the cost model's steps (batch {model.batch}, up to position {longest}) do not fit the KV "
                          f"cache of {cache.batch_size} x {cache.max_len}; use a smaller CostModel or a larger "
                          "CacheConfig")


def _regions(times: list[float], overhead: float) -> RegionCosts:
    layers = list(times)
    embed = head = 0.0
    if len(layers) > 2:
        typical = statistics.median(layers[1:-1])
        embed, head = max(layers[0] - typical, 0.0), max(layers[-1] - typical, 0.0)
        layers[0] -= embed
        layers[-1] -= head
    return RegionCosts(layers=tuple(layers), embed=embed, head=head, stage=overhead, unit="ms")


def _half_regions(times: list[float], units: list, overhead: float) -> RegionCosts:
    """Per-unit times (a layer's two halves, or a whole layer) -> ``RegionCosts`` with ``attention``; the embedding
    and head come out of the first and last unit as ``_regions`` takes them out of the first and last layer."""
    layers, attn, split, k = [], [], [], 0
    while k < len(units):
        cut = units[k] != 1  # a layer's attention half, then its MLP half
        layers.append(times[k] + times[k + 1] if cut else times[k])
        attn.append(times[k] if cut else 0.0)
        split.append(cut)
        k += 2 if cut else 1
    embed = head = 0.0
    middle = range(1, len(layers) - 1)
    if len(layers) > 2:
        if split[0]:
            embed = max(attn[0] - statistics.median([attn[j] for j in middle if split[j]] or [attn[0]]), 0.0)
            attn[0] -= embed
        else:
            embed = max(layers[0] - statistics.median([layers[j] for j in middle]), 0.0)
        layers[0] -= embed
        if split[-1]:
            mlp = [layers[j] - attn[j] for j in middle if split[j]] or [layers[-1] - attn[-1]]
            head = max(layers[-1] - attn[-1] - statistics.median(mlp), 0.0)
        else:
            head = max(layers[-1] - statistics.median([layers[j] for j in middle]), 0.0)
        layers[-1] -= head
    return RegionCosts(layers=tuple(layers), embed=embed, head=head, stage=overhead, unit="ms", attention=tuple(attn))


def _inputs(stage, batch: int, tokens: int, position: int):
    plan = stage.meta["ppsplit.plan"]
    device = module_device(stage)
    generator = torch.Generator(device="cpu").manual_seed(0)
    if stage.meta["ppsplit.stage"] == 0:
        x = torch.randint(0, 100, (batch, tokens), generator=generator)
    else:
        x = torch.randn(batch, tokens, plan.hidden_size, generator=generator).to(model_dtype(plan))
        # Values carried beside the hidden state may be indices: zeros are valid for any of them.
        x = torch.nn.functional.pad(x, (0, plan.width(stage.meta["ppsplit.stage"]) - plan.hidden_size))
    aux = torch.zeros(plan.n_slots, batch, tokens, plan.hidden_size, dtype=model_dtype(plan))
    return x.to(device), torch.arange(position, position + tokens, device=device), aux.to(device)


def _time_stages(stages, batch: int, tokens: int, position: int, rounds: int) -> list[float]:
    """Milliseconds per call of each stage; stages interleaved round by round, so drift hits all alike. On a GPU
    the median replay; on the CPU the fastest round, since other processes only ever add time there."""
    runs = [stage_timer(stage, batch, tokens, position) for stage in stages]
    samples = [[] for _ in runs]
    for _ in range(rounds):
        for k, run in enumerate(runs):
            samples[k].append(run())
    pick = statistics.median if module_device(stages[0]).type == "cuda" else min
    return [pick(s) for s in samples]


def stage_timer(stage, batch: int, tokens: int, position: int, repeat: int | None = None):
    """A function returning ``stage``'s milliseconds per call for ``batch x tokens`` at ``position``: on a GPU the
    mean of ``repeat`` (default 20) replays of a captured CUDA graph, timed with events; on the CPU the mean of
    ``repeat`` (default 1) eager calls, after one warm-up call.

    Example::

        run = stage_timer(split.stages[1], batch=8, tokens=1, position=512)
        times = [run() for _ in range(7)]
    """
    x, positions, aux = _inputs(stage, batch, tokens, position)
    if module_device(stage).type == "cuda":
        captured = CapturedStage(stage, batch, tokens)
        captured.x.copy_(x)
        captured.positions.copy_(positions)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        captured.replay()
        replays = repeat or 20

        def run():
            begin.record()
            for _ in range(replays):
                captured.replay()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / replays
        return run
    calls = repeat or 1

    def run():
        with torch.no_grad():
            begin = time.perf_counter()
            for _ in range(calls):
                stage(x, positions, aux)
            return (time.perf_counter() - begin) / calls * 1e3
    with torch.no_grad():
        stage(x, positions, aux)  # warm-up
    return run
