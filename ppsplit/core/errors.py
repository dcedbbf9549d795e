"""User-facing errors. Every message names the offending values, what is allowed, and what to change."""


class PpsplitError(Exception):
    """Base class of every error ppsplit raises on purpose; the CLI prints it in one line and exits 2."""


class ConfigError(PpsplitError, ValueError):
    """An option is out of range or inconsistent with the model (pp, aux ids, balance, ...)."""


class LayersNotFoundError(PpsplitError):
    """The model's decoder layers (the ModuleList the pipeline is cut along) could not be located."""


class TraceError(PpsplitError):
    """torch.export could not capture the model."""


class CrossingError(PpsplitError):
    """A value other than the residual stream (and the aux prefix) would have to cross a stage boundary."""
