"""Driver support: which checkpoint tensors produce each model parameter, through transformers' own weight
conversions, and producing them one conversion group at a time.

transformers 5 converts many checkpoints on load: it renames keys (Mixtral's ``block_sparse_moe`` -> ``mlp``) and
fuses tensors (per-expert ``experts.{e}.gate_proj`` / ``up_proj`` stacked and concatenated into one
``experts.gate_up_proj``). ``from_pretrained`` does this in ``convert_and_load_state_dict_in_model``: it renames
every checkpoint key with ``rename_source_key`` (renamings, then at most one ``WeightConverter``), groups the keys
by the parameter they become, and runs each group's ``convert``. ``Sources`` replays the same grouping over the
checkpoint's header (no tensor read), so each stage can ask for exactly the groups its parameters come from and run
them lazily; no name of any architecture is written here.

Every use of ``transformers.core_model_loading`` and ``transformers.conversion_mapping`` (internal modules whose
functions ``from_pretrained`` and PEFT use; the same in transformers 5.17 and 5.24) is in this file.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from ppsplit.compile.checkpoint import ST_DTYPES, Checkpoint
from ppsplit.compile.quantized import dequantized, exponent_values, is_exponents, mxfp4_as_model_weights, pair_scales
from ppsplit.core.errors import ConfigError
from ppsplit.triton_kernels.fp8 import scale_grid

_TORCH_DTYPES = {v: k for k, v in ST_DTYPES.items()}
_AS_BYTES = {"F8_E8M0": torch.uint8}  # read as their bytes (E8M0 exponents: ppsplit.compile.quantized)


@dataclass
class Group:
    """The checkpoint keys that become ``targets`` (one key for a plain rename; many for a fused converter)."""
    first: str                  # the first target: the key transformers files the group under
    targets: list[str]
    dtype: torch.dtype          # what from_pretrained casts each source tensor to before converting
    converter: object = None    # the transformers WeightConverter (a template, copied per run), None for a rename
    sources: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint key, converter source pattern)
    stored: bool = False        # FP8 weights converted as stored (the stage keeps them FP8), not dequantised
    scales_of: str | None = None  # a group of scales, converted as group ``scales_of``'s weights are


_STACKING = ("MergeModulelist", "Concatenate")  # conversions under which block scales convert like their weights


class Sources:
    """For every parameter of ``model`` (a meta skeleton), the conversion group that produces it from
    ``checkpoint``, found the way ``from_pretrained`` finds it.

    Example::

        sources = Sources(model, Checkpoint(folder))
        group = sources.group_of("model.layers.3.mlp.experts.gate_up_proj")
        tensors = sources.run(group)   # {target name: tensor}, reading only group.sources
    """

    def __init__(self, model: torch.nn.Module, checkpoint: Checkpoint, scheme=None):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        self.model, self.checkpoint, self.scheme = model, checkpoint, scheme
        # {FP8 weight key: its scale key} (ppsplit.compile.quantized); a weight read as a float is dequantised
        self.scales: dict[str, str] = {} if scheme is None else pair_scales(checkpoint, scheme)
        if scheme is None:
            fp8 = next((k for k in checkpoint.where if checkpoint.raw_range(k).dtype.startswith("F8")), None)
            if fp8 is not None:
                raise ConfigError(f"the checkpoint stores {fp8} in {checkpoint.raw_range(fp8).dtype}, but its "
                                  "config.json has no quantization_config saying how to scale it; restore the "
                                  "config's quantization_config")
        mapping = get_model_conversion_mapping(model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        meta = model.state_dict()
        prefix = model.base_model_prefix
        self.groups: dict[str, Group] = {}
        # Sorted as from_pretrained sorts them: a converter stacks experts in the order their keys arrive.
        for key in sorted(checkpoint.where, key=dot_natural_key):
            if scheme is not None and scheme.method == "mxfp4" and key in self.scales:
                self._add_mxfp4(key, rename_source_key, renamings, converters, prefix, meta)
                continue
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if renamed not in meta and key in meta:
                renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta)
            if renamed not in meta:
                continue  # a tensor the model does not use (e.g. DeepSeek-V3's multi-token-prediction layer)
            group = self.groups.get(renamed)
            if group is None:
                converter = by_pattern[pattern] if pattern is not None else None
                targets = [renamed] if converter is None else \
                    [renamed.replace(converter.target_patterns[0], t) for t in converter.target_patterns]
                group = self.groups[renamed] = Group(renamed, targets, meta[renamed].dtype, converter)
            group.sources.append((key, pattern))
        self.producer = {t: g.first for g in self.groups.values() for t in g.targets}

    def _add_mxfp4(self, key, rename_source_key, renamings, converters, prefix, meta) -> None:
        """``<name>_blocks`` + ``<name>_scales`` become parameter ``<name>`` (renamed as a plain key would be)."""
        base = key[:-len("_blocks")]
        renamed, _ = rename_source_key(base, renamings, converters, prefix, meta)
        if renamed not in meta:
            renamed, _ = rename_source_key(base, [], [], base_model_prefix=prefix, meta_state_dict=meta)
        if renamed in meta:
            self.groups[renamed] = Group(renamed, [renamed], meta[renamed].dtype, None,
                                         [(key, None), (self.scales[key], None)])

    def is_mxfp4(self, group: Group) -> bool:
        """Whether ``group`` makes MXFP4 experts of their ``_blocks`` and ``_scales``."""
        return self.scheme is not None and self.scheme.method == "mxfp4" and group.converter is None \
            and len(group.sources) == 2 and group.sources[0][0] in self.scales

    def group_of(self, name: str) -> Group | None:
        first = self.producer.get(name)
        return self.groups[first] if first is not None else None

    def plain_source(self, group: Group) -> str | None:
        """The checkpoint key that a one-to-one rename reads as it is, else None."""
        return group.sources[0][0] if group.converter is None and len(group.sources) == 1 else None

    def stored_block(self, group: Group) -> tuple[int, int] | None:
        """The block ``(bn, bk)`` of the FP8 stack ``group`` converts its FP8 weights into when they can stay FP8,
        else None. They can when the conversion only stacks and concatenates them (transformers' MoE experts:
        ``experts.{e}.gate_proj`` and ``up_proj`` into ``experts.gate_up_proj [E, 2I, H]``), every weight has
        scales of one block size (a per-tensor scale is one block the weight's size: gate and up, of one shape,
        concatenate into two such blocks), and its dimensions are whole blocks (so each block of the stack is one
        weight's block, and the scales, read as their grids of blocks, convert like the weights: a 0-d per-tensor
        scale, as transformers saves an FP8 model without ``weight_block_size``, is a grid of one)."""
        operations = getattr(group.converter, "operations", None)
        if self.scheme is None or not operations \
                or len(group.targets) != 1 or any(type(op).__name__ not in _STACKING for op in operations) \
                or any(type(op).__name__ == "MergeModulelist" and op.dim != 0 for op in operations):
            return None
        keys = [key for key, _ in group.sources]
        if not all(key in self.scales for key in keys):
            return None
        shapes = [tuple(self.checkpoint.raw_range(key).shape) for key in keys]
        blocks = {self.scheme.block_of(shape) for shape in shapes}
        scale_dtypes = {self.checkpoint.raw_range(self.scales[key]).dtype for key in keys}
        if len(blocks) != 1 or len(scale_dtypes) != 1:
            return None
        bn, bk = blocks.pop()
        return (bn, bk) if all(n % bn == 0 and k % bk == 0 for n, k in shapes) else None

    def add_scales(self, group: Group, name: str) -> Group:
        """The group of the scales of FP8 stack ``group`` (``stored_block``), as stage tensor ``name``: the same
        conversion over each weight's scale (fp32 for E8M0 exponents)."""
        dtype = self._stored_dtype(self.scales[group.sources[0][0]])
        self.groups[name] = Group(name, [name], dtype, group.converter,
                                  [(self.scales[k], pattern) for k, pattern in group.sources], scales_of=group.first)
        self.producer[name] = name
        return self.groups[name]

    def run(self, group: Group) -> dict[str, torch.Tensor]:
        """Read ``group``'s source tensors and apply transformers' conversion: ``{target name: tensor}``."""
        if self.is_mxfp4(group):  # dequantised: the stage did not keep them as stored
            blocks, scales = (read_tensor(self.checkpoint, k) for k, _ in group.sources)
            return {group.first: mxfp4_as_model_weights(blocks, scales, group.dtype)}
        if group.converter is None:
            return {group.first: self.read(group.sources[0][0], group.dtype)}
        if group.scales_of is not None:  # converted under the weights' name, returned under the scales'
            # each weight's scales as its grid of blocks (a per-tensor [1] is [1, 1], a per-channel [N] is [N, 1]),
            # so that they stack and concatenate as the weights do
            weights = self.groups[group.scales_of]
            bn, bk = self.stored_block(weights)
            grid = {self.scales[k]: scale_grid(*self.checkpoint.raw_range(k).shape, bn, bk) for k, _ in weights.sources}
            out = self._convert(group.converter, group.scales_of, group.sources,
                                lambda key: lambda: self.read(key, group.dtype).reshape(grid[key]))
            return {group.first: next(iter(out.values()))}
        return self._convert(group.converter, group.first, group.sources,
                             lambda key: (lambda: read_tensor(self.checkpoint, key)) if group.stored
                             else _reader(self, key, group.dtype))

    def _convert(self, template, first: str, sources: list, reader) -> dict[str, torch.Tensor]:
        converter = copy.deepcopy(template)
        for key, pattern in sources:
            # A callable is read when the converter materialises its inputs (transformers' synchronous path).
            converter.add_tensor(first, key, pattern, reader(key))
        threads = torch.get_num_threads()
        # The operations are memory copies (stack, cat, chunk): one thread runs them at memory speed, while more
        # threads wait on each other whenever the cores are shared (5x slower on a busy 2-core machine).
        torch.set_num_threads(1)
        try:
            out = converter.convert(first, model=self.model, config=self.model.config, hf_quantizer=None,
                                    loading_info=None)
        except Exception as e:
            raise ConfigError(f"transformers' conversion {type(template).__name__} failed on the checkpoint "
                              f"tensors of {first} ({type(e).__name__}: {e}); the checkpoint does not match "
                              "its config.json") from None
        finally:
            torch.set_num_threads(threads)
        return {name: t[0] if isinstance(t, list) else t for name, t in out.items()}


    def read(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """Checkpoint tensor ``key`` as ``dtype``: an FP8 weight dequantised with its scale, a scale stored as E8M0
        exponents as the values they stand for."""
        if self._exponents(self.checkpoint.raw_range(key).dtype):
            return exponent_values(read_tensor(self.checkpoint, key)).to(dtype)
        t = read_tensor(self.checkpoint, key)
        scale = self.scales.get(key)
        if scale is None:
            return t.to(dtype)
        return dequantized(t, self.read(scale, torch.float32), self.scheme, dtype)

    def add_plain(self, name: str, key: str) -> None:
        """A stage tensor read from checkpoint ``key`` that the model skeleton does not have (a scale, MXFP4 blocks):
        as stored, or fp32 for E8M0 exponent scales of FP8 (the FP8 kernels read float scales; a power of two is
        exact in fp32)."""
        self.groups[name] = Group(name, [name], self._stored_dtype(key), None, [(key, None)])
        self.producer[name] = name

    def _stored_dtype(self, key: str) -> torch.dtype:
        """What a stage holds plain tensor ``key`` in: as stored, or fp32 for E8M0 exponent scales."""
        raw = self.checkpoint.raw_range(key).dtype
        return torch.float32 if self._exponents(raw) else _TORCH_DTYPES[raw]

    def _exponents(self, raw_dtype: str) -> bool:
        """Whether a tensor stored as ``raw_dtype`` is a scale of E8M0 exponents (``scale_fmt: "ue8m0"``)."""
        return self.scheme is not None and self.scheme.exponents and is_exponents(raw_dtype)


def _reader(sources: Sources, key: str, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    return lambda: sources.read(key, dtype)


def read_tensor(checkpoint: Checkpoint, key: str) -> torch.Tensor:
    """One tensor from its shard: one read of exactly its bytes (no mapping of the shard, no reopening a header).

    Example::

        w = read_tensor(Checkpoint(folder), "model.layers.0.mlp.experts.3.up_proj.weight")
    """
    raw = checkpoint.raw_range(key)
    dtype = _TORCH_DTYPES.get(raw.dtype) or _AS_BYTES.get(raw.dtype)
    if dtype is None:
        return checkpoint.read_one(key)
    data = bytearray(raw.nbytes)
    with open(raw.path, "rb") as f:
        f.seek(raw.offset)
        if f.readinto(data) != raw.nbytes:
            raise ConfigError(f"{os.path.basename(raw.path)} ended early; the shard is truncated, re-download it")
    if not data:
        return torch.empty(raw.shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(raw.shape)
