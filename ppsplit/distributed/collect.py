"""Multi-process ``ppsplit collect``: one rank per stage (``ppsplit collect DIR ... --ranks PP``, or on several hosts
``torchrun --nproc-per-node 1 --nnodes PP ... -m ppsplit.distributed.collect DIR --prompts FILE -o OUT``).

The last rank prepares the job (``ppsplit.eagle3.collect.prepare``: it checks the rows and owns OUT, whose files it
writes) and hands every rank the rows still to write; prompts that ask for a reply are answered first by the
multi-process engine (a folder with a paged cache). Then each row goes down the pipe once, rank ``k`` sending rank
``k + 1``::

    head    int64 [2]                   row index, T tokens (index -1: no more rows)
    ids     int64 [T], mask int64 [T]   the row (relayed to the last rank, which writes them)
    hidden  the stage's output          [T, W] (paged cache) or [1, T, W]
    aux     aux[:filled(k)]             the aux prefix

and the last rank writes the row's file exactly as the single process does. Each rank holds only its stage.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

from ppsplit.artifact.folder import CompiledFolder
from ppsplit.artifact.loader import load_stage
from ppsplit.core.errors import ConfigError, PpsplitError
from ppsplit.core.ragged import CacheLayout, RaggedStep
from ppsplit.core.tensors import model_dtype, new_aux
from ppsplit.distributed.launch import add_collect_arguments
from ppsplit.distributed.transport import Links, agree, backend_for
from ppsplit.eagle3.collect import HeadInput, Job, Report, finish, prepare, sample_tensors, write_sample


def collect_ranks(folder: str, prompts: str, out: str, *, generate: int = 0, logits: bool = False,
                  shard_size: int = 5000, layout: str = "eagle3") -> Report | None:
    """This rank's part (a collective call, every rank with the same arguments); the last rank returns the
    ``Report``, the others ``None``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    last = rank == world - 1
    box: list = [None]
    if last:
        try:
            box[0] = prepare(folder, prompts, out, generate=generate, logits=logits, shard_size=shard_size,
                             layout=layout)
        except PpsplitError as e:
            box[0] = str(e)
    dist.broadcast_object_list(box, src=world - 1)  # the job, or the reason there is none (the same on every rank)
    if isinstance(box[0], str):
        raise ConfigError(box[0])
    job: Job = box[0]
    opened = CompiledFolder(folder)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu")
    header = {"fingerprint": opened.fingerprint, "world": world, "pp": opened.plan.pp}
    try:
        if opened.plan.pp != world:
            raise ConfigError(f"the folder has {opened.plan.pp} stages but {world} ranks were launched: launch one "
                              "process per stage")
        stage = load_stage(opened, rank, device)
    except PpsplitError as e:
        header["error"] = str(e)
    agree(header)
    rows = _answered(stage, opened, job, device) if job.record.generate else job.rows
    report = _Pipe(stage, opened.plan, device).run(rows, job, rank)
    if report is not None:
        finish(job)
    return report


def _answered(stage, opened: CompiledFolder, job: Job, device):
    """The rows with the target's greedy replies (rank 0's; the engine runs on every rank)."""
    from ppsplit.distributed.engine import PipelineEngine
    from ppsplit.serve.sampling import SamplingParams

    engine = PipelineEngine(stage, eos_token_id=opened.manifest.eos_token_id, device=device,
                            max_num_batched_tokens=max(256, job.record.generate))
    asks = [r for r in job.rows if r.answer]
    outs = engine.generate([list(r.ids) for r in asks] if engine.first else None,
                           SamplingParams(max_tokens=job.record.generate))
    if not engine.first:
        return job.rows
    replies = {r.index: tuple(o.token_ids) for r, o in zip(asks, outs)}
    return [dataclasses.replace(r, ids=r.ids + replies[r.index], mask=r.mask + (1,) * len(replies[r.index]),
                                answer=False) if r.answer else r for r in job.rows]


