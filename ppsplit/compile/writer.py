"""Compiling: ``ppsplit compile``, from a checkpoint to a compiled folder (its format: ``ppsplit.artifact.folder``).

Weights are streamed from the source shards into the stage files, so memory holds one tensor, or one group of
tensors that transformers' weight conversions fuse into one (``ppsplit.compile.conversion``), at a time. Everything is
written into a hidden temporary folder beside the output, created before the slow work (so an unwritable
destination fails at once), and renamed into place when complete: an error, Ctrl-C or SIGTERM
leaves no output folder behind.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time

import torch
from torch import fx

from ppsplit.compile.api import split_model
from ppsplit.compile.checkpoint import ST_DTYPES, Checkpoint, RawRange, write_safetensors
from ppsplit.core.options import CacheConfig, SplitOptions, StageOptions
from ppsplit.compile.conversion import Sources
from ppsplit.compile.quantized import Scheme, is_exponents, read_scheme
from ppsplit.core.quant import Quantization
from ppsplit.triton_kernels.fp8 import scale_grid
from ppsplit.core.errors import ConfigError
from ppsplit.core.fx_utils import get_tensor, is_cache_buffer, tied_names, tied_parameters
from ppsplit.artifact.folder import (MANIFEST, PLAN, Manifest, RankFiles, StageFiles, fingerprint, program_name,
                                     serving_files, weights_name, write_json)
from ppsplit.artifact.program import graph_to_json
from ppsplit.serve.runtime import SplitModel
from ppsplit.core.tensors import DTYPE_ALIASES, DTYPES, MODEL_DTYPES, dtype_name, nbytes

log = logging.getLogger("ppsplit")
_TMP_TAG = ".ppsplit-tmp-"
_PROBE_TAG = ".ppsplit-probe-"


def compile_model(model: str, out: str, *, options: SplitOptions | None = None, dtype: str | None = None,
                  force: bool = False, progress: bool = False, drafter: str | None = None,
                  drafter_convention: str | None = None, default_cache: bool = False, mtp: bool = False,
                  **split_options) -> str:
    """Split the checkpoint ``model`` and write the artifacts to ``out``. Returns ``out``.

    The split is described by ``options`` (a ``SplitOptions``) or by the same keywords as ``split_model``
    (``pp``, ``aux``, ``balance``, ``aux_convention``, ``cache``, ``fuse``, ``fuse_projections``: recorded in
    ``manifest.json`` and applied by ``load``/``load_stage``, the files keep the checkpoint's names). With
    ``drafter`` (an EAGLE-3 checkpoint), the taps come from its config (ids numbered as its format writes them,
    or in ``drafter_convention``)
    and the drafter, with its embedding copy, is stored in ``out/drafter`` (``ppsplit.load`` attaches it as
    ``split.drafter``). ``mtp``: store the checkpoint's own first MTP layer in ``out/mtp`` instead (the taps
    then include the last layer's output, ``L``), attached the same way. ``default_cache`` (what ``ppsplit compile``
    passes): without ``cache``, give the stages ``default_cache_for(...)``'s paged cache, so the folder can generate
    and serve as written.

    Example::

        compile_model("demo", "demo-pp4", pp=4, aux="eagle3")
        split = ppsplit.load("demo-pp4")
    """
    from ppsplit.compile.source import load_config, resolve_model, skeleton

    if options is None:
        if "pp" not in split_options:
            raise ConfigError("compile_model needs pp, the number of pipeline stages (or options=SplitOptions(...))")
        options = SplitOptions(**split_options)
    elif split_options:
        raise ConfigError(f"pass either options= or split keywords, not both ({', '.join(split_options)})")
    out = os.path.abspath(out)
    if os.path.exists(out) and not force:
        raise ConfigError(f"{out} already exists; pass --force to replace it, or -o another folder")
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype is not None and dtype not in MODEL_DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(MODEL_DTYPES + tuple(DTYPE_ALIASES))}, but got {dtype!r}")
    folder = resolve_model(model)
    if mtp:  # first: a model type whose MTP layers ppsplit refuses (MiMo-7B) is told why, before transformers is asked
        from ppsplit.compile.mtp import mtp_checkpoint
        if drafter is not None:
            raise ConfigError("pass either --drafter or --mtp: a compiled folder stores one drafter")
        mtp_checkpoint(folder)
    config = load_config(folder)
    scheme = read_scheme(config, model)
    speculators_mtp = None  # a speculators mtp folder as --drafter: stored in out/mtp as --mtp stores a layer
    if drafter is not None:
        from ppsplit.compile.mtp import check_compiled_speculators_mtp, speculators_mtp_source
        from ppsplit.eagle3.formats import compile_taps
        speculators_mtp = speculators_mtp_source(drafter)
        if speculators_mtp is None:
            aux = compile_taps(drafter, config, options.aux, drafter_convention)
            options = dataclasses.replace(options, aux=aux, aux_convention="vllm")
        else:
            layers = check_compiled_speculators_mtp(speculators_mtp, config, drafter_convention)
            options = _mtp_options(options, layers, default_cache, "--drafter")
    if mtp:
        options = _mtp_options(options, mtp_checkpoint(model)[1]["num_hidden_layers"], default_cache, "--mtp")
    checkpoint = Checkpoint(folder)
    torch_dtype = DTYPES[dtype] if dtype else _config_dtype(config)

    # The stage rewrites are applied when a stage is loaded (the manifest records them): the stage files keep the
    # checkpoint's own tensor names and the stored programs the traced ATen calls.
    stage_options = options.stage
    options = dataclasses.replace(options, stage=StageOptions(fuse_projections=False, fuse_pointwise=False,
                                                                   gemv=False, compile=False))
    # Tensor parallelism cuts the stages last (after the FP8 rewrite, so block scales are cut with their weights).
    tp = options.tp
    options = dataclasses.replace(options, tp=1, tp_rank=None)
    _make_tmp(out, probe=True)  # an unwritable destination fails now, before the slow trace
    start = time.perf_counter()
    model_obj, buffers = skeleton(config, torch_dtype)
    if default_cache and options.cache is None:
        options = dataclasses.replace(options, cache=default_cache_for(model_obj))
    sources = Sources(model_obj, checkpoint, scheme)  # before split_model: the skeleton as transformers builds it
    split = split_model(planned(model_obj, sources, options), options=options)
    log.info("split into %d stages in %.1fs", split.plan.pp, time.perf_counter() - start)
    tied = tied_names(tied_parameters(model_obj))  # name -> every name sharing its tensor
    fp8 = [quantize_stage(stage, sources) for stage in split.stages] if scheme is not None else None
    sharded = None
    if tp > 1:
        from ppsplit.passes.tp import shard_stage

        sharded = [shard_stage(stage, tp, getattr(config, "base_model_tp_plan", None)) for stage in split.stages]
        split.plan = dataclasses.replace(split.plan, tp=tp, sharded=tuple(s.report for s in sharded))
        log.info("cut every stage over %d TP ranks", tp)
    stage_specs = [_stage_tensors(stage, k, sources, buffers, tied) for k, stage in enumerate(split.stages)]
    quantization = None if scheme is None else _quantization(scheme, fp8, stage_specs, sources)

    tmp = _tmp_name(out)
    try:  # from before the folder exists: a SIGTERM just after its creation still removes it
        _make_tmp(out)
        _write(tmp, split, stage_specs, sources, buffers, model, torch_dtype, progress, stage_options, quantization,
               sharded)
        if speculators_mtp is not None:
            from ppsplit.compile.mtp import write_speculators_mtp
            write_speculators_mtp(tmp, speculators_mtp, split, checkpoint, tied)
        elif drafter is not None:
            from ppsplit.eagle3.formats import write_compiled_drafter
            write_compiled_drafter(tmp, drafter, split, checkpoint, tied, drafter_convention)
        if mtp:
            from ppsplit.compile.mtp import write_mtp
            write_mtp(tmp, folder, split)
        if os.path.exists(out):
            backup = tmp + "-old"
            os.rename(out, backup)
            os.rename(tmp, out)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s in %.1fs", out, time.perf_counter() - start)
    return out


def _mtp_options(options: SplitOptions, layers: int, default_cache: bool, flag: str) -> SplitOptions:
    """``options`` with tap ``layers`` (``L``: what an MTP layer reads) added, or one ``ConfigError`` before anything
    is traced when the split cannot store an MTP layer (``flag``: the option that asked for one)."""
    from ppsplit.core.options import parse_aux, to_taps

    if options.cache is None and not default_cache:
        raise ConfigError(f"the MTP layer drafts over the stages' paged KV cache: leave out --no-cache (or {flag})")
    if options.aux == "eagle3":
        raise ConfigError(f"{flag} adds its tap to explicit --aux ids only: pass them as numbers, or leave --aux out")
    taps = to_taps(parse_aux(options.aux), options.aux_convention, layers) if options.aux else ()
    return dataclasses.replace(options, aux=",".join(map(str, sorted({*taps, layers}))), aux_convention="vllm")


DEFAULT_SEQUENCES = 8  # sequence slots of the cache ``ppsplit compile`` gives a folder when none is asked for
DEFAULT_MAX_LEN = 4096  # ... and positions per sequence, or the model's context length where that is shorter
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def default_cache_for(model_obj) -> CacheConfig | None:
    """``CacheConfig(8, min(context length, 4096))`` (a pool of every slot full: 32768 positions per layer at most),
    or ``None``, logged with the reason, for a model whose stages cannot have ppsplit's cache."""
    from ppsplit.passes.trace import cache_refusal

    why = cache_refusal(model_obj)
    if why is not None:
        log.info("no KV cache: %s", why.split(";")[0])
        return None
    config = model_obj.config
    context = next((v for v in (getattr(config, k, None) for k in _CONTEXT_KEYS) if isinstance(v, int) and v > 0),
                   DEFAULT_MAX_LEN)
    return CacheConfig(batch_size=DEFAULT_SEQUENCES, max_len=min(context, DEFAULT_MAX_LEN))


