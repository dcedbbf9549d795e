"""Artifact: the compiled folder's format, in one place: file names, the manifest, the plan fingerprint, and the
readers that check everything a folder holds before anything is built from it.

    DIR/plan.json               the SplitPlan
    DIR/manifest.json           source, dtype, versions, files, generation ids, the stage options load applies
    DIR/stage_<k>.json          stage k's program (its FX graph; ``ppsplit.artifact.program``) and tensor list
    DIR/stage_<k>.safetensors   stage k's tensors only, under their original names
    DIR/stage_<k>.tp<r>.safetensors   instead, with tensor parallelism (plan.tp > 1): TP rank r's pieces of them
                                (the program, shared by the ranks, says how each tensor is cut: its ``shard``)
    DIR/drafter/                the EAGLE-3 drafter (``ppsplit compile --drafter``), if any
    DIR/mtp/                    the target's own MTP layer (``ppsplit compile --mtp``), if any: config.json,
                                block.json (its decoder block's program, as a stage's), block.safetensors,
                                drafter.safetensors (its own small tensors)
    DIR/tokenizer.json, ...     tokenizer and generation files, copied from the source (read as data only)

A folder is untrusted input. ``CompiledFolder`` reads ``plan.json`` and ``manifest.json`` once, checks every
field's type, and checks each stage program (``stage_program``) and the header of each weights file (names,
shapes and dtypes, without reading tensor data) against it; every problem is one ``FolderError`` naming the file
and the field. ``ppsplit inspect`` runs ``check``, which is exactly what ``load`` runs before it reads tensors.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from dataclasses import dataclass

from ppsplit.core.checked import FolderError, check, from_json
# pure data: the drafter config a compiled folder stores, and its checks
from ppsplit.core.drafter_config import DFLASH_KEYS, DRAFTER_KEYS, FAMILY_KEYS, dflash_drafter_config
from ppsplit.core.errors import ConfigError
from ppsplit.core.options import StageOptions
from ppsplit.core.plan import SplitPlan
from ppsplit.core.quant import SCALE_DTYPES, WEIGHT_DTYPES, Quantization
from ppsplit.core.shards import Shard
from ppsplit.core.tensors import DTYPES, MODEL_DTYPES

PLAN = "plan.json"
MANIFEST = "manifest.json"
DRAFTER = "drafter"
MTP = "mtp"
# Tokenizer and generation files a folder carries beside the weights, copied from the source checkpoint; all data
# (JSON, a tokenizer model, Jinja templates), never Python.
SERVING_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "generation_config.json",
                 "chat_template.jinja", "chat_template.json")
# The most bytes a JSON file of a folder may hold (ppsplit's own are kilobytes per stage; tokenizer.json files of
# large vocabularies are tens of megabytes): a larger one is refused before it is parsed.
MAX_JSON_BYTES = 64 << 20
_TENSOR_KINDS = ("parameter", "buffer")
_INITS = ("file", "zeros")


def serving_files(source: str) -> list[str]:
    """The ``SERVING_FILES`` a checkpoint folder has (plain files only)."""
    return [n for n in SERVING_FILES if os.path.isfile(os.path.join(source, n)) and not os.path.islink(os.path.join(source, n))]


def program_name(k: int) -> str:
    return f"stage_{k}.json"


def weights_name(k: int, tp_rank: int | None = None) -> str:
    return f"stage_{k}.safetensors" if tp_rank is None else f"stage_{k}.tp{tp_rank}.safetensors"


def fingerprint(plan_json: bytes | str) -> str:
    """The plan's fingerprint: the first 16 hex digits of the sha256 of its ``plan.json`` text. Every stage program
    records the fingerprint of the plan it was written with, and the ranks of a pipeline compare theirs."""
    data = plan_json.encode() if isinstance(plan_json, str) else plan_json
    return hashlib.sha256(data).hexdigest()[:16]


@dataclass(frozen=True)
class RankFiles:
    weights: str
    bytes: int


@dataclass(frozen=True)
class StageFiles:
    """A stage's files; with tensor parallelism ``weights`` is empty and ``ranks`` lists each TP rank's."""

    program: str
    weights: str
    bytes: int
    ranks: tuple[RankFiles, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` records. ``stage_options``: the stage rewrites ``load`` applies unless told otherwise
    (folders written before it record ``fuse_projections`` alone)."""

    ppsplit: str = ""
    torch: str = ""
    transformers: str = ""
    source: str = ""
    dtype: str = ""
    stages: tuple[StageFiles, ...] = ()
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    stage_options: StageOptions = StageOptions()
    quantization: Quantization | None = None  # FP8 weights stored as shipped (ppsplit.core.quant)

    @classmethod
    def from_dict(cls, data, where: str = MANIFEST) -> "Manifest":
        if isinstance(data, dict) and "fuse_projections" in data:  # the layout before stage_options
            data = dict(data)
            fuse = check(bool, data.pop("fuse_projections"), f"{where}.fuse_projections")
            data.setdefault("stage_options", {"fuse_projections": fuse})
        return from_json(cls, data, where)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a stage: ``init`` ``"file"`` (read from the weights file) or ``"zeros"`` (state: the KV cache).
    ``source`` / ``convert`` / ``target`` say where the compile found it (informational)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    persistent: bool
    init: str
    source: str | None = None
    convert: str | None = None
    target: str | None = None
    shard: Shard | None = None  # how TP ranks cut it (the shape above is one rank's)

    def __post_init__(self):
        if self.kind not in _TENSOR_KINDS or self.init not in _INITS:
            raise ValueError(f"tensor {self.name!r}: kind must be one of {_TENSOR_KINDS} and init one of {_INITS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"tensor {self.name!r}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if any(s < 0 for s in self.shape):
            raise ValueError(f"tensor {self.name!r}: shape {list(self.shape)} has a negative size")


@dataclass(frozen=True)
class StageProgram:
    """Stage ``index``'s program file: its tensors and its graph (validated)."""

    index: int
    tensors: tuple[TensorSpec, ...]
    graph: object  # torch.fx.Graph

    @property
    def stored(self) -> dict[str, TensorSpec]:
        """The tensors its weights file holds, by name."""
        return {t.name: t for t in self.tensors if t.init == "file"}


@dataclass(frozen=True)
class StageMemory:
    """What loading stage ``stage`` allocates on its device, in bytes: ``weights`` (read from its weights file),
    ``state`` (the zero-initialised tensors its program declares: KV pools, recurrent rings, ...; ``largest`` names
    the largest), and on the last stage of a folder with a drafter, ``drafter`` (its weights and paged KV pool)."""

    stage: int
    weights: int
    state: int
    largest: str | None = None
    drafter: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.state + self.drafter


def tensor_bytes(spec: TensorSpec) -> int:
    n = DTYPES[spec.dtype].itemsize
    for size in spec.shape:
        n *= size
    return n


def stage_memory(program: StageProgram) -> StageMemory:
    """The weights and zero-initialised state of a checked ``program`` (its drafter is added by
    ``CompiledFolder.memory``)."""
    state = [t for t in program.tensors if t.init == "zeros"]
    largest = max(state, key=tensor_bytes, default=None)
    return StageMemory(program.index, sum(tensor_bytes(t) for t in program.tensors if t.init == "file"),
                       sum(tensor_bytes(t) for t in state),
                       None if largest is None else f"{largest.name} {list(largest.shape)} {largest.dtype}")


def scheduler_bytes(plan: SplitPlan) -> int:
    """What the engine's scheduler keeps on the host for a paged cache: the block table (``max_batch`` x
    ``blocks_per_seq`` int64), the free-block list (a Python int per block, 36 bytes with its list entry) and the
    per-slot lists (64 bytes a slot)."""
    if not plan.paged:
        return 0
    return 8 * plan.max_batch * plan.blocks_per_seq + 36 * plan.num_blocks + 64 * plan.max_batch


def host_memory() -> int:
    """This machine's RAM in bytes (a very large number where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


class CompiledFolder:
    """A compiled folder opened for reading: ``plan`` and ``manifest`` read once and checked; ``program(k)``,
    ``weights(k)`` and ``check()`` check the rest.

    Example::

        folder = CompiledFolder("demo-pp4")
        folder.plan.pp, folder.manifest.source, folder.program(1).stored
    """

    def __init__(self, path: str):
        if not isinstance(path, str) or not os.path.isdir(path):
            what = "does not exist" if not isinstance(path, str) or not os.path.exists(path) else "is a file"
            raise FolderError(f"{path} {what}; pass a folder written by ppsplit compile")
        self.path = path
        text = read_file(self.file(PLAN), MAX_JSON_BYTES, path)
        self.fingerprint = fingerprint(text)
        self.plan = SplitPlan.from_dict(_json(text, self.file(PLAN)), self.file(PLAN))
        _check_plan(self.plan, self.file(PLAN))
        manifest = read_file(self.file(MANIFEST), MAX_JSON_BYTES, path)
        self.manifest = Manifest.from_dict(_json(manifest, self.file(MANIFEST)), self.file(MANIFEST))
        _check_manifest(self.manifest, self.plan, self.file(MANIFEST))

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def weights(self, k: int, tp_rank: int | None = None) -> str:
        """Stage ``k``'s weights file (TP rank ``tp_rank``'s, in a folder cut for tensor parallelism), checked to be
        a regular file inside the folder."""
        if self.plan.tp > 1:
            if tp_rank is None or not isinstance(tp_rank, int) or not 0 <= tp_rank < self.plan.tp:
                raise FolderError(f"{self.path} is cut for tensor parallelism (tp={self.plan.tp}): each stage runs on "
                                  f"{self.plan.tp} ranks; run it with ppsplit run / serve --ranks (pp x tp processes) "
                                  f"or load_stage(folder, k, tp_rank=r) with r in [0, {self.plan.tp})")
            return regular_file(self.file(weights_name(k, tp_rank)), self.path)
        return regular_file(self.file(weights_name(k)), self.path)

    @property
    def drafter(self) -> str | None:
        """The drafter folder inside, or ``None``."""
        return self._subfolder(DRAFTER)

    @property
    def mtp(self) -> str | None:
        """The MTP layer's folder inside (``ppsplit compile --mtp``), or ``None``."""
        return self._subfolder(MTP)

    def _subfolder(self, name: str) -> str | None:
        path = self.file(name)
        if not os.path.lexists(path):
            return None
        _inside(path, self.path)
        if not os.path.isdir(path):
            raise FolderError(f"{path} is not a folder; a compiled folder keeps it in {name}/: compile the folder "
                              "again")
        return path

    def program(self, k: int) -> StageProgram:
        """Stage ``k``'s program, checked: its tensor list, its graph (``ppsplit.artifact.program``) and that it
        was written with this folder's plan."""
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < self.plan.pp:
            raise FolderError(f"stage {k} does not exist: {self.path} has stages 0 to {self.plan.pp - 1}")
        return self._program(self.file(program_name(k)), k)

    def mtp_program(self) -> StageProgram:
        """The program of the MTP layer's decoder block (``mtp/block.json``), checked as a stage's is; its index is
        the number of stages (it runs after the last one)."""
        return self._program(os.path.join(self.file(MTP), MTP_BLOCK), self.plan.pp)

    def _program(self, where: str, k: int) -> StageProgram:
        from ppsplit.artifact.program import ProgramError, graph_from_json, tensor_path

        data = _json(read_file(where, MAX_JSON_BYTES, self.path), where)
        if not isinstance(data, dict):
            raise FolderError(f"{where} must be a JSON object")
        if check(int, data.get("stage"), f"{where}: stage") != k:
            raise FolderError(f"{where} holds stage {data.get('stage')}, not stage {k}; compile the folder again")
        recorded = data.get("plan_sha256")
        if recorded is not None and recorded != self.fingerprint:
            raise FolderError(f"{where} was written with another plan.json (fingerprint {str(recorded)[:16]!r}, "
                              f"{PLAN} has {self.fingerprint}); the folder mixes two compiles: compile it again")
        tensors = check(tuple[TensorSpec, ...], data.get("tensors"), f"{where}: tensors")
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise FolderError(f"{where}: tensors lists a name twice")
        try:
            for name in names:
                tensor_path(name)
            graph = graph_from_json(data.get("program"), set(names))
        except ProgramError as e:
            raise FolderError(f"{where}: {e}; compile the folder again") from None
        _check_quantized(graph, {t.name: t for t in tensors}, self.manifest.quantization, where)
        return StageProgram(k, tensors, graph)

    def program_weights(self, program: StageProgram, tp_rank: int | None = None) -> str:
        """The weights file of ``program``: stage ``program.index``'s, or the MTP block's (index ``plan.pp``)."""
        if program.index == self.plan.pp:
            return regular_file(os.path.join(self.file(MTP), MTP_BLOCK_WEIGHTS), self.path)
        return self.weights(program.index, tp_rank)

    def check_weights(self, program: StageProgram, tp_rank: int | None = None) -> None:
        """The weights file of ``program``'s stage (of TP rank ``tp_rank``: with tensor parallelism) holds exactly
        its stored tensors, with their shapes and dtypes (read from the safetensors header; no tensor data is
        read)."""
        from safetensors import safe_open

        path = self.program_weights(program, tp_rank)
        expected = program.stored
        try:
            with safe_open(path, framework="pt") as f:
                stored = set(f.keys())
                if stored != set(expected):
                    extra = sorted(stored - set(expected))[:3]
                    missing = sorted(set(expected) - stored)[:3]
                    raise FolderError(f"{path} does not hold the tensors {program_name(program.index)} lists (missing "
                                      f"{missing or 'none'}, unexpected {extra or 'none'}); the folder is corrupt, "
                                      "compile it again")
                for name, spec in expected.items():
                    piece = f.get_slice(name)
                    shape, dtype = list(piece.get_shape()), _SAFETENSORS_DTYPES.get(piece.get_dtype())
                    if shape != list(spec.shape) or dtype != spec.dtype:
                        raise FolderError(f"{path}: {name} is {tuple(shape)} {dtype or piece.get_dtype()}, the program "
                                          f"expects {tuple(spec.shape)} {spec.dtype}; compile the folder again")
        except FolderError:
            raise
        except Exception as e:  # OSError, safetensors' SafetensorError (a truncated or oversized file), ...
            first = (str(e).splitlines() or [type(e).__name__])[0][:160]
            raise FolderError(f"cannot read {path} ({first}); the file is incomplete or corrupt: compile the folder "
                              "again") from None

    def memory(self, programs: list[StageProgram]) -> list[StageMemory]:
        """What loading each stage allocates (``StageMemory``), the drafter's weights and paged KV pool counted on
        the last stage (``ppsplit inspect`` prints it; ``load`` refuses a stage larger than its device)."""
        out = [stage_memory(p) for p in programs]
        if self.drafter is not None and out:
            cfg, _ = check_drafter(self.drafter, self.plan)
            heads = cfg["num_attention_heads"]
            kv_heads, head_dim = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or \
                cfg["hidden_size"] // max(1, heads)
            layers = cfg.get("num_hidden_layers") or 1  # DFlash: a pool per draft layer
            pool = 2 * layers * self.plan.num_blocks * self.plan.block_size * kv_heads * head_dim * \
                DTYPES[self.plan.dtype].itemsize
            weights = os.path.getsize(regular_file(os.path.join(self.drafter, "drafter.safetensors")))
            out[-1] = dataclasses.replace(out[-1], drafter=weights + pool)
        if self.mtp is not None and out:  # the MTP block's weights and pools, and its own tensors
            own = os.path.getsize(regular_file(os.path.join(self.mtp, MTP_OWN_WEIGHTS), self.path))
            block = stage_memory(self.mtp_program()).total
            out[-1] = dataclasses.replace(out[-1], drafter=out[-1].drafter + block + own)
        return out

    def check(self) -> list[StageProgram]:
        """Everything ``load`` checks before it reads a tensor: the plan, the manifest, every stage program and
        every weights file's header, and the drafter's config and tensor names (``ppsplit inspect``). Returns the
        stage programs."""
        programs = [self.program(k) for k in range(self.plan.pp)]
        for program in programs:
            for r in (range(self.plan.tp) if self.plan.tp > 1 else [None]):
                self.check_weights(program, r)
        if self.drafter is not None:
            check_drafter(self.drafter, self.plan)
        if self.mtp is not None:
            self.check_mtp()
        return programs

    def check_mtp(self) -> tuple[dict, StageProgram, dict]:
        """The stored MTP layer (``ppsplit compile --mtp``), checked without reading tensor data: its config by
        type and against the plan (tap ``L``), its block's program and weights header, and the names and shapes of
        its own tensors. Returns ``(config, block program, {name: shape})``."""
        from safetensors import safe_open

        path = self.mtp
        where = os.path.join(path, "config.json")
        raw = read_json_object(where, root=self.path)
        unknown = sorted(set(raw) - set(_MTP_CONFIG))
        if unknown:
            raise FolderError(f"{where} has {unknown[0]!r}, which ppsplit does not write there; compile the folder "
                              "again with ppsplit compile --mtp")
        cfg = {}
        for key, kind in _MTP_CONFIG.items():
            if key not in raw:
                raise FolderError(f"{where} lacks {key}; compile the folder again with ppsplit compile --mtp")
            cfg[key] = check(kind, raw[key], f"{where}: {key}")
        if cfg["ppsplit_family"] != "mtp":
            raise FolderError(f"{where}: ppsplit_family is {cfg['ppsplit_family']!r}, not 'mtp'; compile the folder "
                              "again with ppsplit compile --mtp")
        layers = self.plan.num_layers
        if cfg["ppsplit_taps"] != (layers,) or layers not in self.plan.taps:
            raise FolderError(f"{where}: the MTP layer reads taps {list(cfg['ppsplit_taps'])}, but it reads tap "
                              f"{layers} (the last layer's output) and the plan carries {list(self.plan.taps)}; "
                              "compile the folder again with ppsplit compile --mtp")
        hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
        if hidden <= 0 or vocab <= 0 or not cfg["rms_norm_eps"] > 0:
            raise FolderError(f"{where}: hidden_size, vocab_size and rms_norm_eps must be positive")
        program = self.mtp_program()
        head = next((tuple(t.shape) for t in program.tensors if t.name == "lm_head.weight"), None)
        if head != (vocab, hidden):
            raise FolderError(f"{where}: hidden_size {hidden} and vocab_size {vocab} do not match the block's "
                              f"lm_head.weight {head}; compile the folder again with ppsplit compile --mtp")
        self.check_weights(program)
        weights = os.path.join(path, MTP_OWN_WEIGHTS)
        try:
            with safe_open(regular_file(weights, self.path), framework="pt") as f:
                shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except FolderError:
            raise
        except Exception as e:  # a missing, truncated or oversized file (safetensors' own error type)
            raise FolderError(f"cannot read {weights} ({str(e).splitlines()[0][:120]}); compile the folder "
                              "again") from None
        expected = {"target_norm.weight": (hidden,), "enorm.weight": (hidden,), "hnorm.weight": (hidden,),
                    "eh_proj.weight": (hidden, 2 * hidden), "embed_tokens": (vocab, hidden)}
        if cfg["feed_normed"]:
            expected["norm.weight"] = (hidden,)
        if shapes != expected:
            wrong = sorted(set(shapes) ^ set(expected)) or sorted(n for n in shapes if shapes[n] != expected[n])
            raise FolderError(f"{weights} does not hold the MTP layer's tensors for hidden_size {hidden} and "
                              f"vocab_size {vocab} ({wrong[0]} differs); compile the folder again")
        return cfg, program, shapes


