"""Multi-process engine: the engine of ``ppsplit.serve.engine`` with one rank per stage over ``torch.distributed``
(NCCL on GPUs, gloo on CPUs).

Rank ``k`` loads only stage ``k`` of a ``ppsplit compile`` folder (with a paged cache). Rank 0 holds the ``Engine``
(scheduler, requests, block tables) and is its runner: each micro-step it runs stage 0 and sends down the pipe, as
named tensors in this order::

    head          int64 [8]             run (1) / end of job (0) / job refused (2), N tokens, R requests, D drawing,
                                        A admissions, serial, what the drawing requests do (SAMPLED | CUT_K | CUT_P |
                                        ADJUSTED; their most logprobs + 1 from bit 4, prompt logprobs + 1 from bit
                                        10), E admission marks (-1: none)
    batch         int64                 the step's packed fields (``ppsplit.serve.batch``: ids, positions, slots,
                                        block table, per-request rows)
    admit_floats  float32 [A, 5]        temperature, top-p, penalties of each request taking a slot (sent once per
                                        admission; ``ppsplit.serve.sampler.admission_tensors``)
    admit_ints    int64 [A, 7]          slot, top-k, seed, output index of its next draw, min_tokens, adjusted,
                                        logprobs of the adjusted logits
    admit_marks   int64 [E, 3]          with E >= 0: the adjusted requests' prompt, output, stop and bias ids
    mark_values   float32 [E]           and the biases
    hidden        [N, W]                the stage's output (and any values carried beside it)
    aux           [filled(k), N, H]     the aux prefix the next stages read

Rank ``k`` relays ``head``, ``batch`` and the admissions and sends its own ``hidden`` and ``aux[:filled(k)]``. The
last rank holds the ``Sampler`` (per-slot parameters, sampling, acceptance, the drafter) and sends rank 0 one tensor
per micro-step, the results (``ppsplit.serve.sampler.result_shape``), through a group of its own. ``pp`` micro-steps
over disjoint requests are in flight, so every stage is busy; a request in flight is not scheduled again until its
result is back. Every rank runs the micro-steps in the order rank 0 sent them, so a slot or block freed while a
micro-step is in flight (an abort) and given to a new request is written by the new request only after the old step
is done with it; a result whose slot generation no longer matches its request is dropped.

Before any tensor moves the ranks exchange a header (plan fingerprint, world size, dtype, cache layout, ``K``,
token budget, buckets; the last rank adds its drafter's lookahead, the positions past a verify window rank 0's
scheduler reserves: ``K``, or ``K + 1`` for a DFlash block); a mismatch raises the same ``ConfigError`` on every rank. A rank that dies or stalls makes
the others fail with a ``PipelineError`` naming it, within ``init(timeout=...)``.

Example (``torchrun --nproc-per-node 2 script.py``)::

    from ppsplit import distributed as ppd
    ppd.init(timeout=60)
    engine = ppd.PipelineEngine("demo-pp2")
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16))  # rank 0: outputs; others: None
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx

from ppsplit.artifact.folder import CompiledFolder
from ppsplit.artifact.folder import fingerprint as plan_fingerprint
from ppsplit.artifact.loader import load_stage, stage_options
from ppsplit.core.errors import ConfigError, PpsplitError
from ppsplit.core.fx_utils import stage_vocab
from ppsplit.core.ragged import CacheLayout, RaggedStep
from ppsplit.core.tensors import model_dtype
from ppsplit.distributed.transport import Links, agree
from ppsplit.serve.batch import StepBatch
from ppsplit.serve.engine import Engine
from ppsplit.serve.runner import buckets_up_to
from ppsplit.serve.sampler import FLOATS, INTS, Sampler, admission_tensors, result_shape, to_device
from ppsplit.serve.sampling import SamplingParams
from ppsplit.serve.scheduler import DEFAULT_BUDGET, Scheduler

RUN, END, REFUSED = 1, 0, 2
SAMPLED, CUT_K, CUT_P, ADJUSTED = 1, 2, 4, 8
LOGPROBS_SHIFT, PROMPT_LOGPROBS_SHIFT = 4, 10
HEAD = 8
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


class _Pending:
    """A micro-step's results on their way back from the last rank."""

    def __init__(self, links, posted, buffer):
        self.links, self.posted, self.buffer = links, posted, buffer

    def wait(self):
        self.links.wait(self.posted)
        return self.buffer.cpu().numpy()


