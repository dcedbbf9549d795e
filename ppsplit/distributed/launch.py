"""Greedy (or EAGLE-3 speculative, ``-k``) generation through a compiled folder, one process per stage.

    ppsplit run DIR --prompt "text" --max-new-tokens 32 [--microbatches M] [--batch B] [-k K [--temperature T]]
    torchrun --nproc-per-node N -m ppsplit.run DIR --prompt-ids 1,2,3 --max-new-tokens 32    # multi-host

``ppsplit run`` starts the ranks itself with torch.distributed's elastic launcher (one per stage, NCCL when the
host has a GPU per stage, else gloo on the CPU); ``python -m ppsplit.run`` is the body of one rank. ``B``
sequences (default ``M``) are decoded in ``M`` groups of ``B / M``; with several prompts, group ``g`` decodes
prompt ``g mod len(prompts)``. Rank 0 prints each group's text (ids when DIR has no tokenizer) and tokens/s.
"""
from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", help="a folder written by ppsplit compile with --max-batch/--max-len")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (needs a tokenizer in the folder); "
                                                                 "repeat for several prompts")
    p.add_argument("--prompt-ids", action="append", default=[], help="prompt token ids like 1,2,3; repeatable")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=1, help="groups of sequences in flight (M)")
    p.add_argument("--batch", type=int, default=None, help="sequences in all (default: M); a multiple of M")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for a peer before failing")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=None,
                   help="EAGLE-3 speculative decoding with K drafts per verify pass (DIR compiled with --drafter)")
    p.add_argument("--temperature", type=float, default=0.0, help="with -k: sample at this temperature (lossless)")


def check(args) -> None:
    """Fail fast, before any process starts: options, folder, tokenizer."""
    from ppsplit.core.errors import ConfigError
    from ppsplit.artifact.tokenizer import has_tokenizer

    if not args.prompt and not args.prompt_ids:
        raise ConfigError("pass --prompt TEXT or --prompt-ids 1,2,3")
    if args.prompt and not has_tokenizer(args.folder):
        raise ConfigError(f"{args.folder} has no tokenizer (tokenizer.json); pass --prompt-ids, or compile from a "
                          "checkpoint folder that has one")
    if args.microbatches < 1:
        raise ConfigError(f"--microbatches must be at least 1, but got {args.microbatches}")
    batch = args.batch or args.microbatches
    if batch % args.microbatches:
        raise ConfigError(f"--batch {batch} must be a multiple of --microbatches {args.microbatches}")
    for text in args.prompt_ids:
        _ids(text)
    if args.num_draft_tokens is not None:
        from ppsplit.eagle3.speculative import check_num_draft_tokens

        check_num_draft_tokens(args.num_draft_tokens)
        from ppsplit.artifact.folder import DRAFTER

        if not os.path.isdir(os.path.join(args.folder, DRAFTER)):
            raise ConfigError(f"{args.folder} holds no drafter; compile it with --drafter DRAFTER to use -k")
    elif args.temperature:
        raise ConfigError("--temperature needs -k (speculative sampling); plain decoding is greedy")


def _ids(text: str) -> list[int]:
    from ppsplit.core.errors import ConfigError

    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ids = []
    if not ids:
        raise ConfigError(f"--prompt-ids must be comma-separated token ids like 1,2,3, but got {text!r}")
    return ids


def _prompts(args, tokenizer) -> list[list[int]]:
    prompts = [_ids(t) for t in args.prompt_ids]
    prompts += [tokenizer.encode(t) for t in args.prompt]
    return prompts


def rank_main(argv: list[str] | None = None) -> int:
    """The body of one rank (``python -m ppsplit.run``, under torchrun or ``ppsplit run``)."""
    import time
    import warnings

    parser = argparse.ArgumentParser(prog="python -m ppsplit.run", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    from ppsplit import distributed as ppd
    from ppsplit.core.errors import ConfigError, PpsplitError

    rank = int(os.environ.get("RANK", "0"))
    try:
        check(args)
        ppd.init(timeout=args.timeout)
        runner = ppd.PipelineRank(args.folder)
        groups, batch = args.microbatches, args.batch or args.microbatches
        prompts, tokenizer = None, None
        if runner.rank == 0:
            if args.prompt:
                from ppsplit.artifact.tokenizer import FolderTokenizer

                tokenizer = FolderTokenizer(args.folder)
            texts = _prompts(args, tokenizer)
            prompts = [torch.tensor([texts[g % len(texts)]] * (batch // groups)) for g in range(groups)]
        start = time.perf_counter()
        k = args.num_draft_tokens
        out = runner.generate(prompts, args.max_new_tokens, num_draft_tokens=k, temperature=args.temperature,
                              return_stats=k is not None)
        elapsed = time.perf_counter() - start
        spec = ""
        if runner.rank == 0 and k is not None:
            out, stats = out
            spec = f", mean acceptance length {sum(s.mean_acceptance_length for s in stats) / len(stats):.2f} at K={k}"
        if runner.rank == 0:
            new = sum(o.shape[0] * (o.shape[1] - p.shape[1]) for o, p in zip(out, prompts))
            for g, (o, p) in enumerate(zip(out, prompts)):
                ids = o[0, p.shape[1]:].tolist()
                shown = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer else ",".join(map(str, ids))
                print(f"[group {g}] {shown}", flush=True)
            print(f"{new} tokens in {elapsed:.2f}s: {new / elapsed:.1f} tokens/s ({runner.world} stages, "
                  f"{runner.backend}, {groups} groups of {batch // groups}{spec})", flush=True)
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
    import logging
    import uuid

    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ppsplit.artifact.folder import CompiledFolder
    from ppsplit.core.errors import PpsplitError

    check(args)
    pp = CompiledFolder(args.folder).plan.pp
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= pp
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # failures are reported below
    if not gpu:  # the ranks share this host's cores
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // pp)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=pp, run_id=f"ppsplit-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          start_method="spawn")
    argv = [args.folder, "--max-new-tokens", str(args.max_new_tokens), "--microbatches", str(args.microbatches),
            "--timeout", str(args.timeout)]
    argv += [x for t in args.prompt for x in ("--prompt", t)] + [x for t in args.prompt_ids for x in ("--prompt-ids", t)]
    if args.batch:
        argv += ["--batch", str(args.batch)]
    if args.num_draft_tokens is not None:
        argv += ["-k", str(args.num_draft_tokens), "--temperature", str(args.temperature)]
    try:
        elastic_launch(config, sys.executable)("-m", "ppsplit.run", *argv)
    except ChildFailedError as e:
        if all(f.exitcode == 2 for f in e.failures.values()):
            return 2  # each rank printed its ppsplit error (a ConfigError once, by rank 0)
        codes = ", ".join(f"rank {r}: exit {e.failures[r].exitcode}" for r in sorted(e.failures))
        raise PpsplitError(f"{len(e.failures)} of {pp} ranks failed ({codes})") from None
    return 0


if __name__ == "__main__":
    rank_main()
