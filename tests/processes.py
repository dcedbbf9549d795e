"""Launch a function on N gloo ranks in fresh processes, with a hard deadline, and collect each rank's outcome.

Each rank runs in its own process (no launcher agent between us and it), so a test can see whether the
survivors of a failure end by themselves, with which error, and that none is left behind.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, timeout: float, target, args, out: str, backend: str,
           deadline: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import faulthandler

    import torch

    torch.set_num_threads(1)
    from ppsplit import distributed as ppd

    faulthandler.dump_traceback_later(max(1.0, deadline - 5), exit=False)  # a hung rank shows where it waits
    try:
        ppd.init(backend, timeout=timeout)
        result = ("ok", target(rank, *args))
    except Exception as e:  # the test inspects the error; the process ends non-zero
        result = ("error", type(e).__name__, str(e), traceback.format_exc())
    with open(out, "wb") as f:
        pickle.dump(result, f)
    os._exit(0 if result[0] == "ok" else 1)  # no teardown that could wait on a dead peer


def launch(world: int, target, *args, timeout: float = 20.0, deadline: float = 90.0, backend: str = "gloo") -> dict:
    """Run ``target(rank, *args)`` on ``world`` ranks (gloo, or NCCL: rank r on cuda:r); returns ``{rank: outcome}``
    plus ``"elapsed"``.

    An outcome is ``("ok", value)``, ``("error", type, message, traceback)`` or ``("exit", code)`` when the
    process died without a word. Any process still alive at ``deadline`` is killed and reported as ``"hung"``.
    """
    ctx = mp.get_context("forkserver")
    # Children fork from one server that has imported torch, the loader and the Triton kernels once (~4 s of CPU
    # per process otherwise, 4 processes on 2 cores); the server is a clean process, not this one (no threads).
    ctx.set_forkserver_preload(["torch", "ppsplit.distributed", "ppsplit.artifact.loader", "ppsplit.triton_kernels",
                                "ppsplit.serve.cuda_graphs", __name__])
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world)]
        procs = [ctx.Process(target=_child, args=(r, world, port, timeout, target, args, paths[r], backend, deadline), daemon=True)
                 for r in range(world)]
        start = time.monotonic()
        for p in procs:
            p.start()
        results: dict = {}
        for r, p in enumerate(procs):
            p.join(max(0.0, deadline - (time.monotonic() - start)))
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join(5)
                results[r] = ("hung",)
            elif os.path.exists(paths[r]):
                with open(paths[r], "rb") as f:
                    results[r] = pickle.load(f)
            else:
                results[r] = ("exit", p.exitcode)
        results["elapsed"] = time.monotonic() - start
        results["alive"] = [p.pid for p in procs if p.is_alive()]
        return results


# -- rank bodies used by tests/distributed/test_distributed.py (here, so that children import nothing heavy) -----------------

def generate(rank, folder, prompts, new, collect_aux=False, cuda_graphs=False):
    """Every rank runs ``PipelineRank(folder).generate``; rank 0 returns ids, the last rank its taps."""
    from ppsplit import distributed as ppd

    runner = ppd.PipelineRank(folder if isinstance(folder, str) else folder[rank], cuda_graphs=cuda_graphs)
    out = runner.generate(prompts if rank == 0 else None, new, collect_aux=collect_aux)
    if collect_aux:
        return out, runner.stats
    # Twice: the second call reuses the communicators and the cache rows the first one wrote.
    again = runner.generate(prompts if rank == 0 else None, new)
    return (out, again), runner.stats


def generate_and_fail(rank, folder, prompts, new, victim, at_item, how):
    """Like ``generate``, but rank ``victim`` is SIGKILLed (``how="kill"``) or sleeps S seconds (``"stall:S"``)
    when it starts its ``at_item``-th item."""
    import signal

    from ppsplit.distributed import pipeline

    if rank == victim:
        real = pipeline.group_stages

        def fragile(stage, groups, rows):
            instances = real(stage, groups, rows)
            count = {"n": 0}
            for inst in instances:
                forward = inst.forward

                def wrapped(*a, _forward=forward):
                    count["n"] += 1
                    if count["n"] == at_item:
                        if how == "kill":
                            os.kill(os.getpid(), signal.SIGKILL)
                        time.sleep(float(how.split(":")[1]))
                    return _forward(*a)
                inst.forward = wrapped
            return instances

        pipeline.group_stages = fragile  # the name the pipeline loop calls
    return generate(rank, folder, prompts, new)


def pipelining(rank, folder, ids, microbatches):
    """Stage ``rank`` as the submodule of ``torch.distributed.pipelining.PipelineStage`` under ``ScheduleGPipe``;
    the last rank returns the merged ``(logits, aux)``."""
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    import ppsplit
    from ppsplit.distributed import for_pipelining

    stage = ppsplit.load_stage(folder, rank)
    plan = stage.meta["ppsplit.plan"]
    world = plan.pp
    pipe = PipelineStage(for_pipelining(stage), rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(pipe, microbatches, args_chunk_spec=(TensorChunkSpec(0), TensorChunkSpec(1)),
                             kwargs_chunk_spec={"positions": _Replicate()},
                             output_merge_spec=(TensorChunkSpec(0), TensorChunkSpec(1)))
    positions = torch.arange(ids.shape[1])
    with torch.no_grad():
        if rank == 0:
            aux = torch.zeros(plan.n_slots, ids.shape[0], ids.shape[1], plan.hidden_size)
            out = schedule.step(ids, aux, positions=positions)
        else:
            out = schedule.step(positions=positions)
    return tuple(t.clone() for t in out) if rank == world - 1 else None


def speculate(rank, folder, prompts, new, k, temperature=0.0, seed=0, cuda_graphs=False):
    """Every rank runs ``PipelineRank(folder).generate`` speculatively (the folder holds a drafter); rank 0 returns
    ``(ids, stats)`` per group."""
    from ppsplit import distributed as ppd

    runner = ppd.PipelineRank(folder, cuda_graphs=cuda_graphs)
    return runner.generate(prompts if rank == 0 else None, new, num_draft_tokens=k, temperature=temperature,
                           seed=seed, return_stats=True)