def _tmp_name(out: str, probe: bool = False) -> str:
    """The hidden temporary folder beside ``out`` (``_make_tmp`` creates it)."""
    tag = _PROBE_TAG if probe else _TMP_TAG
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}{tag}{os.getpid()}")


def _make_tmp(out: str, probe: bool = False) -> str:
    """The hidden temporary folder beside ``out``; fails with a one-line error if that place is not writable.
    ``probe=True`` creates and removes it at once (the check before slow work, leaving nothing behind)."""
    parent = os.path.dirname(out)
    tmp = _tmp_name(out, probe)
    try:
        os.makedirs(parent, exist_ok=True)
        _remove_stale_tmp(parent)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        if probe:
            os.rmdir(tmp)
    except OSError as e:
        raise ConfigError(f"cannot write the output folder {out}: {e.strerror or e}; pass -o a folder you can "
                          "write to") from None
    return tmp


def _config_dtype(config) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    return DTYPES.get(str(value).replace("torch.", ""), torch.float32)


def _stage_tensors(stage: fx.GraphModule, k: int, sources: Sources, buffers: dict, tied: dict) -> list[dict]:
    """What stage ``k`` needs and where each tensor comes from; raises before anything is written.

    A tensor comes from the checkpoint through transformers' own conversions (``ppsplit.compile.conversion``): a plain
    tensor is copied as stored (``source``: its checkpoint key); a renamed-and-fused one (``convert``: the
    conversion group) is produced by running that group on only its own source tensors."""
    persistent = set(stage.state_dict().keys())
    specs = []
    for kind, items in (("parameter", stage.named_parameters(remove_duplicate=False)),
                        ("buffer", stage.named_buffers(remove_duplicate=False))):
        for name, t in items:
            spec = {"name": name, "kind": kind, "shape": list(t.shape), "dtype": dtype_name(t.dtype),
                    "persistent": kind == "parameter" or name in persistent}
            names = tied.get(name, (name,))  # a tied tensor is stored under one of its names
            group = next((g for g in map(sources.group_of, names) if g is not None), None)
            if is_cache_buffer(name):
                spec["init"] = "zeros"  # state, not weights: allocated by load_stage
            elif group is not None:
                spec["init"], spec["source"] = "file", sources.plain_source(group)
                stored = spec["source"] and sources.checkpoint.raw_range(spec["source"]).shape
                if stored and list(stored) != spec["shape"]:
                    raise ConfigError(f"the checkpoint's {spec['source']} has shape {tuple(stored)}, but {name} needs "
                                      f"shape {tuple(spec['shape'])}: the checkpoint does not match its config.json; "
                                      "re-download it or fix the config")
                if spec["source"] is None:  # the group's output ``target`` (``name``, or the name it is tied to)
                    spec["convert"], spec["target"] = group.first, next(n for n in names if n in group.targets)
            elif name in buffers or t.device.type != "meta":
                spec["init"], spec["source"] = "file", None
            elif not spec["persistent"]:
                raise ConfigError(f"stage {k} reads {name!r}, a constant the model's forward makes from Python data in "
                                  "a way the trace on the meta device keeps no value of; compile cannot fill it "
                                  "(split_model of the loaded model can). Report the model")
            else:
                raise ConfigError(f"the checkpoint has no tensor that becomes {name!r}, which stage {k} needs, "
                                  "through transformers' weight conversions for this architecture; the checkpoint "
                                  "does not match its config.json (or needs trust_remote_code, which ppsplit "
                                  "does not run)")
            specs.append(spec)
    return specs


