"""Core: the split plan, pure data that says which layers each stage runs and where each tap goes.

A ``SplitPlan`` is what ``ppsplit inspect`` prints and what ``plan.json`` stores. It is computed by
``ppsplit.passes.plan.make_plan`` and applied by the partition, taps and emit passes; the fuse pass's report
(``StageFusion``) is attached by the driver that ran the passes.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from ppsplit.core.checked import FolderError, check, from_json
from ppsplit.core.options import CostModel

_ELEMENT_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
PLAN_VERSION = 7  # 7: tensor parallelism inside stages; 6: a residual stream of several vectors per token; 5: a paged cache; 4: stages may end mid-layer;
# 3: carried values; 2: structured fusion


@dataclass(frozen=True)
class ModelCosts:
    """Parameter counts and bytes of the embedding (stage 0), each decoder layer, and the head (last stage)."""

    embed_params: int
    head_params: int
    layer_params: tuple[int, ...]
    embed_bytes: int = 0
    head_bytes: int = 0
    layer_bytes: tuple[int, ...] = ()
    layer_cache_bytes: tuple[int, ...] = ()  # static KV cache per layer, when the split has one
    # Weights counted in both the embedding and the head (a tied lm_head): each end's stage holds a copy, but a
    # stage holding both ends holds one.
    tied_params: int = 0
    tied_bytes: int = 0
    # Half layers (planned only when asked for): the layers with a cut point between their attention and MLP
    # blocks, and per layer the parameters and bytes of its attention half (its KV cache is all there too).
    mid_layers: tuple[int, ...] = ()
    attn_params: tuple[int, ...] = ()
    attn_bytes: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layer_params)


@dataclass(frozen=True)
class RegionCosts:
    """What each part of the model costs under one balance policy, in ``unit``: the embedding (stage 0), each
    decoder layer, the head (last stage), and ``stage``, a fixed cost that every stage pays once (recomputing
    rotary tables and masks, launching its graph). A stage's cost is the sum of what it runs.

    Example::

        RegionCosts(layers=(1.0,) * 4, embed=0.5, head=2.0, unit="ms").stage_costs([2, 2])   # [2.5, 4.0]
    """

    layers: tuple[float, ...]
    embed: float = 0.0
    head: float = 0.0
    stage: float = 0.0
    unit: str = ""
    attention: tuple[float, ...] = ()  # half layers: the part of each layer's cost in its attention half

    def span_costs(self, bounds) -> list[float]:
        """The cost of each stage when stage ``k`` runs half-layer positions ``[bounds[k], bounds[k+1])``
        (position ``2j`` is the start of layer ``j``, ``2j + 1`` its middle, after the attention block).

        Example::

            RegionCosts(layers=(2.0,) * 2, attention=(0.5, 0.5)).span_costs([0, 3, 4])   # [2.5, 1.5]
        """
        prefix = [0.0]
        for j, c in enumerate(self.layers):
            prefix += [prefix[-1] + (self.attention[j] if self.attention else 0.0), prefix[-1] + c]
        last = len(bounds) - 2
        return [prefix[q] - prefix[p] + self.stage + (self.embed if k == 0 else 0.0) + (self.head if k == last else 0.0)
                for k, (p, q) in enumerate(zip(bounds, bounds[1:]))]

    def stage_costs(self, sizes) -> list[float]:
        """The cost of each stage when stage ``k`` runs the next ``sizes[k]`` layers."""
        out, start = [], 0
        for k, n in enumerate(sizes):
            cost = self.stage + sum(self.layers[start:start + n])
            cost += (self.embed if k == 0 else 0.0) + (self.head if k == len(sizes) - 1 else 0.0)
            out.append(cost)
            start += n
        return out


def imbalance(costs) -> float:
    """The slowest stage over the mean stage (1.0: perfectly even; a pipeline runs at its slowest stage)."""
    costs = list(costs)
    mean = sum(costs) / len(costs) if costs else 0.0
    return max(costs) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class StagePlan:
    """Stage ``index`` runs decoder layers ``[start, end)``; ``params``/``bytes`` count what it holds."""

    index: int
    start: int
    end: int
    cost: float
    params: int
    bytes: int
    cache_bytes: int = 0
    half_end: bool = False  # also runs the attention half of layer ``end``; the next stage starts with its MLP half

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TapFusion:
    """How tap ``tap`` (slot ``slot``) is stored: ``op`` is the fused op (``"add+rms+store"``, ``"add+store"``,
    ``"store"`` for the plain copy, ...); ``note`` says where (the norm module, or why nothing fused)."""

    tap: int
    slot: int
    op: str
    note: str = ""

    def describe(self) -> str:
        return f"tap {self.tap} -> slot {self.slot}: {self.op}" + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class StageFusion:
    """The fuse pass's report for one stage: its tap stores (ascending tap id) and how many add + norm or norm
    groups without a tap it fused."""

    taps: tuple[TapFusion, ...] = ()
    other_norms: int = 0

    def lines(self) -> tuple[str, ...]:
        extra = (f"{self.other_norms} add+norm / norm groups without a tap fused",) if self.other_norms else ()
        return tuple(t.describe() for t in self.taps) + extra


@dataclass(frozen=True)
class StageSharding:
    """The TP pass's report for one stage: its column- and row-parallel products, vocab-parallel lookups,
    all-reduces and all-gathers, and what each TP rank holds (weights, of which ``whole_bytes`` are not cut, and
    cache)."""

    column: int = 0
    row: int = 0
    vocab: int = 0
    all_reduces: int = 0
    gathers: int = 0
    rank_bytes: int = 0
    whole_bytes: int = 0
    rank_cache_bytes: int = 0

    def lines(self) -> tuple[str, ...]:
        cut = f"{self.column} column-parallel + {self.row} row-parallel products"
        if self.vocab:
            cut += f", {self.vocab} vocab-parallel lookup"
        comm = f"{self.all_reduces} all-reduce(s)" + (f", {self.gathers} all-gather" if self.gathers else "")
        held = (f"per TP rank: {fmt_bytes(self.rank_bytes)} weights ({fmt_bytes(self.whole_bytes)} held whole)"
                + (f", cache {fmt_bytes(self.rank_cache_bytes)}" if self.rank_cache_bytes else ""))
        return (f"tp: {cut}; {comm} per step", held)


def token_major(rank: int, batch_dim: int, token_dim: int) -> list[int]:
    """The permutation that brings a value's batch and token axes to the front, its other axes after them in order:
    how ``x`` and the aux slots lay out a value the model keeps another way (its inverse puts it back)."""
    return [batch_dim, token_dim] + [d for d in range(rank) if d not in (batch_dim, token_dim)]


class PerToken:
    """What ``Carry`` and ``Stream`` share: a value with a batch axis, a token axis and fixed per-token dims
    (``shape``, the other dims in the model's order), packed token-major into ``[B, T, elements]``."""

    shape: tuple[int, ...]
    batch_dim: int
    token_dim: int

    def order(self, inverse: bool = False) -> list[int]:
        """The permutation to token-major (``inverse``: back to the model's layout)."""
        order = token_major(2 + len(self.shape), self.batch_dim, self.token_dim)
        return [order.index(d) for d in range(len(order))] if inverse else order

    def dims(self) -> str:
        """``"B, T, 4, 64"``-style dims in the model's order."""
        dims = [str(d) for d in self.shape]
        for axis, name in sorted(((self.batch_dim, "B"), (self.token_dim, "T"))):
            dims.insert(axis, name)
        return ", ".join(dims)


@dataclass(frozen=True)
class Stream(PerToken):
    """The residual stream when it is not one ``[B, T, hidden_size]`` tensor but a fixed number of hidden vectors
    per token: Gemma 3n's AltUp stack ``[4, B, T, H]``, hyper-connection streams ``[B, T, 4, H]``. Every cut has it
    in the same layout; ``x`` and each aux slot hold it token-major, ``[B, T, prod(shape)]`` (the model's tensor
    with its batch and token axes moved to the front), so ``plan.hidden_size`` is ``prod(shape)``.

    Example::

        Stream(shape=(4, 2048), batch_dim=1, token_dim=2)   # Gemma 3n: [4, B, T, 2048], x is [B, T, 8192]
    """

    shape: tuple[int, ...]
    batch_dim: int = 0
    token_dim: int = 1

    @property
    def vector(self) -> int:
        """The width of one hidden vector (what the model's norms normalise)."""
        return self.shape[-1]


@dataclass(frozen=True)
class Carry(PerToken):
    """A token-dependent value, other than the residual stream, that a later stage reads (Gemma 4's per-layer
    inputs, say). It crosses the boundary into each stage in ``stages`` packed into ``x`` after the hidden
    state: ``x`` is ``[B, T, plan.width(k)]`` in the model dtype, and this value takes ``width`` of those
    elements per token (its bytes, reinterpreted), at ``plan.carried(k)``'s offset.

    Example::

        Carry(name="select_3", shape=(256,), dtype="bfloat16", stages=(1, 2), width=256)   # [B, T, 256]
    """

    name: str  # the traced node that computes it
    shape: tuple[int, ...]  # per token: its dims other than the batch and the tokens, in order
    dtype: str
    stages: tuple[int, ...]  # the stages whose input carries it
    width: int  # elements of the model dtype per token
    token_dim: int = 1  # where the value keeps the token axis: 1 for [B, T, ...], 2 for keys [B, heads, T, dim]
    batch_dim: int = 0  # where it keeps the batch axis

    def describe(self) -> str:
        into = ",".join(map(str, self.stages))
        return f"{self.name} [{self.dims()}] {self.dtype} into stage(s) {into}"


@dataclass(frozen=True)
class AttentionSite:
    """One layer's attention over the KV cache after the attention pass: replaced by ``cache_attention``
    (``detail`` names its parameters) or left as traced (``detail`` says why)."""

    layer: int
    stage: int
    replaced: bool
    detail: str


@dataclass(frozen=True)
class ModelFacts:
    """What a plan records about the model beside its costs, as the trace found it: sizes, names, and the cache
    layout (``max_batch`` x ``max_len`` positions, ``state_slots`` ring slots of recurrent layers)."""

    hidden_size: int = 0
    dtype: str = ""
    model_class: str = ""
    layers_fqn: str = ""
    max_batch: int = 0
    max_len: int = 0
    state_slots: int = 0
    block_size: int = 0
    num_blocks: int = 0
    stream: Stream | None = None

    def fields(self) -> dict:
        """The facts as ``SplitPlan`` keyword arguments (nested dataclasses kept, unlike ``dataclasses.asdict``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class SplitPlan:
    """Stage ranges, costs and taps of one split. ``taps`` are the slots: distinct tap ids, ascending.

    Example::

        plan.owner(16)    # the stage that computes tap 16
        plan.slot(16)     # its index in the packed aux buffer
        plan.filled(1)    # how many slots are written once stage 1 has run (the prefix it sends)
    """

    num_layers: int
    hidden_size: int  # elements per token of the residual stream: x's first part, one aux slot (see stream)
    dtype: str
    stages: tuple[StagePlan, ...]
    taps: tuple[int, ...] = ()
    balance: str = "layers"
    model_class: str = ""
    layers_fqn: str = ""
    costs: ModelCosts | None = None
    max_batch: int = 0  # static KV cache shape (0: no cache)
    max_len: int = 0
    fused: tuple[StageFusion, ...] = ()  # per stage, what the fuse pass did (empty when it did not run)
    attention: tuple[AttentionSite, ...] = ()  # per layer with a cached attention: replaced or left (attention pass)
    version: int = field(default=PLAN_VERSION)
    region_costs: RegionCosts | None = None  # what the stage costs were summed from (the balance policy's unit)
    cost_model: CostModel | None = None  # the workload of a flops or time balance
    max_stage_bytes: int | None = None  # the per-stage cap on weights + KV cache the split was made under
    carries: tuple[Carry, ...] = ()  # values other than the residual stream that cross boundaries (partition)
    replicas: tuple[tuple[int, str, int], ...] = ()  # (stage, cache buffer, bytes): another stage's cache kept too
    state_slots: int = 0  # ring slots of recurrent layers' states: the most tokens a verify pass can take back
    block_size: int = 0  # a paged cache (ragged stages): positions per block, and blocks in each layer's pool
    num_blocks: int = 0
    lockstep_reason: str = ""  # why a cached split has a lockstep cache (no ragged steps), when it does
    stream: Stream | None = None  # a residual stream of several hidden vectors per token (None: [B, T, H])
    tp: int = 1  # tensor-parallel ranks inside every stage (ppsplit.passes.tp)
    sharded: tuple[StageSharding, ...] = ()  # per stage, what the TP pass did (when tp > 1)

    def __post_init__(self):
        if list(self.taps) != sorted(set(self.taps)) or any(not 0 <= t <= self.num_layers for t in self.taps):
            raise ValueError(f"plan taps must be distinct, ascending and within [0, {self.num_layers}], got {self.taps}")
        expected = 0
        for i, s in enumerate(self.stages):
            if s.index != i or s.start != expected or (s.end <= s.start and not (s.half_end and s.end == s.start
                                                                                   and not self.starts_mid(i))):
                raise ValueError(f"stage {i} covers layers [{s.start}, {s.end}); stages must be contiguous, "
                                 "in order and non-empty")
            expected = s.end
        if expected != self.num_layers:
            raise ValueError(f"stages cover {expected} layers but the model has {self.num_layers}")
        if self.stages and self.stages[-1].half_end:
            raise ValueError("the last stage ends in the middle of a layer; it must run the model to its end")

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def paged(self) -> bool:
        """Whether the stages own a paged cache and take ragged steps (else: no cache, or a folder from before
        paging with a lockstep ``max_batch x max_len`` cache)."""
        return self.block_size > 0

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_len // self.block_size) if self.paged else 0

    @property
    def vector_size(self) -> int:
        """The width of one hidden vector, what the model's norms normalise: ``hidden_size`` unless the stream
        holds several vectors per token."""
        return self.stream.vector if self.stream else self.hidden_size

    @property
    def n_slots(self) -> int:
        return len(self.taps)

    @property
    def imbalance(self) -> float:
        """The slowest stage's cost over the mean stage cost, under the balance policy (1.0 is even)."""
        return imbalance(s.cost for s in self.stages)

    def stage_of_layer(self, layer: int, attention: bool = False) -> int:
        """The stage that computes the end of ``layer`` (its MLP half); with ``attention``, the stage that runs
        its attention half, the one before when a stage boundary cuts the layer in the middle."""
        for s in self.stages:
            if attention and s.half_end and s.end == layer:
                return s.index
            if s.start <= layer < s.end:
                return s.index
        raise ValueError(f"layer {layer} is outside [0, {self.num_layers})")

    def starts_mid(self, stage: int) -> bool:
        """Whether ``stage`` starts in the middle of its first layer (with that layer's MLP half)."""
        return stage > 0 and self.stages[stage - 1].half_end

    @property
    def bounds(self) -> tuple[int, ...]:
        """Stage boundaries in half-layer positions: ``2j`` is the start of layer ``j``, ``2j + 1`` its middle
        (after the attention block); stage ``k`` runs ``[bounds[k], bounds[k+1])``."""
        return (0,) + tuple(2 * s.end + s.half_end for s in self.stages)

    @property
    def sizes(self) -> tuple[float, ...]:
        """Layers per stage, a half layer counting 0.5 (whole numbers unless a stage ends mid-layer)."""
        b = self.bounds
        return tuple((q - p) / 2 if self.half_layers else (q - p) // 2 for p, q in zip(b, b[1:]))

    @property
    def half_layers(self) -> bool:
        """Whether some stage boundary falls in the middle of a layer."""
        return any(s.half_end for s in self.stages)

    def owner(self, tap: int) -> int:
        """The stage that computes tap ``tap``: ``start < tap <= end``, stage 0 for tap 0."""
        return 0 if tap == 0 else self.stage_of_layer(tap - 1)

    def slot(self, tap: int) -> int:
        return self.taps.index(tap)

    def filled(self, stage: int) -> int:
        """Number of slots written after ``stage`` has run: the aux prefix that it sends on."""
        end = self.stages[stage].end
        return sum(1 for t in self.taps if t <= end)

    def slots_of(self, stage: int) -> range:
        return range(self.filled(stage - 1) if stage else 0, self.filled(stage))

    def carried(self, stage: int) -> list[tuple[Carry, int]]:
        """The values stage ``stage`` receives beside the hidden state, each with its offset in ``x``'s last dim."""
        out, offset = [], self.hidden_size
        for c in self.carries:
            if stage in c.stages:
                out.append((c, offset))
                offset += c.width
        return out

    def width(self, stage: int) -> int:
        """The last dimension of ``x`` that stage ``stage > 0`` receives: the hidden size plus what is carried."""
        return self.hidden_size + sum(c.width for c, _ in self.carried(stage))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        # Half-layer fields are written only when used: a whole-layer plan.json keeps its older layout.
        for s in d["stages"]:
            if not s["half_end"]:
                del s["half_end"]
        if not self.paged:
            del d["block_size"], d["num_blocks"]
        if not self.lockstep_reason:
            del d["lockstep_reason"]
        if self.stream is None:  # written only when used, as the fields above: older plans keep their layout
            del d["stream"]
        if self.tp == 1:
            del d["tp"], d["sharded"]
        for c in d["carries"]:
            if not c["batch_dim"]:
                del c["batch_dim"]
        for key, names in (("costs", ("mid_layers", "attn_params", "attn_bytes")), ("region_costs", ("attention",))):
            for name in names:
                if d.get(key) is not None and not d[key][name]:
                    del d[key][name]
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "plan") -> "SplitPlan":
        """The plan of ``d`` (a ``to_dict`` result, or plan.json as read), every field's type checked: a bad value
        is a ``FolderError`` naming ``where`` and the field."""
        if not isinstance(d, dict):
            return from_json(cls, d, where)  # the error
        d = dict(d)
        version = check(int, d.get("version", PLAN_VERSION), f"{where}.version")
        if version > PLAN_VERSION:
            raise FolderError(f"{where}: plan version {version} is newer than this ppsplit understands "
                              f"({PLAN_VERSION}); upgrade ppsplit")
        if version < 2:  # its fusion report is text lines, informational only: dropped
            d["fused"], d["version"] = (), PLAN_VERSION
        return from_json(cls, d, where)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "SplitPlan":
        return cls.from_dict(json.loads(text))

    def attention_lines(self, stage: int) -> tuple[str, ...]:
        """How many of ``stage``'s attentions became ``cache_attention`` (``paged_attention`` over a paged cache),
        and which stayed as traced, and why."""
        sites = [a for a in self.attention if a.stage == stage]
        if not sites:
            return ()
        replaced = [a for a in sites if a.replaced]
        kinds = sorted({a.detail for a in replaced})
        op = "paged_attention" if self.paged else "cache_attention"
        return ((f"attention: {len(replaced)} of {len(sites)} -> {op}"
                 + (f" ({'; '.join(kinds)})" if kinds else ""),)
                + tuple(f"attention layer {a.layer} left as traced: {a.detail}" for a in sites if not a.replaced))

    def layer_range(self, stage: int) -> str:
        """``"8-15"``; with half layers, ``"8.mlp-16.attn"`` names the halves of the layers a boundary cuts."""
        s = self.stages[stage]
        if not self.half_layers:
            return f"{s.start}-{s.end - 1}"
        if s.end == s.start:
            return f"{s.start}.attn"
        first = f"{s.start}.mlp" if self.starts_mid(stage) else str(s.start)
        last = f"{s.end}.attn" if s.half_end else str(s.end - 1)
        return first if last == str(s.start) else f"{first}-{last}"

    def describe(self) -> str:
        """A human-readable table of stages and taps (what ``ppsplit inspect`` prints)."""
        cache = f", KV cache {self.max_batch} x {self.max_len} tokens" if self.max_len else ""
        if self.paged:
            cache = (f", paged cache of {self.num_blocks} blocks x {self.block_size} positions for {self.max_batch} "
                     f"sequences of up to {self.max_len}")
        elif self.lockstep_reason:
            cache += f" (lockstep: no ragged steps, because {self.lockstep_reason})"
        hidden = f"stream [{self.stream.dims()}]" if self.stream else f"hidden {self.hidden_size}"
        tp = f" x tp={self.tp} ({self.pp * self.tp} ranks)" if self.tp > 1 else ""
        lines = [f"{self.model_class or 'model'}: {self.num_layers} layers, {hidden}, {self.dtype}, "
                 f"pp={self.pp}{tp}, balance={self.balance}, {self.n_slots} aux slots{cache}"]
        unit = self.region_costs.unit if self.region_costs else ("layers" if self.balance == "layers" else "params")
        balance = f"stage cost in {unit}: slowest / mean = {self.imbalance:.3f}"
        r = self.region_costs
        if r is not None and r.unit != "layers" and r.layers:
            balance += (f" (embedding {r.embed:.4g}, a layer {min(r.layers):.4g} to {max(r.layers):.4g}, head "
                        f"{r.head:.4g}, every stage {r.stage:.4g})")
        if self.cost_model is not None:
            balance += f"; workload {_fmt_workload(self.cost_model)}"
        if self.max_stage_bytes:
            balance += f"; cap {fmt_bytes(self.max_stage_bytes)} per stage (weights + KV cache)"
        lines.append(balance)
        if self.half_layers:
            cut = ", ".join(str(s.end) for s in self.stages if s.half_end)
            lines.append(f"half layers: a stage boundary after the attention block of layer(s) {cut} (x.attn / x.mlp "
                         "name the halves)")
        head = f"{'stage':>5}  {'layers':>9}  {'params':>12}  {'bytes':>10}  {'cost':>10}  {'taps owned':<14} {'sends':<12}"
        lines.append(head)
        for s in self.stages:
            owned = ",".join(str(self.taps[k]) for k in self.slots_of(s.index)) or "-"
            role = "+embed" if s.index == 0 else ""
            role += "+head" if s.index == self.pp - 1 else ""
            sends = "logits" if s.index == self.pp - 1 else f"h + aux[:{self.filled(s.index)}]"
            if s.index < self.pp - 1 and self.carried(s.index + 1):
                sends = sends.replace("h +", f"h+{len(self.carried(s.index + 1))} +")
            cache = f"  cache {fmt_bytes(s.cache_bytes)}" if s.cache_bytes else ""
            lines.append(f"{s.index:>5}  {self.layer_range(s.index):>9}  {s.params:>12,}  {fmt_bytes(s.bytes):>10}  "
                         f"{s.cost:>10.4g}  {owned:<14} {sends:<12} {role}{cache}")
            for line in (self.fused[s.index].lines() if s.index < len(self.fused) else ()):
                lines.append(f"{'':>7}{line}")
            for line in (self.sharded[s.index].lines() if s.index < len(self.sharded) else ()):
                lines.append(f"{'':>7}{line}")
            for line in self.attention_lines(s.index):
                lines.append(f"{'':>7}{line}")
            for stage, name, size in self.replicas:
                if stage == s.index:
                    lines.append(f"{'':>7}replica of {name} (a later layer shares it), {fmt_bytes(size)}")
        if self.carries:
            size = _ELEMENT_BYTES.get(self.dtype, 0)
            lines.append("carried beside the residual stream (packed after h in x):")
            for c in self.carries:
                lines.append(f"  {c.describe()}, {size * c.width} B/token")
        if self.taps:
            lines.append(f"{'tap':>5}  {'slot':>4}  {'owner':>5}  meaning")
            for k, t in enumerate(self.taps):
                meaning = "residual entering layer %d" % t if t < self.num_layers else "output of the last layer"
                lines.append(f"{t:>5}  {k:>4}  {self.owner(t):>5}  {meaning}")
        return "\n".join(lines)


def _fmt_workload(m: CostModel) -> str:
    parts = []
    if m.decode_weight:
        parts.append(f"{m.decode_weight:g} x decode (batch {m.batch}, {m.tokens} token(s) after {m.context})")
    if m.prefill_weight:
        parts.append(f"{m.prefill_weight:g} x prefill (batch {m.batch}, {m.prefill} tokens)")
    return " + ".join(parts)


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
