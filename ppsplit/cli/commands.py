"""ppsplit splits a Hugging Face decoder into pipeline stages that carry EAGLE-3 taps, and runs and serves them.

    ppsplit compile MODEL --pp 4 --aux 2,16,29 [-o DIR]     write per-stage artifacts (MODEL: also a .gguf file)
    ppsplit inspect DIR                                     check a compiled folder and print its plan
    ppsplit plan MODEL --pp 4 --aux eagle3                  print the plan only (meta device, writes nothing)
    ppsplit generate DIR --prompt-ids 1,2,3 [-k 4]          decode (speculatively with the folder's drafter)
    ppsplit check-drafter MODEL DRAFTER                     which tap numbering an EAGLE-3 drafter was trained on
    ppsplit save-drafter DIR --format speculators -o OUT    the folder's drafter as a vLLM / SGLang checkpoint
    ppsplit collect DIR --prompts FILE.jsonl -o OUT         drafter training data (taps) for SpecForge
    ppsplit run DIR --prompt "text" --max-new-tokens 32     generate, one process per stage (torch.distributed)
    ppsplit serve DIR [--port 8000] [-k 4]                  the OpenAI HTTP API over the engine

Every ppsplit error is printed as one line on stderr with exit code 2, without a traceback; an interrupt exits 130.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
import warnings

from ppsplit.cli import collect as cli_collect  # argparse only; its commands import torch when run
from ppsplit.cli import generate as cli_generate
from ppsplit.cli import serve as cli_serve


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # also during the first imports, before any work
        print("ppsplit: interrupted; nothing was written", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="ppsplit: %(message)s", stream=sys.stderr)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from ppsplit.core.errors import PpsplitError

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return COMMANDS[args.command](args)
    except PpsplitError as e:
        print(f"ppsplit: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `ppsplit plan ... | head`: the reader left; that is not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def build_parser() -> argparse.ArgumentParser:
    from ppsplit import __version__

    parser = argparse.ArgumentParser(prog="ppsplit", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n")[1])
    parser.add_argument("--version", action="version", version=f"ppsplit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="split MODEL and write per-stage programs and weights to a folder")
    _add_split_args(p)
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the config's)")
    p.add_argument("--max-batch", type=int, default=None, help="sequences the stages' KV cache holds at once "
                   "(default: 8, with --max-len the model's context length up to 4096)")
    p.add_argument("--max-len", type=int, default=None, help="... and tokens per sequence (prompt included)")
    p.add_argument("--no-cache", action="store_true", help="stages without a KV cache (every call attends within "
                   "itself: no generate, run or serve)")
    p.add_argument("--state-slots", type=int, default=8, help="states per recurrent layer (Mamba, Gated DeltaNet) "
                   "and sequence: verify passes of up to this many tokens (K + 1) can be taken back")
    p.add_argument("-o", "--output", default=None, help="output folder (default: <model name>-pp<N>)")
    p.add_argument("--force", action="store_true", help="replace the output folder if it exists")
    p.add_argument("--no-fuse", action="store_true", help="keep the traced ops (no Triton tap/norm kernels)")
    p.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=None,
                   help="fuse sibling projections (q/k/v, gate/up) into one linear each when the stages are loaded "
                   "(the files keep the checkpoint's names); default: on CUDA devices")
    p.add_argument("--drafter", default=None, help="EAGLE-3, DFlash, DFlash2 or DSpark drafter folder or hub id: "
                   "taps from its config, stored in DIR/drafter; a speculators mtp folder: stored in DIR/mtp as --mtp "
                   "stores a layer")
    p.add_argument("--mtp", action="store_true", help="store the checkpoint's own MTP layer (DeepSeek-V3, GLM-4.5, "
                   "Qwen3-Next, MiMo-V2-Flash) in DIR/mtp as the drafter; adds tap L (the last layer's output)")
    p.add_argument("--drafter-convention", choices=("sglang", "vllm"), default=None,
                   help="numbering of the drafter's tap ids (default: its format's own; speculators: vllm, "
                        "SpecForge/EAGLE: sglang): sglang (SpecForge layer outputs, +1) or vllm (as written)")

    p = sub.add_parser("inspect", help="check a compiled folder as loading and serving would, and print its stages, "
                                       "taps and the memory loading it allocates")
    p.add_argument("folder", help="a folder written by ppsplit compile")
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="refuse a folder whose stage (or scheduler) allocates more than this, like 80GiB (default: "
                        "this machine's largest memory, its RAM or its largest GPU's)")

    p = sub.add_parser("plan", help="trace MODEL on the meta device and print the split plan (writes nothing)")
    _add_split_args(p)
    p.add_argument("--max-batch", type=int, default=None, help="plan with a static KV cache of this batch")
    p.add_argument("--max-len", type=int, default=None, help="... and this many tokens (counts in stage memory)")
    p.add_argument("--json", action="store_true", help="print plan.json instead of the table")
    cli_generate.add_parsers(sub)
    cli_collect.add_parser(sub)

    p = sub.add_parser("run", help="generate through a compiled folder, one process per stage (torch.distributed)")
    from ppsplit.distributed.launch import add_arguments
    add_arguments(p)
    cli_serve.add_parser(sub)
    return parser


def _terminate(signum, frame):
    raise KeyboardInterrupt  # unwinds through the compile's cleanup


def _add_split_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="'demo', a local checkpoint folder, a .gguf file (or a folder holding one), or a hub "
                                 "id (local HF cache, else downloaded)")
    p.add_argument("--pp", type=int, required=True, help="number of pipeline stages")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks inside every stage (pp x tp processes "
                   "run the folder; default 1)")
    p.add_argument("--aux", default=None,
                   help="tap ids like 2,16,29, or 'eagle3' for (2, L//2, L-3) (default: no taps)")
    p.add_argument("--aux-convention", choices=("vllm", "sglang"), default="vllm",
                   help="vllm: tap j enters layer j; sglang: the same tensor numbered j-1 (default: %(default)s)")
    p.add_argument("--balance", default="layers",
                   help="layers, params, flops, time (needs real weights), memory (weights + KV cache), or explicit "
                        "counts like 8,9,9,6; every name minimises the slowest stage")
    p.add_argument("--max-stage-memory", default=None, metavar="SIZE",
                   help="cap on each stage's weights + KV cache, like 20GiB or 512MB")
    p.add_argument("--half-layers", action="store_true",
                   help="stages may also end between a layer's attention and MLP blocks (finer balance; explicit "
                        "counts may then use halves, like 8.5,8,8,7.5)")
    p.add_argument("--cost-model", default="", metavar="K=V,...",
                   help="workload of the flops/time policies: batch, tokens, context, prefill, decode_weight, "
                        "prefill_weight (default: batch=1,tokens=1,context=1024: one decode step)")


def split_options(args, **extra):
    """The command line's split options as one validated ``SplitOptions``."""
    from ppsplit.core.options import BALANCE_POLICIES, CostModel, SplitOptions, parse_bytes
    from ppsplit.core.errors import ConfigError

    balance = args.balance
    if balance not in BALANCE_POLICIES:
        try:
            balance = [float(x) if "." in x else int(x) for x in balance.split(",")]
        except ValueError:
            raise ConfigError(f"--balance must be one of {', '.join(BALANCE_POLICIES)}, or layer counts like 8,8,8,8, "
                              f"but got {args.balance!r}") from None
    cap = parse_bytes(args.max_stage_memory) if args.max_stage_memory else None
    return SplitOptions(pp=args.pp, aux=args.aux, balance=balance, aux_convention=args.aux_convention,
                           max_stage_bytes=cap, cost_model=CostModel.parse(args.cost_model),
                           half_layers=args.half_layers, tp=args.tp, **extra)