MTP_BLOCK, MTP_BLOCK_WEIGHTS, MTP_OWN_WEIGHTS = "block.json", "block.safetensors", "drafter.safetensors"
# The config of a stored MTP layer, every key required (ppsplit writes it: ppsplit.compile.mtp.write_mtp).
_MTP_CONFIG = {"ppsplit_family": str, "ppsplit_taps": tuple[int, ...], "hidden_size": int, "vocab_size": int,
               "rms_norm_eps": float, "offset_norms": bool, "zero_first": bool, "feed_normed": bool}


# What the config of a drafter stored in a compiled folder may hold, by type (ppsplit writes it: save_drafter).
_FOREIGN_DRAFTER_FILES = ("model.safetensors", "pytorch_model.bin")
_STORED_CONFIG = {**DRAFTER_KEYS, **DFLASH_KEYS, **{k: t for own in FAMILY_KEYS.values() for k, t in own.items()},
                  "ppsplit_rope_scale": float, "ppsplit_taps": tuple[int, ...]}


def check_drafter(path: str, plan) -> tuple[dict, dict]:
    """The config and tensor names of the drafter a compiled folder stores, checked by type and against ``plan``
    (what ``ppsplit inspect`` and ``load`` check) without reading tensor data. Returns ``(config, {name: shape})``."""
    from safetensors import safe_open

    where = os.path.join(path, "config.json")
    cfg = read_json_object(where)
    for name in _FOREIGN_DRAFTER_FILES:  # what a drafter checkpoint may hold and ppsplit never writes here
        if os.path.lexists(os.path.join(path, name)):
            raise FolderError(f"{os.path.join(path, name)} is not a file ppsplit writes (a compiled folder's drafter "
                              "is config.json and drafter.safetensors): remove it, or compile the folder again")
    for key, kind in _STORED_CONFIG.items():
        if key in cfg and cfg[key] is not None:
            cfg[key] = check(kind, cfg[key], f"{where}: {key}")
    for key in ("hidden_size", "num_attention_heads", "ppsplit_taps"):
        if key not in cfg:
            raise FolderError(f"{where} lacks {key}; compile the folder again with ppsplit compile --drafter")
    if any(t not in plan.taps for t in cfg["ppsplit_taps"]):
        raise FolderError(f"{where}: the drafter reads taps {list(cfg['ppsplit_taps'])}, but the folder's plan "
                          f"carries {list(plan.taps)}; compile the folder again")
    family = cfg.get("ppsplit_family")
    if family is not None:  # a DFlash-family drafter: every key read and checked as loading does
        try:
            dflash_drafter_config(cfg)
        except ConfigError as e:
            raise FolderError(f"{where}: {e}") from None
    weights = os.path.join(path, "drafter.safetensors")
    try:
        with safe_open(regular_file(weights), framework="pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except FolderError:
        raise
    except Exception as e:  # a missing, truncated or oversized file (safetensors' own error type)
        raise FolderError(f"cannot read {weights} ({str(e).splitlines()[0][:120]}); compile the folder again") from None
    for name in ("embed_tokens.weight", "head.weight") if family is not None else ("embed_tokens.weight",):
        if name not in shapes:
            raise FolderError(f"{weights} has no {name}; recompile the folder with ppsplit compile --drafter")
    return cfg, shapes



# safetensors' dtype names -> ppsplit's (DTYPES keys)
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "C64": "complex64", "F8_E4M3": "float8_e4m3fn"}


