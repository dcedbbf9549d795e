"""Multi-process pipeline: one rank per stage over ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

Rank ``k`` loads only stage ``k`` of a ``ppsplit compile`` folder. Per step it receives ``positions``, the hidden
state and the aux prefix ``aux[:plan.filled(k - 1)]`` from rank ``k - 1`` straight into the prefix of its own
full-size aux buffer (relaying costs no copy), runs the stage, and sends ``positions``, its hidden state and
``aux[:plan.filled(k)]`` to rank ``k + 1``. The last rank picks the next tokens and sends them back to rank 0 in
a fixed-width message ``[rows, 1 + width]`` (column 0: how many tokens follow; greedy sends 1, EAGLE-3
verification will send 1..K+1), so every rank posts the same size whatever was accepted.

Sequences are decoded in ``M`` groups of ``rows`` sequences. Prefill runs the groups as microbatches in GPipe
order; decode keeps all groups in flight round-robin, group ``g`` at stage ``(t - g) mod pp`` at step ``t``, so
with ``M >= pp`` every stage is busy. Group ``g`` owns rows ``[g * rows, (g + 1) * rows)`` of every stage's KV
cache: each group runs its own instance of the stage (``group_stages``), a GraphModule over the same graph and
parameters whose cache buffers are row slices (views) of the stage's buffers, so the cache layer's in-place
``index_copy_`` lands in the shared buffer and the compiled program needs no change.

Before any tensor moves, the ranks exchange a header (plan fingerprint, stage, world size, dtype, hidden size,
cache shape, message width) and rank 0 broadcasts the job (groups, prompt lengths, new tokens); a mismatch raises
the same ``ConfigError`` on every rank. A rank that dies or stalls makes its neighbours fail with a
``PipelineError`` naming it, within the process group's timeout (``init(timeout=...)``).

Example (``torchrun --nproc-per-node 2 script.py``)::

    from ppsplit import distributed as ppd
    ppd.init(timeout=60)
    runner = ppd.PipelineRank("demo-pp2")
    out = runner.generate([ids_a, ids_b] if runner.rank == 0 else None, max_new_tokens=32)   # rank 0: ids
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx

from ppsplit.fx_utils import is_cache_buffer
from ppsplit.errors import ConfigError, PpsplitError

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
    _TIMEOUT[0] = timeout
    return backend


_TIMEOUT = [DEFAULT_TIMEOUT]  # the timeout init() was given: groups made later get the same


def group_stages(stage: fx.GraphModule, groups: int, rows: int) -> list[fx.GraphModule]:
    """``groups`` instances of ``stage``; instance ``g`` keeps its KV cache in rows ``[g*rows, (g+1)*rows)``.

    The instances share the stage's parameters and its cache buffers: each cache buffer of an instance is a row
    slice (a view) of the stage's buffer, and the cache update writes in place through it.

    Example::

        a, b = group_stages(stage, groups=2, rows=4)   # a writes cache rows 0-3, b rows 4-7
    """
    plan = stage.meta["ppsplit.plan"]
    caches = {name: buf for name, buf in stage.named_buffers() if is_cache_buffer(name)}
    if not caches:
        raise ConfigError("the folder's stages have no KV cache; compile it with --max-batch and --max-len")
    if groups * rows > plan.max_batch:
        raise ConfigError(f"{groups} groups of {rows} sequences need {groups * rows} cache rows, but the folder was "
                          f"compiled with --max-batch {plan.max_batch}; use fewer or smaller groups, or compile "
                          f"with --max-batch {groups * rows}")
    out = []
    for g in range(groups):
        graph = fx.Graph()
        graph.output(graph.graph_copy(stage.graph, {}))
        inst = fx.GraphModule(stage, graph, class_name=type(stage).__name__)
        for name, buf in caches.items():
            prefix, _, leaf = name.rpartition(".")
            inst.get_submodule(prefix)._buffers[leaf] = buf[g * rows:(g + 1) * rows]
        inst.meta.update(stage.meta)
        out.append(inst)
    return out


def plan_fingerprint(folder: str) -> str:
    """sha256 of the folder's ``plan.json``: equal on every rank iff the stages come from one compile."""
    with open(os.path.join(folder, "plan.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def agree(header: dict, group=None) -> list[dict]:
    """Gather every rank's ``header`` and raise the same ``ConfigError`` on every rank if they disagree.

    A header may carry ``"error"`` (the rank could not load its stage): then every rank raises it.
    """
    headers: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(headers, header, group=group)
    for r, h in enumerate(headers):
        if "error" in h:
            raise ConfigError(f"rank {r}: {h['error']}")
    ref = headers[0]
    for r, h in enumerate(headers[1:], 1):
        diff = [f"{key} {h.get(key)!r} (rank 0: {ref.get(key)!r})" for key in sorted(set(ref) | set(h))
                if key not in ("stage", "rank") and h.get(key) != ref.get(key)]
        if diff:
            raise ConfigError(f"rank {r} disagrees with rank 0 on {', '.join(diff)}: every rank must load the same "
                              "compiled folder with the same options")
    return headers


@dataclass
class Stats:
    """Per-rank counters of the last ``generate``: items run, seconds in the stage and waiting, bytes sent.

    On a GPU the seconds are host time (launches and waits), not device time: the loop never synchronises.
    """

    items: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    wall_s: float = 0.0
    tokens: int = 0  # token positions run through this rank's stage (rows x T per item)
    bytes_sent: int = 0
    payload_bytes: int = 0  # hidden + aux prefix only: the minimum that must cross the boundary


class PipelineRank:
    """This process's stage of a compiled folder, and the pipeline loop around it.

    ``width`` is the number of token columns in the message the last rank sends back (1 for greedy decoding;
    ``K + 1`` for EAGLE-3 verification). ``device`` defaults to ``cuda:<LOCAL_RANK>`` under NCCL, else the CPU.

    ``source`` is a compiled folder (this rank loads its stage) or this rank's stage module from an in-process
    ``split_model`` (then pass ``eos_token_id``/``pad_token_id``). ``cuda_graphs`` replays decode steps (one token)
    from a CUDA graph per group, captured at the start of each ``generate``.

    Example::

        runner = PipelineRank("demo-pp2")
        out = runner.generate([prompt_ids] if runner.rank == 0 else None, max_new_tokens=16)
    """

    def __init__(self, source: str | fx.GraphModule, *, device: torch.device | str | None = None, width: int = 1,
                 cuda_graphs: bool = False, eos_token_id=(), pad_token_id: int | None = None, group=None):
        from ppsplit import load_stage

        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if self.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.width, self.cuda_graphs = width, cuda_graphs and self.device.type == "cuda"
        header = {"world": self.world, "backend": self.backend, "width": width}
        manifest = {"eos_token_id": list(eos_token_id), "pad_token_id": pad_token_id}
        try:
            if isinstance(source, str):
                with open(os.path.join(source, "manifest.json")) as f:
                    manifest = json.load(f)
                self.stage = load_stage(source, self.rank, self.device)
                fingerprint = plan_fingerprint(source)
            else:  # a stage of an in-process split (split_model), already where it runs
                self.stage = source
                fingerprint = hashlib.sha256(source.meta["ppsplit.plan"].to_json().encode()).hexdigest()[:16]
            plan = self.plan = self.stage.meta["ppsplit.plan"]
            header.update(fingerprint=fingerprint, pp=plan.pp, dtype=plan.dtype, hidden=plan.hidden_size,
                          slots=plan.n_slots, cache=(plan.max_batch, plan.max_len), eos=manifest.get("eos_token_id"))
            if plan.pp != self.world:
                header["error"] = (f"the folder has {plan.pp} stages but {self.world} ranks were launched: launch "
                                   f"one process per stage (--nproc-per-node {plan.pp})")
            elif self.stage.meta.get("ppsplit.stage", self.rank) != self.rank:
                header["error"] = f"rank {self.rank} was given stage {self.stage.meta['ppsplit.stage']}"
        except PpsplitError as e:
            header["error"] = str(e)
        agree(header, group)
        # The tokens go back to rank 0 through a group of their own: NCCL runs the operations of one communicator
        # in order on one stream, so with pp=2 a token receive queued behind the next hidden send (or the next
        # hidden receive queued before a token send) would wait on each other.
        self.back = None
        if self.world > 1:
            if group is not None:
                raise ConfigError("PipelineRank runs a pipeline over the whole world, or over a one-rank group; "
                                  "launch one process per stage instead of passing a larger subgroup")
            self.back = dist.new_group([0, self.world - 1], timeout=datetime.timedelta(seconds=_TIMEOUT[0]))
        self.eos = torch.tensor(manifest.get("eos_token_id") or [], dtype=torch.long, device=self.device)
        pad = manifest.get("pad_token_id")
        self.pad = pad if pad is not None else int(self.eos[0]) if len(self.eos) else 0
        self.dtype = getattr(torch, plan.dtype)
        self.first, self.last = self.rank == 0, self.rank == self.world - 1
        self.received = plan.filled(self.rank - 1) if self.rank else 0
        self.sends = plan.filled(self.rank)
        self.stats = Stats()

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # -- agreement on the job ------------------------------------------------------------------------------------

    def _job(self, prompts, max_new_tokens) -> dict:
        """Rank 0 checks and broadcasts (groups, rows, prompt lengths, new tokens); every rank raises the same."""
        job = None
        if self.first:
            try:
                job = self._check(prompts, max_new_tokens)
            except PpsplitError as e:
                job = {"error": str(e)}
        box = [job]
        dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        job = box[0]
        if "error" in job:
            raise ConfigError(job["error"])
        return job

    def _check(self, prompts, max_new_tokens) -> dict:
        if not prompts:
            raise ConfigError("generate needs at least one group of prompt ids on rank 0")
        rows = {p.shape[0] for p in prompts}
        if len(rows) != 1 or any(p.dim() != 2 or p.shape[1] < 1 for p in prompts):
            raise ConfigError(f"every group must be a [rows, tokens] id tensor with the same rows, but got shapes "
                              f"{[tuple(p.shape) for p in prompts]}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be a positive integer, but got {max_new_tokens!r}")
        lengths = [p.shape[1] for p in prompts]
        rows = rows.pop()
        plan = self.plan
        if max(lengths) + max_new_tokens > plan.max_len:
            raise ConfigError(f"prompt of {max(lengths)} tokens + {max_new_tokens} new ones does not fit the KV cache "
                              f"of {plan.max_len} tokens; compile with a larger --max-len")
        if len(prompts) * rows > plan.max_batch:
            raise ConfigError(f"{len(prompts)} groups of {rows} sequences need {len(prompts) * rows} cache rows, but "
                              f"the folder was compiled with --max-batch {plan.max_batch}")
        return {"rows": rows, "lengths": lengths, "new": max_new_tokens}

    # -- the loop --------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[torch.Tensor] | None = None, max_new_tokens: int | None = None, *,
                 collect_aux: bool = False) -> list[torch.Tensor] | None:
        """Greedy decoding of groups of sequences through the pipeline; a collective call on every rank.

        Rank 0 passes ``prompts`` (one ``[rows, T_g]`` id tensor per group; groups may differ in length) and
        ``max_new_tokens``; other ranks pass nothing. Rank 0 returns one ``[rows, T_g + n]`` tensor per group,
        equal to ``SplitModel.generate`` of that group (a sequence that ended continues with padding; the output
        stops at the step where the whole group has ended). With ``collect_aux`` the last rank returns, per
        group, the aux buffers it saw (``[n_slots, rows, T, H]`` on the CPU, prefill then each decode step).
        """
        job = self._job(prompts, max_new_tokens)
        rows, lengths, new = job["rows"], job["lengths"], job["new"]
        groups = len(lengths)
        stages = decode = group_stages(self.stage, groups, rows)
        if self.cuda_graphs:  # capture before prefill: capture writes the cache at position 0
            from ppsplit import cuda_graph

            pool = torch.cuda.graph_pool_handle()
            decode = [cuda_graph(st, rows, 1, pool=pool) for st in stages]
        items = [(g, lengths[g]) for g in range(groups)] + [(g, 1) for _ in range(new - 1) for g in range(groups)]
        self.stats = stats = Stats()
        dev, H = self.device, self.plan.hidden_size
        t_max = max(lengths)
        # Receive and send buffers, two of each so that item i+1 arrives while item i runs.
        flat = [torch.empty(self.plan.n_slots * rows * t_max * H, dtype=self.dtype, device=dev) for _ in range(2)]
        hidden = [torch.empty(rows * t_max * H, dtype=self.dtype, device=dev) for _ in range(2)]
        pos_in = [torch.empty(t_max, dtype=torch.long, device=dev) for _ in range(2)]
        msgs = [torch.zeros(rows, 1 + self.width, dtype=torch.long, device=dev) for _ in range(groups)]
        pending: list[list] = [[] for _ in range(2)]  # send works still reading buffer set 0 / 1
        msg_works: list = [None] * groups
        prev, nxt = self.rank - 1, (self.rank + 1) % self.world

        def aux_view(slot, T):
            return flat[slot][: self.plan.n_slots * rows * T * H].view(self.plan.n_slots, rows, T, H)

        def post_recv(i):
            slot, T = i % 2, items[i][1]
            self._wait(pending[slot], "send to", nxt, stats)
            pending[slot] = []
            tensors = [pos_in[slot][:T], hidden[slot][: rows * T * H]]
            if self.received:
                tensors.append(aux_view(slot, T)[: self.received])
            return [self._post(dist.irecv, t, prev, "receive from") for t in tensors]

        out: list[list[torch.Tensor]] = [[p.to(dev)] for p in prompts] if self.first else []
        taps: list[list[torch.Tensor]] = [[] for _ in range(groups)]
        starts = [torch.full((1,), lengths[g], dtype=torch.long, device=dev) for g in range(groups)]
        done = [torch.zeros(rows, dtype=torch.bool, device=dev) for _ in range(groups)]
        arange = torch.arange(t_max, device=dev)
        recv = post_recv(0) if not self.first else None
        begin = time.perf_counter()
        for i, (g, T) in enumerate(items):
            slot = i % 2
            if self.first:
                if i < groups:
                    x, positions = out[g][0], arange[:T]
                else:
                    self._wait([msg_works[g]], "receive tokens from", self.world - 1, stats)
                    x = msgs[g][:, 1:1 + T]
                    out[g].append(x.clone())  # before the next message lands in the same buffer
                    positions = starts[g] + arange[:T]
                    starts[g] += msgs[g][0, 0]
                aux = aux_view(slot, T)
                self._wait(pending[slot], "send to", nxt, stats)
                pending[slot] = []
            else:
                self._wait(recv, "receive from", prev, stats)
                x = hidden[slot][: rows * T * H].view(rows, T, H)
                positions, aux = pos_in[slot][:T], aux_view(slot, T)
                if i + 1 < len(items):
                    recv = post_recv(i + 1)
            if self.cuda_graphs and groups == 1 and i:  # the replay rewrites the output the last send reads
                self._wait(pending[(i - 1) % 2], "send to", nxt, stats)
            start = time.perf_counter()
            y, aux = (decode if i >= groups else stages)[g](x, positions, aux)
            stats.compute_s += time.perf_counter() - start
            stats.items += 1
            stats.tokens += rows * T
            if collect_aux and self.last:
                taps[g].append(aux.to("cpu", copy=True))
            if not self.last:
                tensors = [positions, y.contiguous(), aux[: self.sends]]
                pending[slot] = [self._post(dist.isend, t, nxt, "send to") for t in tensors if t.numel()]
                stats.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
                stats.payload_bytes += sum(t.numel() * t.element_size() for t in tensors[1:])
            else:
                self._wait([msg_works[g]], "send tokens to", 0, stats)
                token = y[:, -1].argmax(-1)
                if len(self.eos):
                    token = torch.where(done[g], torch.full_like(token, self.pad), token)
                    done[g] |= torch.isin(token, self.eos)
                msgs[g][:, 0] = 1
                msgs[g][:, 1] = token
                if self.world > 1:
                    msg_works[g] = self._post(dist.isend, msgs[g], 0, "send tokens to", self.back)
                    stats.bytes_sent += msgs[g].numel() * 8
            if self.first:
                if self.world > 1:
                    msg_works[g] = self._post(dist.irecv, msgs[g], self.world - 1, "receive tokens from", self.back)
        for g in range(groups):  # the last message of each group carries its final token
            self._wait([msg_works[g]], "exchange tokens with", self.world - 1 if self.first else 0, stats)
            if self.first:
                out[g].append(msgs[g][:, 1:2].clone())
        for works in pending:
            self._wait(works, "send to", nxt, stats)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        stats.wall_s = time.perf_counter() - begin
        if self.first:
            return [self._trim(torch.cat(o, dim=1).cpu(), lengths[g]) for g, o in enumerate(out)]
        if collect_aux and self.last:
            return [torch.cat(t, dim=2) for t in taps]
        return None

    def _trim(self, ids: torch.Tensor, prompt: int) -> torch.Tensor:
        """Stop at the step where every sequence of the group has emitted an end-of-sequence token."""
        if not len(self.eos):
            return ids
        ended = torch.isin(ids[:, prompt:], self.eos.cpu()).cummax(dim=1).values.all(dim=0)
        hits = ended.nonzero()
        return ids[:, : prompt + int(hits[0]) + 1] if len(hits) else ids

    def _post(self, op, tensor: torch.Tensor, peer: int, what: str, group=None):
        try:
            return op(tensor, self._global(peer), group=group or self.group)
        except Exception as e:  # posting on a connection that is already gone fails at once
            raise self._lost(e, what, peer) from None

    def _wait(self, works, what: str, peer: int, stats: Stats) -> None:
        start = time.perf_counter()
        for w in works:
            if w is None:
                continue
            try:
                w.wait()
            except Exception as e:  # gloo raises RuntimeError, NCCL DistBackendError; both mean the peer is gone
                raise self._lost(e, what, peer) from None
        stats.wait_s += time.perf_counter() - start

    def _lost(self, error: Exception, what: str, peer: int) -> PipelineError:
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0][:160]  # gloo: "[file:line] What [addr]. Hint"
        cause = "stalled past the timeout" if "timed out" in text.lower() or "timeout" in text.lower() \
            else "died or closed its connection"
        message = f"rank {self.rank}: could not {what} rank {peer}: rank {peer} {cause} ({text})"
        first = _first_failure(message)
        if first != message:
            message += f"; first failure reported: {first}"
        return PipelineError(message)


