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


def _child(rank: int, world: int, port: int, timeout: float, target, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch

    torch.set_num_threads(1)
    from ppsplit import distributed as ppd

    try:
        ppd.init("gloo", timeout=timeout)
        result = ("ok", target(rank, *args))
    except Exception as e:  # the test inspects the error; the process ends non-zero
        result = ("error", type(e).__name__, str(e), traceback.format_exc())
    with open(out, "wb") as f:
        pickle.dump(result, f)
    os._exit(0 if result[0] == "ok" else 1)  # no teardown that could wait on a dead peer


def launch(world: int, target, *args, timeout: float = 20.0, deadline: float = 90.0) -> dict:
    """Run ``target(rank, *args)`` on ``world`` gloo ranks; returns ``{rank: outcome}`` plus ``"elapsed"``.

    An outcome is ``("ok", value)``, ``("error", type, message, traceback)`` or ``("exit", code)`` when the
    process died without a word. Any process still alive at ``deadline`` is killed and reported as ``"hung"``.
    """
    ctx = mp.get_context("forkserver")
    # Children fork from one server that has imported torch and ppsplit once (~5 s of imports per process
    # otherwise, 4 processes on 2 cores); the server is a clean process, not this one (no inherited threads).
    ctx.set_forkserver_preload(["torch", "ppsplit.distributed", __name__])
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world)]
        procs = [ctx.Process(target=_child, args=(r, world, port, timeout, target, args, paths[r]), daemon=True)
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