def cache_options(args):
    from ppsplit.core.options import CacheConfig
    from ppsplit.core.errors import ConfigError

    if args.max_batch is None and args.max_len is None:
        return None
    if getattr(args, "no_cache", False):
        raise ConfigError("--no-cache gives the stages no cache; drop it, or drop --max-batch / --max-len")
    if args.max_batch is None or args.max_len is None:
        raise ConfigError("--max-batch and --max-len go together: pass both to size the stages' KV cache")
    return CacheConfig(batch_size=args.max_batch, max_len=args.max_len, state_slots=getattr(args, "state_slots", 8))


def cmd_compile(args) -> int:
    from ppsplit.artifact.folder import CompiledFolder
    from ppsplit.compile.demo import DEMO_NAME
    from ppsplit.compile.writer import compile_model

    out = args.output or (f"{os.path.basename(os.path.normpath(args.model)).replace('/', '--')}-pp{args.pp}"
                          + (f"-tp{args.tp}" if args.tp > 1 else ""))
    cache = cache_options(args)
    options = split_options(args, cache=cache, fuse="none" if args.no_fuse else "all",
                            fuse_projections=args.fuse_projections)
    drafter, convention = args.drafter, args.drafter_convention
    if drafter is None and args.model == DEMO_NAME and options.aux is not None:
        drafter, options = demo_drafter(options), dataclasses.replace(options, aux=None)
    path = compile_model(args.model, out, options=options, dtype=args.dtype, force=args.force,
                         progress=sys.stderr.isatty(), drafter=drafter, drafter_convention=convention,
                         default_cache=cache is None and not args.no_cache, mtp=args.mtp)
    print(CompiledFolder(path).plan.describe())
    print(f"wrote {path}")
    return 0


