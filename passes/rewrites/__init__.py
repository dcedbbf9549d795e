"""Stage rewrites: what is applied to built stages, by ``split_model`` and by ``load`` alike, one entry each.

Each rewrite is switched on by the ``StageOptions`` field of its name and imported only when it runs, so a
serving process imports only the rewrites it applies. Its report goes into ``stage.meta`` (``ppsplit.projections``,
``ppsplit.gemv``, ``ppsplit.compile``).

    fuse_projections   sibling linears on one input -> one linear over the concatenated weight (projections.py)
    fuse_pointwise     rotary embedding, SiLU-and-multiply -> one Triton kernel each (pointwise.py)
    gemv               projections with >= 4096 outputs -> ppsplit::linear, a Triton GEMV at batch 1 (gemv.py);
                       then each next projection's first weight bytes prefetched into L2 (prefetch.py)
    compile            the stage compiled with Inductor at its first call per shape (inductor.py)

A new rewrite is one ``StageOptions`` field and one entry of ``REWRITES``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from ppsplit.core.options import StageOptions
from ppsplit.core.tensors import module_device


@dataclass(frozen=True)
class StageRewrite:
    """``function`` (``module:name`` under ``ppsplit.passes.rewrites``) rewrites one stage in place and returns
    its report, kept in ``stage.meta[meta]``; ``cuda_only``: it changes nothing elsewhere, so ``load`` skips it on
    other devices."""

    option: str
    function: str
    meta: str
    cuda_only: bool = False

    def run(self, stage: torch.fx.GraphModule):
        module, name = self.function.split(":")
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)(stage)


REWRITES = (
    StageRewrite("fuse_projections", "projections:fuse_projections", "ppsplit.projections"),
    StageRewrite("fuse_pointwise", "pointwise:fuse_pointwise", "ppsplit.pointwise", cuda_only=True),
    StageRewrite("gemv", "gemv:route_gemv", "ppsplit.gemv", cuda_only=True),
    StageRewrite("compile", "inductor:compile_stage", "ppsplit.compile"),
)
assert [r.option for r in REWRITES] == list(StageOptions.__dataclass_fields__), "one rewrite per StageOptions field"


def apply_rewrites(stage: torch.fx.GraphModule, options: StageOptions, device: torch.device | None = None) -> None:
    """Apply the rewrites ``options`` switches on, in ``REWRITES`` order. With ``device`` (what ``load`` passes)
    the CUDA-only rewrites run only on a CUDA device. An option left ``None`` (on where it is the fast path)
    is decided by ``device``, or else by where the stage's tensors are."""
    where = device or module_device(stage)
    for rewrite in REWRITES:
        if not options.on(rewrite.option, where):
            continue
        if rewrite.cuda_only and device is not None and device.type != "cuda":
            continue
        stage.meta[rewrite.meta] = rewrite.run(stage)
