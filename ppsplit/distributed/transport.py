"""Multi-process transport: joining the process group, agreeing before any tensor moves, and point-to-point
transfers whose failures name the peer.

A rank that dies or stalls makes its neighbours fail with a ``PipelineError`` naming it, within the process group's
timeout (``init(timeout=...)``); the first failure any rank reports is kept in the rendezvous store, so a rank two
hops away names the rank that died, not only the neighbour that left. A rank that is alive but stopped (frozen,
SIGSTOP, a hung driver) keeps its connections open, so it is told apart from one that waits by a ``Heartbeat``: a
counter in the rendezvous store that its own thread advances and another rank reads (``heartbeat``).
"""
from __future__ import annotations

import datetime
import os
import re
import threading
import time

import torch
import torch.distributed as dist

from ppsplit.core.errors import ConfigError, PpsplitError

DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for a peer before giving up


class PipelineError(PpsplitError):
    """A peer rank died, stalled past the timeout, or a transfer failed."""


def init(backend: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> str:
    """Join the process group that ``torchrun`` (or ``ppsplit run``) describes in the environment.

    NCCL when every local rank has its own GPU, else gloo. ``timeout`` (seconds) bounds every wait on a peer.
    Returns the backend. Example: ``ppsplit.distributed.init(timeout=60)``.
    """
    if dist.is_initialized():
        return dist.get_backend()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    TIMEOUT[0] = timeout
    return backend


def backend_for(device: str | None) -> str | None:
    """The backend for a command's ``--device`` under ranks: ``cpu`` gloo, ``cuda`` NCCL, ``auto`` ``init``'s choice."""
    if device not in (None, "auto", "cpu", "cuda"):
        raise ConfigError(f"--device with one process per stage is auto, cpu or cuda (each rank takes the GPU of its "
                          f"local rank), but got {device!r}")
    return {"cpu": "gloo", "cuda": "nccl"}.get(device)


TIMEOUT = [DEFAULT_TIMEOUT]  # the timeout init() was given: groups made later get the same


def agree(header: dict, group=None) -> list[dict]:
    """Gather every rank's ``header`` (of ``group``, default the world) and raise the same ``ConfigError`` on every
    rank if they disagree.

    A header may carry ``"error"`` (the rank could not load its stage): then every rank raises it. Keys
    ``stage``, ``rank`` and ``lookahead`` (the last rank's drafter tells rank 0) may differ.
    """
    headers: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(headers, header, group=group)
    for r, h in enumerate(headers):
        if "error" in h:
            raise ConfigError(f"rank {r}: {h['error']}")
    ref = headers[0]
    for r, h in enumerate(headers[1:], 1):
        diff = [f"{key} {h.get(key)!r} (rank 0: {ref.get(key)!r})" for key in sorted(set(ref) | set(h))
                if key not in ("stage", "rank", "lookahead") and h.get(key) != ref.get(key)]
        if diff:
            raise ConfigError(f"rank {r} disagrees with rank 0 on {', '.join(diff)}: every rank must load the same "
                              "compiled folder with the same options")
    return headers


class Links:
    """This rank's transfers: ``send``/``recv`` post one (to a peer rank, on the pipeline's group or the back group
    from the last rank to rank 0), ``wait`` waits for posted ones; both raise a ``PipelineError`` naming the peer.
    ``wait_s`` and ``bytes_sent`` count what this rank spent and sent."""

    def __init__(self, rank: int, world: int, group=None):
        self.rank, self.world, self.group = rank, world, group
        self.wait_s = 0.0
        self.bytes_sent = 0
        # Results go back to rank 0 through a group of their own: NCCL runs the operations of one communicator in
        # order on one stream, so with pp=2 a result receive queued behind the next send down the pipe (or the
        # next receive from rank 0 queued before a result send) would wait on each other.
        self.back = None
        if world > 1:
            # in a pipeline group (tensor parallelism: ppsplit.distributed.tensor_parallel) only its ranks make it
            self.back = dist.new_group([self.global_rank(0), self.global_rank(world - 1)],
                                       timeout=datetime.timedelta(seconds=TIMEOUT[0]),
                                       use_local_synchronization=group is not None)

    def global_rank(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def send(self, tensor: torch.Tensor, peer: int, what: str = "send to", back: bool = False):
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return self._post(dist.isend, tensor, peer, what, back)

    def recv(self, tensor: torch.Tensor, peer: int, what: str = "receive from", back: bool = False):
        return self._post(dist.irecv, tensor, peer, what, back)

    def _post(self, op, tensor, peer, what, back):
        try:
            dst = self.global_rank(peer)
            return (op(tensor, dst, group=self.back) if back else op(tensor, dst, group=self.group)), what, peer
        except Exception as e:  # posting on a connection that is already gone fails at once
            raise self.lost(e, what, peer) from None

    def wait(self, posted) -> None:
        """Wait for ``posted`` (what ``send``/``recv`` returned; ``None`` entries are skipped)."""
        start = time.perf_counter()
        for item in posted:
            if item is None:
                continue
            work, what, peer = item
            try:
                work.wait()
            except Exception as e:  # gloo raises RuntimeError, NCCL DistBackendError; both mean the peer is gone
                raise self.lost(e, what, peer) from None
        self.wait_s += time.perf_counter() - start

    def exchange(self, tensors, peer: int, what: str, back: bool = False, receive: bool = True) -> None:
        """Post ``tensors`` to (or from) ``peer`` and wait for all of them."""
        op = self.recv if receive else self.send
        self.wait([op(t, peer, what, back) for t in tensors if t.numel()])

    def lost(self, error: Exception, what: str, peer: int) -> PipelineError:
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0][:160]  # gloo: "[file:line] What [addr]. Hint"
        cause = "stalled past the timeout" if "timed out" in text.lower() or "timeout" in text.lower() \
            else "died or closed its connection"
        message = f"rank {self.rank}: could not {what} rank {peer}: rank {peer} {cause} ({text})"
        first = first_failure(message, self.rank, self.world)
        if first != message:
            message += f"; first failure reported: {first}"
        return PipelineError(message)


LINGER_S = 3.0  # how long rank 0, which hosts the rendezvous store, waits for the other ranks' failure reports


def first_failure(message: str, rank: int, world: int) -> str:
    """Record ``message`` in the rendezvous store unless another rank did first; return the first one.

    A rank two hops from a dead one only sees its neighbour leave; the first report names the rank that died. The
    store lives in rank 0's process (``init``'s env:// rendezvous), so rank 0 waits up to ``LINGER_S`` for every
    other rank to report before it goes on to exit: leaving at once would close the store (and rank 0's links) under
    ranks that have not read the first report yet, and they would name rank 0 instead of the rank that died.
    """
    try:
        store = _store()
        store.set_timeout(datetime.timedelta(seconds=2))  # the store's host may be gone too
        first = store.compare_set("ppsplit/first_failure", "", message)
        reported = store.add("ppsplit/failures_reported", 1)
        deadline = time.monotonic() + LINGER_S
        while rank == 0 and reported < world and time.monotonic() < deadline:  # a dead rank never reports
            time.sleep(0.05)
            reported = store.add("ppsplit/failures_reported", 0)
        return first.decode() if isinstance(first, bytes) else str(first)
    except Exception:  # no store (or it died with its host): report what this rank saw
        return message


def _store():
    from torch.distributed.distributed_c10d import _get_default_store  # the one internal name used here

    return _get_default_store()


def _beat_key(rank: int) -> str:
    return f"ppsplit/heartbeat/{rank}"


class Heartbeat(threading.Thread):
    """Advances this rank's counter in the rendezvous store every ``period`` seconds, from a thread of its own: it
    stops exactly when the whole process stops (a thread blocked on a peer still beats). Start it after ``init``."""

    def __init__(self, rank: int, period: float):
        super().__init__(name="ppsplit-heartbeat", daemon=True)
        self.key, self.period, self.stopped = _beat_key(rank), period, threading.Event()

    def run(self) -> None:
        try:
            store = _store()
            while True:
                store.add(self.key, 1)
                if self.stopped.wait(self.period):
                    return
        except Exception:  # the store lived in rank 0, which is gone: nobody is left to tell
            return


def heartbeat(rank: int) -> int | None:
    """Rank ``rank``'s heartbeat counter (0 before its first beat), or ``None`` before ``init`` or without a store."""
    try:
        return int(_store().add(_beat_key(rank), 0))
    except Exception:
        return None
