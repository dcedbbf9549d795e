"""Command line: ``ppsplit plan MODEL --pp N --aux ids``.

Every ``PpsplitError`` is printed as one line on stderr with exit code 2, without a traceback.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ppsplit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="trace MODEL on the meta device and print the split plan (writes nothing)")
    _add_split_args(p)
    p.add_argument("--json", action="store_true", help="print plan.json instead of the table")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="ppsplit: %(message)s", stream=sys.stderr)
    warnings.filterwarnings("ignore")
    from ppsplit.errors import PpsplitError

    try:
        return {"plan": cmd_plan}[args.command](args)
    except PpsplitError as e:
        print(f"ppsplit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ppsplit: interrupted", file=sys.stderr)
        return 130


def _add_split_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="'demo', a local checkpoint folder, or a hub id in the local HF cache")
    p.add_argument("--pp", type=int, required=True, help="number of pipeline stages")
    p.add_argument("--aux", default=None, help="tap ids like 2,16,29, or 'eagle3' for (2, L//2, L-3)")
    p.add_argument("--aux-convention", choices=("vllm", "sglang"), default="vllm",
                   help="vllm: tap j enters layer j; sglang: the same tensor numbered j-1")
    p.add_argument("--balance", default="layers", help="layers, params, or explicit counts like 8,9,9,6")
    p.add_argument("--layers", default=None, help="dotted name of the decoder-layer ModuleList (found automatically)")


def _balance(text: str):
    if "," in text or text.isdigit():
        from ppsplit.errors import ConfigError

        try:
            return [int(x) for x in text.split(",")]
        except ValueError:
            raise ConfigError(f"--balance must be layers, params, or layer counts like 8,8,8,8, but got {text!r}") from None
    return text


def cmd_plan(args) -> int:
    import ppsplit
    from ppsplit.source import load_config, meta_model

    start = time.perf_counter()
    config = load_config(args.model)
    model = meta_model(config)
    opts = ppsplit.SplitOptions(pp=args.pp, aux=args.aux, balance=_balance(args.balance),
                                aux_convention=args.aux_convention, layers=args.layers)
    split = ppsplit.split_model(model, opts.pp, opts.aux, balance=opts.balance, aux_convention=opts.aux_convention,
                                layers=opts.layers)
    print(split.plan.to_json() if args.json else split.plan.describe())
    logging.getLogger("ppsplit").info("planned in %.1fs", time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
