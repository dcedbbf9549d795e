"""``ppsplit compile``: from a checkpoint to a folder of per-stage artifacts, and loading them back.

The folder::

    plan.json              the SplitPlan
    manifest.json          source, dtype, versions, files, generation ids
    stage_<k>.json         stage k's program (its FX graph; see ppsplit.program)
    stage_<k>.safetensors  stage k's tensors under their original names, nothing else

Weights are streamed tensor by tensor from the source shards into the stage files, so memory holds one tensor
at a time. Everything is written into a hidden temporary folder beside the output and renamed into place when
complete: an error, Ctrl-C or SIGTERM leaves no output folder behind.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from typing import Sequence

import torch
from torch import fx

from ppsplit.api import SplitOptions, split_model
from ppsplit.cache import CacheConfig, is_cache_buffer
from ppsplit.checkpoint import ST_DTYPES, Checkpoint, write_safetensors
from ppsplit.errors import ConfigError
from ppsplit.plan import SplitPlan
from ppsplit.program import ProgramError, graph_from_json, graph_to_json
from ppsplit.runtime import SplitModel
from ppsplit.serving_files import copy_serving_files

log = logging.getLogger("ppsplit")
_TMP_TAG = ".ppsplit-tmp-"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def compile_model(model: str, out: str, *, pp: int, aux=None, aux_convention: str = "vllm", balance="layers",
                  dtype: str | None = None, cache: CacheConfig | None = None, force: bool = False,
                  fuse: bool | str = True, progress: bool = False) -> str:
    """Split the checkpoint ``model`` into ``pp`` stages and write the artifacts to ``out``. Returns ``out``.

    Example::

        compile_model("demo", "demo-pp4", pp=4, aux="eagle3")
        split = ppsplit.load("demo-pp4")
    """
    from ppsplit.passes.annotate import find_layers
    from ppsplit.passes.trace import _tied_parameters
    from ppsplit.source import load_config, resolve_model

    opts = SplitOptions(pp=pp, aux=aux, balance=balance, aux_convention=aux_convention, fuse=fuse)
    out = os.path.abspath(out)
    if os.path.exists(out) and not force:
        raise ConfigError(f"{out} already exists; pass --force to replace it, or -o another folder")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, but got {dtype!r}")
    folder = resolve_model(model)
    config = load_config(folder)
    checkpoint = Checkpoint(folder)
    torch_dtype = DTYPES[dtype] if dtype else _config_dtype(config)

    start = time.perf_counter()
    model_obj, buffers = skeleton(config, torch_dtype)
    opts.taps(find_layers(model_obj).num_layers)  # bad --pp / --aux fail here, before the trace
    split = split_model(model_obj, opts.pp, opts.aux, balance=opts.balance, aux_convention=opts.aux_convention,
                        cache=cache, fuse=opts.fuse)
    log.info("split into %d stages in %.1fs", split.plan.pp, time.perf_counter() - start)
    tied = dict(_tied_parameters(model_obj))  # alias -> the name a tied checkpoint stores
    stage_specs = [_stage_tensors(stage, k, checkpoint, buffers, tied) for k, stage in enumerate(split.stages)]

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    _remove_stale_tmp(parent)
    tmp = os.path.join(parent, f".{os.path.basename(out)}{_TMP_TAG}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _write(tmp, split, stage_specs, checkpoint, buffers, model, torch_dtype, progress)
        if os.path.exists(out):
            backup = tmp + "-old"
            os.rename(out, backup)
            os.rename(tmp, out)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s in %.1fs", out, time.perf_counter() - start)
    return out


def _config_dtype(config) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    return DTYPES.get(str(value).replace("torch.", ""), torch.float32)


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters go to the meta device as they are registered (no memory, no init work); buffers computed in
    ``__init__`` (rotary ``inv_freq``, ...) stay real on the CPU, since no checkpoint holds them."""
    register = torch.nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def skeleton(config, dtype: torch.dtype):
    """The model with parameters on the meta device, and the values of its buffers (moved to meta too, so the
    model traces as a pure meta model). Returns ``(model, {buffer name: CPU tensor})``."""
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    buffers = {name: b.detach().clone() for name, b in model.named_buffers(remove_duplicate=False)
               if b.device.type != "meta"}
    model.to("meta")
    return model, buffers