def _inside(path: str, root: str) -> str:
    """The real path of ``path`` when it resolves inside folder ``root``, or a ``FolderError``."""
    base, real = os.path.realpath(root), os.path.realpath(path)
    if os.path.commonpath([base, real]) != base:
        raise FolderError(f"{path} leads to {real}, outside {root}; a folder's files must be inside it: copy the file "
                          "in (or compile the folder again)")
    return real


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def regular_file(path: str, root: str | None = None) -> str:
    """The real path of ``path``, checked to be a regular file inside folder ``root`` (default: ``path``'s own
    folder), or one ``FolderError``. A folder's files are never pipes, devices or links leading out of it: reading
    one could block forever (a pipe), never end (``/dev/zero``) or read a file the folder's author picked."""
    real = _inside(path, root or os.path.dirname(path) or ".")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        raise FolderError(f"{path} is missing: {os.path.dirname(path) or '.'} is not a complete ppsplit compile "
                          "folder") from None
    except OSError as e:
        raise FolderError(f"{path} is unreadable ({e.strerror or e}); compile the folder again") from None
    if not stat.S_ISREG(mode):
        kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
        raise FolderError(f"{path} is {kind}, not a regular file; replace it with the file ppsplit wrote (compile "
                          "the folder again)")
    return real


def read_file(path: str, limit: int, root: str | None = None) -> bytes:
    """The bytes of ``path`` (a ``regular_file`` inside ``root``) when it holds at most ``limit`` of them."""
    real = regular_file(path, root)
    try:
        # O_NONBLOCK: a file swapped for a pipe after the check still cannot block the open.
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise FolderError(f"{path} is unreadable ({e.strerror or e}); compile the folder again") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FolderError(f"{path} is not a regular file; replace it with the file ppsplit wrote")
        if info.st_size > limit:
            raise FolderError(f"{path} holds {info.st_size:,} bytes, more than the {limit:,} ppsplit reads from such "
                              "a file; it is not a file ppsplit or a tokenizer wrote: compile the folder again")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise FolderError(f"{path} is unreadable ({e.strerror or e}); compile the folder again") from None
    if len(data) > limit:  # grew after the check
        raise FolderError(f"{path} holds more than the {limit:,} bytes ppsplit reads from such a file")
    return data


