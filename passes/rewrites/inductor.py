"""Optional Inductor compilation of stages: ``split_model(..., compile=True)``, ``load(..., compile=True)``.

Each stage's forward goes through ``torch.compile`` in its default mode: Inductor fuses the traced elementwise
ops (rotary, SiLU-and-multiply, casts) into a few kernels, while ppsplit's Triton ops (fused norms and taps,
``cache_attention``) are kept as they are. Inductor's own CUDA graphs stay off, because ppsplit captures the
stage itself (``capture``/``cuda_graph``), cache and aux writes included. The stage stays the same
``GraphModule`` (same buffers, names and ``meta``); only its call is compiled, at the first call of each
``(batch, tokens)`` shape: nothing compiled is stored, so a compiled folder stays plain data. Before compiling,
the stage's cache writes become ``ppsplit::cache_write`` (``in_place_cache_writes``), which Inductor keeps in
place: otherwise it copied whole K/V buffers every step.
"""
from __future__ import annotations

import torch

from ppsplit.core.fx_utils import get_tensor


def compile_stage(stage: torch.fx.GraphModule, *, dynamic: bool | None = False) -> dict:
    """Compile ``stage`` in place with Inductor (the ``compile`` stage rewrite); returns its report, how many cache
    writes became ``ppsplit::cache_write``. ``dynamic=False`` specialises each ``(batch, tokens)`` shape, one
    compilation per CUDA-graph bucket.

    Example::

        stage = ppsplit.load_stage("demo-pp4", 2, "cuda:2")
        compile_stage(stage)
        y, aux = stage(x, positions, aux)
    """
    writes = in_place_cache_writes(stage)
    # Compile the GraphModule's own generated forward: its code object is unique to this stage, so the compiled
    # entries of different stages do not share (and exhaust) one Dynamo cache.
    compiled = torch.compile(stage.forward, dynamic=dynamic, fullgraph=True)

    def inference(*args, **kwargs):
        # Stages are inference-only; without this, parameters that require grad make Inductor build a backward.
        with torch.no_grad():
            return compiled(*args, **kwargs)

    stage._compiled_call_impl = inference  # what nn.Module.compile sets: __call__ goes through it
    return {"cache_writes_in_place": writes}


def in_place_cache_writes(stage: torch.fx.GraphModule) -> int:
    """Rewrite the stage's cache writes ``<buffer>[:B].index_copy_(dim, positions, value)`` into
    ``ppsplit::cache_write(<buffer>, value, positions, dim)`` followed by a fresh ``<buffer>[:B]`` for the readers,
    so that Inductor writes the buffer in place instead of copying it whole (see ``triton_kernels/cache.py``).
    Buffers of one row are left as traced (Inductor kept those writes in place). Returns how many writes were
    rewritten; the stage computes the same values."""
    import ppsplit.triton_kernels  # noqa: F401  (registers torch.ops.ppsplit.cache_write)

    aten = torch.ops.aten
    graph = stage.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.index_copy_.default or node.kwargs:
            continue
        view, dim, positions, value = node.args
        buffer, rows = view, None
        if isinstance(view, torch.fx.Node) and view.op == "call_function" and view.target is aten.slice.Tensor:
            args = list(view.args) + [None] * (5 - len(view.args))
            buffer, sliced_dim, start, rows, step = args[:5]
            if sliced_dim != 0 or start not in (None, 0) or step not in (None, 1):
                continue
        if not isinstance(buffer, torch.fx.Node) or buffer.op != "get_attr":
            continue
        if get_tensor(stage, buffer.target).shape[0] <= 1:
            # One cache row: Inductor was measured writing in place there, fused with the rotary (H200, batch 1).
            continue
        with graph.inserting_before(node):
            write = graph.call_function(torch.ops.ppsplit.cache_write.default, (buffer, value, positions, dim))
            write.meta["val"] = None
        with graph.inserting_after(write):
            read = graph.call_function(aten.slice.Tensor, (buffer, 0, None, rows)) if rows is not None else buffer
            if rows is not None:
                read.meta.update({k: v for k, v in view.meta.items() if k in ("val", "tensor_meta")})
        node.replace_all_uses_with(read)
        graph.erase_node(node)
        if isinstance(view, torch.fx.Node) and view is not buffer and not view.users:
            graph.erase_node(view)
        count += 1
    if count:
        graph.lint()
        stage.recompile()
    return count
