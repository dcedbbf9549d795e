"""Kernels: the one Triton preamble every kernel file shares, and how ppsplit's ops are registered.

Triton is optional: without it (or on CPU tensors, or under ``TRITON_INTERPRET=1`` in the tests) every op takes
its plain torch path. Ops are registered with ``torch.library.triton_op`` when Triton is there, so
``torch.compile``, ``torch.export`` and CUDA-graph capture see through the kernels; otherwise as custom ops.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    HAVE_TRITON = True
except ImportError:  # the torch path still works everywhere
    triton = tl = triton_op = None
    HAVE_TRITON = False

    def wrap_triton(kernel):
        return kernel


def register(name: str, mutates_args: tuple[str, ...] = (), *, opaque: bool = False):
    """The decorator that registers ``name`` (``"ppsplit::..."``) as an op.

    ``opaque``: an op whose torch path reads its metadata on the host (a loop over the sequences of a ragged step).
    ``torch.compile`` traces a ``triton_op``'s body on every device, and it cannot trace that loop, so such an op
    is a plain custom op with its own fake: compiled graphs call it, and its CUDA path launches the kernel itself."""
    if HAVE_TRITON and not opaque:
        return triton_op(name, mutates_args=mutates_args)
    return torch.library.custom_op(name, mutates_args=mutates_args)


def on_gpu(t: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for ``t`` (a CUDA tensor, Triton installed)."""
    return HAVE_TRITON and t.device.type == "cuda"
