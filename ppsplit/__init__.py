"""ppsplit: split any Hugging Face decoder into pipeline stages that carry EAGLE-3 taps in one packed buffer."""
from ppsplit.cache import CacheConfig
from ppsplit.errors import ConfigError, CrossingError, LayersNotFoundError, PpsplitError, TraceError
from ppsplit.plan import ModelCosts, SplitPlan, StagePlan
from ppsplit.runtime import SplitModel
from ppsplit.api import SplitOptions, split_model, trace_model
from ppsplit.cuda_graphs import CapturedStage, cuda_graph
from ppsplit.compile import compile_model, load, load_stage
from ppsplit.drafter import Eagle3Drafter
from ppsplit.drafter_load import load_drafter
from ppsplit.speculative import SpeculativeStats

__all__ = [
    "CacheConfig", "ConfigError", "CrossingError", "LayersNotFoundError", "PpsplitError", "TraceError",
    "ModelCosts", "SplitPlan", "StagePlan", "SplitModel", "SplitOptions", "split_model", "trace_model",
    "CapturedStage", "cuda_graph", "compile_model", "load", "load_stage", "Eagle3Drafter", "load_drafter",
    "SpeculativeStats",
]
__version__ = "0.1.0"
