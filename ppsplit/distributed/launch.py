"""Generation through a compiled folder, one process per stage: the multi-process engine on many requests.

    ppsplit run DIR --prompt "text" --prompt "more text" --max-new-tokens 32 [--temperature T] [-k K]
    torchrun --nproc-per-node N -m ppsplit.run DIR --prompt-ids 1,2,3 --prompt-ids 4,5 --max-new-tokens 32

``ppsplit run`` starts the ranks itself with torch.distributed's elastic launcher (one per stage, NCCL when the
host has a GPU per stage, else gloo on the CPU); ``python -m ppsplit.run`` is the body of one rank. Every prompt is
a request of its own (any lengths); rank 0 prints each request's text (ids when DIR has no tokenizer) and tokens/s.
"""
from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ppsplit.serve.requests import add_request_arguments, add_runtime_arguments

    p.add_argument("folder", help="a folder written by ppsplit compile (with its cache)")
    add_request_arguments(p)
    add_runtime_arguments(p, ranks=True)
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests in flight at most (default: the "
                                                                  "cache's sequence slots)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per micro-step at most (default: 2048)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for a peer before failing")


def check(args) -> None:
    """Fail fast, before any process starts: options, folder, tokenizer, drafter."""
    from ppsplit.core.errors import ConfigError
    from ppsplit.serve.requests import check_requests, has_drafter

    from ppsplit.distributed.transport import backend_for

    check_requests(args, args.folder)
    backend_for(args.device)
    if args.num_draft_tokens is not None and not has_drafter(args.folder):
        raise ConfigError(f"{args.folder} holds no drafter; compile it with --drafter DRAFTER or --mtp to use -k")
    if args.max_num_batched_tokens is None:
        from ppsplit.serve.scheduler import DEFAULT_BUDGET

        args.max_num_batched_tokens = DEFAULT_BUDGET
    if args.max_num_batched_tokens < 1:
        raise ConfigError(f"--max-num-batched-tokens must be at least 1, but got {args.max_num_batched_tokens}")


