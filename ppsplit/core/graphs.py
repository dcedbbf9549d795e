"""Core: capturing a function as a CUDA graph, the one warm-up-then-capture sequence every capture uses.

The function runs ``warmup`` times on a side stream first (lazy kernel loads, Triton compiles and autotuning,
allocator growth happen there, outside the graph), then once under capture; its static inputs are whatever
tensors it closes over, and its outputs live in the graph's memory pool (``pool`` shares one between graphs).
"""
from __future__ import annotations

from typing import Callable

import torch


def capture(fn: Callable[[], object], device: torch.device, *, pool=None, warmup: int = 2):
    """``(graph, output)``: ``fn`` captured on ``device``; ``graph.replay()`` reruns it and rewrites ``output``.

    Example::

        graph, y = capture(lambda: stage(x, positions, aux), x.device)
        x.copy_(new_x); graph.replay()      # y holds the result for new_x
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.no_grad():
        output = fn()
    return graph, output
