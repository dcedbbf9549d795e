"""Driver: loading a ``ppsplit compile`` folder (the serving path).

Imports torch, safetensors and the core only (and, through the op allowlist, ``ppsplit.triton_kernels``): a
serving process pays neither for transformers nor for the passes. Nothing is unpickled; every op of a stage
program is resolved against an allowlist (see ``ppsplit.program``).
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import torch
from torch import fx

from ppsplit.errors import ConfigError
from ppsplit.fx_utils import copy_buffer_persistence, set_tensor
from ppsplit.plan import SplitPlan
from ppsplit.program import ProgramError, graph_from_json
from ppsplit.runtime import SplitModel
from ppsplit.tensors import DTYPES


def read_json(path: str) -> dict:
    """A JSON file of a compiled folder, or a ``ConfigError`` that says what is wrong with the folder."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing: {os.path.dirname(path)} is not a complete ppsplit compile folder") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable ({e}); compile the folder again") from None


def check_folder(folder: str) -> None:
    if not os.path.isdir(folder):
        what = "does not exist" if not os.path.exists(folder) else "is a file"
        raise ConfigError(f"{folder} {what}; pass a folder written by ppsplit compile")


def load_plan(folder: str) -> SplitPlan:
    """The ``SplitPlan`` stored in ``folder/plan.json``."""
    check_folder(folder)
    data = read_json(os.path.join(folder, "plan.json"))
    try:
        return SplitPlan.from_dict(data)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ConfigError(f"{folder}/plan.json is not a valid plan ({e}); compile the folder again") from None


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


def read_program(folder: str, k: int) -> tuple[dict, fx.Graph]:
    """Stage ``k``'s program file and its graph, validated (every op on the allowlist)."""
    data = read_json(os.path.join(folder, f"stage_{k}.json"))
    try:
        return data, graph_from_json(data["program"])
    except (ProgramError, KeyError, TypeError) as e:
        raise ConfigError(f"{folder}/stage_{k}.json: {e}; compile the folder again") from None


def load_stage(folder: str, k: int, device: torch.device | str = "cpu", *, compile: bool = False,
               fuse_projections: bool | None = None, gemv: bool = True) -> fx.GraphModule:
    """Stage ``k`` of a compiled folder, ready to run on ``device``: ``y, aux = stage(x, positions, aux)``.
    ``compile=True`` compiles it with Inductor at its first call (see ``ppsplit.inductor``). ``fuse_projections``:
    fuse sibling projections (q/k/v, gate/up) into one linear each (``None``: as the folder was compiled).
    ``gemv``: on a CUDA device, route projections through ``ppsplit::linear`` (Triton GEMV at batch 1; see
    ``ppsplit.passes.gemv``).

    Example::

        stage = ppsplit.load_stage("demo-pp4", 2, "cuda:2")
    """
    from safetensors import safe_open

    plan = load_plan(folder)
    if not isinstance(k, int) or not 0 <= k < plan.pp:
        raise ConfigError(f"stage {k} does not exist: {folder} has stages 0 to {plan.pp - 1}")
    device = check_device(device)
    data, graph = read_program(folder, k)
    root = torch.nn.Module()
    weights = os.path.join(folder, f"stage_{k}.safetensors")
    try:
        with safe_open(weights, framework="pt", device=str(device)) as f:
            _check_stored(weights, set(f.keys()), data, k)
            for t in data["tensors"]:
                dtype = DTYPES[t["dtype"]]
                if t["init"] == "file":
                    value = f.get_tensor(t["name"])
                    if list(value.shape) != t["shape"] or value.dtype != dtype:
                        raise ConfigError(f"{weights}: {t['name']} is {tuple(value.shape)} {value.dtype}, the program "
                                          f"expects {tuple(t['shape'])} {dtype}; compile the folder again")
                else:
                    value = torch.zeros(t["shape"], dtype=dtype, device=device)
                set_tensor(root, t["name"], value, parameter=t["kind"] == "parameter", persistent=t["persistent"])
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"cannot read {weights}: {e}; compile the folder again") from None
    stage = fx.GraphModule(root, graph, class_name=f"Stage{k}")
    copy_buffer_persistence(stage, root)
    stage.meta["ppsplit.stage"] = k
    stage.meta["ppsplit.plan"] = plan
    if fuse_projections is None:
        fuse_projections = bool(read_json(os.path.join(folder, "manifest.json")).get("fuse_projections"))
    if fuse_projections:
        from ppsplit.passes.projections import fuse_projections as fuse_stage_projections
        stage.meta["ppsplit.projections"] = fuse_stage_projections(stage)
    if gemv and device.type == "cuda":  # elsewhere the op is the traced call: serving on the CPU imports no pass
        from ppsplit.passes.gemv import route_gemv
        stage.meta["ppsplit.gemv"] = route_gemv(stage)
    if compile:
        from ppsplit.inductor import compile_stage
        compile_stage(stage)
    return stage


def _check_stored(weights: str, stored: set, program: dict, k: int) -> None:
    expected = {t["name"] for t in program["tensors"] if t["init"] == "file"}
    if stored != expected:
        raise ConfigError(f"{weights} holds {sorted(stored ^ expected)[:3]} contrary to stage_{k}.json; "
                          "the folder is corrupt, compile it again")


def validate(folder: str) -> tuple[SplitPlan, dict]:
    """Check a compiled folder as ``load`` would, without reading any tensor data: the plan, the manifest, every
    stage program against the op allowlist, and every weights file's tensor names. Returns ``(plan, manifest)``."""
    from safetensors import safe_open

    plan = load_plan(folder)
    manifest = read_json(os.path.join(folder, "manifest.json"))
    for k in range(plan.pp):
        data, _ = read_program(folder, k)
        weights = os.path.join(folder, f"stage_{k}.safetensors")
        try:
            with safe_open(weights, framework="pt") as f:
                _check_stored(weights, set(f.keys()), data, k)
        except (OSError, RuntimeError) as e:
            raise ConfigError(f"cannot read {weights}: {e}; compile the folder again") from None
    return plan, manifest


def load(folder: str, devices: Sequence[torch.device | str] | None = None, *, compile: bool = False,
         fuse_projections: bool | None = None, gemv: bool = True) -> SplitModel:
    """The whole ``SplitModel`` of a compiled folder; stage ``k`` on ``devices[k]`` (default: all on the CPU).
    ``compile``, ``fuse_projections`` and ``gemv`` as in ``load_stage``.

    Example::

        split = ppsplit.load("demo-pp4")
        logits, aux = split(input_ids)
    """
    plan = load_plan(folder)
    manifest = read_json(os.path.join(folder, "manifest.json"))
    devices = list(devices) if devices is not None else ["cpu"] * plan.pp
    if len(devices) != plan.pp:
        raise ConfigError(f"{folder} has {plan.pp} stages; pass one device per stage, got {len(devices)}")
    stages = [load_stage(folder, k, devices[k], compile=compile, fuse_projections=fuse_projections, gemv=gemv)
              for k in range(plan.pp)]
    split = SplitModel(plan, stages, eos_token_id=manifest.get("eos_token_id") or (),
                       pad_token_id=manifest.get("pad_token_id"))
    from ppsplit.drafter_load import attach_compiled_drafter
    attach_compiled_drafter(split, folder)  # split.drafter, when compiled with --drafter
    return split
