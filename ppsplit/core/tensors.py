"""Core: small facts about tensors and modules that every layer shares (dtype names, sizes, devices, the aux buffer).

Imports torch and the core only, so the serving path (loader, runtimes) can use it without the passes.
"""
from __future__ import annotations

from typing import Sequence

import torch

# The one table of dtype names: the name ppsplit writes (``str(dtype)`` without ``torch.``) -> dtype.
DTYPES: dict[str, torch.dtype] = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn)}
# Short names the command line accepts for the model dtype.
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MODEL_DTYPES = ("float32", "bfloat16", "float16")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name stored in plans and programs)."""
    return str(dtype).replace("torch.", "")


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``."""
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def module_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` lives: its first parameter's device, else its first buffer's, else the CPU."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def model_dtype(plan) -> torch.dtype:
    """The model dtype a ``SplitPlan`` records (``plan.dtype`` is its name)."""
    return DTYPES[plan.dtype]


def new_aux(plan, batch: int, tokens: int, device, fill=torch.empty) -> torch.Tensor:
    """The packed aux buffer of ``plan``: ``[n_slots, batch, tokens, H]`` in the model dtype."""
    return fill((plan.n_slots, batch, tokens, plan.hidden_size), dtype=model_dtype(plan), device=device)


def stream_rows(plan, stream: torch.Tensor) -> torch.Tensor:
    """The residual stream as the model keeps it (``output_hidden_states[j]``: ``[B, T, H]``, or Gemma 3n's
    ``[4, B, T, H]``) laid out as ``x`` and the aux slots hold it, ``[B, T, plan.hidden_size]``."""
    if plan.stream is None:
        return stream
    return stream.permute(plan.stream.order()).flatten(2)
