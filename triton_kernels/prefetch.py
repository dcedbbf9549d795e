"""The first bytes of the next projection's weight asked of L2 while the kernels before it run, beside the step.

At decode batch 1 every projection is a GEMV that streams its weight once, and each one starts slowly: its first
wave of loads pays HBM's latency before the stream reaches full rate. Between two projections run kernels that read
little (the attention and its combine, the norms). ``l2_prefetch`` starts, on a second stream forked from the current
one, a small kernel that asks L2 for the first bytes of the next projections' weights; the current stream runs on
beside it. ``l2_join`` makes the current stream wait for that kernel again, just before the projection (a CUDA-graph
capture needs every fork joined); under capture the fork and the join become a branch of the graph.

The kernel issues Hopper's bulk prefetch (``cp.async.bulk.prefetch.L2``): one instruction per thread asks for a
chunk, the SM's copy engine fetches it, and nothing is written, so the step's bits do not change. One program asks
for ``PROGRAM_BYTES``: a copy engine fetches at a fraction of HBM's rate, so the request is spread over one program
an SM or more. Where it cannot run (CPU tensors, the interpreter, a GPU before sm_90, ``torch.compile`` tracing) or
for more than one row (``rows``: the GEMV serves one-row steps) both calls do nothing.
"""
from __future__ import annotations

import torch

from ppsplit.triton_kernels.common import HAVE_TRITON, compiled_for_hopper, tl, triton

PROGRAM_BYTES = 64 * 1024
THREADS = 32  # one bulk prefetch a thread, one warp a program
_SIDE: dict[int, torch.cuda.Stream] = {}

if HAVE_TRITON:
    @triton.jit
    def _prefetch_kernel(address, nbytes, CHUNK: tl.constexpr, THREADS: tl.constexpr):
        start = (tl.program_id(0) * THREADS + tl.arange(0, THREADS)).to(tl.int64) * CHUNK
        size = tl.maximum(tl.minimum(nbytes - start, CHUNK), 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t"
            "mov.u32 $0, 0;\n\t}", "=r,l,r", [address + start, size], dtype=tl.int32, is_pure=False, pack=1)


def forks(rows: torch.Tensor) -> bool:
    """Whether ``l2_prefetch`` and ``l2_join`` act for a projection input ``rows``: one row, compiled for sm_90 or
    later, not traced by ``torch.compile``. The two must agree, or a capture is left with a fork never joined."""
    return rows.numel() == rows.shape[-1] and not torch.compiler.is_compiling() and compiled_for_hopper(rows)


def _side(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(index)
    return _SIDE[index]


def launch_prefetch(weight: torch.Tensor, nbytes: int) -> None:
    """Ask L2 for the first ``nbytes`` of ``weight``'s storage (at most all of it, rounded down to 16 bytes), on the
    current stream."""
    nbytes = min(nbytes, weight.numel() * weight.element_size()) // 16 * 16
    if nbytes:
        _prefetch_kernel[(triton.cdiv(nbytes, PROGRAM_BYTES),)](
            weight.data_ptr(), nbytes, CHUNK=PROGRAM_BYTES // THREADS, THREADS=THREADS, num_warps=1)


def l2_prefetch(rows: torch.Tensor, nbytes: int, *weights: torch.Tensor) -> None:
    """Ask L2, on a stream forked from the current one, for ``nbytes`` of ``weights`` in order (the first one's first
    bytes first), where ``rows`` (a projection's input) has one row."""
    if not weights or not forks(rows):
        return
    device = rows.device
    side = _side(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for w in weights:
            if nbytes <= 0:
                break
            launch_prefetch(w, nbytes)
            nbytes -= w.numel() * w.element_size()


def l2_join(rows: torch.Tensor) -> None:
    """The current stream waits for what ``l2_prefetch`` forked (nothing where it did not run)."""
    if forks(rows):
        torch.cuda.current_stream(rows.device).wait_stream(_side(rows.device))