def _json(data: bytes, where: str):
    try:
        return json.loads(data)
    except ValueError as e:  # also UnicodeDecodeError
        raise FolderError(f"{where} is not valid JSON ({str(e)[:120]}); compile the folder again") from None


def read_json_object(path: str, missing_ok: bool = False, root: str | None = None) -> dict:
    """The JSON object in ``path`` (``{}`` when nothing has that name and ``missing_ok``), a ``regular_file`` inside
    ``root`` (default: its own folder) of at most ``MAX_JSON_BYTES``, or one ``FolderError``."""
    if missing_ok and not os.path.lexists(path):
        return {}
    data = _json(read_file(path, MAX_JSON_BYTES, root), path)
    if not isinstance(data, dict):
        raise FolderError(f"{path} must be a JSON object")
    return data


def _check_plan(plan: SplitPlan, where: str) -> None:
    """What a plan read from a folder must hold beyond its types: a model dtype, sizes that make sense."""
    if plan.dtype not in MODEL_DTYPES:
        raise FolderError(f"{where}: dtype {plan.dtype!r} is not one of {', '.join(MODEL_DTYPES)}")
    if plan.tp < 1 or plan.tp > 1 and len(plan.sharded) != plan.pp:
        raise FolderError(f"{where}: tp must be positive, with one TP report per stage")
    if plan.hidden_size < 1 or plan.max_batch < 0 or plan.max_len < 0 or plan.state_slots < 0:
        raise FolderError(f"{where}: hidden_size must be positive and max_batch, max_len, state_slots not negative")
    if plan.block_size < 0 or plan.num_blocks < 0:
        raise FolderError(f"{where}: block_size and num_blocks must not be negative")
    host = scheduler_bytes(plan)
    if host > host_memory():
        from ppsplit.core.plan import fmt_bytes

        raise FolderError(f"{where}: its cache ({plan.max_batch} sequences of {plan.max_len} tokens, {plan.num_blocks} "
                          f"blocks) makes the scheduler keep {fmt_bytes(host)} on the host, more than this machine has "
                          f"({fmt_bytes(host_memory())}); compile the folder again with a smaller cache")
    for c in plan.carries:
        if c.dtype not in DTYPES or c.width < 1 or any(s < 1 for s in c.shape) or c.token_dim < 1:
            raise FolderError(f"{where}: carried value {c.name!r} has an impossible layout")
        if any(not 0 < s < plan.pp for s in c.stages):
            raise FolderError(f"{where}: carried value {c.name!r} goes into stage(s) {list(c.stages)}, not all of "
                              f"1 to {plan.pp - 1}")


