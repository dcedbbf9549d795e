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

import torch


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
                                "ppsplit.serve.engine", __name__])
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


# -- rank bodies used by the multi-process tests (here, so that children import nothing heavy) -------------------

def serve(rank, folder, requests, k=0, options=None, script=None):
    """Every rank builds ``PipelineEngine(folder, num_draft_tokens=k, **options)``. Rank 0 adds ``requests``
    (``(prompt, SamplingParams, arrival step)``, request ``i`` named ``"i"``) when the step count reaches their
    arrival, steps to the end and closes; ``script(engine, step)`` (optional) runs before each step. Rank 0 returns
    ``({id: (token_ids, finish_reason, accepted, drafts)}, blocks in use at the end, pool size, script)``; the others their
    ``Stats``."""
    from ppsplit import distributed as ppd

    engine = ppd.PipelineEngine(folder, num_draft_tokens=k, **(options or {}))
    if rank:
        engine.follow()
        return engine.stats
    outputs, pending, steps = {}, sorted(enumerate(requests), key=lambda r: r[1][2]), 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][2] <= steps:
            i, (prompt, params, _) = pending.pop(0)
            engine.add_request(prompt, params, request_id=str(i))
        if script is not None:
            script(engine, steps)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = (out.token_ids, out.finish_reason, out.accepted, out.drafts)
        steps += 1
    engine.close()
    return outputs, engine.blocks_in_use, engine.layout.num_blocks, script


def generate(rank, folder, prompts, params=None, k=0):
    """The collective ``PipelineEngine.generate`` on every rank, twice (the second reuses the communicators and the
    cache the first wrote); rank 0 returns both runs' outputs as ``(token_ids, accepted, drafts)`` lists."""
    from ppsplit import distributed as ppd
    from ppsplit.serve.sampling import SamplingParams

    if isinstance(params, int):  # max_tokens
        params = SamplingParams(max_tokens=params)
    if isinstance(prompts, torch.Tensor):
        prompts = [row.tolist() for row in prompts]
    engine = ppd.PipelineEngine(folder if isinstance(folder, str) else folder[rank], num_draft_tokens=k)
    runs = [engine.generate(prompts if rank == 0 else None, params) for _ in range(2)]
    if rank:
        return engine.stats
    return [[(o.token_ids, o.accepted, o.drafts) for o in run] for run in runs]


def generate_choices(rank, folder, prompt, params):
    """Choices of one prompt across the ranks, choice 0 the parent whose prompt blocks the others share; rank 0
    returns their token ids, the prompt tokens shared and the blocks still in use."""
    from ppsplit import distributed as ppd

    engine = ppd.PipelineEngine(folder)
    if rank:
        engine.follow()
        return None
    inner = engine.engine
    ids = [inner.add_request(prompt, params[0])]
    ids += [inner.add_request(prompt, p, parent=ids[0]) for p in params[1:]]
    final = {}
    while inner.has_unfinished():
        final.update({o.request_id: o.token_ids for o in inner.step() if o.finished})
    engine.close()
    return [final[i] for i in ids], inner.scheduler.shared_tokens, inner.blocks_in_use


def equal_to_hf(run, expected: torch.Tensor, eos=()) -> bool:
    """A ``generate`` run's token ids against HF ``generate``'s ``[B, T + new]``: the same tokens, ending early only
    at an end-of-sequence token (after which HF pads)."""
    prompt = expected.shape[1] - max(len(r[0]) for r in run)
    for (tokens, _, _), row in zip(run, expected.tolist()):
        want = row[prompt:]
        if tokens != want[:len(tokens)] or (len(tokens) < len(want) and tokens[-1] not in eos):
            return False
    return True


class Fragile:
    """A stage that SIGKILLs its process (``how="kill"``) or sleeps S seconds (``"stall:S"``) at its ``at``-th
    call."""

    def __init__(self, stage, at: int, how: str):
        self.stage, self.at, self.how, self.calls = stage, at, how, 0

    def __getattr__(self, name):  # a drafter's other attributes (taps, d2t, ...)
        if name == "stage":
            raise AttributeError(name)
        return getattr(self.stage, name)

    def __call__(self, *args):
        import signal

        self.calls += 1
        if self.calls == self.at:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(float(self.how.split(":")[1]))
        return self.stage(*args)


def generate_and_fail(rank, folder, prompts, params, victim, at, how, k=0, part="stage"):
    """Like ``generate`` (once, ``k`` drafts), but rank ``victim``'s stage (or, ``part="drafter"``, the last rank's
    drafter) fails at its ``at``-th call (see ``Fragile``)."""
    from ppsplit import distributed as ppd

    engine = ppd.PipelineEngine(folder, num_draft_tokens=k)
    if rank == victim and part == "stage":
        engine.stage = Fragile(engine.stage, at, how)
    elif rank == victim:
        proposer = engine.sampler.proposer
        proposer.drafter = Fragile(proposer.drafter, at, how)
    out = engine.generate(prompts if rank == 0 else None, params)
    return None if out is None else [o.token_ids for o in out]


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


