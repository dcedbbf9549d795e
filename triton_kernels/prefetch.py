"""Weights streamed into L2 ahead of the kernel that reads them, on a branch beside the decode step.

At decode batch 1 a layer's HBM sits nearly idle while the attention, its combine and the norms run (they read
little), and each projection's GEMV then streams its whole weight. ``l2_prefetch`` starts, on a second stream
forked from the current one, a tiny kernel that asks the L2 cache for the first bytes of the weights the next
projections read; it returns at once, so the attention runs on the current stream beside it. ``l2_join`` makes the
current stream wait for that kernel again (a CUDA-graph capture needs every fork joined), placed just before the
projection. Under capture the fork and the join become a branch of the graph.

The kernel issues Hopper's bulk prefetch (``cp.async.bulk.prefetch.L2``: one instruction asks for a whole chunk, and
the copy engine fetches it without holding the thread) or, with ``BULK=False``, one ``prefetch.global.L2`` a
128-byte line. Neither waits for the data, and neither changes a bit of what the step computes. Where it cannot run
(CPU tensors, the interpreter, a GPU before sm_90) both calls do nothing.
"""
from __future__ import annotations

import os

import torch

from ppsplit.triton_kernels.common import HAVE_TRITON, tl, triton

PROGRAM_BYTES = {"on": 64 * 1024}  # bytes a program asks for: one program an SM or more (each SM's copy engine
THREADS = 32       # bulk prefetches a program (one warp)     # fetches its own requests, at a fraction of HBM's rate)
_SIDE: dict[int, torch.cuda.Stream] = {}

if HAVE_TRITON:
    @triton.jit
    def _prefetch_kernel(address, nbytes, BULK: tl.constexpr, CHUNK: tl.constexpr, THREADS: tl.constexpr):
        if BULK:
            start = (tl.program_id(0) * THREADS + tl.arange(0, THREADS)).to(tl.int64) * CHUNK
            size = tl.maximum(tl.minimum(nbytes - start, CHUNK), 0).to(tl.int32)
            tl.inline_asm_elementwise(
                "{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t"
                "mov.u32 $0, 0;\n\t}", "=r,l,r", [address + start, size], dtype=tl.int32, is_pure=False, pack=1)
        else:
            start = (tl.program_id(0) * (CHUNK * THREADS // 128) + tl.arange(0, CHUNK * THREADS // 128)).to(tl.int64) * 128
            start = tl.minimum(start, nbytes - 128)
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [address + start], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_usable(t: torch.Tensor) -> bool:
    """Whether ``l2_prefetch`` does anything for ``t``: a CUDA tensor on sm_90 or later, Triton compiled."""
    return (HAVE_TRITON and t.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(t.device)[0] >= 9)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _side(device: torch.device) -> torch.cuda.Stream:
    index = _index(device)
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(index)
    return _SIDE[index]


def launch_prefetch(weight: torch.Tensor, nbytes: int, bulk: bool = True) -> None:
    """Ask L2 for the first ``nbytes`` of ``weight``'s storage (rounded down to 16 bytes), on the current stream."""
    nbytes = min(nbytes, weight.numel() * weight.element_size()) // 16 * 16
    if nbytes < 128:
        return
    per_program = PROGRAM_BYTES["on"]
    _prefetch_kernel[(triton.cdiv(nbytes, per_program),)](
        weight.data_ptr(), nbytes, BULK=bulk, CHUNK=per_program // THREADS, THREADS=THREADS,
        num_warps=1 if bulk else 4)


def l2_prefetch(nbytes: int, *weights: torch.Tensor, bulk: bool = True, fork: bool = True) -> None:
    """Ask L2 for ``nbytes`` of ``weights`` in order (the first weight's first bytes first), on a stream forked from
    the current one (``fork=False``: on the current stream). Nothing on CPU tensors or before sm_90."""
    if not weights or not prefetch_usable(weights[0]):
        return
    device = weights[0].device
    side = _side(device) if fork else torch.cuda.current_stream(device)
    if fork:
        side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for w in weights:
            if nbytes <= 0:
                break
            launch_prefetch(w, nbytes, bulk)
            nbytes -= w.numel() * w.element_size()


def l2_join(weight: torch.Tensor) -> None:
    """The current stream waits for the prefetches forked on ``weight``'s device (a no-op where they never ran)."""
    if prefetch_usable(weight) and _index(weight.device) in _SIDE:
        torch.cuda.current_stream(weight.device).wait_stream(_side(weight.device))
