"""ppsplit: split any Hugging Face decoder into pipeline stages that carry EAGLE-3 taps in one packed buffer."""
from ppsplit.errors import ConfigError, CrossingError, LayersNotFoundError, PpsplitError, TraceError
from ppsplit.plan import ModelCosts, SplitPlan, StagePlan
from ppsplit.runtime import SplitModel
from ppsplit.api import SplitOptions, split_model, trace_model

__all__ = [
    "ConfigError", "CrossingError", "LayersNotFoundError", "PpsplitError", "TraceError",
    "ModelCosts", "SplitPlan", "StagePlan", "SplitModel", "SplitOptions", "split_model", "trace_model",
]
__version__ = "0.1.0"