def demo_drafter(options) -> str:
    """The demo's drafter (random weights, like the demo) for the taps ``options`` asks for: compiled into the demo
    folder, so ``generate`` / ``serve -k K`` run speculative decoding on the first folder README makes."""
    from ppsplit.compile.demo import demo_config
    from ppsplit.compile.source import materialize_demo_drafter

    taps = options.taps(demo_config().num_hidden_layers)
    logging.getLogger("ppsplit").info("drafter: the demo's (seeded random weights) for taps %s",
                                      ",".join(map(str, taps)))
    return materialize_demo_drafter(taps)


def cmd_inspect(args) -> int:
    from ppsplit.artifact.folder import CompiledFolder, scheduler_bytes
    from ppsplit.artifact.loader import largest_memory
    from ppsplit.artifact.tokenizer import check_tokenizer, has_tokenizer
    from ppsplit.core.options import parse_bytes

    cap = parse_bytes(args.max_memory) if args.max_memory is not None else None
    folder = CompiledFolder(args.folder)
    programs = folder.check()  # exactly what load checks before it reads a tensor
    memory = folder.memory(programs)
    tokenizer = "tokenizer: none (token ids only)"
    if has_tokenizer(args.folder):  # rendered and tokenised within the budget serve gives a request by default
        from ppsplit.serve.openai_api import default_max_request_bytes, prompt_budget

        tokenizer = check_tokenizer(args.folder, prompt_budget(default_max_request_bytes(folder.plan.max_len)))
    plan, manifest = folder.plan, folder.manifest
    print(plan.describe())
    defaults = {"fuse_projections": "default (on CUDA)", "fuse_pointwise": "default (on CUDA unless compiled)"}
    rewrites = ", ".join(f"{name}={defaults[name] if on is None else on}"
                         for name, on in dataclasses.asdict(manifest.stage_options).items())
    print(f"source {manifest.source}, {manifest.dtype}, compiled with ppsplit {manifest.ppsplit}, torch "
          f"{manifest.torch}, transformers {manifest.transformers}"
          + {True: "; sibling projections fused at load", None: "; sibling projections fused at load on CUDA",
             False: ""}[manifest.stage_options.fuse_projections])
    print(f"stage rewrites load applies: {rewrites}")
    q = manifest.quantization
    if q is not None:
        print(f"quantized: {q.describe()}; per stage, weights on FP8 (linears and expert stacks) {list(q.linears)}, "
              f"tensors dequantized to {manifest.dtype} at compile {list(q.dequantized)}")
    print(f"{'stage':>5}  {'program':<14} {'weights':<24} {'bytes':>12} {'tensors':>8}")
    for program, files in zip(programs, manifest.stages):
        for weights, size in ([(f.weights, f.bytes) for f in files.ranks] or [(files.weights, files.bytes)]):
            cut = sum(1 for t in program.stored.values() if t.shard is not None and t.shard.kind == "split")
            held = f"{len(program.stored):>8}" + (f"  ({cut} cut over the TP ranks)" if files.ranks else "")
            print(f"{program.index:>5}  {files.program:<14} {weights:<24} {size:>12,} {held}")
    print(tokenizer)
    _check_memory(memory, scheduler_bytes(plan), cap if cap is not None else largest_memory(), cap is None)
    return 0


