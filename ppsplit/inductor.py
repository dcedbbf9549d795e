"""Optional Inductor compilation of stages: ``split_model(..., compile=True)``, ``load(..., compile=True)``.

Each stage's forward goes through ``torch.compile`` in its default mode: Inductor fuses the traced elementwise
ops (rotary, SiLU-and-multiply, casts) into a few kernels, while ppsplit's Triton ops (fused norms and taps,
``cache_attention``) are kept as they are. Inductor's own CUDA graphs stay off, because ppsplit captures the
stage itself (``capture``/``cuda_graph``), cache and aux writes included. The stage stays the same
``GraphModule`` (same buffers, names and ``meta``); only its call is compiled, at the first call of each
``(batch, tokens)`` shape: nothing compiled is stored, so a compiled folder stays plain data.
"""
from __future__ import annotations

from typing import Iterable

import torch


def compile_stage(stage: torch.nn.Module, *, dynamic: bool | None = False) -> torch.nn.Module:
    """Compile ``stage`` in place with Inductor and return it. ``dynamic=False`` specialises each
    ``(batch, tokens)`` shape, one compilation per CUDA-graph bucket.

    Example::

        stage = compile_stage(ppsplit.load_stage("demo-pp4", 2, "cuda:2"))
        y, aux = stage(x, positions, aux)
    """
    # Compile the GraphModule's own generated forward: its code object is unique to this stage, so the compiled
    # entries of different stages do not share (and exhaust) one Dynamo cache.
    compiled = torch.compile(stage.forward, dynamic=dynamic, fullgraph=True)

    def inference(*args, **kwargs):
        # Stages are inference-only; without this, parameters that require grad make Inductor build a backward.
        with torch.no_grad():
            return compiled(*args, **kwargs)

    stage._compiled_call_impl = inference  # what nn.Module.compile sets: __call__ goes through it
    return stage


def compile_stages(stages: Iterable[torch.nn.Module], *, dynamic: bool | None = False) -> None:
    for stage in stages:
        compile_stage(stage, dynamic=dynamic)
