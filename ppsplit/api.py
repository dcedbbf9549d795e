"""``split_model``: the one public verb, and the options it validates."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Sequence, Union

import torch
from torch import fx

from ppsplit.cache import CacheConfig
from ppsplit.errors import ConfigError
from ppsplit.passes.annotate import annotate, find_layers
from ppsplit.passes.attention import attention as cache_attention
from ppsplit.passes.emit import emit
from ppsplit.passes.fuse import fuse as fuse_kernels
from ppsplit.passes.partition import partition
from ppsplit.passes.plan import Balance, check_pp, check_tap, plan as make_split_plan
from ppsplit.passes.taps import taps as add_taps
from ppsplit.passes.trace import trace
from ppsplit.runtime import SplitModel

log = logging.getLogger("ppsplit")

Aux = Union[None, str, int, Sequence[int]]
CONVENTIONS = ("vllm", "sglang")


@dataclass(frozen=True)
class SplitOptions:
    """Validated options of ``split_model``. Checks that need the model's layer count live in ``taps``."""

    pp: int
    aux: Aux = None
    balance: Balance = "layers"
    aux_convention: str = "vllm"
    layers: str | None = None
    fuse: bool | str = True

    def __post_init__(self):
        if self.fuse not in (True, False, "norms"):
            raise ConfigError(f"fuse must be True (fuse taps, adds and norms into Triton kernels), 'norms' (fuse adds "
                              f"and norms, keep a separate store per tap) or False, but got {self.fuse!r}")
        if not isinstance(self.pp, int) or isinstance(self.pp, bool) or self.pp < 1:
            raise ConfigError(f"pp must be a positive number of stages, but got {self.pp!r}")
        if self.aux_convention not in CONVENTIONS:
            raise ConfigError(f"aux_convention must be 'vllm' (tap j = residual entering layer j) or 'sglang' "
                              f"(the same tensor numbered j - 1), but got {self.aux_convention!r}")
        parse_aux(self.aux)  # syntax only; ranges need the model

    def taps(self, num_layers: int) -> tuple[int, ...]:
        """The tap ids in vLLM numbering, checked against the model's ``num_layers``."""
        check_pp(self.pp, num_layers)
        if self.aux == "eagle3":
            if num_layers < 4:
                raise ConfigError(f"aux='eagle3' taps layers (2, L//2, L-3) and needs at least 4 decoder layers; "
                                  f"the model has {num_layers}: pass explicit aux ids instead")
            return tuple(sorted({2, num_layers // 2, num_layers - 3}))
        ids = parse_aux(self.aux)
        shift = 1 if self.aux_convention == "sglang" else 0
        for given in ids:
            try:
                check_tap(given + shift, num_layers)
            except ConfigError:
                lo, hi = -shift, num_layers - shift
                raise ConfigError(f"aux id {given} is out of range: with --aux-convention {self.aux_convention} tap "
                                  f"ids go from {lo} to {hi} for this {num_layers}-layer model") from None
        return tuple(sorted({i + shift for i in ids}))


def parse_aux(aux: Aux) -> tuple[int, ...]:
    """``None`` -> no taps; ``"2,16,29"`` or ``[2, 16, 29]`` -> ids; ``"eagle3"`` is resolved by ``taps``."""
    if aux is None or aux == "eagle3" or aux == "":
        return ()
    if isinstance(aux, int) and not isinstance(aux, bool):
        return (aux,)
    items = aux.split(",") if isinstance(aux, str) else aux
    ids = []
    for item in items:
        try:
            ids.append(int(str(item).strip()))
        except ValueError:
            raise ConfigError(f"aux must be 'eagle3' or comma-separated layer ids like '2,16,29', but got {aux!r}") from None
    return tuple(ids)


def trace_model(model: torch.nn.Module, *, layers: str | None = None, cache: CacheConfig | None = None) -> fx.GraphModule:
    """Trace and annotate ``model`` once; pass the result to ``split_model`` to split it several ways.

    Example::

        traced = trace_model(model)
        for pp in (2, 4):
            split_model(traced, pp)
    """
    stack = find_layers(model, layers)
    start = time.perf_counter()
    log.info("tracing %s (%d decoder layers) with torch.export", type(model).__name__, stack.num_layers)
    gm = annotate(trace(model, cache=cache, num_layers=stack.num_layers), stack)
    log.info("traced %d nodes in %.1fs", len(gm.graph.nodes), time.perf_counter() - start)
    return gm


def split_model(model: torch.nn.Module | fx.GraphModule, pp: int, aux: Aux = None, *, balance: Balance = "layers",
                aux_convention: str = "vllm", layers: str | None = None, cache: CacheConfig | None = None,
                fuse: bool | str = True, attention: bool = True, compile: bool = False) -> SplitModel:
    """Split a Hugging Face decoder LM into ``pp`` pipeline stages that carry the taps ``aux``.

    ``aux``: ``None`` (no taps), ``"eagle3"`` (``2, L//2, L-3``), or tap ids (``"2,16,29"`` or a list) in vLLM's
    numbering: tap ``j`` is the residual stream entering layer ``j``, tap ``L`` the last layer's output.
    ``balance``: ``"layers"``, ``"params"``, a list of layer counts, or ``f(costs, pp) -> counts``.
    ``cache``: ``CacheConfig(batch_size, max_len)`` gives every stage a static KV cache for its layers; then
    ``positions`` are the cache positions of the new tokens and the same stages serve prefill, decode and
    verification. ``fuse``: ``True`` folds each tap store, with the residual add and norm around it, into one
    Triton kernel (and fuses the other add+norm pairs the same way); ``"norms"`` keeps a separate store per tap;
    ``False`` keeps the traced ops. ``attention``: replace the attention over the static cache with
    ``ppsplit::cache_attention`` where it is provably equal (the plan says per stage). ``compile``: compile each
    stage with Inductor (``torch.compile``, no CUDA graphs inside: ``capture`` adds ppsplit's own). The stages
    share the model's parameters (no copy).

    Example::

        split = split_model(AutoModelForCausalLM.from_config(cfg), pp=4, aux="2,16,29")
        logits, aux = split(input_ids)
    """
    opts = SplitOptions(pp=pp, aux=aux, balance=balance, aux_convention=aux_convention, layers=layers, fuse=fuse)
    if isinstance(model, fx.GraphModule) and "ppsplit.layers" in model.meta:
        traced = model
        opts.taps(traced.meta["ppsplit.layers"].num_layers)
        if cache is not None and traced.meta["ppsplit.trace"].cache != cache:
            raise ConfigError(f"the traced graph was made with cache={traced.meta['ppsplit.trace'].cache}, not {cache}; "
                              "pass cache= to trace_model instead")
    else:
        opts.taps(find_layers(model, layers).num_layers)  # fail on bad options before the slow trace
        traced = trace_model(model, layers=layers, cache=cache)
    stack = traced.meta["ppsplit.layers"]
    gm = _fresh_copy(traced)
    plan = make_split_plan(gm, opts.pp, opts.taps(stack.num_layers), balance=opts.balance)
    gm = partition(gm, plan)
    gm = add_taps(gm, plan)
    if attention:
        plan = dataclasses.replace(plan, attention=cache_attention(gm, plan).lines(plan.pp))
    if opts.fuse:
        gm = fuse_kernels(gm, plan, taps=opts.fuse is True)
        plan = dataclasses.replace(plan, fused=gm.meta["ppsplit.fused"])
    info = traced.meta["ppsplit.trace"]
    stages = emit(gm, plan)
    if compile:
        from ppsplit.inductor import compile_stages
        compile_stages(stages)
    return SplitModel(plan, stages, eos_token_id=info.eos_token_id, pad_token_id=info.pad_token_id)


def _fresh_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph over the same tensors, so one trace can be split many times."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copy.meta.update(gm.meta)
    from ppsplit.passes.trace import copy_buffer_persistence
    copy_buffer_persistence(copy, gm)
    return copy
