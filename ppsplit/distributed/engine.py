"""Multi-process engine: the serving loop of ``ppsplit.serve.engine`` with one rank per stage over
``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

Rank ``k`` loads only stage ``k`` of a ``ppsplit compile`` folder (with a paged cache). Rank 0 holds the
``Scheduler`` (requests, sequence slots, block tables) and the last rank the ``Sampler`` (sampling, EAGLE-3
acceptance, the drafter); the other ranks hold nothing but their stage. Each micro-step rank 0 schedules a ragged
step, runs stage 0 and sends down the pipe, in this order::

    head   int64 [4]                      run (1) / end of job (0) / job refused (2), N tokens, R works, serial
    meta   int64 [4N + S*M + 2S]          token ids, positions, seq, block_table, seq_start, seq_count
    works  int64 [R, 10 + K + 2]          what the sampler needs per request (the two last columns: float64 bits)
    hidden [N, W]                         the stage's output (and any values carried beside it)
    aux    [filled(k), N, H]              the aux prefix the next stages read

Rank ``k`` relays ``head``, ``meta`` and ``works`` and sends its own ``hidden`` and ``aux[:filled(k)]``. The last
rank samples and sends rank 0 the results of the micro-step in a fixed-width message ``int64 [S, 6 + 2K]`` (slot,
generation, tokens committed, drafts accepted, drafts proposed, then the tokens and the drafts) through a group of
its own. ``pp`` micro-steps over disjoint requests are in flight, so every stage is busy; a request in flight is
not scheduled again until its result is back. Every rank runs the micro-steps in the order rank 0 sent them, so a
slot or block freed while a micro-step is in flight (an abort) and given to a new request is written by the new
request only after the old step is done with it; a result whose slot generation no longer matches its request is
dropped.

Before any tensor moves the ranks exchange a header (plan fingerprint, world size, dtype, cache layout, ``K``,
token budget, buckets); a mismatch raises the same ``ConfigError`` on every rank. A rank that dies or stalls makes
the others fail with a ``PipelineError`` naming it, within ``init(timeout=...)``.

Example (``torchrun --nproc-per-node 2 script.py``)::

    from ppsplit import distributed as ppd
    ppd.init(timeout=60)
    engine = ppd.PipelineEngine("demo-pp2")
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16))  # rank 0: outputs; others: None
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx

from ppsplit.artifact.folder import CompiledFolder
from ppsplit.artifact.folder import fingerprint as plan_fingerprint
from ppsplit.artifact.loader import load_stage
from ppsplit.core.errors import ConfigError, PpsplitError
from ppsplit.core.ragged import CacheLayout, RaggedStep, Segment
from ppsplit.core.tensors import model_dtype
from ppsplit.distributed.transport import Links, agree
from ppsplit.core.fx_utils import stage_vocab
from ppsplit.serve.engine import Result, Sampler, Scheduler, Work, finish_step, run_to_end, add_all
from ppsplit.serve.sampling import SamplingParams

RUN, END, REFUSED = 1, 0, 2
HEAD = 4
WORK_INTS = ("slot", "generation", "position", "count", "final", "next_token", "index", "seed", "top_k", "drafts")
MESSAGE_BYTES = 1024  # a refused job's error text


@dataclass
class Stats:
    """Per-rank counters: micro-steps and tokens run, seconds in the stage and waiting on peers, bytes sent.
    On a GPU the seconds are host time (launches and waits): the loop synchronises only where it reads results."""

    steps: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    bytes_sent: int = 0


def buckets_up_to(budget: int) -> list[int]:
    """The token counts a step is padded to: powers of two below ``budget``, and ``budget``."""
    out, n = [], 1
    while n < budget:
        out.append(n)
        n *= 2
    return out + [budget]


class PipelineEngine:
    """This rank's part of the engine. Every rank constructs it with the same options (a collective call).

    ``source``: a compiled folder (this rank loads its stage) or this rank's stage module from an in-process split
    (then pass ``eos_token_id``). ``drafter``: an ``Eagle3Drafter`` for the last rank (default: the folder's, when
    ``num_draft_tokens`` > 0). ``cuda_graphs``: capture every bucket on every rank at start (``buckets_up_to`` the
    token budget) and replay them. ``device`` defaults to ``cuda:<LOCAL_RANK>`` under NCCL, else the CPU.

    Rank 0 drives: ``add_request``, ``abort``, ``step`` (returns the ``RequestOutput`` s of the oldest micro-step in
    flight, after filling the pipeline), ``stream``, ``generate``, ``close`` (ends the job on every rank). The other
    ranks call ``follow()``, which runs micro-steps until rank 0 closes. ``generate(prompts, params)`` is collective:
    rank 0 runs the prompts to the end and closes; the others follow; rank 0 returns the outputs, the others None.
    """

    def __init__(self, source: str | fx.GraphModule, *, drafter=None, num_draft_tokens: int = 0,
                 max_num_batched_tokens: int = 256, max_num_seqs: int | None = None, cuda_graphs: bool = False,
                 device: torch.device | str | None = None, eos_token_id=(), group=None):
        # group: the pipeline's ranks when the world holds more (tensor parallelism: one TP rank per stage)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.backend = dist.get_backend()
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if self.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.first, self.last = self.rank == 0, self.rank == self.world - 1
        self.k = num_draft_tokens
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        header = {"world": self.world, "backend": self.backend, "k": num_draft_tokens,
                  "budget": max_num_batched_tokens, "max_seqs": max_num_seqs, "graphs": bool(cuda_graphs)}
        eos = list(eos_token_id)
        try:
            folder = CompiledFolder(source) if isinstance(source, str) else None
            if folder is not None:
                eos = list(folder.manifest.eos_token_id)
                self.stage = load_stage(folder, self.rank, self.device)
                fingerprint = folder.fingerprint
            else:  # a stage of an in-process split (split_model), already where it runs
                self.stage = source
                fingerprint = plan_fingerprint(source.meta["ppsplit.plan"].to_json())
            plan = self.plan = self.stage.meta["ppsplit.plan"]
            header.update(fingerprint=fingerprint, pp=plan.pp, dtype=plan.dtype, hidden=plan.hidden_size, eos=eos)
            self._check(plan)
            self.layout = CacheLayout.of(plan)
            if self.last and self.k:
                self.drafter = drafter or self._folder_drafter(folder)
                from ppsplit.eagle3.speculative import check_speculation

                check_speculation(plan, self.k, self.drafter)
            self.buckets = buckets_up_to(max_num_batched_tokens)
        except PpsplitError as e:
            header["error"] = str(e)

        agree(header, group)
        self.dtype, self.eos = model_dtype(plan), eos
        self.received = plan.filled(self.rank - 1) if self.rank else 0
        self.sends = plan.filled(self.rank)
        self.x_width = plan.width(self.rank)
        self.scheduler = Scheduler(self.layout, vocab=stage_vocab(self.stage), eos=eos, k=self.k,
                                   budget=max_num_batched_tokens, max_seqs=max_num_seqs,
                                   buckets=self.buckets) if self.first else None
        self.sampler = Sampler(self.drafter if self.k else None, self.k, self.layout) if self.last else None
        self.links = Links(self.rank, self.world, group)
        self.stats = Stats()
        self.flight: deque = deque()  # rank 0: (plan, posted result receive, result buffer) per micro-step
        self.sent: list = []  # the sends of the last micro-step (its buffers stay alive until they are done)
        self.serial = 0
        self.graphs = {}
        self._warm_up()
        self._connect()

    # -- setup ---------------------------------------------------------------------------------------------------
    def _check(self, plan) -> None:
        if not plan.paged:
            why = plan.lockstep_reason or "it was compiled without a cache: compile it without --no-cache"
            raise ConfigError(f"the multi-process engine needs a folder with a paged cache, and this one keeps none "
                              f"because {why}")
        if plan.pp != self.world:
            raise ConfigError(f"the folder has {plan.pp} stages but {self.world} ranks were launched: launch one "
                              f"process per stage (--nproc-per-node {plan.pp})")
        if self.stage.meta.get("ppsplit.stage", self.rank) != self.rank:
            raise ConfigError(f"rank {self.rank} was given stage {self.stage.meta['ppsplit.stage']}")

    def _folder_drafter(self, folder):
        if folder is None or folder.drafter is None:
            raise ConfigError("speculative decoding needs an EAGLE-3 drafter on the last rank: compile the folder "
                              "with --drafter, or pass PipelineEngine(..., drafter=ppsplit.load_drafter(...)) there")
        from ppsplit.eagle3.formats import load_folder_drafter

        return load_folder_drafter(folder.drafter, self.plan, self.device)

    def _warm_up(self) -> None:
        """On a GPU, run (or capture) the stage once per bucket and the sampler's ops once, before any transfer is
        pending. CUDA loads a kernel at its first launch (Triton compiles at its first call), and a load can wait
        for the device to go idle: with a receive pending there that waits on a peer which waits on this rank, it
        never does (seen on two H200s under NCCL)."""
        if self.device.type != "cuda":
            return
        from ppsplit.serve.cuda_graphs import CapturedStage

        pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        for n in self.buckets:
            if self.cuda_graphs:
                self.graphs[n] = CapturedStage(self.stage, 0, n, pool=pool)
            else:
                step = RaggedStep.build([], {}, self.layout, pad_to=n).to(self.device)
                self._run(self._input(n), step, self._aux(n))
        if self.last:
            self._warm_sampler()
        torch.cuda.synchronize(self.device)

    def _warm_sampler(self) -> None:
        """The sampler's ops once each (greedy and sampled; a draw, then a verify of ``K`` drafts), on slot 0 of a
        step of its own. What they write (slot 0's first block) is overwritten by any request before it is read."""
        k = self.k
        step = RaggedStep.build([Segment(0, 0, k + 1)], {0: list(range(-(-(k + 1) // self.layout.block_size)))},
                                self.layout)
        y, aux = self._run(self._input(k + 1), step.to(self.device), self._aux(k + 1))
        for params in (SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, top_k=4)):
            draw = Work(0, 0, 0, (0,) * (k + 1), True, -1, (), 0, 0, params)
            self.sampler.run([draw], y, aux, step, step.block_table, self.layout)
            if k:
                verify = Work(0, 0, 0, (0,) * (k + 1), True, -1, (0,) * k, 0, 0, params)
                self.sampler.run([verify], y, aux, step, step.block_table, self.layout)
        self.sampler.draft_probs.clear()

    def _connect(self) -> None:
        """Open every connection the loop uses now, with one small transfer each, in pipeline order. NCCL creates
        a communicator on the first transfer between two ranks and blocks the host until the peer joins; blocked
        there mid-loop, a rank can deadlock with a peer whose GPU waits on a transfer from it."""
        if self.world == 1:
            return
        probe = torch.zeros(1, device=self.device)
        if not self.first:
            self.links.wait([self.links.recv(probe, self.rank - 1)])
        if not self.last:
            self.links.wait([self.links.send(probe, self.rank + 1)])
        if self.first:
            self.links.wait([self.links.recv(probe, self.world - 1, "receive results from", back=True)])
        elif self.last:
            self.links.wait([self.links.send(probe, 0, "send results to", back=True)])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- rank 0 --------------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        return self._driver().add(prompt_ids, params, request_id)

    def abort(self, request_id: str) -> None:
        self._driver().abort(request_id)

    def has_unfinished(self) -> bool:
        return self._driver().has_unfinished() or bool(self.flight)

    @property
    def blocks_in_use(self) -> int:
        return self._driver().blocks_in_use

    def _driver(self) -> Scheduler:
        if not self.first:
            raise ConfigError(f"requests go to rank 0; rank {self.rank} calls follow() (or generate with no prompts)")
        return self.scheduler

    @torch.no_grad()
    def step(self):
        """Fill the pipeline with up to ``pp`` micro-steps (the requests spread evenly over them), then take the
        oldest one's results; its outputs."""
        sched = self._driver()
        share = -(-(len(sched.running) + len(sched.waiting)) // self.world)  # requests spread over the micro-steps
        while len(self.flight) < self.world:
            plan = sched.schedule(max_seqs=share)
            if not plan:
                break
            self._launch(plan)
        if not self.flight:
            if sched.waiting:
                raise ConfigError("no request fits the cache: every waiting request needs more blocks than the pool has")
            return []
        plan, posted, buffer = self.flight.popleft()
        self.links.wait(posted)
        return finish_step(sched, plan, self._results(buffer, plan))

    def stream(self, prompts, params=None):
        add_all(self, prompts, params)
        while self.has_unfinished():
            yield from self.step()

    @torch.no_grad()
    def generate(self, prompts=None, params: SamplingParams | list[SamplingParams] | None = None):
        """Collective: rank 0 runs ``prompts`` to the end (``RequestOutput`` s in order) and closes the job; the
        other ranks follow it and return ``None``. A refused prompt raises the same ``ConfigError`` on every rank."""
        if not self.first:
            self.follow()
            return None
        try:
            outputs = run_to_end(self, prompts, params)
        except ConfigError as e:
            for request in list(self.scheduler.requests.values()):
                self.scheduler.abort(request.id)
            self._drain()
            self._send_head(REFUSED, message=str(e))
            raise
        self.close()
        return outputs

    def close(self) -> None:
        """Rank 0: end the job; every other rank returns from ``follow``. Requests still running are aborted."""
        for request in list(self._driver().requests.values()):
            self.scheduler.abort(request.id)
        self._drain()
        self._send_head(END)

    def _drain(self) -> None:
        while self.flight:
            _, posted, _ = self.flight.popleft()
            self.links.wait(posted)

    def _send_head(self, kind: int, message: str = "") -> None:
        if self.world == 1:
            return
        self.links.wait(self.sent)
        head = torch.tensor([kind, 0, 0, self.serial], device=self.device)
        tensors = [head] + ([_text(message, self.device)] if kind == REFUSED else [])
        self.links.wait([self.links.send(t, 1) for t in tensors])
        self.sent = []

    def _launch(self, plan) -> None:
        """Run stage 0 on ``plan``'s step and send it down the pipe (one rank: run everything here)."""
        sched, dev = self.scheduler, self.device
        step = sched.step_of(plan)
        n = step.num_tokens
        ids = torch.zeros(n, dtype=torch.long)
        feeds = [t for _, w in plan for t in w.tokens]
        ids[:len(feeds)] = torch.tensor(feeds)
        works = [w for _, w in plan]
        self.serial += 1
        if self.world == 1:
            y, aux = self._run(ids.to(dev), step.to(dev), self._aux(n))
            results = self.sampler.run(works, y, aux, step, step.block_table, self.layout)
            self.flight.append((plan, [], pack_results(results, self.layout.slots, self.k)))
            return
        meta = torch.cat([ids, *step.tensors()[:1], *(t.reshape(-1) for t in step.tensors()[1:])])
        head = torch.tensor([RUN, n, len(works), self.serial])
        packed = pack_works(works, self.k)
        dstep = RaggedStep(*(t.to(dev) for t in step.tensors()))
        y, aux = self._run(ids.to(dev), dstep, self._aux(n))
        self._send_on([head.to(dev), meta.to(dev), packed.to(dev)], y, aux)
        buffer = torch.zeros(self.layout.slots, 6 + 2 * self.k, dtype=torch.long, device=dev)
        posted = [self.links.recv(buffer, self.world - 1, "receive results from", back=True)]
        self.flight.append((plan, posted, buffer))

    def _results(self, buffer: torch.Tensor, plan) -> list:
        return unpack_results(buffer.cpu(), plan, self.k)

    # -- every other rank ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def follow(self) -> None:
        """Ranks 1..pp-1: run the micro-steps rank 0 sends until it ends the job."""
        if self.first:
            raise ConfigError("rank 0 drives the engine (add_request, step, generate); the other ranks follow")
        prev, dev = self.rank - 1, self.device
        while True:
            head = torch.zeros(HEAD, dtype=torch.long, device=dev)
            self.links.wait([self.links.recv(head, prev)])
            kind, n, r, serial = head.tolist()
            if kind != RUN:
                message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=dev)
                if kind == REFUSED:
                    self.links.wait([self.links.recv(message, prev)])
                if not self.last:
                    self.links.wait(self.sent)
                    self.links.wait([self.links.send(t, self.rank + 1) for t in
                                     ([head, message] if kind == REFUSED else [head])])
                    self.sent = []
                if kind == REFUSED:
                    raise ConfigError(bytes(message.cpu().tolist()).rstrip(b"\0").decode(errors="replace"))
                return
            S, M = self.layout.slots, self.layout.blocks_per_seq
            meta = torch.empty(4 * n + S * M + 2 * S, dtype=torch.long, device=dev)
            works = torch.empty(r, len(WORK_INTS) + self.k + 2, dtype=torch.long, device=dev)
            x = torch.empty(n, self.x_width, dtype=self.dtype, device=dev)
            aux = self._aux(n)
            tensors = [meta, works, x] + ([aux[: self.received]] if self.received else [])
            self.links.wait([self.links.recv(t, prev) for t in tensors])
            ids, step = unpack_meta(meta, n, S, M)
            y, aux = self._run(x, step, aux)
            if not self.last:
                self._send_on([head, meta, works], y, aux)
                continue
            cpu_works = unpack_works(works.cpu(), ids.cpu(), step.seq_start.cpu(), self.k)
            results = self.sampler.run(cpu_works, y, aux, step, step.block_table, self.layout)
            message = pack_results(results, S, self.k).to(dev)
            self.links.wait(self.sent)
            self.sent = [self.links.send(message, 0, "send results to", back=True)]
            self._message = message  # alive until its send is done

    # -- both ----------------------------------------------------------------------------------------------------
    def _input(self, n: int) -> torch.Tensor:
        if self.first:
            return torch.zeros(n, dtype=torch.long, device=self.device)
        return torch.zeros(n, self.x_width, dtype=self.dtype, device=self.device)

    def _aux(self, n: int) -> torch.Tensor:
        return torch.zeros(self.plan.n_slots, n, self.plan.hidden_size, dtype=self.dtype, device=self.device)

    def _run(self, x, step: RaggedStep, aux):
        stage = self.graphs.get(step.num_tokens, self.stage)
        start = time.perf_counter()
        y, aux = stage(x, step.positions, aux, *step.tensors()[1:])
        self.stats.compute_s += time.perf_counter() - start
        self.stats.steps += 1
        self.stats.tokens += step.num_tokens
        return y, aux

    def _send_on(self, relayed, y, aux) -> None:
        """Send the relayed tensors, this stage's output and the aux prefix to the next rank. The previous
        micro-step's sends must be done first: a captured stage's output is a static buffer."""
        self.links.wait(self.sent)
        tensors = relayed + [y.contiguous()] + ([aux[: self.sends]] if self.sends else [])
        self.sent = [self.links.send(t, self.rank + 1) for t in tensors if t.numel()]
        self._alive = tensors
        self.stats.bytes_sent = self.links.bytes_sent
        self.stats.wait_s = self.links.wait_s


# -- messages ------------------------------------------------------------------------------------------------------

def pack_works(works: list[Work], k: int) -> torch.Tensor:
    """``int64 [R, 10 + k + 2]``: ``WORK_INTS``, the drafts (padded with -1), temperature and top-p as float64 bits."""
    out = torch.full((len(works), len(WORK_INTS) + k + 2), -1, dtype=torch.long)
    for i, w in enumerate(works):
        p = w.params
        out[i, :len(WORK_INTS)] = torch.tensor([w.slot, w.generation, w.position, len(w.tokens), int(w.final),
                                                w.next_token, w.index, w.seed, p.top_k, len(w.drafts)])
        out[i, len(WORK_INTS):len(WORK_INTS) + len(w.drafts)] = torch.tensor(w.drafts, dtype=torch.long)
        out[i, -2:] = torch.tensor([p.temperature, p.top_p], dtype=torch.float64).view(torch.long)
    return out


def unpack_works(packed: torch.Tensor, ids: torch.Tensor, seq_start: torch.Tensor, k: int) -> list[Work]:
    works = []
    for row in packed:
        slot, generation, position, count, final, next_token, index, seed, top_k, n = row[:len(WORK_INTS)].tolist()
        temperature, top_p = row[-2:].view(torch.float64).tolist()
        start = int(seq_start[slot])
        drafts = tuple(row[len(WORK_INTS):len(WORK_INTS) + n].tolist())
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        works.append(Work(slot, generation, position, tuple(ids[start:start + count].tolist()), bool(final),
                          next_token, drafts, index, seed, params))
    return works


def unpack_meta(meta: torch.Tensor, n: int, slots: int, blocks: int) -> tuple[torch.Tensor, RaggedStep]:
    ids, positions, seq = meta[:n], meta[n:2 * n], meta[2 * n:3 * n]
    at = 3 * n
    table = meta[at:at + slots * blocks].view(slots, blocks)
    at += slots * blocks
    return ids, RaggedStep(positions, seq, table, meta[at:at + slots], meta[at + slots:at + 2 * slots])


def pack_results(results: list[Result | None], slots: int, k: int) -> torch.Tensor:
    """``int64 [S, 6 + 2k]`` (fixed width): slot, generation, tokens committed (-1: a prefill chunk, nothing
    drawn), drafts accepted (-1: no verify), drafts proposed, then ``k + 1`` token columns and ``k`` draft columns."""
    out = torch.full((slots, 6 + 2 * k), -1, dtype=torch.long)
    for i, r in enumerate(results):
        if r is None:
            out[i, 2] = -1
            continue
        out[i, :5] = torch.tensor([r.slot, r.generation, len(r.tokens), r.accepted, len(r.drafts)])
        out[i, 5:5 + len(r.tokens)] = torch.tensor(r.tokens)
        out[i, 6 + k:6 + k + len(r.drafts)] = torch.tensor(r.drafts, dtype=torch.long)
    return out


def unpack_results(packed: torch.Tensor, plan, k: int) -> list[Result | None]:
    results = []
    for i, (_, w) in enumerate(plan):
        slot, generation, count, accepted, n = packed[i, :5].tolist()
        if count < 0:
            results.append(None)
            continue
        if slot != w.slot:
            raise ConfigError(f"the last rank's result {i} is for slot {slot}, but rank 0 sent slot {w.slot} there")
        results.append(Result(slot, generation, tuple(packed[i, 5:5 + count].tolist()), accepted,
                              tuple(packed[i, 6 + k:6 + k + n].tolist())))
    return results


def _text(message: str, device) -> torch.Tensor:
    data = message.encode()[:MESSAGE_BYTES]
    out = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    out[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return out.to(device)
