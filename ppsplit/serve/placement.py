"""Serving: where a compiled folder's stages run in one process, chosen before anything loads.

``--device`` of ``generate`` / ``serve`` / ``collect``: ``auto`` (the default: CUDA when the machine has a GPU, else
the CPU), ``cpu``, ``cuda`` (every stage on the current GPU when the folder fits it, else the stages spread in order
over the visible GPUs), or a list ``cuda:0,cuda:1`` (one device per stage, or fewer: consecutive stages share one).
A stage needs its file's bytes, its KV cache and, on the last stage, the drafter; a placement whose stages do not fit
a GPU's free memory (less a margin for activations and CUDA graphs) is refused, naming the sizes.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from ppsplit.core.errors import ConfigError
from ppsplit.core.plan import fmt_bytes

log = logging.getLogger("ppsplit")
MARGIN = 0.08  # of a GPU's free memory kept for activations, CUDA graphs and the allocator
MARGIN_BYTES = 1 << 30


def stage_memory(opened) -> list[int]:
    """Bytes each stage of a ``CompiledFolder`` takes on its device: its weights, its KV cache (and replicated
    caches), and on the last stage the drafter's files."""
    plan = opened.plan
    need = [os.path.getsize(opened.weights(k)) + s.cache_bytes for k, s in enumerate(plan.stages)]
    for stage, _, size in plan.replicas:
        need[stage] += size
    if opened.drafter is not None:
        need[-1] += sum(os.path.getsize(os.path.join(opened.drafter, f)) for f in os.listdir(opened.drafter)
                        if f.endswith((".safetensors", ".bin")))
    return need


def usable(device: torch.device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, int(free * (1 - MARGIN)) - MARGIN_BYTES)


def placement(opened, device: str | None = None) -> list[torch.device]:
    """One device per stage of ``opened`` for ``device`` (see the module docstring); a ``ConfigError`` when the
    machine lacks it or the stages do not fit."""
    from ppsplit.artifact.loader import check_device

    pp = opened.plan.pp
    device = (device or "auto").strip()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return [torch.device("cpu")] * pp
    listed = [check_device(d.strip()) for d in device.split(",") if d.strip()]
    if not listed or any(d.type != "cuda" for d in listed) and len(listed) > 1:
        raise ConfigError(f"--device must be auto, cpu, cuda or a list like cuda:0,cuda:1, but got {device!r}")
    if listed[0].type == "cpu":
        return [torch.device("cpu")] * pp
    if len(listed) > pp:
        raise ConfigError(f"--device lists {len(listed)} devices but the folder has {pp} stages; list at most {pp}")
    need = stage_memory(opened)
    listed = [torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device()) for d in listed]
    if device == "cuda" and sum(need) > usable(listed[0]) and torch.cuda.device_count() > 1:
        listed = [torch.device("cuda", i) for i in range(min(pp, torch.cuda.device_count()))]
    devices = spread(need, listed)
    for dev in sorted(set(devices), key=str):
        here = sum(n for n, d in zip(need, devices) if d == dev)
        if here > usable(dev):
            stages = [k for k, d in enumerate(devices) if d == dev]
            raise ConfigError(f"stages {stages} need {fmt_bytes(here)} on {dev} (weights, KV cache"
                              f"{', drafter' if pp - 1 in stages and opened.drafter else ''}) but it has "
                              f"{fmt_bytes(usable(dev))} to spare; pass --device with more GPUs, compile with a "
                              "smaller --max-batch / --max-len or more stages, or --device cpu")
    return devices


def spread(need: list[int], devices: list[torch.device]) -> list[torch.device]:
    """Consecutive stages over ``devices`` in order: a stage goes to the device whose share of the total bytes its
    middle falls in."""
    if len(devices) == len(need):
        return list(devices)
    total, out, before = max(sum(need), 1), [], 0
    for n in need:
        out.append(devices[min(len(devices) - 1, int((before + n / 2) * len(devices) / total))])
        before += n
    return out


def load_placed(folder: str, device: str | None = None):
    """``ppsplit.load`` of ``folder`` on ``placement(device)``, with one progress line."""
    from ppsplit.artifact.folder import CompiledFolder
    from ppsplit.serve.runtime import load

    opened = CompiledFolder(folder)
    devices = placement(opened, device)
    where = ", ".join(sorted({str(d) for d in devices}))
    start = time.perf_counter()
    log.info("loading %s: %d stage%s on %s (%s) ...", folder, opened.plan.pp, "s" * (opened.plan.pp != 1), where,
             fmt_bytes(sum(stage_memory(opened))))
    split = load(folder, devices)
    log.info("loaded in %.1fs", time.perf_counter() - start)
    return split