def _check_manifest(manifest: Manifest, plan: SplitPlan, where: str) -> None:
    if manifest.dtype and manifest.dtype not in MODEL_DTYPES:
        raise FolderError(f"{where}: dtype {manifest.dtype!r} is not one of {', '.join(MODEL_DTYPES)}")
    if len(manifest.stages) not in (0, plan.pp):
        raise FolderError(f"{where} lists {len(manifest.stages)} stages but plan.json has {plan.pp}; compile the "
                          "folder again")
    q = manifest.quantization
    if q is not None and not (len(q.linears) == len(q.dequantized) == plan.pp):
        raise FolderError(f"{where}: quantization.linears and .dequantized must list one count per stage ({plan.pp})")
    for k, files in enumerate(manifest.stages):
        if plan.tp > 1:
            names = [weights_name(k, r) for r in range(plan.tp)]
            if files.program != program_name(k) or files.weights or [f.weights for f in files.ranks] != names \
                    or any(f.bytes < 0 for f in files.ranks):
                raise FolderError(f"{where}: stage {k}'s files must be {program_name(k)} and {', '.join(names)}; "
                                  "compile the folder again")
        elif (files.program, files.weights) != (program_name(k), weights_name(k)) or files.bytes < 0 or files.ranks:
            raise FolderError(f"{where}: stage {k}'s files must be {program_name(k)} and {weights_name(k)}, but it "
                              f"lists {files.program[:40]!r} and {files.weights[:40]!r}")