class _Pipe:
    """One rank of the row pipeline (see the module docstring)."""

    def __init__(self, stage, plan, device):
        self.plan, self.device = plan, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.last = self.rank == self.world - 1
        self.stage = HeadInput(stage) if self.last else stage
        self.links = Links(self.rank, self.world)
        self.layout = CacheLayout.of(plan) if plan.paged else None

    def run(self, rows, job: Job, rank: int) -> Report | None:
        report = Report(skipped=job.skipped)
        if self.rank == 0:
            for row in rows:
                ids = torch.tensor(row.ids, device=self.device)
                self._forward(row.index, ids, torch.tensor(row.mask, device=self.device), ids, job, report)
            if self.world > 1:
                self.links.exchange([torch.tensor([-1, 0], device=self.device)], 1, "send to", receive=False)
            return report if self.last else None
        while True:
            head = torch.zeros(2, dtype=torch.long, device=self.device)
            self.links.exchange([head], self.rank - 1, "receive from")
            index, t = head.tolist()
            if index < 0:
                if not self.last:
                    self.links.exchange([head], self.rank + 1, "send to", receive=False)
                return report if self.last else None
            ids, mask = (torch.empty(t, dtype=torch.long, device=self.device) for _ in range(2))
            x = torch.empty(*self._rows(t), self.plan.width(self.rank), dtype=model_dtype(self.plan),
                            device=self.device)
            aux = self._aux(t)
            self.links.exchange([ids, mask, x, aux[:self.plan.filled(self.rank - 1)]], self.rank - 1, "receive from")
            self._forward(index, ids, mask, x, job, report, aux)

    def _forward(self, index: int, ids, mask, x, job: Job, report: Report, aux=None) -> None:
        t = ids.shape[0]
        aux = self._aux(t) if aux is None else aux
        if self.rank == 0:
            x = x if self.layout is not None else x[None]
        with torch.no_grad():
            y, aux = self._stage(x, t, aux)
        if not self.last:
            head = torch.tensor([index, t], device=self.device)
            self.links.exchange([head, ids, mask, y.contiguous(), aux[:self.plan.filled(self.rank)]], self.rank + 1,
                                "send to", receive=False)
            return
        hidden = self.stage.hidden.reshape(t, -1)
        write_sample(job.out, index, job.record,
                     sample_tensors(ids.tolist(), mask.tolist(), hidden, aux.reshape(aux.shape[0], t, -1),
                                    y.reshape(t, -1) if job.record.logits else None, job.record.layout))
        report.written += 1
        report.tokens += t

    def _stage(self, x, t: int, aux):
        if self.layout is None:
            return self.stage(x, torch.arange(t, device=self.device), aux)
        step = RaggedStep.lockstep(1, t, 0, self.layout).to(self.device)
        return self.stage(x, step.positions, aux, *step.tensors()[1:])

    def _rows(self, t: int) -> tuple[int, ...]:
        return (t,) if self.layout is not None else (1, t)

    def _aux(self, t: int) -> torch.Tensor:
        aux = new_aux(self.plan, 1, t, self.device)
        return aux[:, 0] if self.layout is not None else aux


def rank_main(argv: list[str] | None = None) -> None:
    """The body of one rank (``python -m ppsplit.distributed.collect``, under torchrun or ``ppsplit collect
    --ranks``)."""
    import time
    import warnings

    parser = argparse.ArgumentParser(prog="python -m ppsplit.distributed.collect", description=__doc__.split("\n")[0])
    add_collect_arguments(parser)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from ppsplit.distributed.transport import init

    rank = int(os.environ.get("RANK", "0"))
    try:
        backend = init(backend_for(args.device), timeout=args.timeout)
        start = time.perf_counter()
        report = collect_ranks(args.folder, args.prompts, args.out, generate=args.generate, logits=args.logits,
                               shard_size=args.shard_size, layout=args.layout)
        if report is not None:
            print(f"wrote {report.written} sequences ({report.tokens} tokens) to {args.out} in "
                  f"{time.perf_counter() - start:.1f}s ({dist.get_world_size()} stages, {backend})"
                  + (f"; {report.skipped} were already there" if report.skipped else ""), flush=True)
        code = 0
    except PpsplitError as e:
        # A ConfigError is the same on every rank: the last rank (which checked the job) says it.
        if rank == int(os.environ.get("WORLD_SIZE", "1")) - 1 or not isinstance(e, ConfigError):
            print(f"ppsplit: error: {e}", file=sys.stderr, flush=True)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no process-group teardown: after a failure it could wait on a dead peer


if __name__ == "__main__":
    rank_main()
