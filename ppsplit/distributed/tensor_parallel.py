"""Tensor parallelism at run time: a stage's TP group looks like one stage to the pipeline engine.

``pp x tp`` processes (torchrun-compatible: global rank ``g`` is TP rank ``g % tp`` of stage ``g // tp``). Each TP
group registers its process group under the name the stage programs' collectives use (``use_group``), so every
rank's stage all-reduces with its group's peers. TP rank 0 of each stage is the pipeline participant: it runs the
engine over the group of the stages' TP rank 0s (``TensorParallel.pipe``), and its stage is a ``Leader`` that
broadcasts every step's inputs (the stage contract's named tensors) to the other TP ranks of its group before it
runs its own shard. Those ranks ``follow``: they receive each step, run the same sharded stage (the all-reduces
inside keep them in step with the leader) and drop its output, until the leader says the job is over (``stop``,
which ``TensorParallelEngine`` calls whenever the job ends on its rank).

A TP rank that dies makes its group's collectives fail on the others: the leader raises a ``PipelineError`` out of
the engine, which ends the pipeline as any dead rank does; followers whose leader is gone fail their next
broadcast. Every wait is bounded by the process group's timeout.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ppsplit.core.errors import ConfigError
from ppsplit.core.shards import TP_GROUP
from ppsplit.core.tensors import model_dtype
from ppsplit.distributed.engine import PipelineEngine
from ppsplit.distributed.transport import TIMEOUT, PipelineError, agree

RUN, END = 1, 0
_HEAD = 4  # kind, tokens, x's width (0: token ids), serial


def use_group(group) -> None:
    """Register ``group`` as the TP group the stage programs' collectives run on (``ppsplit_tp``)."""
    from torch.distributed.distributed_c10d import _register_process_group, _unregister_process_group

    try:
        _unregister_process_group(TP_GROUP)  # the group of an earlier job in this process
    except Exception:  # none registered (torch raises its own error type)
        pass
    _register_process_group(TP_GROUP, group)


@dataclass
class TensorParallel:
    """This process's place in the ``pp x tp`` grid and its groups (``setup``)."""

    stage: int
    tp_rank: int
    tp: int
    pp: int
    group: object  # this stage's TP group
    pipe: object  # the stages' TP rank 0s: the group the pipeline engine runs on

    @property
    def leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def leader_rank(self) -> int:
        """The global rank of this stage's TP rank 0."""
        return self.stage * self.tp


def setup(tp: int, pp: int, fingerprint: str = "") -> TensorParallel:
    """Form the TP groups and the pipeline group over an initialised world of ``pp * tp`` ranks (collective: every
    rank calls it), register this rank's TP group, and check that the group's ranks agree on ``fingerprint``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != pp * tp:
        raise ConfigError(f"the folder has {pp} stages of {tp} TP ranks, {pp * tp} ranks in all, but {world} were "
                          f"launched: launch {pp * tp} processes (--nproc-per-node {pp * tp})")
    timeout = datetime.timedelta(seconds=TIMEOUT[0])
    mine = None
    for s in range(pp):  # new_group is collective over the world: every rank makes every group, in order
        g = dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=timeout)
        if s == rank // tp:
            mine = g
    pipe = dist.new_group([s * tp for s in range(pp)], timeout=timeout)
    use_group(mine)
    tpar = TensorParallel(rank // tp, rank % tp, tp, pp, mine, pipe)
    agree_group({"fingerprint": fingerprint, "tp": tp, "pp": pp, "rank": rank}, mine)
    return tpar


def agree_group(header: dict, group) -> None:
    """``transport.agree`` within one group."""
    agree(header, group)


class Leader(torch.nn.Module):
    """TP rank 0's stage as the engine sees it: ``y, aux = leader(x, positions, aux, *step)`` sends the step to the
    group's other ranks, then runs this rank's shard. Attributes it does not have (``graph``, ``meta``, the tensors)
    are the stage's."""

    def __init__(self, stage: torch.nn.Module, tpar: TensorParallel):
        super().__init__()
        self.inner = stage
        self.tpar = tpar
        self.serial = 0

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, x, positions, aux, *step):
        self.serial += 1
        width = x.shape[1] if x.dim() == 2 else 0
        head = torch.tensor([RUN, x.shape[0], width, self.serial], device=x.device)
        meta = torch.cat([positions.reshape(-1), *(t.reshape(-1) for t in step)])
        try:
            for t in (head, meta, x.contiguous()):
                dist.broadcast(t, src=self.tpar.leader_rank, group=self.tpar.group)
            return self.inner(x, positions, aux, *step)
        except RuntimeError as e:  # gloo / NCCL: a peer of the group is gone
            raise lost(self.tpar, e) from None

    def stop(self) -> None:
        """End the followers' loop (the job is over)."""
        head = torch.tensor([END, 0, 0, self.serial], device=_device(self.inner))
        try:
            dist.broadcast(head, src=self.tpar.leader_rank, group=self.tpar.group)
        except RuntimeError as e:
            raise lost(self.tpar, e) from None


