"""Time tracing and splitting full-size decoders on the meta device (no weights), on this machine's CPU.

    python bench/trace_plan.py                       # Llama-3.1-8B shape, pp=4, EAGLE-3 taps
    python bench/trace_plan.py --shapes all --pp 4
"""
import argparse
import platform
import time
import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM

import ppsplit
from ppsplit.core.layers import find_layers
from ppsplit.passes.annotate import annotate
from ppsplit.passes.trace import trace

try:
    from bench.shapes import SHAPES, config
except ImportError:  # run as a script from bench/
    from shapes import SHAPES, config

warnings.filterwarnings("ignore")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.1-8b", help="comma-separated names, or 'all': " + ", ".join(SHAPES))
    ap.add_argument("--pp", type=int, default=4)
    args = ap.parse_args()
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"{'shape':<14} {'layers':>6} {'build s':>8} {'export s':>9} {'annotate s':>10} {'split s':>8} {'total s':>8} "
          f"{'nodes':>6}  stages (layers)")
    for name in names:
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config(name, torch_dtype=torch.bfloat16)).to(torch.bfloat16)
        t1 = time.perf_counter()
        stack = find_layers(model)
        traced = trace(model, num_layers=stack.num_layers)
        t2 = time.perf_counter()
        annotated = annotate(traced, stack)
        t3 = time.perf_counter()
        split = ppsplit.split_model(annotated, args.pp, aux="eagle3")
        t4 = time.perf_counter()
        layers = "/".join(str(s.num_layers) for s in split.plan.stages)
        print(f"{name:<14} {stack.num_layers:>6} {t1 - t0:>8.1f} {t2 - t1:>9.1f} {t3 - t2:>10.2f} {t4 - t3:>8.2f} "
              f"{t4 - t0:>8.1f} {len(annotated.gm.graph.nodes):>6}  {layers}")


if __name__ == "__main__":
    main()
