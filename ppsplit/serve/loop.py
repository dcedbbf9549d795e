"""Serving: the engine loop in one background thread, and the thread-safe door the HTTP handlers use.

Only the loop's thread touches the engine (the ``Engine`` and the ``PipelineEngine`` are not thread-safe). Handlers
``submit`` a request and ``abort`` one through an inbox queue; the loop adds what arrived, runs one step while any
request is unfinished (else waits on the inbox), and hands each request's events to the callback it was submitted
with. The first event of a request is ``("added", None)`` or ``("error", message)`` (refused by the engine, e.g. a
prompt longer than the cache), then ``("output", RequestOutput)`` until one is finished. If a step raises, every
request gets ``("error", message)``, ``failed`` holds the message, and the loop ends.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ppsplit.core.errors import PpsplitError

log = logging.getLogger("ppsplit")


class QueueFull(Exception):
    """More requests than the server admits are unfinished (the HTTP layer answers 503)."""


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, buckets):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip(self.buckets + (float("inf"),), self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{"+Inf" if bound == float("inf") else repr(bound)}"}} {total}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                    40.0, 80.0)


@dataclass
class Metrics:
    """What ``/metrics`` shows; written by the loop's thread only, read under ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    prompt_tokens: int = 0
    prompt_tokens_shared: int = 0
    generation_tokens: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    running: int = 0
    waiting: int = 0
    blocks_in_use: int = 0
    blocks_total: int = 0
    steps: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))

    def text(self, model: str) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        label = f'model_name="{model}"'
        with self.lock:
            rows = [("gauge", "num_requests_running", "requests in the engine's running set", self.running),
                    ("gauge", "num_requests_waiting", "requests waiting for a sequence slot or blocks", self.waiting),
                    ("gauge", "kv_blocks_in_use", "KV cache blocks held by requests", self.blocks_in_use),
                    ("gauge", "kv_blocks_total", "KV cache blocks of the pool", self.blocks_total),
                    ("counter", "prompt_tokens_total", "prompt tokens of admitted requests", self.prompt_tokens),
                    ("counter", "prompt_tokens_shared_total", "prompt tokens read from another choice's blocks, not "
                     "computed", self.prompt_tokens_shared),
                    ("counter", "generation_tokens_total", "tokens generated", self.generation_tokens),
                    ("counter", "spec_decode_draft_tokens_total", "drafts verified", self.drafts_proposed),
                    ("counter", "spec_decode_accepted_tokens_total", "drafts accepted", self.drafts_accepted),
                    ("counter", "engine_steps_total", "engine steps run", self.steps)]
            lines = []
            for kind, name, what, value in rows:
                lines += [f"# HELP ppsplit_{name} {what}", f"# TYPE ppsplit_{name} {kind}",
                          f"ppsplit_{name}{{{label}}} {value}"]
            rate = self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0
            lines += ["# HELP ppsplit_spec_decode_acceptance_rate accepted / verified drafts",
                      "# TYPE ppsplit_spec_decode_acceptance_rate gauge",
                      f"ppsplit_spec_decode_acceptance_rate{{{label}}} {rate!r}",
                      "# HELP ppsplit_request_success_total finished requests by finish reason",
                      "# TYPE ppsplit_request_success_total counter"]
            lines += [f'ppsplit_request_success_total{{{label},finished_reason="{r}"}} {n}'
                      for r, n in self.finished.items()]
            for name, hist, what in (("time_to_first_token_seconds", self.ttft, "arrival to the first token"),
                                     ("inter_token_latency_seconds", self.itl, "between a request's token deliveries")):
                lines += [f"# HELP ppsplit_{name} {what}", f"# TYPE ppsplit_{name} histogram"]
                lines += [_labelled(line, label) for line in hist.lines(f"ppsplit_{name}")]
        return "\n".join(lines) + "\n"


def _labelled(line: str, label: str) -> str:
    name, value = line.rsplit(" ", 1)
    if "{" in name:
        return f"{name[:-1]},{label}}} {value}"
    return f"{name}{{{label}}} {value}"


@dataclass
class _Tracked:
    callback: object
    arrival: float
    last: float | None = None


