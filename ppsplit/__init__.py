"""ppsplit: split any Hugging Face decoder into pipeline stages that carry EAGLE-3 taps in one packed buffer.

Three layers, imports pointing down only::

    drivers   api (split_model, trace_model), writer (compile), loader (load, load_stage), runtime (SplitModel),
              cuda_graphs, cli; EAGLE-3: drafter (Eagle3Drafter), drafter_load (load_drafter), speculative,
              cli_generate
    passes    ppsplit.passes: trace -> annotate -> plan -> partition -> taps -> fuse -> emit  (+ triton_kernels)
    core      errors, config (SplitOptions, CacheConfig), plan (SplitPlan), tensors, fx_utils, program

Names are imported on first use (PEP 562), so ``ppsplit.load`` in a serving process imports neither
transformers nor the passes.
"""
from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

# A source checkout keeps passes/ and triton_kernels/ beside this folder (installed as ppsplit.passes and
# ppsplit.triton_kernels): when the package runs from a checkout, look for its subpackages there too.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_checkout, "pyproject.toml")) and os.path.isdir(os.path.join(_checkout, "passes")):
    __path__.append(_checkout)

_EXPORTS = {
    "CacheConfig": "ppsplit.config", "CostModel": "ppsplit.config", "SplitOptions": "ppsplit.config",
    "ConfigError": "ppsplit.errors", "CrossingError": "ppsplit.errors", "LayersNotFoundError": "ppsplit.errors",
    "PpsplitError": "ppsplit.errors", "TraceError": "ppsplit.errors",
    "ModelCosts": "ppsplit.plan", "RegionCosts": "ppsplit.plan", "SplitPlan": "ppsplit.plan", "StagePlan": "ppsplit.plan",
    "StageFusion": "ppsplit.plan", "TapFusion": "ppsplit.plan",
    "SplitModel": "ppsplit.runtime",
    "CapturedStage": "ppsplit.cuda_graphs", "cuda_graph": "ppsplit.cuda_graphs",
    "split_model": "ppsplit.api", "trace_model": "ppsplit.api",
    "compile_model": "ppsplit.writer",
    "load": "ppsplit.loader", "load_stage": "ppsplit.loader",
    "backend": "ppsplit.compile_backend", "TapBackend": "ppsplit.compile_backend",
    "last_taps": "ppsplit.compile_backend",
    "Eagle3Drafter": "ppsplit.drafter", "load_drafter": "ppsplit.drafter_load",
    "SpeculativeStats": "ppsplit.speculative",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:  # a submodule: ppsplit.loader, ppsplit.passes, ...
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'ppsplit' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