def _check_memory(memory, host: int, cap: int, default: bool) -> None:
    """Print what loading allocates per stage; refuse a stage (or the scheduler's host tables) above ``cap``."""
    from ppsplit.core.errors import ConfigError
    from ppsplit.core.plan import fmt_bytes

    what = "this machine's largest memory" if default else "--max-memory"
    print(f"memory loading allocates, per stage on its device (cap {fmt_bytes(cap)}: {what}):")
    print(f"{'stage':>5}  {'weights':>10}  {'zero-init':>10}  {'drafter':>10}  {'total':>10}  largest zero-initialised")
    for m in memory:
        print(f"{m.stage:>5}  {fmt_bytes(m.weights):>10}  {fmt_bytes(m.state):>10}  "
              f"{fmt_bytes(m.drafter) if m.drafter else '-':>10}  {fmt_bytes(m.total):>10}  {m.largest or '-'}")
    print(f"host, rank 0's scheduler (block table, free-block list): {fmt_bytes(host)}")
    for m in memory:
        if m.total > cap:
            raise ConfigError(f"stage {m.stage} allocates {fmt_bytes(m.total)} (weights {fmt_bytes(m.weights)}, "
                              f"zero-initialised {fmt_bytes(m.state)}, the largest {m.largest}, drafter "
                              f"{fmt_bytes(m.drafter)}), more than the cap of {fmt_bytes(cap)} ({what}); pass "
                              f"--max-memory {-(-m.total // (1 << 30))}GiB if you mean it")
    if host > cap:
        raise ConfigError(f"the folder's cache layout makes the scheduler keep {fmt_bytes(host)} of block tables on "
                          f"the host, more than the cap of {fmt_bytes(cap)} ({what}); pass --max-memory "
                          f"{-(-host // (1 << 30))}GiB if you mean it")


def cmd_plan(args) -> int:
    from ppsplit.compile.api import split_model
    from ppsplit.compile.source import load_config, skeleton

    start = time.perf_counter()
    options = split_options(args, cache=cache_options(args))
    config = load_config(args.model)
    model = skeleton(config)[0]
    if getattr(config, "quantization_config", None):  # FP8 weights counted as stored, as compile plans them
        from ppsplit.compile.checkpoint import Checkpoint
        from ppsplit.compile.conversion import Sources
        from ppsplit.compile.quantized import read_scheme
        from ppsplit.compile.source import resolve_model
        from ppsplit.compile.writer import planned

        scheme = read_scheme(config, args.model)
        model = planned(model, Sources(model, Checkpoint(resolve_model(args.model)), scheme), options)
    split = split_model(model, options=options)
    print(split.plan.to_json() if args.json else split.plan.describe(), flush=True)
    logging.getLogger("ppsplit").info("planned in %.1fs", time.perf_counter() - start)
    return 0


def cmd_run(args) -> int:
    from ppsplit.distributed.launch import launch
    from ppsplit.serve.requests import apply_cpu_threads

    apply_cpu_threads(args)
    return launch(args)


COMMANDS = {"compile": cmd_compile, "inspect": cmd_inspect, "plan": cmd_plan, "generate": cli_generate.cmd_generate,
            "check-drafter": cli_generate.cmd_check_drafter, "save-drafter": cli_generate.cmd_save_drafter,
            "collect": cli_collect.cmd_collect,
            "run": cmd_run, "serve": cli_serve.cmd_serve}


if __name__ == "__main__":
    sys.exit(main())