def planned(model_obj, sources: Sources, options: SplitOptions):
    """What ``split_model`` plans from: the skeleton, or for a quantised checkpoint its trace with each FP8 weight
    counted as stored, so the plan's stage bytes (and ``balance="memory"``) see the real sizes."""
    if sources.scheme is None:
        return model_obj
    from ppsplit.compile.api import trace_model

    traced = trace_model(model_obj, layers=options.layers, cache=options.cache)
    return dataclasses.replace(traced, costs=_stored_costs(traced, sources))


def _stored_costs(traced, sources: Sources):
    """The trace's costs with each weight the stages will keep quantised counted as stored (``_stored_bytes``), not
    in the model dtype; attributed to its decoder layer by name (``<layers>.<i>.``), else to the head."""
    costs = traced.costs
    prefix = traced.layers.fqn + "."
    layers, head = list(costs.layer_bytes), costs.head_bytes
    gm = traced.traced.gm
    for node in {n.target: n for n in gm.graph.find_nodes(op="get_attr")}.values():  # a tensor counted once
        p = get_tensor(gm, node.target)
        group = sources.group_of(node.target)
        stored = None if group is None or not isinstance(p, torch.nn.Parameter) else \
            _stored_bytes(node, p, group, sources)
        if stored is None:
            continue
        delta = stored - p.numel() * p.element_size()
        index = node.target[len(prefix):].split(".")[0] if node.target.startswith(prefix) else ""
        if index.isdigit() and int(index) < len(layers):
            layers[int(index)] += delta
        else:
            head += delta
    return dataclasses.replace(costs, layer_bytes=tuple(layers), head_bytes=head)


