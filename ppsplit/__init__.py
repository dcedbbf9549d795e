"""ppsplit: split any Hugging Face decoder into pipeline stages that carry EAGLE-3 taps in one packed buffer.

Folders by layer, imports pointing down only (README "How it works"; ``tests/test_layers.py`` checks it)::

    cli > compile > distributed > serve > eagle3 > artifact > ppsplit.passes > ppsplit.triton_kernels > core

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
    "CacheConfig": "ppsplit.core.options", "CostModel": "ppsplit.core.options", "SplitOptions": "ppsplit.core.options",
    "ConfigError": "ppsplit.core.errors", "CrossingError": "ppsplit.core.errors", "LayersNotFoundError": "ppsplit.core.errors",
    "PpsplitError": "ppsplit.core.errors", "TraceError": "ppsplit.core.errors",
    "ModelCosts": "ppsplit.core.plan", "RegionCosts": "ppsplit.core.plan", "SplitPlan": "ppsplit.core.plan", "StagePlan": "ppsplit.core.plan",
    "StageFusion": "ppsplit.core.plan", "TapFusion": "ppsplit.core.plan",
    "StageOptions": "ppsplit.core.options", "SplitModel": "ppsplit.serve.runtime",
    "CapturedStage": "ppsplit.serve.cuda_graphs", "cuda_graph": "ppsplit.serve.cuda_graphs",
    "split_model": "ppsplit.compile.api", "trace_model": "ppsplit.compile.api",
    "compile_model": "ppsplit.compile.writer",
    "load": "ppsplit.serve.runtime", "load_stage": "ppsplit.artifact.loader",
    "backend": "ppsplit.compile.dynamo_backend", "TapBackend": "ppsplit.compile.dynamo_backend",
    "last_taps": "ppsplit.compile.dynamo_backend",
    "Eagle3Drafter": "ppsplit.eagle3.drafter", "load_drafter": "ppsplit.compile.mtp",
    "MTPDrafter": "ppsplit.eagle3.mtp", "load_mtp": "ppsplit.compile.mtp",
    "SpeculativeStats": "ppsplit.serve.speculative",
    "Engine": "ppsplit.serve.engine", "RequestOutput": "ppsplit.serve.engine", "SamplingParams": "ppsplit.serve.sampling",
    "RaggedStep": "ppsplit.core.ragged", "Segment": "ppsplit.core.ragged", "CacheLayout": "ppsplit.core.ragged",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:  # a submodule: ppsplit.artifact.loader, ppsplit.passes, ...
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
