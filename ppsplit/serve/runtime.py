"""Driver: the in-process runtime. A ``SplitModel`` runs its stages in order, optionally stage ``k`` on device ``k``."""
from __future__ import annotations

from typing import Sequence

import torch

from ppsplit.artifact.folder import CompiledFolder
from ppsplit.artifact.loader import build_stage, check_device, stage_options
from ppsplit.serve.cuda_graphs import CapturedStage
from ppsplit.core.errors import ConfigError
from ppsplit.core.fx_utils import is_cache_buffer
from ppsplit.core.plan import SplitPlan
from ppsplit.core.ragged import CacheLayout, RaggedStep
from ppsplit.core.tensors import model_dtype, module_device, new_aux

_INDEX_DTYPES = (torch.int64, torch.int32)


class SplitModel(torch.nn.Module):
    """The stages of one split, with the plan that made them.

    Example::

        split = split_model(model, pp=4, aux="eagle3")
        logits, aux = split(input_ids)                 # runs stage 0, 1, 2, 3 in order
        features = split.drafter_inputs(aux)           # [B, T, 3 * H], the EAGLE-3 input
    """

    def __init__(self, plan: SplitPlan, stages: Sequence[torch.nn.Module], *,
                 eos_token_id: Sequence[int] = (), pad_token_id: int | None = None):
        super().__init__()
        self.plan = plan
        self.stages = torch.nn.ModuleList(stages)
        self.eos_token_id = tuple(eos_token_id)
        self.pad_token_id = pad_token_id
        self.graphs: dict[tuple[int, int], list] = {}  # (batch, tokens) -> one CapturedStage per stage; paged: (0, N)
        self.layout = CacheLayout.of(plan) if plan.paged else None
        self.drafter = None  # an Eagle3Drafter on the last stage: load() attaches a folder's, or set it yourself

    @property
    def dtype(self) -> torch.dtype:
        return model_dtype(self.plan)

    def place(self, devices: Sequence[torch.device | str]) -> "SplitModel":
        """Move stage ``k`` to ``devices[k]``; ``__call__`` then moves the hidden state and the aux prefix."""
        if len(devices) != self.plan.pp:
            raise ValueError(f"place needs one device per stage ({self.plan.pp}), got {len(devices)}")
        for stage, dev in zip(self.stages, devices):
            _move(stage, torch.device(dev))
        return self

    def new_aux(self, batch: int, tokens: int, device: torch.device | str | None = None) -> torch.Tensor:
        """An uninitialised packed buffer ``[n_slots, batch, tokens, H]``; every slot is written by its owner."""
        return new_aux(self.plan, batch, tokens, device if device is not None else module_device(self.stages[0]))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, *, check: bool = True):
        """Run all stages: ``(input_ids [B, T], positions [T]) -> (logits [B, T, V], aux [n_slots, B, T, H])``.

        The inputs are checked first (shapes, dtypes, and that batch and positions fit the KV cache: one host read
        of ``positions``); ``check=False`` skips that, for loops that know their positions are in range. With a
        paged cache this is a ragged step in which row ``b`` is sequence slot ``b`` (``step`` runs any other)."""
        if positions is None and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        if check:
            self.check_inputs(input_ids, positions)
        batch, tokens = input_ids.shape
        if self.layout is not None:
            step = RaggedStep.lockstep(batch, tokens, int(positions[0]), self.layout)
            logits, aux = self.step(input_ids.reshape(-1), step)
            return logits.view(batch, tokens, -1), aux.view(aux.shape[0], batch, tokens, self.plan.hidden_size)
        captured = self.graphs.get((batch, tokens))
        x, aux = input_ids, None
        for k, stage in enumerate(self.stages):
            dev = module_device(stage)
            if captured is not None:
                stage = captured[k]
            if aux is None:
                aux = self.new_aux(batch, tokens, dev)
            elif aux.device != dev:
                # The receiver owns a full-size buffer and receives the filled prefix into it.
                moved = self.new_aux(batch, tokens, dev)
                filled = self.plan.filled(k - 1)
                moved[:filled].copy_(aux[:filled])
                aux = moved
            x, aux = stage(x.to(dev), positions.to(dev), aux)
        return x, aux

    def step(self, tokens: torch.Tensor, step: RaggedStep):
        """One ragged step through every stage: ``tokens [N]`` (ids) at ``step``'s positions, sequences and blocks
        -> ``(logits [N, V], aux [n_slots, N, H])``. ``step`` is checked when it is built (``RaggedStep.build``)."""
        if self.layout is None:
            raise ConfigError("ragged steps need a paged cache" + (f"; this split keeps a lockstep cache because "
                              f"{self.plan.lockstep_reason}" if self.plan.lockstep_reason else
                              ": split with cache=CacheConfig(batch_size, max_len)"))
        if tokens.dim() != 1 or tokens.shape[0] != step.num_tokens:
            raise ConfigError(f"a step of {step.num_tokens} tokens takes ids [{step.num_tokens}], but got "
                              f"{list(tokens.shape)}")
        n = step.num_tokens
        captured = self.graphs.get((0, n))
        x, aux, on = tokens, None, {}
        for k, stage in enumerate(self.stages):
            dev = module_device(stage)
            meta = on.setdefault(dev, step if step.device == dev else step.to(dev, non_blocking=True))
            if captured is not None:
                stage = captured[k]
            if aux is None:
                aux = new_aux(self.plan, 1, n, dev)[:, 0]
            elif aux.device != dev:
                moved = new_aux(self.plan, 1, n, dev)[:, 0]
                filled = self.plan.filled(k - 1)
                moved[:filled].copy_(aux[:filled])
                aux = moved
            x, aux = stage(x.to(dev), meta.positions, aux, *meta.tensors()[1:])
        return x, aux

    def check_inputs(self, input_ids, positions) -> None:
        """Raise a ``ConfigError`` naming the problem if ``(input_ids, positions)`` cannot run through the stages."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in _INDEX_DTYPES:
            what = (f"a {input_ids.dim()}-D {input_ids.dtype} tensor of shape {tuple(input_ids.shape)}"
                    if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__)
            raise ConfigError(f"input_ids must be a 2-D integer tensor [batch, tokens] of token ids, but got {what}; "
                              "for one sequence use ids[None]")
        batch, tokens = input_ids.shape
        if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.dtype not in _INDEX_DTYPES \
                or positions.shape[0] != tokens:
            what = (f"a {positions.dim()}-D {positions.dtype} tensor of shape {tuple(positions.shape)}"
                    if isinstance(positions, torch.Tensor) else type(positions).__name__)
            raise ConfigError(f"positions must be a 1-D integer tensor with one cache position per token ({tokens}), "
                              f"but got {what}")
        if not self.plan.max_len:
            return
        if batch > self.plan.max_batch:
            raise ConfigError(f"batch {batch} does not fit the KV cache of {self.plan.max_batch} sequences; split "
                              f"with CacheConfig(batch_size>={batch}, ...) or send at most {self.plan.max_batch}")
        lo, hi = (int(v) for v in torch.stack([positions.min(), positions.max()]).tolist())
        if self.layout is not None and hi - lo + 1 != tokens:
            raise ConfigError(f"positions must be consecutive ({lo} to {lo + tokens - 1} for {tokens} tokens), but got "
                              f"{lo} to {hi}; a step of other positions is a ragged step (SplitModel.step)")
        if lo < 0 or hi >= self.plan.max_len:
            raise ConfigError(f"positions {lo}..{hi} do not fit the KV cache of {self.plan.max_len} tokens (positions "
                              f"0 to {self.plan.max_len - 1}); split with a larger CacheConfig(max_len=...)")

    def capture(self, batch: int, tokens: Sequence[int]) -> "SplitModel":
        """Capture every stage as a CUDA graph for each token count (e.g. ``[prompt, 1, K + 1]``); calls whose
        ``(batch, tokens)`` match a bucket then replay graphs. Buckets share each stage's KV cache and one
        memory pool. A lockstep cache: capture before the cache holds live sequences (capture writes it). A paged
        cache: a bucket is a step of ``batch * tokens`` tokens (``batch=0``: of ``tokens``), which any ragged step
        of at most that many tokens is padded to (``step``, the engine); capturing writes no cache entry."""
        for k, stage in enumerate(self.stages):
            if module_device(stage).type != "cuda":
                raise ConfigError(f"capture needs CUDA: stage {k} is on {module_device(stage)}"
                                  + ("" if torch.cuda.is_available() else " and this machine has no CUDA GPU")
                                  + "; place the stages on GPUs first (split.place([...]) or load(folder, devices))")
        pool = torch.cuda.graph_pool_handle()
        for t in tokens:
            key = (0, (batch or 1) * t) if self.layout is not None else (batch, t)
            self.graphs[key] = [CapturedStage(stage, *key, pool=pool) for stage in self.stages]
        return self

    def drafter_inputs(self, aux: torch.Tensor) -> torch.Tensor:
        """The EAGLE-3 input ``[B, T, n_slots * H]``: the taps concatenated along hidden, ascending tap id."""
        n, batch, tokens, hidden = aux.shape
        return aux.permute(1, 2, 0, 3).reshape(batch, tokens, n * hidden)

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, *, drafter=None, num_draft_tokens: int = 4,
                 temperature: float = 0.0, generator: torch.Generator | None = None, return_stats: bool = False,
                 seed: int | None = None, enforce_eager: bool = False):
        """Decoding through the engine (``ppsplit.serve.engine``), greedy or sampled at ``temperature`` (sequence
        ``b`` seeded ``seed + b``; default: ``generator``'s initial seed, else 0). ``input_ids``: a ``[B, T]``
        tensor, or a list of prompts of any lengths (1-D tensors or lists of ids).

        With ``drafter`` (an EAGLE-3 drafter from ``ppsplit.load_drafter``): speculative decoding, ``K =
        num_draft_tokens`` drafts per verify pass, each sequence accepting its own (greedy, or the lossless
        rejection rule); with ``return_stats`` returns ``(ids, SpeculativeStats)`` of the first sequence. On CUDA
        the engine captures the stages' token buckets unless ``enforce_eager``.

        A ``[B, T]`` tensor gives ``[B, T + new]``, equal to ``model.generate(input_ids, do_sample=False, ...)``: a
        sequence that has emitted an end-of-sequence token continues with padding to the longest. A list gives one
        tensor per prompt, each equal to generating that prompt alone. Needs a paged cache: a split that keeps a
        lockstep one (``plan.lockstep_reason``) runs ``forward`` only.

        Example::

            split = split_model(model, pp=2, cache=CacheConfig(batch_size=4, max_len=256))
            out = split.generate(input_ids, max_new_tokens=32)   # [B, T + new]
            outs = split.generate([ids_a, ids_b], max_new_tokens=32)
        """
        from ppsplit.serve.engine import Engine
        from ppsplit.serve.sampling import SamplingParams
        from ppsplit.serve.speculative import SpeculativeStats

        if self.layout is None:
            if self.plan.lockstep_reason:
                raise ConfigError(f"generation runs through the engine, which needs a paged cache, and this split keeps "
                                  f"a lockstep one because {self.plan.lockstep_reason}; it runs forward only")
            if self.plan.max_batch:
                raise ConfigError("generation runs through the engine, which needs a paged cache, and this split keeps "
                                  "a lockstep one because it was traced with paged=False; it runs forward only")
            raise ConfigError("this split has no KV cache: pass cache=CacheConfig(batch_size, max_len) to split_model "
                              "(generation runs through the engine, over a paged cache)")
        k = num_draft_tokens if drafter is not None else 0
        seed = seed if seed is not None else (generator.initial_seed() if generator is not None else 0)
        batch = isinstance(input_ids, torch.Tensor)
        if batch and (input_ids.dim() != 2 or input_ids.dtype not in _INDEX_DTYPES):
            raise ConfigError(f"input_ids must be a 2-D integer tensor [batch, tokens] or a list of prompts, but got "
                              f"{input_ids.dim()}-D {input_ids.dtype}")
        rows = list(input_ids) if batch else [torch.as_tensor(p).flatten() for p in input_ids]
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
                  for i in range(len(rows))]
        outs = Engine(self, drafter=drafter, num_draft_tokens=k, enforce_eager=enforce_eager).generate(rows, params)
        device = rows[0].device
        seqs = [torch.cat([r.to(device), torch.tensor(o.token_ids, dtype=torch.long, device=device)]) for r, o in
                zip(rows, outs)]
        if batch:  # Hugging Face's batch layout: ended sequences continue with padding to the longest
            pad = self.pad_token_id if self.pad_token_id is not None else (self.eos_token_id or (0,))[0]
            longest = max(len(s) for s in seqs)
            result = torch.full((len(seqs), longest), pad, dtype=torch.long, device=device)
            for i, s in enumerate(seqs):
                result[i, :len(s)] = s
        else:
            result = seqs
        if not return_stats:
            return result
        first = outs[0]
        return result, SpeculativeStats(num_draft_tokens=k, draft_tokens=first.drafts, accepted=first.accepted,
                                        committed=first.accepted, verify_passes=len(first.accepted))

    def reset_cache(self) -> None:
        """Zero every stage's KV cache (not needed for correctness: positions overwrite, the mask hides the rest)."""
        for stage in self.stages:
            for name, buf in stage.named_buffers():
                if is_cache_buffer(name):
                    buf.zero_()


def load(folder: str, devices: Sequence[torch.device | str] | None = None, *, compile: bool | None = None,
         fuse_projections: bool | None = None, fuse_pointwise: bool | None = None,
         gemv: bool | None = None) -> SplitModel:
    """The whole ``SplitModel`` of a compiled folder; stage ``k`` on ``devices[k]`` (default: all on the CPU).
    ``compile``, ``fuse_projections``, ``fuse_pointwise`` and ``gemv`` as in ``load_stage``. A drafter compiled into the folder
    (``ppsplit compile --drafter``), or its MTP layer (``--mtp``), is attached as ``split.drafter``.

    Example::

        split = ppsplit.load("demo-pp4")
        logits, aux = split(input_ids)
    """
    opened = CompiledFolder(folder)
    programs = opened.check()  # what ppsplit inspect runs, before any tensor is read
    plan = opened.plan
    devices = [check_device(d) for d in (devices if devices is not None else ["cpu"] * plan.pp)]
    if len(devices) != plan.pp:
        raise ConfigError(f"{folder} has {plan.pp} stages; pass one device per stage, got {len(devices)}")
    options = stage_options(opened, compile=compile, fuse_projections=fuse_projections,
                            fuse_pointwise=fuse_pointwise, gemv=gemv)
    stages = [build_stage(opened, program, device, options) for program, device in zip(programs, devices)]
    split = SplitModel(plan, stages, eos_token_id=opened.manifest.eos_token_id,
                       pad_token_id=opened.manifest.pad_token_id)
    if opened.drafter is not None:
        from ppsplit.eagle3.formats import load_folder_drafter

        split.drafter = load_folder_drafter(opened.drafter, plan, module_device(stages[-1]))
    if opened.mtp is not None:  # the target's own MTP layer (ppsplit compile --mtp)
        from ppsplit.eagle3.mtp import load_folder_mtp

        split.drafter = load_folder_mtp(opened, module_device(stages[-1]), options)
    return split


def _move(stage: torch.nn.Module, device: torch.device) -> None:
    """``stage.to(device)`` without touching the tensors it shares: splits of one trace hold the same ``Parameter``
    objects, which ``Module.to`` moves in place (``param.data = ...``), so placing one split would move the other's
    weights too. Each moved tensor is a new one here."""
    for module in stage.modules():
        for name, param in module._parameters.items():
            if param is not None and param.device != device:
                module._parameters[name] = torch.nn.Parameter(param.detach().to(device), param.requires_grad)
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