class EngineLoop:
    """``engine`` (an ``Engine``, or rank 0's ``PipelineEngine``) driven by one thread; ``max_queue``: unfinished
    requests admitted at most (``submit`` raises ``QueueFull`` beyond); ``close``: called on the loop's thread when it
    stops without a failure (``PipelineEngine.close`` ends the job on the other ranks)."""

    def __init__(self, engine, *, max_queue: int = 256, idle_wait: float = 0.05, close=None):
        self.engine, self.max_queue, self.idle_wait, self.close = engine, max_queue, idle_wait, close
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.metrics = Metrics(blocks_total=engine.scheduler.layout.num_blocks)
        self.failed: str | None = None
        self._admitted = 0  # submitted and not finished; guarded by _lock
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._tracked: dict[str, _Tracked] = {}  # the loop's thread only
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ppsplit-engine", daemon=True)

    # -- any thread ----------------------------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self.thread.start()
        return self

    def submit(self, prompt_ids, params, callback, parent: str | None = None) -> str:
        """Queue a request; ``callback(kind, payload)`` gets its events on the loop's thread (keep it short).
        ``parent``: a request submitted before with the same prompt, whose prompt blocks this one shares."""
        with self._lock:
            if self.failed is not None:
                raise QueueFull(f"the engine stopped: {self.failed}")
            if self._admitted >= self.max_queue:
                raise QueueFull(f"the server holds {self._admitted} unfinished requests, its limit (--max-queue "
                                f"{self.max_queue}); retry later")
            self._admitted += 1
        request_id = f"req-{next(self._ids)}"
        self.inbox.put(("add", request_id, (list(prompt_ids), params, callback, time.monotonic(), parent)))
        return request_id

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id, None))

    def fail(self, message: str) -> None:
        """Mark the engine failed from outside (a rank that exited); the server then ends with exit code 1."""
        log.error("%s", message)
        with self._lock:
            self.failed = self.failed or message

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.inbox.put(("wake", "", None))
        self.thread.join(timeout)

    @property
    def admitted(self) -> int:
        with self._lock:
            return self._admitted

    # -- the loop's thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._take_inbox(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    self._snapshot()  # before any client hears of the step: /metrics is never behind what it saw
                    self._deliver(outputs)
                else:
                    self._snapshot()
            if self.close is not None and self.failed is None:
                self.close()
        except Exception as e:  # a failed step (or a rank that died): every request learns it, the server ends
            message = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log.error("the engine loop stopped: %s", message)
            with self._lock:
                self.failed = message
            for request_id in list(self._tracked):
                self._finish(request_id, "error", message)
            self._drain_failed(message)

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=self.idle_wait) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, request_id: str, payload) -> None:
        if kind == "add":
            prompt, params, callback, arrival, parent = payload
            try:
                self.engine.add_request(prompt, params, request_id=request_id,
                                        parent=parent if parent in self._tracked else None)
            except PpsplitError as e:
                self._release_slot()
                callback("error", str(e))
                return
            self._tracked[request_id] = _Tracked(callback, arrival)
            with self.metrics.lock:
                self.metrics.prompt_tokens += len(prompt)
            callback("added", None)
        elif kind == "abort" and request_id in self._tracked:
            self.engine.abort(request_id)
            self._finish(request_id, None, None, reason="abort")

    def _deliver(self, outputs) -> None:
        now = time.monotonic()
        m = self.metrics
        with m.lock:
            m.steps += 1
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            with m.lock:
                m.generation_tokens += len(out.new_token_ids)
                if out.new_token_ids:
                    (m.ttft if tracked.last is None else m.itl).observe(now - (tracked.last or tracked.arrival))
                if out.finished:
                    m.drafts_accepted += sum(out.accepted)
                    m.drafts_proposed += sum(len(d) for d in out.drafts)
            if out.new_token_ids:
                tracked.last = now
            if out.finished:
                self._finish(out.request_id, "output", out, reason=out.finish_reason)
            else:
                tracked.callback("output", out)

    def _finish(self, request_id: str, kind, payload, reason: str | None = None) -> None:
        """End a request: its slot and the finished count first, then its last event (a client that has its last
        event finds it counted)."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self._release_slot()
        if reason is not None:
            with self.metrics.lock:
                self.metrics.finished[reason] = self.metrics.finished.get(reason, 0) + 1
        if kind is not None:
            tracked.callback(kind, payload)

    def _release_slot(self) -> None:
        with self._lock:
            self._admitted -= 1

    def _snapshot(self) -> None:
        sched = self.engine.scheduler
        with self.metrics.lock:
            self.metrics.running = len(sched.running)
            self.metrics.waiting = len(sched.waiting)
            self.metrics.blocks_in_use = sched.blocks_in_use
            self.metrics.prompt_tokens_shared = sched.shared_tokens

    def _drain_failed(self, message: str) -> None:
        """After a failure: refuse what is still in the inbox, until ``stop``."""
        while not self._stop.is_set():
            try:
                kind, request_id, payload = self.inbox.get(timeout=self.idle_wait)
            except queue.Empty:
                continue
            if kind == "add":
                self._release_slot()
                payload[2]("error", message)
