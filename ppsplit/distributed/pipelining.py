"""Multi-process: a stage in ``torch.distributed.pipelining``'s own schedules (``ScheduleGPipe`` and the like)."""
from __future__ import annotations

from torch import fx

from ppsplit.core.errors import ConfigError


def for_pipelining(stage: fx.GraphModule) -> fx.GraphModule:
    """``stage`` with its inputs ordered ``(x, aux, positions)`` for ``torch.distributed.pipelining``.

    A pipelining stage receives the previous stage's outputs ``(y, aux)`` as its leading positional arguments and
    the ``step(...)`` keywords after them, so ``positions`` must come last; and its transport sends contiguous
    tensors, so the returned aux is made contiguous (a copy only for a microbatch slice on the first stage).
    Same graph otherwise, same parameters and cache buffers (shared, not copied), same outputs.

    Example::

        pipe = PipelineStage(for_pipelining(stage), rank, pp, device)
        schedule = ScheduleGPipe(pipe, n_microbatches, args_chunk_spec=(TensorChunkSpec(0), TensorChunkSpec(1)),
                                 kwargs_chunk_spec={"positions": _Replicate()},
                                 output_merge_spec=(TensorChunkSpec(0), TensorChunkSpec(1)))
        schedule.step(ids, aux, positions=positions)      # rank 0; the others: schedule.step(positions=positions)
    """
    if stage.meta["ppsplit.plan"].paged:
        raise ConfigError("torch.distributed.pipelining splits a batch along its rows, and a paged stage's step is "
                          "one ragged row of tokens: compile the folder without a cache for pipelining, or serve the "
                          "paged one with ppsplit.distributed.PipelineEngine")
    graph = fx.Graph()
    graph.output(graph.graph_copy(stage.graph, {}))
    x, positions, aux = [n for n in graph.nodes if n.op == "placeholder"]
    aux.append(positions)  # placeholder order is the forward signature
    # A microbatch of aux is a slice along dim 1 (batch), not contiguous when there are 2+ slots; the transport
    # sends contiguous tensors only. No copy when it already is (every stage after the first).
    output = graph.output_node()
    y_out, aux_out = output.args[0]
    with graph.inserting_before(output):
        dense = graph.call_method("contiguous", (aux_out,))
    output.args = ((y_out, dense),)
    graph.lint()
    out = fx.GraphModule(stage, graph, class_name=type(stage).__name__)
    out.meta.update(stage.meta)
    return out