def _stored_bytes(node: fx.Node, p: torch.Tensor, group, sources: Sources) -> int | None:
    """The bytes parameter ``p`` (read by ``node``) will be held in when the stage keeps it quantised: an FP8
    weight or stack of experts with its scales (E8M0 exponents held as fp32), MXFP4 experts' blocks and scales;
    ``None`` for a weight held in the model dtype (the quantize pass would leave it)."""
    from ppsplit.passes.quantize import runs_fp8, runs_mxfp4

    checkpoint = sources.checkpoint
    if sources.is_mxfp4(group):
        return sum(checkpoint.raw_range(k).nbytes for k, _ in group.sources) if runs_mxfp4(node) else None
    key = sources.plain_source(group)
    if key and key in sources.scales:
        keys = [key]
    elif p.dim() == 3 and sources.stored_block(group) is not None:
        keys = [k for k, _ in group.sources]  # an FP8 stack of experts
    else:
        return None
    if not runs_fp8(node, p.dim()):
        return None
    stored = 0
    for k in keys:
        scale = checkpoint.raw_range(sources.scales[k])
        stored += checkpoint.raw_range(k).nbytes + scale.nbytes * (4 if is_exponents(scale.dtype) else 1)
    return stored


def quantize_stage(stage: fx.GraphModule, sources: Sources):
    """Stage linears over the checkpoint's FP8 weights run on them as stored (``ppsplit.passes.quantize``); the
    scales become tensors of ``sources`` (the stages of a compile, and the MTP block: ``ppsplit.compile.mtp``)."""
    from ppsplit.passes.quantize import QuantizedWeight, quantize_linears

    scheme: Scheme = sources.scheme
    if scheme.method == "mxfp4":
        return _keep_mxfp4(stage, sources)
    weights, stacks = {}, {}
    for name, t in stage.named_parameters(remove_duplicate=False):
        group = sources.group_of(name)
        key = group is not None and sources.plain_source(group)
        if key and key in sources.scales:
            scale_name = name[:-len("weight")] + scheme.suffix
            raw = sources.checkpoint.raw_range(sources.scales[key])
            sources.add_plain(scale_name, sources.scales[key])
            weights[name] = QuantizedWeight(scale_name, raw.shape, sources.groups[scale_name].dtype,
                                            scheme.block_of(tuple(t.shape)))
        elif group is not None and t.dim() == 3 and (block := sources.stored_block(group)) is not None:
            # MoE experts stacked by transformers' conversions: their scales stacked alike, beside them as
            # transformers' FP8 experts name them (experts.gate_up_proj_scale_inv)
            scale = sources.add_scales(group, name + scheme.suffix.removeprefix("weight"))
            e, n, k = t.shape
            weights[name] = QuantizedWeight(scale.first, (e, *scale_grid(n, k, *block)), scale.dtype, block)
            stacks[name] = group
    done = quantize_linears(stage, weights)
    for name in done.fp8:
        if name in stacks:
            stacks[name].stored = True
    return done


