"""``ppsplit collect`` (imported lazily by ``ppsplit.cli``): EAGLE-3 drafter training data from a compiled folder, in
the layout SpecForge's offline training reads (``ppsplit.eagle3.collect``)."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("collect", help="run prompts through a compiled folder and write each sequence's taps, token "
                                       "ids and final hidden state as SpecForge offline training data")
    p.add_argument("folder", help="a folder written by ppsplit compile with taps (--aux or --drafter)")
    p.add_argument("--prompts", required=True, help="JSONL, one row per line: {\"prompt\": ..., \"response\": ...} "
                   "(chat template), {\"text\": ...} or {\"input_ids\": [...], \"loss_mask\": [...]}")
    p.add_argument("-o", "--out", required=True, help="output folder; a re-run skips the rows already written")
    p.add_argument("--generate", type=int, default=0, metavar="N", help="the target answers prompts that have no "
                   "response, greedily, N new tokens at most (needs a folder with a KV cache)")
    p.add_argument("--logits", action="store_true", help="also write the target's logits [1, T, V] per sequence")
    p.add_argument("--shard-size", type=int, default=5000, help="rows per rows_<a>-<b> subfolder")


def cmd_collect(args: argparse.Namespace) -> int:
    import ppsplit
    from ppsplit.eagle3.collect import prepare, run

    job = prepare(args.folder, args.prompts, args.out, generate=args.generate, logits=args.logits,
                  shard_size=args.shard_size)
    if job.rows:
        report = run(job, ppsplit.load(args.folder))
        print(f"wrote {report.written} sequences ({report.tokens} tokens) to {args.out} in {report.seconds:.1f}s"
              + (f"; {job.skipped} were already there" if job.skipped else ""))
    else:
        print(f"{args.out} already holds all {job.skipped} sequences")
    return 0