def rank_main(argv: list[str] | None = None) -> int:
    """The body of one rank (``python -m ppsplit.run``, under torchrun or ``ppsplit run``)."""
    import time
    import warnings

    parser = argparse.ArgumentParser(prog="python -m ppsplit.run", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from ppsplit import distributed as ppd
    from ppsplit.core.errors import ConfigError, PpsplitError
    from ppsplit.distributed.tensor_parallel import pipeline_engine
    from ppsplit.serve.requests import PROGRESS_SECONDS, print_outputs, prompts_of, sampling_params

    rank = int(os.environ.get("RANK", "0"))
    try:
        check(args)
        ppd.init(ppd.backend_for(args.device), timeout=args.timeout)
        options = dict(num_draft_tokens=args.num_draft_tokens or 0, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs, cuda_graphs=not args.enforce_eager)
        engine = pipeline_engine(args.folder, **options)
        if engine is None:  # a TP follower whose job is over
            os._exit(0)
        prompts, tokenizer, params = None, None, None
        if engine.rank == 0:
            prompts, tokenizer = prompts_of(args, args.folder)
            params = [sampling_params(args, i) for i in range(len(prompts))]
        start = time.perf_counter()
        outputs = engine.generate(prompts, params, progress=PROGRESS_SECONDS)
        if engine.rank == 0:
            print_outputs(outputs, tokenizer, time.perf_counter() - start,
                          f"{engine.world} stages, {engine.backend}, {len(outputs)} request"
                          + ("s" if len(outputs) != 1 else "")
                          + (f", K={args.num_draft_tokens}" if args.num_draft_tokens else ""))
        code = 0
    except PpsplitError as e:
        # A ConfigError is the same on every rank: rank 0 says it. A PipelineError differs per rank.
        if rank == 0 or not isinstance(e, ConfigError):
            print(f"ppsplit: error: {e}", file=sys.stderr, flush=True)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    # No process-group teardown: after a failure it could wait on a dead peer. The OS closes the sockets.
    os._exit(code)


def launch(args) -> int:
    """Start one rank per stage of ``args.folder`` on this host and wait for them (``ppsplit run``)."""
    check(args)
    return start_ranks(args.folder, "ppsplit.run", run_argv(args), args.device)


def start_ranks(folder: str, module: str, argv: list[str], device: str = "auto") -> int:
    """Run ``python -m module *argv`` as one rank per stage of ``folder`` on this host (torch's elastic launcher) and
    wait for them. A rank's ppsplit error is printed by the rank (exit 2); any other failure is raised here."""
    import logging
    import uuid

    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ppsplit.artifact.folder import CompiledFolder
    from ppsplit.core.errors import PpsplitError

    plan = CompiledFolder(folder).plan
    pp = plan.pp * plan.tp  # one process per stage, or per (stage, TP rank)
    gpu = device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() >= pp
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # failures are reported below
    if not gpu:  # the ranks share this host's cores
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // pp)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=pp, run_id=f"ppsplit-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          start_method="spawn")
    try:
        elastic_launch(config, sys.executable)("-m", module, *argv)
    except ChildFailedError as e:
        if all(f.exitcode == 2 for f in e.failures.values()):
            return 2  # each rank printed its ppsplit error (a ConfigError once, by rank 0)
        codes = ", ".join(f"rank {r}: exit {e.failures[r].exitcode}" for r in sorted(e.failures))
        raise PpsplitError(f"{len(e.failures)} of {pp} ranks failed ({codes})") from None
    return 0


def add_collect_arguments(p: argparse.ArgumentParser) -> None:
    """``ppsplit collect``'s options (one process, or one rank per stage: ``ppsplit.distributed.collect``)."""
    p.add_argument("folder", help="a folder written by ppsplit compile with taps (--aux or --drafter)")
    p.add_argument("--prompts", required=True, help="JSONL, one row per line: {\"prompt\": ..., \"response\": ...} "
                   "(chat template), {\"text\": ...} or {\"input_ids\": [...], \"loss_mask\": [...]}")
    p.add_argument("-o", "--out", required=True, help="output folder; a re-run skips the rows already written")
    p.add_argument("--generate", type=int, default=0, metavar="N", help="the target answers prompts that have no "
                   "response, greedily, N new tokens at most (needs a folder with a KV cache)")
    p.add_argument("--logits", action="store_true", help="also write the target's logits [1, T, V] per sequence")
    p.add_argument("--shard-size", type=int, default=5000, help="rows per rows_<a>-<b> subfolder")
    p.add_argument("--layout", choices=("eagle3", "dflash", "speculators"), default="eagle3", help="eagle3: "
                   "SpecForge's offline EAGLE-3 files (taps, final hidden state); dflash: its DFlash-family files "
                   "(hidden_states: the taps); speculators: speculators' offline data (needs tap L)")
    p.add_argument("--timeout", type=float, default=300.0, help="one rank per stage: seconds a rank waits for a peer")
    p.add_argument("--device", default="auto", help="auto: CUDA when the machine has a GPU (one per rank with "
                   "--ranks), else the CPU; cpu; cuda; or (one process) a list cuda:0,cuda:1 (default: %(default)s)")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch's threads for the CPU's work, in each process "
                   "(default: OMP_NUM_THREADS when set, else 1)")


def collect_argv(args) -> list[str]:
    """The command line of one collect rank for ``args`` (every option passed on as given)."""
    return [args.folder, "--prompts", args.prompts, "-o", args.out, "--generate", str(args.generate),
            "--shard-size", str(args.shard_size), "--layout", args.layout, "--timeout", str(args.timeout),
            "--device", args.device] + \
        (["--logits"] if args.logits else [])


def run_argv(args) -> list[str]:
    """The command line of one rank for ``args`` (every option passed on as given)."""
    argv = [args.folder, "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature),
            "--top-p", str(args.top_p), "--top-k", str(args.top_k), "--seed", str(args.seed), "--timeout",
            str(args.timeout), "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--device", args.device]
    argv += [x for t in args.prompt for x in ("--prompt", t)] + [x for t in args.prompt_ids for x in ("--prompt-ids", t)]
    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--stop-token-ids", args.stop_token_ids),
                        ("-k", args.num_draft_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--ignore-eos"] if args.ignore_eos else []) + (["--enforce-eager"] if args.enforce_eager else [])


if __name__ == "__main__":
    rank_main()