def _keep_mxfp4(stage: fx.GraphModule, sources: Sources):
    """MXFP4 experts run on their blocks and scales as stored (``ppsplit.passes.quantize.quantize_mxfp4_experts``)."""
    from ppsplit.passes.quantize import Mxfp4Experts, quantize_mxfp4_experts

    experts = {}
    for name, t in stage.named_parameters(remove_duplicate=False):
        group = sources.group_of(name)
        if group is None or not sources.is_mxfp4(group):
            continue
        (blocks_key, _), (scales_key, _) = group.sources
        sources.add_plain(f"{name}_blocks", blocks_key)
        sources.add_plain(f"{name}_scales", scales_key)
        experts[name] = Mxfp4Experts(f"{name}_blocks", tuple(sources.checkpoint.raw_range(blocks_key).shape),
                                     f"{name}_scales")
    return quantize_mxfp4_experts(stage, experts)


def _quantization(scheme: Scheme, fp8: list, stage_specs: list, sources: Sources) -> Quantization:
    """The manifest's record: per stage, the weights kept quantised and the tensors dequantised at compile."""
    dequantized = []
    for specs in stage_specs:
        count = 0
        for s in specs:
            keys = [s["source"]] if s.get("source") else \
                [k for k, _ in sources.groups[s["convert"]].sources] if s.get("convert") else []
            count += s["dtype"] in MODEL_DTYPES and any(k in sources.scales for k in keys)
        dequantized.append(count)
    return Quantization(scheme.method, scheme.scheme, scheme.block, linears=tuple(len(q.fp8) for q in fp8),
                        dequantized=tuple(dequantized))


def _spec_bytes(spec: dict) -> int:
    return nbytes(spec["shape"], DTYPES[spec["dtype"]])


