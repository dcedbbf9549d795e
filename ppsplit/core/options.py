"""Core: the options of a split, validated once, in one place (``SplitOptions``), and the KV-cache shape.

Everything here is plain data; checks that need the model (its number of layers) are in ``SplitOptions.taps``.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Sequence, Union

from ppsplit.core.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ppsplit")

Aux = Union[None, str, int, Sequence[int]]
Balance = Union[str, Sequence[int], Callable]
# Tap numberings, the one table: what a numbering adds to its ids to give ppsplit's (vLLM's) tap ids. vLLM and
# SGLang capture the residual entering layer j as id j; SpecForge hooks layer outputs and writes the same tensor as
# j - 1 (``sglang`` here is that numbering, the name the CLI has always used for it).
TAP_NUMBERINGS = {"vllm": 0, "sglang": 1, "specforge": 1}
CONVENTIONS = ("vllm", "sglang")  # what SplitOptions.aux_convention accepts
# Balance policies whose costs come from the traced graph or the device, not from parameter counts.
COUNTED_POLICIES = ("flops", "time")
# The built-in balance policies (``ppsplit.passes.plan``): what a stage's cost counts.
BALANCE_POLICIES = ("layers", "params", "flops", "time", "memory")
# What the fuse pass does: "all" folds tap stores, residual adds and norms into Triton kernels; "norms" fuses the
# adds and norms but keeps a separate store per tap; "none" keeps the traced ops. The API also takes the older
# spellings True / False.
Fuse = Literal["all", "norms", "none"]
_FUSE_SPELLINGS = {True: "all", False: "none", "all": "all", "norms": "norms", "none": "none"}


@dataclass(frozen=True)
class CacheConfig:
    """The stages' paged cache: a pool of ``num_blocks`` blocks of ``block_size`` token positions per layer, shared
    by up to ``batch_size`` sequence slots of up to ``max_len`` positions each (prompt and output). Which blocks a
    slot owns is host data the caller passes with every step (its block table); by default the pool holds every
    slot full (``batch_size * ceil(max_len / block_size)`` blocks), and a smaller ``num_blocks`` sizes it by the
    tokens in flight instead. ``state_slots``: the states each recurrent layer (Mamba, Gated DeltaNet) keeps per
    sequence slot, the longest verify pass (``K + 1`` tokens) the stages can take back.

    Example::

        split = split_model(model, pp=4, aux="eagle3", cache=CacheConfig(batch_size=8, max_len=4096))
        CacheConfig(batch_size=64, max_len=8192, num_blocks=8192)       # 64 slots over 131072 pooled tokens
    """

    batch_size: int
    max_len: int
    state_slots: int = 8
    block_size: int = 16
    num_blocks: int | None = None

    def __post_init__(self):
        for name in ("batch_size", "max_len", "state_slots", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"CacheConfig.{name} must be a positive integer, but got {value!r}")
        if self.block_size & (self.block_size - 1) or not 16 <= self.block_size <= 256:
            raise ConfigError(f"CacheConfig.block_size must be a power of two from 16 to 256 (the attention kernel "
                              f"reads a block as one tile), but got {self.block_size}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or isinstance(self.num_blocks, bool)
                                            or self.num_blocks < self.blocks_per_seq):
            raise ConfigError(f"CacheConfig.num_blocks must be an integer of at least {self.blocks_per_seq} (one "
                              f"sequence of max_len={self.max_len} positions), but got {self.num_blocks!r}")

    @property
    def blocks_per_seq(self) -> int:
        """The block table's width: blocks that hold ``max_len`` positions."""
        return -(-self.max_len // self.block_size)

    @property
    def pool_blocks(self) -> int:
        return self.num_blocks if self.num_blocks is not None else self.batch_size * self.blocks_per_seq


@dataclass(frozen=True)
class CostModel:
    """The workload that the ``flops`` and ``time`` balance policies weigh: decode steps of ``tokens`` new tokens
    (1, or K+1 when verifying K drafted tokens) for ``batch`` sequences that already hold ``context`` tokens, and
    prefill steps of ``prefill`` prompt tokens. A stage's cost is ``decode_weight`` times its decode step plus
    ``prefill_weight`` times its prefill step (e.g. the number of decode steps per prompt, and 1).

    Example::

        CostModel(batch=8, context=4096)                                        # decode only
        CostModel(batch=8, context=2048, prefill=2048, decode_weight=256, prefill_weight=1)
        CostModel.parse("batch=8,context=4096")                                 # the CLI's --cost-model
    """

    batch: int = 1
    tokens: int = 1
    context: int = 1024
    prefill: int = 0
    decode_weight: float = 1.0
    prefill_weight: float = 0.0

    def __post_init__(self):
        for name, low in (("batch", 1), ("tokens", 1), ("context", 0), ("prefill", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"CostModel.{name} must be an integer >= {low}, but got {value!r}")
        for name in ("decode_weight", "prefill_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"CostModel.{name} must be a finite number >= 0, but got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.prefill_weight > 0 and self.prefill == 0:
            raise ConfigError(f"CostModel.prefill_weight={self.prefill_weight} weighs a prefill step, but prefill=0 "
                              "gives it no tokens: set prefill to the prompt length")
        if self.decode_weight == 0 and self.prefill_weight == 0:
            raise ConfigError("CostModel.decode_weight and prefill_weight are both 0: give decode or prefill a weight")

    @classmethod
    def parse(cls, text: str) -> "CostModel":
        """``"batch=8,context=4096,prefill=2048,prefill_weight=0.01"`` -> ``CostModel``."""
        kw = {}
        names = {f.name: f.type for f in dataclasses.fields(cls)}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, _, value = item.partition("=")
            key = key.strip()
            if key not in names or not value:
                raise ConfigError(f"cost model entry {item!r} is not name=value with a name among "
                                  f"{', '.join(names)}; e.g. 'batch=8,context=4096'")
            try:
                kw[key] = float(value) if key.endswith("_weight") else int(value)
            except ValueError:
                raise ConfigError(f"cost model entry {item!r}: {value!r} is not a number") from None
        return cls(**kw)


@dataclass(frozen=True)
class StageOptions:
    """Rewrites of built stages (``ppsplit.passes.rewrites``), applied by ``split_model`` and by ``load`` alike;
    ``ppsplit compile`` records them in the folder's manifest and leaves the stored programs as traced.

    ``fuse_projections``: sibling linears on one input (q/k/v, gate/up) become one linear per stage. ``None`` (the
    default): on stages whose tensors are on a CUDA device, where it is the faster decode step, compiled or not;
    ``True`` / ``False`` everywhere.
    ``fuse_pointwise``: the rotary embedding and SiLU-and-multiply become one Triton kernel each (bit-equal in fp16
    / bf16). ``None`` (the default): on CUDA stages, unless ``compile`` is on (Inductor fuses them itself).
    ``gemv``: one-row projections (decode at batch 1) on CUDA go through ppsplit's Triton GEMV.
    ``compile``: each stage is compiled with Inductor at its first call per shape.

    Example::

        split_model(model, pp=4, fuse_projections=True)           # keywords of split_model and load
        SplitOptions(pp=4, stage=StageOptions(fuse_projections=True))
    """

    fuse_projections: bool | None = None
    fuse_pointwise: bool | None = None
    gemv: bool = True
    compile: bool = False

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool) and not (value is None and f.default is None):
                raise ConfigError(f"{f.name} must be True or False{' or None' if f.default is None else ''}, but got "
                                  f"{value!r}")

    def on(self, option: str, device: torch.device) -> bool:
        """Whether rewrite ``option`` runs on a stage on ``device`` (an option left ``None``: on CUDA, except the
        rewrites that Inductor does itself when ``compile`` is on)."""
        value = getattr(self, option)
        if value is None:
            return device.type == "cuda" and not (self.compile and option in _INDUCTOR_DOES)
        return value


# rewrites whose kernels Inductor generates itself from the traced ops: left to it under ``compile``
_INDUCTOR_DOES = frozenset({"fuse_pointwise"})
STAGE_OPTIONS = tuple(f.name for f in dataclasses.fields(StageOptions))


@dataclass(frozen=True, init=False)
class SplitOptions:
    """Everything ``split_model`` and ``ppsplit compile`` take, validated on construction, by when it applies:

    - the plan: ``pp``, ``aux`` and ``aux_convention`` (the taps), ``layers``, ``balance``, ``cost_model``,
      ``max_stage_bytes``, ``half_layers``, ``cache`` (the cache layout), ``tp`` (tensor-parallel ranks per stage;
      ``tp_rank``: build only that rank's shards);
    - lowering, recorded in the stage programs: ``attention``, ``fuse``;
    - built stages: ``stage`` (``StageOptions``: fuse_projections, fuse_pointwise, gemv, compile), applied again
      by ``load``.

    The stage options are also taken as plain keywords: ``SplitOptions(pp=4, fuse_projections=True)``.

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
    attention: bool = True  # replace the attention over the cache with ppsplit::cache_attention where provably equal
    max_stage_bytes: int | None = None  # per-stage cap on weights + KV cache
    cost_model: CostModel = CostModel()  # the workload of the flops and time policies
    half_layers: bool = False  # stages may also end between a layer's attention and MLP blocks
    tp: int = 1  # tensor-parallel ranks inside each stage (ppsplit.passes.tp)
    tp_rank: int | None = None  # split_model: build only this TP rank's shards (None: every rank's)
    stage: StageOptions = StageOptions()

    def __init__(self, pp: int, **options):
        # The dataclass fields, plus the StageOptions fields as plain keywords (what split_model and the CLI pass).
        stage = {k: options.pop(k) for k in STAGE_OPTIONS if k in options}
        fields = {f.name: f for f in dataclasses.fields(self)}
        unknown = [k for k in options if k not in fields]
        if unknown:
            raise ConfigError(f"unknown option {unknown[0]!r}; the options are "
                              f"{', '.join([*fields][:-1] + list(STAGE_OPTIONS))}")
        options["pp"] = pp
        for name, f in fields.items():
            object.__setattr__(self, name, options[name] if name in options else f.default)
        if not isinstance(self.stage, StageOptions):
            raise ConfigError(f"stage must be a ppsplit.StageOptions(...), but got {self.stage!r}")
        if stage:
            object.__setattr__(self, "stage", dataclasses.replace(self.stage, **stage))
        self.__post_init__()

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
        if self.max_stage_bytes is not None and (not isinstance(self.max_stage_bytes, int)
                                                 or isinstance(self.max_stage_bytes, bool) or self.max_stage_bytes < 1):
            raise ConfigError(f"max_stage_bytes must be a positive number of bytes (or None for no cap), but got "
                              f"{self.max_stage_bytes!r}")
        if not isinstance(self.cost_model, CostModel):
            raise ConfigError(f"cost_model must be a ppsplit.CostModel(batch, tokens, context, ...), but got "
                              f"{self.cost_model!r}")
        if not isinstance(self.half_layers, bool):
            raise ConfigError(f"half_layers must be True (stages may end between a layer's attention and MLP blocks) "
                              f"or False, but got {self.half_layers!r}")
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ConfigError(f"tp must be a positive number of tensor-parallel ranks per stage, but got {self.tp!r}")
        if self.tp_rank is not None and (not isinstance(self.tp_rank, int) or isinstance(self.tp_rank, bool)
                                         or not 0 <= self.tp_rank < self.tp):
            raise ConfigError(f"tp_rank must be a rank in [0, {self.tp}) (or None for every rank), but got "
                              f"{self.tp_rank!r}")
        if isinstance(self.balance, str) and self.balance not in BALANCE_POLICIES:
            raise ConfigError(f"balance must be one of {', '.join(BALANCE_POLICIES)}, a list of layer counts, or "
                              f"f(costs, pp) -> counts, but got {self.balance!r}")

    def taps(self, num_layers: int) -> tuple[int, ...]:
        """The tap ids in vLLM numbering (distinct, ascending), checked with ``pp`` against ``num_layers``."""
        if not 1 <= self.pp <= num_layers:
            raise ConfigError(f"pp must be between 1 and {num_layers} (the model has {num_layers} decoder layers), "
                              f"but got {self.pp!r}")
        if self.aux == "eagle3":
            return eagle3_taps(num_layers)
        ids = parse_aux(self.aux)
        taps = to_taps(ids, self.aux_convention, num_layers)
        if len(taps) < len(ids):
            log.warning("aux ids %s repeat a tap; the aux buffer holds each tap once: %d slots for taps %s",
                        ",".join(map(str, ids)), len(taps), ",".join(map(str, taps)))
        return taps


def eagle3_taps(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default taps ``(2, L//2, L-3)`` in vLLM numbering (the residual entering those layers)."""
    if num_layers < 4:
        raise ConfigError(f"aux='eagle3' taps layers (2, L//2, L-3) and needs at least 4 decoder layers; the model "
                          f"has {num_layers}: pass explicit aux ids instead")
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


def to_taps(ids, numbering: str, num_layers: int, what: str = "aux id") -> tuple[int, ...]:
    """Tap ids written in ``numbering`` (``TAP_NUMBERINGS``) as ppsplit's (vLLM's) ids, distinct and ascending,
    each checked to lie in ``[0, num_layers]``."""
    if numbering not in TAP_NUMBERINGS:
        raise ConfigError(f"tap numbering must be one of {', '.join(TAP_NUMBERINGS)}, but got {numbering!r}")
    shift = TAP_NUMBERINGS[numbering]
    for given in ids:
        if not 0 <= given + shift <= num_layers:
            if shift:
                raise ConfigError(f"{what} {given} is out of range: with --aux-convention {numbering} tap ids go from "
                                  f"{-shift} to {num_layers - shift} for this {num_layers}-layer model")
            raise ConfigError(f"{what} {given} is out of range: tap ids go from 0 (the embedding output) to "
                              f"{num_layers} (the last layer's output) for this {num_layers}-layer model")
    return tuple(sorted({int(i) + shift for i in ids}))


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


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"20GiB"`` -> 21474836480, ``"1.5 GB"`` -> 1500000000, ``"4096"`` -> 4096 (bytes)."""
    s = str(text).strip().replace(" ", "").replace("_", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = s[len(number):].lower()
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ConfigError(f"{text!r} is not a size: write a number with an optional unit, like 20GiB, 1.5GB, "
                          f"512MiB or 4096 (units: {', '.join(u for u in _UNITS if u)})") from None
    if value < 1:
        raise ConfigError(f"{text!r} is not a positive size")
    return int(value)
