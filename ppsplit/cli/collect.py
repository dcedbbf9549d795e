"""``ppsplit collect`` (imported lazily by ``ppsplit.cli``): EAGLE-3 drafter training data from a compiled folder, in
the layout SpecForge's offline training reads (``ppsplit.eagle3.collect``), in this process or one process per stage
(``--ranks``, ``ppsplit.distributed.collect``)."""
from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    from ppsplit.distributed.launch import add_collect_arguments

    p = sub.add_parser("collect", help="run prompts through a compiled folder and write each sequence's taps, token "
                                       "ids and final hidden state as SpecForge offline training data")
    add_collect_arguments(p)
    p.add_argument("--ranks", type=int, default=None, help="one process per stage on this host (torch.distributed; "
                   "the folder's number of stages)")


def cmd_collect(args: argparse.Namespace) -> int:
    from ppsplit.core.errors import ConfigError
    from ppsplit.eagle3.collect import prepare, run

    from ppsplit.serve.requests import apply_cpu_threads

    job = prepare(args.folder, args.prompts, args.out, generate=args.generate, logits=args.logits,
                  shard_size=args.shard_size, layout=args.layout)  # every refusal before a stage loads (the ranks check it again)
    apply_cpu_threads(args)
    if not job.rows:
        from ppsplit.eagle3.collect import finish

        finish(job)  # an interrupted run may have left the last index unwritten
        print(f"{args.out} already holds all {job.skipped} sequences")
        return 0
    if args.ranks is not None:
        from ppsplit.artifact.folder import CompiledFolder
        from ppsplit.distributed.launch import collect_argv, start_ranks
        from ppsplit.distributed.transport import backend_for

        backend_for(args.device)

        pp = CompiledFolder(args.folder).plan.pp
        if args.ranks != pp:
            raise ConfigError(f"--ranks must be the folder's number of stages, {pp}, but got {args.ranks}")
        return start_ranks(args.folder, "ppsplit.distributed.collect", collect_argv(args), args.device)
    from ppsplit.serve.placement import load_placed

    try:
        report = run(job, load_placed(args.folder, args.device))
    except KeyboardInterrupt:
        print(f"ppsplit: interrupted; the rows written so far stay in {args.out} (whole files only): the same command "
              "resumes", file=sys.stderr)
        return 130
    print(f"wrote {report.written} sequences ({report.tokens} tokens) to {args.out} in {report.seconds:.1f}s"
          + (f"; {job.skipped} were already there" if job.skipped else ""))
    return 0