def _write(tmp: str, split: SplitModel, stage_specs: list, sources: Sources, buffers: dict, source: str,
           dtype: torch.dtype, progress: bool, stage_options: StageOptions,
           quantization: Quantization | None = None, sharded: list | None = None) -> None:
    import transformers

    import ppsplit

    plan_json = split.plan.to_json()
    with open(os.path.join(tmp, PLAN), "w") as f:
        f.write(plan_json)
    for name in serving_files(sources.checkpoint.folder):  # tokenizer, chat template, generation_config.json
        shutil.copyfile(os.path.join(sources.checkpoint.folder, name), os.path.join(tmp, name))
    total = sum(_spec_bytes(s) for specs in stage_specs for s in specs if s["init"] == "file")
    bar = _progress(total, progress)
    files = []
    try:
        for k, (stage, specs) in enumerate(zip(split.stages, stage_specs)):
            cut = sharded[k] if sharded else None
            listed = _rank_specs(specs, cut) if cut else specs
            graph = cut.graph if cut else stage.graph
            write_json(os.path.join(tmp, program_name(k)), {"stage": k, "plan_sha256": fingerprint(plan_json),
                                                            "tensors": listed, "program": graph_to_json(graph)})
            in_file = sorted((s for s in listed if s["init"] == "file"), key=lambda s: _order(s, sources))
            own = dict(stage.named_parameters(remove_duplicate=False)) | dict(stage.named_buffers(remove_duplicate=False))
            entries = [(s["name"], tuple(s["shape"]), DTYPES[s["dtype"]]) for s in in_file]
            bar.set_description(f"stage {k}")
            if cut is None:
                size = write_safetensors(os.path.join(tmp, weights_name(k)), entries,
                                         _stage_stream(in_file, own, sources, buffers),
                                         metadata={"format": "pt", "ppsplit_stage": k}, progress=bar.update)
                files.append(StageFiles(program_name(k), weights_name(k), size))
                continue
            ranks = []
            for r in range(cut.tp):  # each rank's file streamed on its own: memory holds one tensor (or piece)
                size = write_safetensors(os.path.join(tmp, weights_name(k, r)), entries,
                                         _stage_stream(in_file, own, sources, buffers, (cut, r)),
                                         metadata={"format": "pt", "ppsplit_stage": k, "ppsplit_tp_rank": r},
                                         progress=lambda n, tp=cut.tp: bar.update(n // tp))
                ranks.append(RankFiles(weights_name(k, r), size))
            files.append(StageFiles(program_name(k), "", sum(f.bytes for f in ranks), tuple(ranks)))
    finally:
        bar.close()
    manifest = Manifest(ppsplit=ppsplit.__version__, torch=torch.__version__, transformers=transformers.__version__,
                        source=source, dtype=dtype_name(dtype), stages=tuple(files),
                        eos_token_id=tuple(split.eos_token_id), pad_token_id=split.pad_token_id,
                        stage_options=stage_options, quantization=quantization)
    write_json(os.path.join(tmp, MANIFEST), manifest.to_dict())


def _order(spec: dict, sources: Sources) -> tuple:
    """Plain tensors by shard (sequential reads), a conversion group's outputs next to each other."""
    where = sources.checkpoint.where
    if spec.get("convert"):
        return (where[sources.groups[spec["convert"]].sources[0][0]], spec["convert"], spec["name"])
    return (where.get(spec["source"] or "", ""), "", spec["name"])


def _rank_specs(specs: list[dict], cut) -> list[dict]:
    """A stage's tensor list as one TP rank holds it: each cut tensor's local shape and its ``shard``, and the
    generated per-rank tensors (a vocab-parallel lookup's first row)."""
    out = []
    for s in specs:
        shard = cut.shards.get(s["name"])
        if shard is None:
            out.append(s)
            continue
        out.append(dict(s, shape=list(shard.local_shape(s["shape"])), shard=dataclasses.asdict(shard)))
    for name, shard in cut.shards.items():
        if shard.kind == "start":
            out.append({"name": name, "kind": "buffer", "shape": [1], "dtype": "int64", "persistent": True,
                        "init": "file", "source": None, "shard": dataclasses.asdict(shard)})
    return out


def _stage_stream(in_file: list[dict], own: dict, sources: Sources, buffers: dict, rank: tuple | None = None):
    """``(name, tensor)`` in ``in_file`` order; at most one conversion group's outputs are held at a time. With
    ``rank`` (a ``ShardedStage`` and a TP rank), each cut tensor is that rank's piece, read alone from its shard
    where the checkpoint stores it as the stage keeps it."""
    if rank is not None:
        yield from _rank_stream(in_file, own, sources, buffers, *rank)
        return
    checkpoint = sources.checkpoint
    group, outputs = None, {}
    for s in in_file:
        if s.get("convert"):
            if s["convert"] != group:
                group, outputs = None, {}  # drop the last group's outputs before converting the next
                group, outputs = s["convert"], sources.run(sources.groups[s["convert"]])
            t = outputs.get(s["target"])
            if t is None or list(t.shape) != s["shape"]:
                got = "nothing" if t is None else f"shape {tuple(t.shape)}"
                raise ConfigError(f"transformers' weight conversion of the checkpoint gives {got} for {s['target']}, "
                                  f"the model needs shape {tuple(s['shape'])}: the checkpoint does not match its "
                                  "config.json (missing experts or a different size); re-download it or fix the config")
            yield s["name"], t
        elif s["source"]:
            raw = checkpoint.raw_range(s["source"])
            # Same dtype: copy the bytes (FP8 weights and scales too); otherwise read the tensor and convert it
            # (an FP8 weight that cannot stay FP8 is dequantised).
            same = raw.dtype == ST_DTYPES[DTYPES[s["dtype"]]]
            yield s["name"], raw if same else sources.read(s["source"], DTYPES[s["dtype"]])
        else:  # a buffer computed at init or a constant captured by the trace
            yield s["name"], buffers.get(s["name"], own[s["name"]])


def _rank_stream(in_file: list[dict], own: dict, sources: Sources, buffers: dict, cut, r: int):
    from safetensors import safe_open

    whole = [dict(s, shape=list(_whole_shape(s))) for s in in_file]
    stream = _stage_stream([s for s in whole if s.get("shard") is None or s["shard"]["kind"] != "start"], own, sources,
                           buffers)
    for s in in_file:
        shard = cut.shards.get(s["name"])
        if shard is not None and shard.kind == "start":
            yield s["name"], shard.take(None, r, cut.tp)
            continue
        if shard is None:
            yield next(stream)
            continue
        raw = s.get("source") and sources.checkpoint.raw_range(s["source"])
        if raw and raw.dtype == ST_DTYPES[DTYPES[s["dtype"]]]:  # stored as kept: read this rank's piece alone
            _skip(stream)
            with safe_open(raw.path, framework="pt") as f:
                yield s["name"], shard.take(f.get_slice(s["source"]), r, cut.tp)
            continue
        name, t = next(stream)
        if isinstance(t, RawRange):
            t = sources.read(s["source"], DTYPES[s["dtype"]])
        yield name, shard.take(t, r, cut.tp).to(DTYPES[s["dtype"]])


def _whole_shape(spec: dict) -> tuple:
    """The stage's shape of a tensor a rank holds a piece of (``spec["shard"]``, its dict form)."""
    shard = spec.get("shard")
    if shard is None or shard["kind"] != "split":
        return tuple(spec["shape"])
    shape = list(spec["shape"])
    shape[shard["dim"]] = sum(shard["segments"])
    return tuple(shape)


def _skip(stream) -> None:
    """Advance ``stream`` past a tensor without reading it (a plain source yields a ``RawRange``, no data)."""
    next(stream)


class _NoBar:
    def update(self, n):
        pass

    def set_description(self, text):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True)


def _remove_stale_tmp(parent: str) -> None:
    """Temporary folders of compiles that were killed outright (SIGKILL) and whose process is gone."""
    for entry in os.listdir(parent):
        tag = next((t for t in (_TMP_TAG, _PROBE_TAG) if t in entry), None)
        if tag is None or not entry.startswith("."):
            continue
        pid = entry.rsplit(tag, 1)[1].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