class PipelineEngine:
    """This rank's part of the engine. Every rank constructs it with the same options (a collective call).

    ``source``: a compiled folder (this rank loads its stage) or this rank's stage module from an in-process split
    (then pass ``eos_token_id``). ``drafter``: a drafter for the last rank (default: the folder's, its ``--drafter``
    or its ``--mtp`` layer, when ``num_draft_tokens`` > 0). ``cuda_graphs``: capture every bucket on every rank at start (``buckets_up_to`` the
    token budget; default: on CUDA). ``device`` defaults to ``cuda:<LOCAL_RANK>`` under NCCL, else the CPU.
    ``group``: the pipeline's ranks when the world holds more (``ppsplit.distributed.tensor_parallel``: the stages'
    TP rank 0s); default the world.

    Rank 0 drives the ``Engine`` (``engine``) and is its runner: ``add_request``, ``abort``, ``step``, ``stream``,
    ``generate``, ``close`` (ends the job on every rank). The other ranks call ``follow()``, which runs micro-steps
    until rank 0 closes. ``generate(prompts, params)`` is collective: rank 0 runs the prompts to the end and closes;
    the others follow; rank 0 returns the outputs, the others None.
    """

    def __init__(self, source: str | fx.GraphModule, *, drafter=None, num_draft_tokens: int = 0,
                 max_num_batched_tokens: int = DEFAULT_BUDGET, max_num_seqs: int | None = None, cuda_graphs: bool | None = None,
                 device: torch.device | str | None = None, eos_token_id=(), group=None):
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.backend = dist.get_backend()
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if self.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.first, self.last = self.rank == 0, self.rank == self.world - 1
        self.k = num_draft_tokens
        self.cuda_graphs = self.device.type == "cuda" and cuda_graphs is not False
        header = {"world": self.world, "backend": self.backend, "k": num_draft_tokens,
                  "budget": max_num_batched_tokens, "max_seqs": max_num_seqs, "graphs": self.cuda_graphs}
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
            proposer = None
            if self.last and self.k:
                from ppsplit.serve.speculative import Proposer, check_speculation

                drafter = drafter or self._folder_drafter(folder)
                if getattr(drafter, "family", None) in ("dspark", "dflash2"):  # not run across ranks yet
                    raise ConfigError(f"a {drafter.family} drafter runs in one process (ppsplit.Engine over a "
                                      "split) for now, not across ranks; use an EAGLE-3 or DFlash drafter with "
                                      "ppsplit.distributed")
                check_speculation(plan, self.k, drafter)
                proposer = Proposer(drafter, self.k, self.layout)
                header["lookahead"] = proposer.lookahead  # rank 0's scheduler reserves it (a DFlash block: K + 1)
            self.sampler = Sampler(self.layout.slots, self.device, proposer,
                                   max_len=self.layout.max_len) if self.last else None
        except PpsplitError as e:
            header["error"] = str(e)

        headers = agree(header, group)
        self.lookahead = headers[-1].get("lookahead", self.k)
        self.dtype, self.eos = model_dtype(plan), eos
        self.received = plan.filled(self.rank - 1) if self.rank else 0
        self.sends = plan.filled(self.rank)
        self.x_width = plan.width(self.rank)
        self.vocab = stage_vocab(self.stage) if self.first else None
        self.buckets = buckets_up_to(max_num_batched_tokens) if self.cuda_graphs else []
        self.depth, self.lag = self.world, False  # the runner interface (ppsplit.serve.runner)
        self.links = Links(self.rank, self.world, group)
        self.stats = Stats()
        self.sent: list = []  # the sends of the last micro-step (its buffers stay alive until they are done)
        self.serial = 0
        self.graphs = {}
        if self.world == 1:  # one rank holds every stage: the in-process runner
            from ppsplit.serve.runner import LocalRunner
            from ppsplit.serve.runtime import SplitModel

            runner = LocalRunner(SplitModel(plan, [self.stage], eos_token_id=eos), proposer=self.sampler.proposer,
                                 budget=max_num_batched_tokens, cuda_graphs=self.cuda_graphs)
            self.engine = Engine(runner, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
            return
        self._warm_up(max_num_batched_tokens)
        self._connect()
        self.engine = Engine(self, max_num_batched_tokens=max_num_batched_tokens,
                             max_num_seqs=max_num_seqs) if self.first else None

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
        if folder is not None and folder.mtp is not None:  # compile --mtp: the block and its own embedding copy
            from ppsplit.eagle3.mtp import load_folder_mtp

            return load_folder_mtp(folder, self.device, stage_options(folder))
        if folder is None or folder.drafter is None:
            raise ConfigError("speculative decoding needs a drafter on the last rank: compile the folder "
                              "with --drafter or --mtp, or pass PipelineEngine(..., drafter=ppsplit.load_drafter(...)) "
                              "there")
        from ppsplit.eagle3.formats import load_folder_drafter

        return load_folder_drafter(folder.drafter, self.plan, self.device)

    def _warm_up(self, budget: int) -> None:
        """On a GPU, run (or capture) the stage once per bucket and the sampler's ops once, before any transfer is
        pending. CUDA loads a kernel at its first launch (Triton compiles at its first call), and a load can wait
        for the device to go idle: with a receive pending there that waits on a peer which waits on this rank, it
        never does (seen on two H200s under NCCL)."""
        if self.device.type != "cuda":
            return
        from ppsplit.serve.cuda_graphs import CapturedStage

        pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        for n in buckets_up_to(budget):
            if self.cuda_graphs:
                self.graphs[n] = CapturedStage(self.stage, 0, n, pool=pool)
            else:
                step = RaggedStep.build([], {}, self.layout, pad_to=n).to(self.device)
                self._run(self._input(n), step, self._aux(n))
        if self.last and self.cuda_graphs and self.sampler.proposer is not None:
            self.sampler.proposer.capture(self.plan, buckets_up_to(budget))  # as the one-process runner does
        if self.last:
            self._warm_sampler()
        torch.cuda.synchronize(self.device)

    def _warm_sampler(self) -> None:
        """The sampler's ops once each (greedy and sampled; a draw, then a verify of ``K`` drafts), on one request of
        a scheduler of its own. What they write (slot 0's first blocks) is overwritten by any request before it is
        read."""
        for params in (SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9, top_k=4)):
            sched = Scheduler(self.layout, vocab=1, k=self.k, budget=max(self.k + 1, 1), lookahead=self.lookahead)
            sched.add([0], params)
            while sched.has_unfinished() and (plan := sched.schedule()) is not None:
                batch = plan.batch.to(self.device)
                self.sampler.admit(plan.admissions)
                y, aux = self._run(self._input(batch.n), batch.step(), self._aux(batch.n))
                results = self.sampler.run(y, aux, batch.tokens, batch.positions, batch, sampled=plan.sampled,
                                           cut_k=plan.cut_k, cut_p=plan.cut_p)
                for request in sched.apply(plan, results.cpu().numpy()):
                    if request.finish_reason is not None:
                        sched.release(request)

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

    # -- rank 0: the engine --------------------------------------------------------------------------------------
    def _driver(self) -> Engine:
        if not self.first:
            raise ConfigError(f"requests go to rank 0; rank {self.rank} calls follow() (or generate with no prompts)")
        return self.engine

    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None, *,
                    parent: str | None = None) -> str:
        return self._driver().add_request(prompt_ids, params, request_id, parent=parent)

    def abort(self, request_id: str) -> None:
        self._driver().abort(request_id)

    def has_unfinished(self) -> bool:
        return self._driver().has_unfinished()

    def step(self):
        return self._driver().step()

    def stream(self, prompts, params=None):
        return self._driver().stream(prompts, params)

    @property
    def scheduler(self) -> Scheduler:
        return self._driver().scheduler

    @property
    def flight(self):
        return self._driver().flight

    @property
    def blocks_in_use(self) -> int:
        return self._driver().blocks_in_use

    @torch.no_grad()
    def generate(self, prompts=None, params: SamplingParams | list[SamplingParams] | None = None, *,
                 progress: float | None = None):
        """Collective: rank 0 runs ``prompts`` to the end (``RequestOutput`` s in order) and closes the job; the
        other ranks follow it and return ``None``. A refused prompt raises the same ``ConfigError`` on every rank."""
        if not self.first:
            self.follow()
            return None
        try:
            outputs = self.engine.generate(prompts, params, progress=progress)
        except ConfigError as e:
            self._end(REFUSED, str(e))
            raise
        self.close()
        return outputs

    def close(self) -> None:
        """Rank 0: end the job; every other rank returns from ``follow``. Requests still running are aborted."""
        self._end(END)

    def _end(self, kind: int, message: str = "") -> None:
        engine = self._driver()
        for request in list(engine.scheduler.requests.values()):
            engine.abort(request.id)
        while engine.flight:
            engine.flight.popleft()[1].wait()
        if self.world > 1:
            self.links.wait(self.sent)
            head = torch.tensor([kind, 0, 0, 0, 0, self.serial, 0, -1], device=self.device)
            tensors = [head] + ([_text(message, self.device)] if kind == REFUSED else [])
            self.links.wait([self.links.send(t, 1) for t in tensors])
            self.sent = []

    def launch(self, plan) -> _Pending:
        """The runner's ``launch``: run stage 0 on ``plan``'s step and send it down the pipe."""
        dev = self.device
        batch = plan.batch.to(dev, non_blocking=True)
        admissions = plan.admissions
        self.serial += 1
        flags = (SAMPLED * plan.sampled | CUT_K * plan.cut_k | CUT_P * plan.cut_p | ADJUSTED * plan.adjusted
                 | (plan.logprobs + 1) << LOGPROBS_SHIFT | (plan.prompt_logprobs + 1) << PROMPT_LOGPROBS_SHIFT)
        admitted = admission_tensors(admissions) if admissions else ()
        marks = len(admitted[2]) if len(admitted) > 2 else -1
        head = torch.tensor([RUN, batch.n, batch.num_rows, batch.num_drawing, len(admissions), self.serial, flags,
                             marks])
        y, aux = self._run(batch.tokens, batch.step(), self._aux(batch.n))
        relayed = [to_device(head, dev), batch.buffer] + [to_device(t, dev) for t in admitted]
        self._send_on(relayed, y, aux)
        shape = result_shape(self.k, batch.num_rows, batch.n, plan.logprobs, plan.prompt_logprobs)
        buffer = torch.zeros(shape, dtype=torch.long, device=dev)
        posted = [self.links.recv(buffer, self.world - 1, "receive results from", back=True)]
        return _Pending(self.links, posted, buffer)

    # -- every other rank ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def follow(self) -> None:
        """Ranks 1..pp-1: run the micro-steps rank 0 sends until it ends the job."""
        if self.first:
            raise ConfigError("rank 0 drives the engine (add_request, step, generate); the other ranks follow")
        prev, dev = self.rank - 1, self.device
        S, M = self.layout.slots, self.layout.blocks_per_seq
        while True:
            head = torch.zeros(HEAD, dtype=torch.long, device=dev)
            self.links.wait([self.links.recv(head, prev)])
            kind, n, rows, drawing, admitted, _, flags, num_marks = head.tolist()
            if kind != RUN:
                self._pass_end(head, kind)
                return
            packed = torch.empty(StepBatch.size(n, rows, drawing, S, M), dtype=torch.long, device=dev)
            admission = [torch.empty(admitted, FLOATS, dtype=torch.float32, device=dev),
                         torch.empty(admitted, INTS, dtype=torch.long, device=dev)] if admitted else []
            if admitted and num_marks >= 0:
                admission += [torch.empty(num_marks, 3, dtype=torch.long, device=dev),
                              torch.empty(num_marks, dtype=torch.float32, device=dev)]
            x = torch.empty(n, self.x_width, dtype=self.dtype, device=dev)
            aux = self._aux(n)
            tensors = [packed] + admission + [x] + ([aux[:self.received]] if self.received
                                                                               else [])
            self.links.wait([self.links.recv(t, prev) for t in tensors])
            batch = StepBatch(packed, n, rows, drawing, S, M)
            y, aux = self._run(x, batch.step(), aux)
            if not self.last:
                self._send_on([head, packed] + admission, y, aux)
                continue
            if admitted:
                self.sampler.admit_tensors(*admission)
            results = self.sampler.run(y, aux, batch.tokens, batch.positions, batch, sampled=bool(flags & SAMPLED),
                                       cut_k=bool(flags & CUT_K), cut_p=bool(flags & CUT_P),
                                       adjusted=bool(flags & ADJUSTED),
                                       logprobs=((flags >> LOGPROBS_SHIFT) & 63) - 1,
                                       prompt_logprobs=(flags >> PROMPT_LOGPROBS_SHIFT) - 1)
            self.links.wait(self.sent)
            self.sent = [self.links.send(results, 0, "send results to", back=True)]
            self._message = results  # alive until its send is done

    def _pass_end(self, head, kind: int) -> None:
        prev = self.rank - 1
        message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
        if kind == REFUSED:
            self.links.wait([self.links.recv(message, prev)])
        if not self.last:
            self.links.wait(self.sent)
            self.links.wait([self.links.send(t, self.rank + 1) for t in ([head, message] if kind == REFUSED
                                                                          else [head])])
            self.sent = []
        if kind == REFUSED:
            raise ConfigError(bytes(message.cpu().tolist()).rstrip(b"\0").decode(errors="replace"))

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


def _text(message: str, device) -> torch.Tensor:
    data = message.encode()[:MESSAGE_BYTES]
    out = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    out[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return out.to(device)
