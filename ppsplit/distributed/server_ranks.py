"""Serving: ``ppsplit serve --ranks N``, one process per stage (per stage and TP rank in a folder compiled with
``--tp``) on this host (gloo on the CPU, NCCL with a GPU each).

The serving process is rank 0: it starts ranks ``1 .. N-1`` as child processes (``python -m ppsplit.distributed.server_ranks``),
joins the process group with them, and drives the ``PipelineEngine`` from its engine loop; the children load their
stage and ``follow()`` until rank 0 closes the job at shutdown, then exit 0. They ignore SIGTERM and SIGINT, so a
signal to the whole process group drains through rank 0 as it does with one process. A child that exits while
serving ends the server with exit code 1 (a watcher thread), and one that loses rank 0 fails its next wait on it.

Waits on a peer are bounded by ``--rank-timeout`` (default one day): the followers wait on rank 0 while the server is
idle, so this is not a stall detector; a rank that dies is seen at once through its closed connections. A rank that
is alive but stopped (SIGSTOP, a hung driver) is seen by its heartbeat (``transport.Heartbeat``): each follower
advances a counter in the rendezvous store every ``--rank-stall-timeout / 5`` seconds, and rank 0's watcher treats
one whose counter has not moved for ``--rank-stall-timeout`` seconds (default 60) as dead: it fails the requests in
flight and ``/health`` at once, kills that rank (so the waits on it end) and the server exits 1.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from ppsplit.serve.scheduler import DEFAULT_BUDGET

log = logging.getLogger("ppsplit")
DEFAULT_RANK_TIMEOUT = 86400.0
DEFAULT_STALL_TIMEOUT = 60.0


def beat_period(stall_timeout: float) -> float:
    return min(1.0, max(0.01, stall_timeout / 5))


def engine_options(args) -> dict:
    return {"num_draft_tokens": args.num_draft_tokens or 0,
            "max_num_batched_tokens": args.max_num_batched_tokens or DEFAULT_BUDGET, "max_num_seqs": args.max_num_seqs,
            "cuda_graphs": not args.enforce_eager, "confidence_threshold": args.confidence_threshold}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, world: int, port: int, threads: int) -> dict:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": str(threads)}


def start(args, world: int):
    """Rank 0: start the other ranks, join the group, build rank 0's ``PipelineEngine``; ``(engine, children)``."""
    import torch

    from ppsplit import distributed as ppd
    from ppsplit.distributed.tensor_parallel import pipeline_engine

    threads = max(1, (os.cpu_count() or 1) // world)
    port = _free_port()
    stall = getattr(args, "rank_stall_timeout", None) or DEFAULT_STALL_TIMEOUT
    argv = [args.folder, "--timeout", str(args.rank_timeout), "--max-num-batched-tokens",
            str(engine_options(args)["max_num_batched_tokens"]), "--device", args.device,
            "--heartbeat", str(beat_period(stall))] + (["--enforce-eager"] if args.enforce_eager else [])
    for flag, value in (("-k", args.num_draft_tokens), ("--max-num-seqs", args.max_num_seqs),
                        ("--confidence-threshold", args.confidence_threshold)):
        if value is not None:
            argv += [flag, str(value)]
    children = []
    for rank in range(1, world):
        env = dict(os.environ, **_rank_env(rank, world, port, threads))
        children.append(subprocess.Popen([sys.executable, "-m", "ppsplit.distributed.server_ranks", *argv], env=env))
    os.environ.update(_rank_env(0, world, port, threads))
    torch.set_num_threads(threads)
    watcher = Watcher(children, stall)
    watcher.start()  # a child that fails while the group forms would leave rank 0 waiting: end the server then
    try:
        ppd.init(ppd.backend_for(args.device), timeout=args.rank_timeout)
        engine = pipeline_engine(args.folder, **engine_options(args))
    except BaseException:  # the same ConfigError is raised on every rank: rank 0 reports it, the children end
        watcher.released.set()
        raise
    return engine, watcher


class Watcher(threading.Thread):
    """Ends this process with exit code 1 if a child rank exits before ``release``, or stops beating (its heartbeat
    counter unchanged for ``stall_timeout`` seconds; the child is then killed)."""

    def __init__(self, children, stall_timeout: float = DEFAULT_STALL_TIMEOUT):
        super().__init__(name="ppsplit-ranks", daemon=True)
        self.children, self.released = children, threading.Event()
        self.stall_timeout = stall_timeout
        self.on_failure = None  # while serving: a callable that ends the server (instead of exiting at once)

    def run(self) -> None:
        beats: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        while not self.released.wait(0.2):
            for rank, child in enumerate(self.children, start=1):
                code = child.poll()
                if code == 0:  # rank 0 closed the job and this rank followed
                    continue
                if code is not None:
                    message = f"rank {rank} exited with code {code}"
                else:
                    message = self._stalled(rank, beats)
                    if message is not None:
                        child.kill()  # its connections close, so every wait on it ends
                if message is not None and not self.released.is_set():
                    self._fail(message)
                    return

    def _stalled(self, rank: int, beats: dict) -> str | None:
        from ppsplit.distributed.transport import heartbeat

        count, now = heartbeat(rank), time.monotonic()
        if count is None:  # no store yet: this rank (0) is still joining the group
            return None
        last = beats.get(rank)
        if last is None or count != last[0]:
            beats[rank] = (count, now)
            return None
        if now - last[1] <= self.stall_timeout:
            return None
        return (f"rank {rank} stopped answering: no heartbeat for {now - last[1]:.1f} s (--rank-stall-timeout "
                f"{self.stall_timeout:g}); killed it")

    def _fail(self, message: str) -> None:
        if self.on_failure is None:
            # Rank 0 may be about to raise the same refusal (and say it); give it that time.
            if self.released.wait(5.0):
                return
            log.error("%s while the ranks were starting", message)
            os._exit(1)
        self.on_failure(message)

    def finish(self, timeout: float = 30.0) -> int:
        """After rank 0 closed the job: wait for the children; the worst exit code (killing any still alive)."""
        self.released.set()
        worst = 0
        for rank, child in enumerate(self.children, start=1):
            try:
                code = child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                code = child.wait()
                log.error("rank %d did not end after the job closed; killed", rank)
            worst = worst or (code != 0)
        return int(worst)


def follower_main(argv: list[str] | None = None) -> int:
    """The body of ranks 1 .. N-1."""
    import warnings

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="python -m ppsplit.distributed.server_ranks")
    parser.add_argument("folder")
    parser.add_argument("--timeout", type=float, default=DEFAULT_RANK_TIMEOUT)
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--confidence-threshold", type=float, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--heartbeat", type=float, default=beat_period(DEFAULT_STALL_TIMEOUT))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from ppsplit import distributed as ppd
    from ppsplit.core.errors import ConfigError, PpsplitError
    from ppsplit.distributed.tensor_parallel import pipeline_engine
    from ppsplit.distributed.transport import Heartbeat

    try:
        ppd.init(ppd.backend_for(args.device), timeout=args.timeout)
        Heartbeat(int(os.environ["RANK"]), args.heartbeat).start()
        engine = pipeline_engine(args.folder, **engine_options(args))
        if engine is not None:  # None: a TP follower, its job already over
            engine.follow()
        code = 0
    except PpsplitError as e:
        if not isinstance(e, ConfigError):  # rank 0 says a ConfigError (every rank raises the same one)
            print(f"ppsplit: error: {e}", file=sys.stderr, flush=True)
        code = 2
    sys.stderr.flush()
    os._exit(code)  # no process-group teardown: it could wait on a peer that is gone


if __name__ == "__main__":
    follower_main()
