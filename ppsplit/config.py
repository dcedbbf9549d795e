"""Core: the options of a split, validated once, in one place (``SplitOptions``), and the KV-cache shape.

Everything here is plain data; checks that need the model (its number of layers) are in ``SplitOptions.taps``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Literal, Sequence, Union

from ppsplit.errors import ConfigError

log = logging.getLogger("ppsplit")

Aux = Union[None, str, int, Sequence[int]]
Balance = Union[str, Sequence[int], Callable]
CONVENTIONS = ("vllm", "sglang")
# What the fuse pass does: "all" folds tap stores, residual adds and norms into Triton kernels; "norms" fuses the
# adds and norms but keeps a separate store per tap; "none" keeps the traced ops. The API also takes the older
# spellings True / False.
Fuse = Literal["all", "norms", "none"]
_FUSE_SPELLINGS = {True: "all", False: "none", "all": "all", "norms": "norms", "none": "none"}


@dataclass(frozen=True)
class CacheConfig:
    """A static KV cache for up to ``batch_size`` sequences of up to ``max_len`` tokens (prompt included).

    Example::

        split = split_model(model, pp=4, aux="eagle3", cache=CacheConfig(batch_size=8, max_len=4096))
    """

    batch_size: int
    max_len: int

    def __post_init__(self):
        for name in ("batch_size", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"CacheConfig.{name} must be a positive integer, but got {value!r}")


@dataclass(frozen=True)
class SplitOptions:
    """Everything ``split_model`` and ``ppsplit compile`` take, validated on construction.

    Example::

        opts = SplitOptions(pp=4, aux="2,16,29", cache=CacheConfig(8, 4096))
        opts.taps(num_layers=32)   # (2, 16, 29), checked against the model
    """

    pp: int
    aux: Aux = None
    balance: Balance = "layers"
    aux_convention: str = "vllm"
    layers: str | None = None
    cache: CacheConfig | None = None
    fuse: Fuse = "all"

    def __post_init__(self):
        try:
            fuse = _FUSE_SPELLINGS[self.fuse]
        except (KeyError, TypeError):
            raise ConfigError(f"fuse must be True (fuse taps, adds and norms into Triton kernels), 'norms' (fuse adds "
                              f"and norms, keep a separate store per tap) or False, but got {self.fuse!r}") from None
        object.__setattr__(self, "fuse", fuse)
        if not isinstance(self.pp, int) or isinstance(self.pp, bool) or self.pp < 1:
            raise ConfigError(f"pp must be a positive number of stages, but got {self.pp!r}")
        if self.aux_convention not in CONVENTIONS:
            raise ConfigError(f"aux_convention must be 'vllm' (tap j = residual entering layer j) or 'sglang' "
                              f"(the same tensor numbered j - 1), but got {self.aux_convention!r}")
        if self.cache is not None and not isinstance(self.cache, CacheConfig):
            raise ConfigError(f"cache must be a ppsplit.CacheConfig(batch_size, max_len), but got {self.cache!r}")
        parse_aux(self.aux)  # syntax only; ranges need the model

    def taps(self, num_layers: int) -> tuple[int, ...]:
        """The tap ids in vLLM numbering (distinct, ascending), checked with ``pp`` against ``num_layers``."""
        if not 1 <= self.pp <= num_layers:
            raise ConfigError(f"pp must be between 1 and {num_layers} (the model has {num_layers} decoder layers), "
                              f"but got {self.pp!r}")
        if self.aux == "eagle3":
            if num_layers < 4:
                raise ConfigError(f"aux='eagle3' taps layers (2, L//2, L-3) and needs at least 4 decoder layers; "
                                  f"the model has {num_layers}: pass explicit aux ids instead")
            return tuple(sorted({2, num_layers // 2, num_layers - 3}))
        ids = parse_aux(self.aux)
        shift = 1 if self.aux_convention == "sglang" else 0
        for given in ids:
            if not 0 <= given + shift <= num_layers:
                if shift:
                    raise ConfigError(f"aux id {given} is out of range: with --aux-convention {self.aux_convention} "
                                      f"tap ids go from {-shift} to {num_layers - shift} for this {num_layers}-layer "
                                      "model")
                raise ConfigError(f"aux id {given} is out of range: tap ids go from 0 (the embedding output) to "
                                  f"{num_layers} (the last layer's output) for this {num_layers}-layer model")
        taps = tuple(sorted({i + shift for i in ids}))
        if len(taps) < len(ids):
            log.warning("aux ids %s repeat a tap; the aux buffer holds each tap once: %d slots for taps %s",
                        ",".join(map(str, ids)), len(taps), ",".join(map(str, taps)))
        return taps


def parse_aux(aux: Aux) -> tuple[int, ...]:
    """``None`` -> no taps; ``"2,16,29"`` or ``[2, 16, 29]`` -> ids; ``"eagle3"`` is resolved by ``taps``."""
    if aux is None or aux == "eagle3" or aux == "":
        return ()
    if isinstance(aux, int) and not isinstance(aux, bool):
        return (aux,)
    items = aux.split(",") if isinstance(aux, str) else aux
    ids = []
    try:
        for item in items:
            ids.append(int(str(item).strip()))
    except (TypeError, ValueError):
        raise ConfigError(f"aux must be 'eagle3' or comma-separated layer ids like '2,16,29', but got {aux!r}") from None
    return tuple(ids)
