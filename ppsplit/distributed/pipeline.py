"""Multi-process pipeline: one rank per stage over ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

Rank ``k`` loads only stage ``k`` of a ``ppsplit compile`` folder. Per step it receives ``positions``, the hidden
state and the aux prefix ``aux[:plan.filled(k - 1)]`` from rank ``k - 1`` straight into the prefix of its own
full-size aux buffer (relaying costs no copy), runs the stage, and sends ``positions``, its hidden state and
``aux[:plan.filled(k)]`` to rank ``k + 1``. The last rank picks the next tokens and sends them back to rank 0 in
a fixed-width message ``[rows, 1 + width]`` (column 0: how many tokens follow; greedy sends 1), so every rank
posts the same size whatever was accepted. Speculative decoding (``generate(..., num_draft_tokens=K)``) keeps the
EAGLE-3 drafter on the last rank, which sends rank 0 the next ``K + 1`` tokens to verify in ``[rows, 2 + K + 1]``
(count, position, tokens; count 0 ends the group); see ``PipelineRank._speculate``.

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
import os
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx

from ppsplit.artifact.folder import CompiledFolder
from ppsplit.artifact.folder import fingerprint as plan_fingerprint
from ppsplit.artifact.loader import load_stage
from ppsplit.core.errors import ConfigError, PpsplitError
from ppsplit.core.fx_utils import is_cache_buffer
from ppsplit.core.tensors import model_dtype

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
    payload_bytes: int = 0  # hidden (+ values carried beside it) + aux prefix: the minimum that must cross


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
                 cuda_graphs: bool = False, eos_token_id=(), pad_token_id: int | None = None, group=None,
                 drafter=None):
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
            folder = None
            if isinstance(source, str):
                folder = CompiledFolder(source)
                manifest = {"eos_token_id": list(folder.manifest.eos_token_id),
                            "pad_token_id": folder.manifest.pad_token_id}
                self.stage = load_stage(folder, self.rank, self.device)
                fingerprint = folder.fingerprint
            else:  # a stage of an in-process split (split_model), already where it runs
                self.stage = source
                fingerprint = plan_fingerprint(source.meta["ppsplit.plan"].to_json())
            plan = self.plan = self.stage.meta["ppsplit.plan"]
            header.update(fingerprint=fingerprint, pp=plan.pp, dtype=plan.dtype, hidden=plan.hidden_size,
                          slots=plan.n_slots, cache=(plan.max_batch, plan.max_len), eos=manifest.get("eos_token_id"))
            self.drafter = drafter
            if drafter is None and folder is not None and folder.drafter is not None and self.rank == self.world - 1:
                from ppsplit.eagle3.formats import load_folder_drafter

                self.drafter = load_folder_drafter(folder.drafter, plan, self.device)
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
        self.dtype = model_dtype(plan)
        self.first, self.last = self.rank == 0, self.rank == self.world - 1
        self.received = plan.filled(self.rank - 1) if self.rank else 0
        self.sends = plan.filled(self.rank)
        self.x_width = plan.width(self.rank)  # the hidden state, and any values carried beside it
        self.stats = Stats()
        self.spec_stats: list = []
        self._warm: set = set()
        self._arange = torch.arange(plan.max_len, device=self.device)
        self._connect()

    def _connect(self) -> None:
        """Open every connection the loop uses now, with one small transfer each, in pipeline order. NCCL creates
        a communicator on the first transfer between two ranks and blocks the host until the peer joins; blocked
        there mid-loop, a rank can deadlock with a peer whose GPU waits on a transfer from it."""
        if self.world == 1:
            return
        probe, stats = torch.zeros(1, device=self.device), Stats()
        if not self.first:
            self._wait([self._post(dist.irecv, probe, self.rank - 1, "receive from")], "receive from",
                       self.rank - 1, stats)
        if not self.last:
            self._wait([self._post(dist.isend, probe, self.rank + 1, "send to")], "send to", self.rank + 1, stats)
        if self.first:
            self._wait([self._post(dist.irecv, probe, self.world - 1, "receive tokens from", self.back)],
                       "receive tokens from", self.world - 1, stats)
        elif self.last:
            self._wait([self._post(dist.isend, probe, 0, "send tokens to", self.back)], "send tokens to", 0, stats)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _warm_up(self, stage, rows: int, lengths, extra=None) -> None:
        """Run ``stage`` once per token count in ``lengths`` (and ``extra()``, the loop's other device work) before
        any transfer is pending. CUDA loads a kernel at its first launch (lazy loading; Triton compiles and loads at
        its first call), and a load can wait for the device to go idle: with a receive pending there that waits on
        a peer, which waits on this rank, it never does (seen on two H200s under NCCL, at the first prefill)."""
        if self.device.type != "cuda":
            return
        plan, dev = self.plan, self.device
        for T in sorted(set(lengths)):
            if (rows, T) in self._warm:
                continue
            x = torch.zeros(rows, T, dtype=torch.long, device=dev) if self.first else \
                torch.zeros(rows, T, self.x_width, dtype=self.dtype, device=dev)
            aux = torch.zeros(plan.n_slots, rows, T, plan.hidden_size, dtype=self.dtype, device=dev)
            y, aux = stage(x, self._arange[:T], aux)
            y.contiguous()
            if self.last:
                self._next_tokens(y, torch.zeros(rows, dtype=torch.bool, device=dev))
            self._warm.add((rows, T))
        if extra is not None:
            extra()
        torch.cuda.synchronize(dev)

    def _next_tokens(self, y: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """Greedy tokens from the last stage's logits; a sequence that ended gets padding (``done`` is updated)."""
        token = y[:, -1].argmax(-1)
        if len(self.eos):
            token = torch.where(done, torch.full_like(token, self.pad), token)
            done |= torch.isin(token, self.eos)
        return token

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # -- agreement on the job ------------------------------------------------------------------------------------

    def _job(self, prompts, max_new_tokens, spec: dict | None = None) -> dict:
        """Rank 0 checks and broadcasts (groups, rows, prompt lengths, new tokens, and for speculative decoding K,
        temperature, seed and the prompts themselves); every rank raises the same error."""
        job = None
        if self.first:
            try:
                job = self._check(prompts, max_new_tokens, spec)
            except PpsplitError as e:
                job = {"error": str(e)}
        box = [job]
        dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        job = box[0]
        if "error" in job:
            raise ConfigError(job["error"])
        return job

    def _check(self, prompts, max_new_tokens, spec: dict | None = None) -> dict:
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
        k = 0
        if spec is not None:
            k = spec["k"]
            if k is None:
                raise ConfigError("return_stats reports speculative decoding: pass num_draft_tokens too")
            from ppsplit.eagle3.speculative import check_speculation

            check_speculation(plan, k)
            if not isinstance(spec["temperature"], (int, float)) or spec["temperature"] < 0:
                raise ConfigError(f"temperature must be a number >= 0, but got {spec['temperature']!r}")
        if max(lengths) + max_new_tokens + k > plan.max_len:
            extra = f" + {k} draft positions" if k else ""
            raise ConfigError(f"prompt of {max(lengths)} tokens + {max_new_tokens} new ones{extra} does not fit the "
                              f"KV cache of {plan.max_len} tokens; compile with a larger --max-len")
        if len(prompts) * rows > plan.max_batch:
            raise ConfigError(f"{len(prompts)} groups of {rows} sequences need {len(prompts) * rows} cache rows, but "
                              f"the folder was compiled with --max-batch {plan.max_batch}")
        job = {"rows": rows, "lengths": lengths, "new": max_new_tokens}
        if spec is not None:  # the last rank runs the speculative loop: it needs the prompts (a few ids)
            job.update(spec, prompts=[p.detach().to("cpu", torch.long) for p in prompts])
        return job

    # -- the loop --------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[torch.Tensor] | None = None, max_new_tokens: int | None = None, *,
                 collect_aux: bool = False, num_draft_tokens: int | None = None, temperature: float = 0.0,
                 seed: int = 0, return_stats: bool = False):
        """Greedy (or speculative) decoding of groups of sequences through the pipeline; a collective call on
        every rank.

        Rank 0 passes ``prompts`` (one ``[rows, T_g]`` id tensor per group; groups may differ in length) and
        ``max_new_tokens``; other ranks pass nothing. Rank 0 returns one ``[rows, T_g + n]`` tensor per group,
        equal to ``SplitModel.generate`` of that group (a sequence that ended continues with padding; the output
        stops at the step where the whole group has ended). With ``collect_aux`` the last rank returns, per
        group, the aux buffers it saw (``[n_slots, rows, T, H]`` on the CPU, prefill then each decode step).

        With ``num_draft_tokens=K`` (rank 0 decides; the last rank needs a drafter: ``PipelineRank(...,
        drafter=d)`` or a folder compiled with ``--drafter``): EAGLE-3 speculative decoding, equal to
        ``SplitModel.generate(ids, n, drafter=d, num_draft_tokens=K)`` per group, greedy or sampled at
        ``temperature`` (group ``g`` samples from ``torch.Generator().manual_seed(seed + g)`` on the last rank's
        device). The drafter runs on the last rank, which sends rank 0 the next ``K + 1`` tokens to verify (the
        last committed token and the drafts) in a fixed-width message ``[rows, 2 + K + 1]`` (count, position,
        tokens), or a count of 0 when the group is done. ``return_stats``: rank 0 returns ``(ids, stats)``, one
        ``SpeculativeStats`` per group (also in ``self.spec_stats`` on every rank).
        """
        spec = None
        if self.first and (num_draft_tokens is not None or return_stats):
            spec = {"k": num_draft_tokens, "temperature": temperature, "seed": seed}
        job = self._job(prompts, max_new_tokens, spec)
        if "k" in job:
            outs, stats = self._speculate(job, collect_aux)
            return (outs, stats) if self.first and return_stats else outs if self.first else None
        rows, lengths, new = job["rows"], job["lengths"], job["new"]
        groups = len(lengths)
        stages = decode = group_stages(self.stage, groups, rows)
        if self.cuda_graphs:  # capture before prefill: capture writes the cache at position 0
            from ppsplit.serve.cuda_graphs import cuda_graph

            pool = torch.cuda.graph_pool_handle()
            decode = [cuda_graph(st, rows, 1, pool=pool) for st in stages]
        items = [(g, lengths[g]) for g in range(groups)] + [(g, 1) for _ in range(new - 1) for g in range(groups)]
        self._warm_up(stages[0], rows, lengths if self.cuda_graphs else lengths + [1], lambda: self._greedy_ops(rows))
        self.stats = stats = Stats()
        dev, H, W = self.device, self.plan.hidden_size, self.x_width
        t_max = max(lengths)
        # Receive and send buffers, two of each so that item i+1 arrives while item i runs.
        flat = [torch.empty(self.plan.n_slots * rows * t_max * H, dtype=self.dtype, device=dev) for _ in range(2)]
        hidden = [torch.empty(rows * t_max * W, dtype=self.dtype, device=dev) for _ in range(2)]
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
            tensors = [pos_in[slot][:T], hidden[slot][: rows * T * W]]
            if self.received:
                tensors.append(aux_view(slot, T)[: self.received])
            return [self._post(dist.irecv, t, prev, "receive from") for t in tensors]

        out: list[list[torch.Tensor]] = [[p.to(dev)] for p in prompts] if self.first else []
        taps: list[list[torch.Tensor]] = [[] for _ in range(groups)]
        starts = [torch.full((1,), lengths[g], dtype=torch.long, device=dev) for g in range(groups)]
        done = [torch.zeros(rows, dtype=torch.bool, device=dev) for _ in range(groups)]
        arange = self._arange
        recv = post_recv(0) if not self.first else None
        begin = time.perf_counter()
        for i, (g, T) in enumerate(items):
            slot = i % 2
            if self.first:
                if i < groups:
                    x, positions = out[g][0], arange[:T]
                else:
                    self._wait([msg_works[g]], "receive tokens from", self.world - 1, stats)
                    x, kept, positions = self._greedy_input(msgs[g], starts[g], T)
                    out[g].append(kept)
                aux = aux_view(slot, T)
                self._wait(pending[slot], "send to", nxt, stats)
                pending[slot] = []
            else:
                self._wait(recv, "receive from", prev, stats)
                x = hidden[slot][: rows * T * W].view(rows, T, W)
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
                self._greedy_message(msgs[g], self._next_tokens(y, done[g]))
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

    # -- speculative decoding ------------------------------------------------------------------------------------

    def _speculate(self, job: dict, collect_aux: bool):
        """The speculative loop (see ``generate``). Items are group passes: every group's prefill, then one
        ``K + 1``-token verify pass per step, round-robin over the groups still decoding. Each item carries a
        control message ``[group, T, start, run]`` ahead of its tensors; ``run = 0`` ends a group on every rank.
        Returns ``(outputs, stats)`` per group on every rank (the last rank's, broadcast at the end)."""
        from ppsplit.eagle3 import speculative

        k, temperature = job["k"], float(job["temperature"])
        rows, lengths, new = job["rows"], job["lengths"], job["new"]
        groups, width = len(lengths), k + 1
        plan, dev, H = self.plan, self.device, self.plan.hidden_size
        self._agree_on_drafter(collect_aux)
        stages = group_stages(self.stage, groups, rows)
        pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        verify = stages
        if self.cuda_graphs:  # capture before prefill: capture writes the cache at positions 0..K
            from ppsplit.serve.cuda_graphs import cuda_graph

            verify = [cuda_graph(st, rows, width, pool=pool) for st in stages]

        def instance(g, T):  # a captured verify pass also serves a prefill of K + 1 tokens (positions are inputs)
            return verify[g] if T == width else stages[g]

        drafter, use, restore = self._drafter_groups(groups, rows, max(lengths) + new + k, k, temperature, pool)
        eos = tuple(self.eos.tolist())
        loops, results = {}, {}
        if self.last:
            for g, prompt in enumerate(job["prompts"]):
                gen = torch.Generator(device=dev).manual_seed(job["seed"] + g)
                loops[g] = speculative.steps(prompt.to(dev), new, drafter, k, temperature, gen, eos_token_id=eos,
                                             pad_token_id=self.pad)
                next(loops[g])  # its prefill request: rank 0 runs the prefill from its own copy of the prompt

        def dummy_run():  # the loop's device work on scratch data, for _warm_up
            if self.first:
                self._spec_read(torch.zeros(rows, 2 + width, dtype=torch.long, device=dev))
            if not self.last:
                return
            self._spec_message(torch.zeros(rows, 2 + width, dtype=torch.long, device=dev),
                               torch.zeros(rows, width, dtype=torch.long, device=dev), 0)
            use(0)

            def forward(ids, positions):
                T = ids.shape[1]
                x = ids if self.first else torch.zeros(rows, T, self.x_width, dtype=self.dtype, device=dev)
                return instance(0, T)(x, positions, torch.zeros(plan.n_slots, rows, T, H, dtype=self.dtype, device=dev))
            prompt = torch.zeros(rows, min(lengths), dtype=torch.long, device=dev)
            scratch = torch.Generator(device=dev).manual_seed(0)
            speculative.decode(forward, prompt, 2, drafter, k, temperature, scratch)  # a verify pass for sure
            speculative.decode(forward, prompt, 1, drafter, k, temperature, scratch, eos_token_id=eos or (0,),
                               pad_token_id=self.pad)

        self._warm_up(stages[0], rows, lengths if self.cuda_graphs else lengths + [width], dummy_run)
        self.stats = stats = Stats()
        begin = time.perf_counter()
        try:
            if self.world == 1:
                self._speculate_alone(job, loops, results, instance, use, rows, H)
            else:
                self._speculate_pipelined(job, loops, results, instance, use, rows, width, stats)
        finally:
            restore()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        stats.wall_s = time.perf_counter() - begin
        payload = None
        if self.last:
            payload = ([results[g][0].cpu() for g in range(groups)], [results[g][1] for g in range(groups)])
        if self.world > 1:
            box = [payload]
            dist.broadcast_object_list(box, src=self._global(self.world - 1), group=self.group)
            payload = box[0]
        self.spec_stats = payload[1]
        return payload

    def _agree_on_drafter(self, collect_aux: bool) -> None:
        """The last rank needs a drafter that reads this split's taps, and no rank may ask for greedy-only output;
        every rank raises the same error if not."""
        problem = "collect_aux is for greedy decoding; drop it or num_draft_tokens" if collect_aux else None
        if self.last and problem is None:
            from ppsplit.eagle3.speculative import check_speculation

            if self.drafter is None:
                problem = ("speculative decoding needs an EAGLE-3 drafter on the last rank: compile the folder with "
                           "--drafter, or pass PipelineRank(..., drafter=ppsplit.load_drafter(...)) there")
            else:
                try:
                    check_speculation(self.plan, 1, self.drafter)
                except ConfigError as e:
                    problem = str(e)
        if self.world > 1:
            box: list = [None] * self.world
            dist.all_gather_object(box, problem, group=self.group)
            problem = next((p for p in box if p), None)
        if problem:
            raise ConfigError(problem)

    def _drafter_groups(self, groups: int, rows: int, needed: int, k: int, temperature: float, pool):
        """On the last rank: the drafter, ``use(g)`` that points its KV cache at group ``g``'s rows (and its captured
        draft at ``g``'s graph), and ``restore()``. Elsewhere: no-ops."""
        d = self.drafter
        if not self.last:
            return None, lambda g: None, lambda: None
        if d.cache_keys is None or d.cache_keys.shape[0] < groups * rows or d.cache_keys.shape[2] < needed:
            d.allocate_cache(max(self.plan.max_batch, groups * rows), max(self.plan.max_len, needed))
        keys, values, graphs = d.cache_keys, d.cache_values, d.graphs
        states = [(keys[g * rows:(g + 1) * rows], values[g * rows:(g + 1) * rows], {}) for g in range(groups)]

        def use(g):
            d.cache_keys, d.cache_values, d.graphs = states[g]

        def restore():
            d.cache_keys, d.cache_values, d.graphs = keys, values, graphs
        if self.cuda_graphs and temperature <= 0:
            for g in range(groups):
                use(g)
                d.capture(rows, k, pool=pool)
        return d, use, restore

    def _speculate_alone(self, job, loops, results, instance, use, rows: int, H: int) -> None:
        """One rank holds the whole model: each group's loop runs its passes here, one group after another."""
        plan = self.plan
        for g, loop in loops.items():
            use(g)
            ids, start = job["prompts"][g].to(self.device), 0
            while True:
                T = ids.shape[1]
                aux = torch.zeros(plan.n_slots, rows, T, H, dtype=self.dtype, device=self.device)
                y, aux = instance(g, T)(ids, self._arange[start:start + T], aux)
                try:
                    ids, start = loop.send((y, aux))
                except StopIteration as done:
                    results[g] = done.value
                    break

    def _speculate_pipelined(self, job, loops, results, instance, use, rows: int, width: int, stats: Stats):
        from collections import deque

        plan, dev, H, W = self.plan, self.device, self.plan.hidden_size, self.x_width
        groups = len(job["lengths"])
        t_max = max(max(job["lengths"]), width)
        flat = [torch.empty(plan.n_slots * rows * t_max * H, dtype=self.dtype, device=dev) for _ in range(2)]
        hidden = [torch.empty(rows * t_max * W, dtype=self.dtype, device=dev) for _ in range(2)]
        ctrl_in = [torch.zeros(4, dtype=torch.long, device=dev) for _ in range(2)]
        msgs = [torch.zeros(rows, 2 + width, dtype=torch.long, device=dev) for _ in range(groups)]
        pending: list[list] = [[] for _ in range(2)]  # send works still reading buffer set 0 / 1
        msg_works: list = [None] * groups
        prev, nxt, last = self.rank - 1, self.rank + 1, self.world - 1
        item = 0  # items run here so far; item i uses buffer set i % 2

        def aux_view(slot, T):
            return flat[slot][: plan.n_slots * rows * T * H].view(plan.n_slots, rows, T, H)

        def free(slot):
            self._wait(pending[slot], "send to", nxt, stats)
            pending[slot] = []

        def forward(slot, g, T, start, x, aux, ctrl):
            """Run item (g, T, start) here and send it on (not on the last rank)."""
            positions = self._arange[start:start + T]
            t0 = time.perf_counter()
            y, aux = instance(g, T)(x, positions, aux)
            stats.compute_s += time.perf_counter() - t0
            stats.items += 1
            stats.tokens += rows * T
            if not self.last:
                tensors = [ctrl, y.contiguous(), aux[: self.sends]]
                pending[slot] = [self._post(dist.isend, t, nxt, "send to") for t in tensors if t.numel()]
                stats.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
                stats.payload_bytes += sum(t.numel() * t.element_size() for t in tensors[1:])
            return y, aux

        def stop_downstream(slot, ctrl):
            if not self.last:
                pending[slot] = [self._post(dist.isend, ctrl, nxt, "send to")]
                stats.bytes_sent += ctrl.numel() * 8

        if self.first:
            order = deque()
            for g in range(groups):
                slot, item = item % 2, item + 1
                free(slot)
                ids = job["prompts"][g].to(dev)
                ctrl = torch.tensor([g, ids.shape[1], 0, 1], device=dev)
                forward(slot, g, ids.shape[1], 0, ids, aux_view(slot, ids.shape[1]), ctrl)
                msg_works[g] = self._post(dist.irecv, msgs[g], last, "receive tokens from", self.back)
                order.append(g)
            while order:
                g = order.popleft()
                self._wait([msg_works[g]], "receive tokens from", last, stats)
                msg_works[g] = None  # waited: a gloo receive waited twice waits for a second message
                T, start, ids = self._spec_read(msgs[g])
                slot, item = item % 2, item + 1
                free(slot)
                if T == 0:
                    stop_downstream(slot, torch.tensor([g, 0, 0, 0], device=dev))
                    continue
                forward(slot, g, T, start, ids, aux_view(slot, T), torch.tensor([g, T, start, 1], device=dev))
                msg_works[g] = self._post(dist.irecv, msgs[g], last, "receive tokens from", self.back)
                order.append(g)
        else:
            stopped = 0
            while stopped < groups:
                slot, item = item % 2, item + 1
                free(slot)
                ctrl = ctrl_in[slot]
                self._wait([self._post(dist.irecv, ctrl, prev, "receive from")], "receive from", prev, stats)
                g, T, start, run = ctrl.tolist()
                if not run:
                    stopped += 1
                    stop_downstream(slot, ctrl)
                    continue
                tensors = [hidden[slot][: rows * T * W]]
                if self.received:
                    tensors.append(aux_view(slot, T)[: self.received])
                self._wait([self._post(dist.irecv, t, prev, "receive from") for t in tensors], "receive from", prev,
                           stats)
                x = hidden[slot][: rows * T * W].view(rows, T, W)
                y, aux = forward(slot, g, T, start, x, aux_view(slot, T), ctrl)
                if not self.last:
                    continue
                use(g)
                try:
                    ids, start = loops[g].send((y, aux))
                except StopIteration as done:
                    results[g] = done.value
                    ids = None
                self._wait([msg_works[g]], "send tokens to", 0, stats)
                self._spec_message(msgs[g], ids, start)
                msg_works[g] = self._post(dist.isend, msgs[g], 0, "send tokens to", self.back)
                stats.bytes_sent += msgs[g].numel() * 8
        for slot in range(2):
            free(slot)
        # Rank 0 waited every message it read; the last rank's final messages may still be in flight.
        self._wait([w for w in msg_works if w is not None], "send tokens to", 0, stats)

    def _spec_read(self, msg: torch.Tensor):
        """Rank 0: ``(T, start, ids [rows, T])`` of the last rank's message (T = 0: the group is done)."""
        T, start = msg[0, :2].tolist()
        return T, start, msg[:, 2:2 + T].clone()

    @staticmethod
    def _spec_message(msg: torch.Tensor, ids: torch.Tensor | None, start: int) -> None:
        """Last rank: the next pass of a group, ``ids [rows, T]`` at ``start``, or ``None``: the group is done."""
        if ids is None:
            msg[:, 0] = 0
            return
        msg[:, 0] = ids.shape[1]
        msg[:, 1] = start
        msg[:, 2:2 + ids.shape[1]] = ids

    def _greedy_input(self, msg: torch.Tensor, start: torch.Tensor, T: int):
        """Rank 0: the tokens of the last rank's message, a copy to keep (the next message lands in the same
        buffer) and their positions; advances ``start`` by the count the message carries."""
        x = msg[:, 1:1 + T]
        positions = start + self._arange[:T]
        start += msg[0, 0]
        return x, x.clone(), positions

    @staticmethod
    def _greedy_message(msg: torch.Tensor, token: torch.Tensor) -> None:
        msg[:, 0] = 1
        msg[:, 1] = token

    def _greedy_ops(self, rows: int) -> None:
        """The loop's small device ops on scratch tensors (``_warm_up``'s ``extra``)."""
        msg = torch.zeros(rows, 1 + self.width, dtype=torch.long, device=self.device)
        if self.first:
            self._greedy_input(msg, torch.zeros(1, dtype=torch.long, device=self.device), 1)
        if self.last:
            self._greedy_message(msg, msg[:, 1].clone())

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