def _stage_tensors(stage: fx.GraphModule, k: int, checkpoint: Checkpoint, buffers: dict, tied: dict) -> list[dict]:
    """What stage ``k`` needs and where each tensor comes from; raises before anything is written."""
    persistent = set(stage.state_dict().keys())
    specs = []
    for kind, items in (("parameter", stage.named_parameters(remove_duplicate=False)),
                        ("buffer", stage.named_buffers(remove_duplicate=False))):
        for name, t in items:
            spec = {"name": name, "kind": kind, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                    "persistent": kind == "parameter" or name in persistent}
            if is_cache_buffer(name):
                spec["init"] = "zeros"  # state, not weights: allocated by load_stage
            elif name in checkpoint:
                spec["init"], spec["source"] = "file", name
            elif tied.get(name) in checkpoint:
                spec["init"], spec["source"] = "file", tied[name]
            elif name in buffers or t.device.type != "meta":
                spec["init"], spec["source"] = "file", None
            else:
                raise ConfigError(f"the checkpoint has no tensor {name!r}, which stage {k} needs; its names differ from "
                                  "the model's (transformers renames or fuses some architectures' weights on load), "
                                  "which ppsplit compile does not support yet")
            specs.append(spec)
    return specs


def _write(tmp: str, split: SplitModel, stage_specs: list, checkpoint: Checkpoint, buffers: dict, source: str,
           dtype: torch.dtype, progress: bool) -> None:
    import transformers

    import ppsplit

    with open(os.path.join(tmp, "plan.json"), "w") as f:
        f.write(split.plan.to_json())
    copy_serving_files(checkpoint.folder, tmp)  # tokenizer, chat template, generation_config.json
    total = sum(_nbytes(s) for specs in stage_specs for s in specs if s["init"] == "file")
    bar = _progress(total, progress)
    files = []
    try:
        for k, (stage, specs) in enumerate(zip(split.stages, stage_specs)):
            program = {"stage": k, "tensors": specs, "program": graph_to_json(stage.graph)}
            with open(os.path.join(tmp, f"stage_{k}.json"), "w") as f:
                json.dump(program, f)
            in_file = sorted((s for s in specs if s["init"] == "file"),
                             key=lambda s: (checkpoint.where.get(s["source"] or "", ""), s["name"]))
            own = dict(stage.named_parameters(remove_duplicate=False)) | dict(stage.named_buffers(remove_duplicate=False))

            def tensors(in_file=in_file, own=own):
                for s in in_file:
                    if s["source"]:
                        raw = checkpoint.raw_range(s["source"])
                        # Same dtype: copy the bytes; otherwise read the tensor with safe_open and convert.
                        same = raw.dtype == ST_DTYPES[getattr(torch, s["dtype"])]
                        t = raw if same else checkpoint.read_one(s["source"])
                    else:  # a buffer computed at init or a constant captured by the trace
                        t = buffers.get(s["name"], own[s["name"]])
                    yield s["name"], t

            entries = [(s["name"], tuple(s["shape"]), getattr(torch, s["dtype"])) for s in in_file]
            bar.set_description(f"stage {k}")
            nbytes = write_safetensors(os.path.join(tmp, f"stage_{k}.safetensors"), entries, tensors(),
                                       metadata={"format": "pt", "ppsplit_stage": k}, progress=bar.update)
            files.append({"program": f"stage_{k}.json", "weights": f"stage_{k}.safetensors", "bytes": nbytes})
    finally:
        bar.close()
    manifest = {"ppsplit": ppsplit.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                "source": source, "dtype": str(dtype).replace("torch.", ""), "stages": files,
                "eos_token_id": list(split.eos_token_id), "pad_token_id": split.pad_token_id}
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)


def _nbytes(spec: dict) -> int:
    return int(torch.Size(spec["shape"]).numel()) * torch.empty((), dtype=getattr(torch, spec["dtype"])).element_size()