def _first_failure(message: str) -> str:
    """Record ``message`` in the rendezvous store unless another rank did first; return the first one.

    A rank two hops from a dead one only sees its neighbour leave; the first report names the rank that died.
    """
    from torch.distributed.distributed_c10d import _get_default_store  # the one internal name used here

    try:
        store = _get_default_store()
        store.set_timeout(datetime.timedelta(seconds=2))  # the store's host may be gone too
        first = store.compare_set("ppsplit/first_failure", "", message)
        return first.decode() if isinstance(first, bytes) else str(first)
    except Exception:  # no store (or it died with its host): report what this rank saw
        return message


def for_pipelining(stage: fx.GraphModule) -> fx.GraphModule:
    """``stage`` with its inputs ordered ``(x, aux, positions)`` for ``torch.distributed.pipelining``.

    A pipelining stage receives the previous stage's outputs ``(y, aux)`` as its leading positional arguments and
    the ``step(...)`` keywords after them, so ``positions`` must come last; and its transport sends contiguous
    tensors, so the returned aux is made contiguous (a copy only for a microbatch slice on the first stage).
    Same graph otherwise, same parameters and cache buffers (shared, not copied), same outputs.

    Example::

        pipe = PipelineStage(for_pipelining(stage), rank, pp, device)
        schedule = ScheduleGPipe(pipe, n_microbatches, args_chunk_spec=(TensorChunkSpec(0), TensorChunkSpec(1)),
                                 kwargs_chunk_spec={"positions": _Replicate()},
                                 output_merge_spec=(TensorChunkSpec(0), TensorChunkSpec(1)))
        schedule.step(ids, aux, positions=positions)      # rank 0; the others: schedule.step(positions=positions)
    """
    graph = fx.Graph()
    graph.output(graph.graph_copy(stage.graph, {}))
    x, positions, aux = [n for n in graph.nodes if n.op == "placeholder"]
    aux.append(positions)  # placeholder order is the forward signature
    # A microbatch of aux is a slice along dim 1 (batch), not contiguous when there are 2+ slots; the transport
    # sends contiguous tensors only. No copy when it already is (every stage after the first).
    output = graph.output_node()
    y_out, aux_out = output.args[0]
    with graph.inserting_before(output):
        dense = graph.call_method("contiguous", (aux_out,))
    output.args = ((y_out, dense),)
    graph.lint()
    out = fx.GraphModule(stage, graph, class_name=type(stage).__name__)
    out.meta.update(stage.meta)
    return out
