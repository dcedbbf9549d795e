"""Kernels: the one Triton preamble every kernel file shares, and how ppsplit's ops are registered.

Triton is optional: without it (or on CPU tensors, or under ``TRITON_INTERPRET=1`` in the tests) every op takes
its plain torch path. Ops are registered with ``torch.library.triton_op`` when Triton is there, so
``torch.compile``, ``torch.export`` and CUDA-graph capture see through the kernels; otherwise as custom ops.
"""
from __future__ import annotations

import os

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


# Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the kernel before it drains,
# and waits on the device (``griddepcontrol.wait``) before it touches what that kernel writes. At decode batch 1 a
# step is about 300 kernels of a few microseconds each, and each one's start and drain is time no weight streams;
# under PDL a GEMV streams its first weight tile into L2 before it waits. The decode-step kernels take a ``PDL``
# constexpr and call ``wait_for_previous`` before their first access to memory another kernel touches; their
# launches add ``launch_options(tensor)``. Off unless switched on (``programmatic_launch``): on an H100
# (bench/RESULTS.md section 38) a captured step keeps its bits, the bf16 decode step gains 3.5% at batch 1, and the
# FP8 step, which it was built for, loses 1.2%.
_PROGRAMMATIC = {"on": False}


def programmatic_launch(on: bool) -> bool:
    """Switch programmatic dependent launch for the decode-step kernels launched from now on; returns the previous
    setting. Where it cannot run (CPU tensors, the interpreter, a GPU before sm_90, torch.compile tracing) the
    kernels launch as usual."""
    previous, _PROGRAMMATIC["on"] = _PROGRAMMATIC["on"], bool(on)
    return previous


def compiled_for_hopper(t: torch.Tensor) -> bool:
    """Whether kernels for ``t`` run compiled on sm_90 or later (a CUDA tensor, Triton there, not interpreted)."""
    return (HAVE_TRITON and t.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(t.device)[0] >= 9)


def supports_programmatic_launch(t: torch.Tensor) -> bool:
    return HAVE_GDC and compiled_for_hopper(t)


def launch_options(t: torch.Tensor) -> dict:
    """The keyword arguments of a launch of a kernel that takes ``PDL``, for the tensors on ``t``'s device (off:
    ``PDL=False`` alone, no launch option that a traced launch would have to carry)."""
    on = (HAVE_TRITON and _PROGRAMMATIC["on"] and not torch.compiler.is_compiling()
          and supports_programmatic_launch(t))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


HAVE_GDC = False
if HAVE_TRITON:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        HAVE_GDC = True
    except ImportError:  # a Triton without grid dependency control: PDL stays off, PDL=False never reaches them
        gdc_launch_dependents = gdc_wait = None

    @triton.jit
    def wait_for_previous(PDL: tl.constexpr):
        """Under PDL: wait until the kernel before this one has finished and its writes are visible, then let the
        kernel after this one start (it waits in turn, so the order of every pair of kernels holds)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(pointers):
        """Ask the L2 cache for the lines at ``pointers`` (valid addresses; a line per pointer is enough), without
        waiting for them: what a kernel may read before ``wait_for_previous`` (weights no kernel writes)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [pointers], dtype=tl.int32,
                                  is_pure=False, pack=1)


def on_gpu(t: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for ``t`` (a CUDA tensor, Triton installed)."""
    return HAVE_TRITON and t.device.type == "cuda"