class AbortInFlight:
    """A ``serve`` script: at the first step where request ``victim`` has a verify window in flight (drafts on their
    way through the ranks), abort it and add request ``"new"`` (``prompt``, ``params``); after the next step,
    record ``(victim's slot, new request's slot, victim still in the pipe then)`` in ``self.seen``."""

    def __init__(self, victim: str, prompt, params):
        self.victim, self.prompt, self.params = victim, prompt, params
        self.slot, self.seen = None, None

    def __call__(self, engine, step):
        requests = engine.scheduler.requests
        if self.slot is None:
            victim = requests.get(self.victim)
            if victim is not None and victim.flight and victim.drafts:
                self.slot = victim.slot
                engine.abort(self.victim)
                engine.add_request(self.prompt, self.params, request_id="new")
                self.in_pipe = any(r is victim for plan, _ in engine.flight for r, _ in plan.entries)
        elif self.seen is None and requests["new"].slot is not None:
            self.seen = (self.slot, requests["new"].slot, self.in_pipe)


class TryAdd:
    """A ``serve`` script: at step 0, add request ``"big"`` (``prompt``, ``params``) and record the one-line error the
    engine raises (or ``None``) in ``self.error``."""

    def __init__(self, prompt, params):
        self.prompt, self.params, self.error = prompt, params, "not tried"

    def __call__(self, engine, step):
        from ppsplit.core.errors import ConfigError

        if step == 0:
            try:
                engine.add_request(self.prompt, self.params, request_id="big")
                self.error = None
            except ConfigError as e:
                self.error = str(e)


def tp_generate(rank, folder, prompts, max_tokens, k=0):
    """Every rank of a ``pp x tp`` world runs ``tensor_parallel.engine(folder)``; pipeline rank 0 generates greedily
    ``max_tokens`` tokens for ``prompts`` and returns ``(token_ids, accepted, drafts)`` per prompt; the other leaders
    return their engine's ``Stats``, the followers ``None``."""
    from ppsplit.distributed import tensor_parallel
    from ppsplit.serve.sampling import SamplingParams

    engine = tensor_parallel.engine(folder, num_draft_tokens=k)
    if engine is None:
        return None
    out = engine.generate(prompts if engine.rank == 0 else None, SamplingParams(max_tokens=max_tokens))
    if engine.rank:
        return engine.stats
    return [(o.token_ids, o.accepted, o.drafts) for o in out]


def tp_prefill(rank, folder, ids):
    """A prefill of ``ids`` through a ``pp x tp`` folder without the engine: each stage's TP ranks run their shards
    (their all-reduces over the TP group), its TP rank 0 sends the hidden state and the aux prefix to every rank of
    the next stage. The last stage's TP rank 0 returns ``(logits, aux)``; the others ``None``."""
    import torch.distributed as dist

    from ppsplit.artifact.folder import CompiledFolder
    from ppsplit.artifact.loader import load_stage
    from ppsplit.core.ragged import CacheLayout, RaggedStep, Segment
    from ppsplit.distributed import tensor_parallel

    opened = CompiledFolder(folder)
    plan = opened.plan
    tp = tensor_parallel.setup(plan.tp, plan.pp, opened.fingerprint)
    stage = load_stage(opened, tp.stage, tp_rank=tp.tp_rank)
    layout = CacheLayout.of(plan)
    step = RaggedStep.build([Segment(0, 0, len(ids))], {0: list(range(layout.blocks_per_seq))}, layout)
    aux = torch.zeros(plan.n_slots, len(ids), plan.hidden_size)
    if tp.stage == 0:
        x = torch.tensor(ids)
    else:
        x = torch.empty(len(ids), plan.width(tp.stage))
        dist.recv(x, (tp.stage - 1) * plan.tp)
        if plan.filled(tp.stage - 1):
            dist.recv(aux[:plan.filled(tp.stage - 1)], (tp.stage - 1) * plan.tp)
    with torch.no_grad():
        y, aux = stage(x, step.positions, aux, *step.tensors()[1:])
    if tp.stage < plan.pp - 1:
        if tp.leader:
            for dst in range((tp.stage + 1) * plan.tp, (tp.stage + 2) * plan.tp):
                dist.send(y.contiguous(), dst)
                if plan.filled(tp.stage):
                    dist.send(aux[:plan.filled(tp.stage)].contiguous(), dst)
        return None
    return (y, aux) if tp.leader else None


def tp_suite(rank, jobs):
    """For each job ``(folder, prompts, max_tokens, k, prefill ids or None)``: ``tp_generate``, then (given ids)
    ``tp_prefill``, one after the other in the same processes. Returns ``[(generated, prefill)]`` per job."""
    return [(tp_generate(rank, folder, prompts, new, k), tp_prefill(rank, folder, ids) if ids else None)
            for folder, prompts, new, k, ids in jobs]


def tp_generate_and_fail(rank, folder, prompts, max_tokens, victim, at):
    """``tp_generate`` where global rank ``victim`` (a follower) SIGKILLs its process at its ``at``-th step."""
    from ppsplit.distributed import tensor_parallel
    from ppsplit.serve.sampling import SamplingParams

    if rank == victim:
        original = tensor_parallel.follow

        def fragile(stage, tpar):
            return original(stage, tpar, run=Fragile(stage, at, "kill"))
        tensor_parallel.follow = fragile
    engine = tensor_parallel.engine(folder)
    if engine is None:
        return None
    out = engine.generate(prompts if engine.rank == 0 else None, SamplingParams(max_tokens=max_tokens))
    return None if out is None else [o.token_ids for o in out]