# The ops that read FP8 tensors: {op: (weight's argument, scale's, block_n's, block_k's, the weight's dimensions)}
_FP8_READERS = {"ppsplit::fp8_linear": (1, 2, 4, 5, 2),          # (x, weight, scale, bias, block_n, block_k)
                "ppsplit::fp8_grouped_mm": (1, 2, 4, 5, 3),      # (x, experts, scale, offs, block_n, block_k)
                "ppsplit::fp8_expert_weights": (0, 1, 3, 4, 3),  # (experts, scale, ids, block_n, block_k, dtype)
                # MLA's kv_b_proj: (q, latents, ropes, weight, ..., weight_scale, block_n, block_k), FP8 when a scale
                # is given (_FP8_OPTIONAL)
                "ppsplit::paged_latent_attention": (3, 14, 15, 16, 2),
                "ppsplit::latent_attention": (3, 10, 11, 12, 2)}
_FP8_OPTIONAL = {"ppsplit::paged_latent_attention", "ppsplit::latent_attention"}  # a float weight without a scale


def _check_quantized(graph, specs: dict, quantization: Quantization | None, where: str) -> None:
    """FP8 tensors are read only as the weights of ppsplit's FP8 ops (``_FP8_READERS``), each with a float scale of
    one value per block (per expert, for a stack of experts), and only in a folder whose manifest records its
    quantization; MXFP4 experts' blocks and scales agree (``_check_mxfp4``)."""
    import math

    from ppsplit.triton_kernels.fp8 import scale_grid

    fp8 = {name for name, t in specs.items() if t.dtype in WEIGHT_DTYPES}
    if fp8 and quantization is None:
        raise FolderError(f"{where}: {sorted(fp8)[0]} is {specs[sorted(fp8)[0]].dtype}, but {MANIFEST} records no "
                          "quantization; compile the folder again")
    readers = {}
    for node in graph.nodes:
        if node.op == "get_attr" and node.target in fp8:
            readers[node.target] = node
        op = _op_name(node)
        if op in _MXFP4_READERS:
            _check_mxfp4(node, [node.args[i] for i in _MXFP4_READERS[op]], specs, where)
        if op not in _FP8_READERS:
            continue
        w_at, s_at, bn_at, bk_at, dims = _FP8_READERS[op]
        args = list(node.args) + [None] * 6
        w, scale, bn, bk = args[w_at], args[s_at], args[bn_at], args[bk_at]
        if op in _FP8_OPTIONAL and scale is None and getattr(w, "target", None) not in fp8:
            continue
        names = [getattr(a, "target", None) if getattr(a, "op", None) == "get_attr" else None for a in (w, scale)]
        if None in names or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in (bn, bk)):
            raise FolderError(f"{where}: {node.name} must read a stored weight and scale with positive block sizes")
        weight, scale_spec = specs[names[0]], specs[names[1]]
        if weight.dtype not in WEIGHT_DTYPES or len(weight.shape) != dims or scale_spec.dtype not in SCALE_DTYPES:
            raise FolderError(f"{where}: {names[0]} ({weight.dtype}) must be a {dims}-D FP8 weight and {names[1]} "
                              f"({scale_spec.dtype}) one of {', '.join(SCALE_DTYPES)}; compile the folder again")
        grid = scale_grid(*weight.shape[-2:], bn, bk)
        count = math.prod(weight.shape[:-2]) * grid[0] * grid[1]
        if math.prod(scale_spec.shape) != count:
            raise FolderError(f"{where}: scale {names[1]} has shape {tuple(scale_spec.shape)}, but {names[0]} "
                              f"{tuple(weight.shape)} in blocks of {bn}x{bk} needs {count} values "
                              f"({' x '.join(map(str, (*weight.shape[:-2], *grid)))}); compile the folder again")
    for name, attr in readers.items():
        if any(_op_name(u) not in _FP8_READERS or u.args[_FP8_READERS[_op_name(u)][0]] is not attr
               for u in attr.users):
            raise FolderError(f"{where}: FP8 tensor {name} is read by something other than ppsplit's FP8 ops as "
                              "their weight; compile the folder again")


_MXFP4_READERS = {"ppsplit::mxfp4_grouped_mm": (1, 2), "ppsplit::mxfp4_expert_weights": (0, 1)}  # blocks, scales


def _check_mxfp4(node, args: list, specs: dict, where: str) -> None:
    """MXFP4 experts are stored uint8 blocks ``[E, N, G, 16]`` and uint8 scales ``[E, N, G]``."""
    names = [a.target if getattr(a, "op", None) == "get_attr" else None for a in args]
    blocks, scales = (specs.get(n) for n in names)
    if blocks is None or scales is None or blocks.dtype != "uint8" or scales.dtype != "uint8" \
            or len(blocks.shape) != 4 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise FolderError(f"{where}: {node.name} must read stored MXFP4 experts, uint8 blocks [E, N, G, 16] and uint8 "
                          f"scales [E, N, G]; compile the folder again")


def _op_name(node) -> str | None:
    return getattr(node.target, "name", lambda: None)() if node.op == "call_function" else None


def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2 if os.path.basename(path) in (PLAN, MANIFEST) else None)