@torch.no_grad()
def follow(stage: torch.nn.Module, tpar: TensorParallel, run=None) -> int:
    """TP ranks 1.. of a stage: run every step the leader sends on this rank's shard (through ``run``, default the
    stage itself) until it stops. Returns the steps run."""
    run = run or stage
    plan = stage.meta["ppsplit.plan"]
    dev = _device(stage)
    dtype = model_dtype(plan)
    slots, blocks = plan.max_batch, plan.blocks_per_seq
    steps = 0
    try:
        while True:
            head = torch.zeros(_HEAD, dtype=torch.long, device=dev)
            dist.broadcast(head, src=tpar.leader_rank, group=tpar.group)
            kind, n, width, _ = head.tolist()
            if kind != RUN:
                return steps
            meta = torch.empty(2 * n + slots * blocks + 2 * slots, dtype=torch.long, device=dev)
            x = torch.empty((n, width) if width else (n,), dtype=dtype if width else torch.long, device=dev)
            for t in (meta, x):
                dist.broadcast(t, src=tpar.leader_rank, group=tpar.group)
            positions, seq = meta[:n], meta[n:2 * n]
            at = 2 * n + slots * blocks
            table = meta[2 * n:at].view(slots, blocks)
            aux = torch.zeros(plan.n_slots, n, plan.hidden_size, dtype=dtype, device=dev)
            run(x, positions, aux, seq, table, meta[at:at + slots], meta[at + slots:at + 2 * slots])
            steps += 1
    except RuntimeError as e:
        raise lost(tpar, e) from None


def lost(tpar: TensorParallel, error: Exception) -> PipelineError:
    text = (str(error).splitlines() or [type(error).__name__])[0][:160]
    first, last = tpar.leader_rank, tpar.leader_rank + tpar.tp - 1
    return PipelineError(f"rank {dist.get_rank()} (TP rank {tpar.tp_rank} of stage {tpar.stage}): a rank of its TP "
                         f"group (ranks {first} to {last}) died or stalled past the timeout ({text})")


def _device(module: torch.nn.Module) -> torch.device:
    for t in module.buffers():
        return t.device
    for t in module.parameters():
        return t.device
    return torch.device("cpu")


class TensorParallelEngine(PipelineEngine):
    """A stage's TP rank 0 in the pipeline: a ``PipelineEngine`` over the pipeline group whose stage is a ``Leader``.
    Whatever ends the job on this rank (``close``, a refused job, the end of ``follow``) also ends its followers."""

    def close(self) -> None:
        super().close()
        self.stage.stop()

    @torch.no_grad()
    def generate(self, prompts=None, params=None, *, progress: float | None = None):
        try:
            return super().generate(prompts, params, progress=progress)
        except ConfigError:
            if self.first:  # the other leaders stopped theirs in follow()
                self.stage.stop()
            raise

    @torch.no_grad()
    def follow(self) -> None:
        try:
            super().follow()
        except ConfigError:  # a refused job ends here too
            self.stage.stop()
            raise
        self.stage.stop()


def engine(folder: str, *, device=None, **options) -> TensorParallelEngine | None:
    """Collective over a world of ``pp x tp`` ranks running a compiled folder cut for tensor parallelism: every
    rank loads its shard of its stage; TP rank 0 of each stage returns its ``TensorParallelEngine`` (used as a
    ``PipelineEngine``); the other ranks follow their leader until the job ends and return ``None``. ``options``:
    ``PipelineEngine``'s."""
    from ppsplit.artifact.folder import CompiledFolder
    from ppsplit.artifact.loader import load_stage

    opened = CompiledFolder(folder)
    plan = opened.plan
    tpar = setup(plan.tp, plan.pp, opened.fingerprint)
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    stage = load_stage(opened, tpar.stage, device, tp_rank=tpar.tp_rank)
    if not tpar.leader:
        follow(stage, tpar)
        return None
    k = options.get("num_draft_tokens", 0)
    if k and tpar.stage == plan.pp - 1 and options.get("drafter") is None:
        if opened.drafter is None:
            raise ConfigError("speculative decoding needs a drafter: compile the folder with --drafter")
        from ppsplit.eagle3.formats import load_folder_drafter

        options["drafter"] = load_folder_drafter(opened.drafter, plan, torch.device(device))
    # A captured graph cannot hold the leader's host-side broadcasts: TP stages run eagerly.
    options["cuda_graphs"] = False
    return TensorParallelEngine(Leader(stage, tpar), group=tpar.pipe, device=device,
                                eos_token_id=opened.manifest.eos_token_id, **options)


def pipeline_engine(folder: str, **options):
    """This rank's engine for a compiled folder: a ``PipelineEngine`` (one rank per stage), or with tensor
    parallelism ``engine``'s (``None`` on a follower, once its job is over)."""
    from ppsplit.artifact.folder import CompiledFolder

    if CompiledFolder(folder).plan.tp > 1:
        return engine(folder, **options)
    return PipelineEngine(folder, **options)