class _NoBar:
    def update(self, n):
        pass

    def set_description(self, text):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True)


def _remove_stale_tmp(parent: str) -> None:
    """Temporary folders of compiles that were killed outright (SIGKILL) and whose process is gone."""
    for entry in os.listdir(parent):
        if _TMP_TAG not in entry or not entry.startswith("."):
            continue
        pid = entry.rsplit(_TMP_TAG, 1)[1].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing: {os.path.dirname(path)} is not a complete ppsplit compile folder") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable ({e}); compile the folder again") from None


def load_plan(folder: str) -> SplitPlan:
    try:
        return SplitPlan.from_dict(_read_json(os.path.join(folder, "plan.json")))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{folder}/plan.json is not a valid plan ({e}); compile the folder again") from None


def load_stage(folder: str, k: int, device: torch.device | str = "cpu") -> fx.GraphModule:
    """Stage ``k`` of a compiled folder, ready to run on ``device``: ``y, aux = stage(x, positions, aux)``.

    Example::

        stage = ppsplit.load_stage("demo-pp4", 2, "cuda:2")
    """
    from safetensors import safe_open

    from ppsplit.passes.trace import _set_tensor, copy_buffer_persistence

    plan = load_plan(folder)
    if not 0 <= k < plan.pp:
        raise ConfigError(f"stage {k} does not exist: {folder} has stages 0 to {plan.pp - 1}")
    data = _read_json(os.path.join(folder, f"stage_{k}.json"))
    try:
        graph = graph_from_json(data["program"])
    except (ProgramError, KeyError) as e:
        raise ConfigError(f"{folder}/stage_{k}.json: {e}") from None
    root = torch.nn.Module()
    weights = os.path.join(folder, f"stage_{k}.safetensors")
    try:
        with safe_open(weights, framework="pt", device=str(device)) as f:
            stored = set(f.keys())
            expected = {t["name"] for t in data["tensors"] if t["init"] == "file"}
            if stored != expected:
                raise ConfigError(f"{weights} holds {sorted(stored ^ expected)[:3]} contrary to stage_{k}.json; "
                                  "the folder is corrupt, compile it again")
            for t in data["tensors"]:
                dtype = getattr(torch, t["dtype"])
                if t["init"] == "file":
                    value = f.get_tensor(t["name"])
                    if list(value.shape) != t["shape"] or value.dtype != dtype:
                        raise ConfigError(f"{weights}: {t['name']} is {tuple(value.shape)} {value.dtype}, the program "
                                          f"expects {tuple(t['shape'])} {dtype}; compile the folder again")
                else:
                    value = torch.zeros(t["shape"], dtype=dtype, device=device)
                _set_tensor(root, t["name"], value, parameter=t["kind"] == "parameter", persistent=t["persistent"])
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"cannot read {weights}: {e}; compile the folder again") from None
    stage = fx.GraphModule(root, graph, class_name=f"Stage{k}")
    copy_buffer_persistence(stage, root)
    stage.meta["ppsplit.stage"] = k
    stage.meta["ppsplit.plan"] = plan
    return stage


def load(folder: str, devices: Sequence[torch.device | str] | None = None) -> SplitModel:
    """The whole ``SplitModel`` of a compiled folder; stage ``k`` on ``devices[k]`` (default: all on the CPU).

    Example::

        split = ppsplit.load("demo-pp4")
        logits, aux = split(input_ids)
    """
    plan = load_plan(folder)
    manifest = _read_json(os.path.join(folder, "manifest.json"))
    devices = list(devices) if devices is not None else ["cpu"] * plan.pp
    if len(devices) != plan.pp:
        raise ConfigError(f"{folder} has {plan.pp} stages; pass one device per stage, got {len(devices)}")
    stages = [load_stage(folder, k, devices[k]) for k in range(plan.pp)]
    return SplitModel(plan, stages, eos_token_id=manifest.get("eos_token_id") or (),
                      pad_token_id=manifest.get("pad_token_id"))
