"""Artifact: building stages from a ``ppsplit compile`` folder (the serving path): ``load_stage``.

Imports torch, safetensors and the core (and, through the op allowlist, ``ppsplit.triton_kernels``), plus the
stage rewrites it applies: a serving process pays neither for transformers nor for the compile passes. The folder
is checked before any tensor is read (``ppsplit.artifact.folder``); nothing is unpickled, and no string from
it reaches Python's compiler (``ppsplit.artifact.program``).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import fx

from ppsplit.artifact.folder import CompiledFolder, FolderError, StageProgram, host_memory, stage_memory
from ppsplit.core.errors import ConfigError
from ppsplit.core.fx_utils import copy_buffer_persistence, set_tensor
from ppsplit.core.options import StageOptions
from ppsplit.core.tensors import DTYPES
from ppsplit.passes.rewrites import apply_rewrites


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``, or a ``ConfigError`` when this machine does not have it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{device!r} is not a device; pass 'cpu', 'cuda' or 'cuda:<index>'") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"device {dev} is not available: this machine has no CUDA GPU (torch "
                              f"{torch.__version__}); load onto 'cpu' instead")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"device {dev} does not exist: this machine has {count} CUDA GPU(s), cuda:0 to "
                              f"cuda:{count - 1}")
    return dev


def device_memory(device: torch.device) -> int:
    """The bytes ``device`` has: this machine's RAM for the CPU, the GPU's own memory for a CUDA device."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    return host_memory()


def largest_memory() -> int:
    """The most memory one stage could be given on this machine: its RAM, or its largest GPU's if that is more."""
    sizes = [device_memory(torch.device("cpu"))]
    if torch.cuda.is_available():
        sizes += [device_memory(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    return max(sizes)


def stage_options(folder: CompiledFolder, **overrides) -> StageOptions:
    """The stage rewrites to apply: the folder's recorded ones, with each override that is not ``None``."""
    return dataclasses.replace(folder.manifest.stage_options, **{k: v for k, v in overrides.items() if v is not None})


def load_stage(folder: str | CompiledFolder, k: int, device: torch.device | str = "cpu", *,
               compile: bool | None = None, fuse_projections: bool | None = None,
               fuse_pointwise: bool | None = None, gemv: bool | None = None,
               tp_rank: int | None = None) -> fx.GraphModule:
    """Stage ``k`` of a compiled folder, ready to run on ``device``: ``y, aux = stage(x, positions, aux)``.
    ``compile``, ``fuse_projections``, ``fuse_pointwise``, ``gemv``: the stage rewrites (``StageOptions``); ``None``
    keeps what the folder records (``ppsplit compile --fuse-projections``; ``gemv`` on, ``compile`` off by default).
    ``fuse_pointwise`` and ``gemv`` run only on a CUDA device. A folder cut for tensor parallelism needs ``tp_rank``:
    the stage is that rank's shard, whose collectives run on the group ``ppsplit.distributed.tensor_parallel``
    registers.

    Example::

        stage = ppsplit.load_stage("demo-pp4", 2, "cuda:2")
    """
    folder = folder if isinstance(folder, CompiledFolder) else CompiledFolder(folder)
    options = stage_options(folder, compile=compile, fuse_projections=fuse_projections,
                            fuse_pointwise=fuse_pointwise, gemv=gemv)
    program = folder.program(k)
    folder.check_weights(program, tp_rank)
    return build_stage(folder, program, check_device(device), options, tp_rank)


def build_stage(folder: CompiledFolder, program: StageProgram, device: torch.device,
                options: StageOptions, tp_rank: int | None = None) -> fx.GraphModule:
    """The stage of a checked ``program`` (TP rank ``tp_rank``'s shard, with tensor parallelism): its tensors read
    onto ``device``, then the stage rewrites. A whole stage that declares more than ``device`` holds is refused
    before anything is allocated (a TP rank's shard is not checked here: the program declares the whole stage)."""
    need, have = stage_memory(program), device_memory(device)
    if tp_rank is None and need.total > have:
        from ppsplit.core.plan import fmt_bytes

        raise FolderError(f"stage {program.index} of {folder.path} allocates {fmt_bytes(need.total)} (weights "
                          f"{fmt_bytes(need.weights)}, zero-initialised {fmt_bytes(need.state)}, the largest "
                          f"{need.largest}), more than {device} has ({fmt_bytes(have)}); run ppsplit inspect on it")
    root = _tensors(folder, program, device, tp_rank)
    stage = fx.GraphModule(root, program.graph, class_name=f"Stage{program.index}")
    copy_buffer_persistence(stage, root)
    stage.meta["ppsplit.stage"] = program.index
    stage.meta["ppsplit.plan"] = folder.plan
    if folder.plan.tp > 1:
        stage.meta["ppsplit.tp"] = (tp_rank, folder.plan.tp)
    apply_rewrites(stage, options, device)
    return stage


def _tensors(folder: CompiledFolder, program: StageProgram, device: torch.device,
             tp_rank: int | None = None) -> torch.nn.Module:
    """A module holding stage ``program.index``'s tensors under their names: read from its weights file (already
    checked against the program) or, for state, zeros."""
    from safetensors import safe_open

    root = torch.nn.Module()
    path = folder.program_weights(program, tp_rank)
    try:
        with safe_open(path, framework="pt", device=str(device)) as f:
            for t in program.tensors:
                value = f.get_tensor(t.name) if t.init == "file" else \
                    torch.zeros(t.shape, dtype=DTYPES[t.dtype], device=device)
                set_tensor(root, t.name, value, parameter=t.kind == "parameter", persistent=t.persistent)
    except (OSError, RuntimeError, MemoryError) as e:  # the header was checked: a read failing now is I/O or memory
        raise FolderError(f"cannot read {path}: {str(e).splitlines()[0][:160]}") from None
    return root
