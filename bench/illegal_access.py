"""The illegal memory access of issue 32 (bench/RESULTS.md sections 27 and 29), in one process per configuration.

A random Llama-3.1-8B-shaped model (bf16, --layers), traced with a cache; then, in a row: a split with the
default (fused projections on CUDA) replayed from a CUDA graph (--first fused, or none), and a second split
(--second compile: Inductor-compiled, projections unfused; compile_fused; plain) replayed five times, each step
synchronised so that an error surfaces at the step that caused it. --noview keeps the source model's tensors as
they are (fusing copies them instead of turning them into views of the fused tensor); --eager runs the second split
without CUDA graphs. Prints "DONE" when nothing failed.

    python bench/illegal_access.py                       # prefill T=2048: crashed on the H200 (section 29)
    python bench/illegal_access.py --first none          # the compiled split alone: ran clean
    compute-sanitizer --tool memcheck python bench/illegal_access.py --eager
"""
import argparse
import sys
import time

import torch

import ppsplit
from ppsplit import CacheConfig
from ppsplit.core.ragged import CacheLayout, RaggedStep

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import build_model, stage_inputs, stage_runs  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--mode", choices=("prefill", "decode"), default="prefill",
                   help="prefill: batch 1, T=2048 from 0; decode: batch 32, T=1 at 512")
    p.add_argument("--first", choices=("fused", "none"), default="fused")
    p.add_argument("--second", choices=("compile", "compile_fused", "plain"), default="compile")
    p.add_argument("--noview", action="store_true")
    p.add_argument("--eager", action="store_true")
    a = p.parse_args()
    if a.noview:
        import ppsplit.passes.rewrites.projections as projections

        def stack(parts, dim, shapes=None):
            shapes = shapes or [tuple(t.shape) for t in parts]
            return torch.cat([t.reshape(s) for t, s in zip(parts, shapes)], dim=dim)

        projections._stack = stack
    batch, tokens, pos, max_len = (1, 2048, 0, 2048) if a.mode == "prefill" else (32, 1, 512, 1024)
    t0 = time.time()
    model = build_model("llama-3.1-8b", "cuda", num_hidden_layers=a.layers)
    traced = ppsplit.trace_model(model, cache=CacheConfig(batch, max_len))
    print(f"traced in {time.time() - t0:.0f} s", flush=True)
    keep = []
    if a.first == "fused":
        keep.append(stage_runs(ppsplit.split_model(traced, 1, aux="eagle3"), batch, tokens, pos, "cuda"))
        torch.cuda.synchronize()
        print("first split (default) replayed", flush=True)
    options = {"compile": a.second.startswith("compile")}
    if a.second == "compile_fused":
        options["fuse_projections"] = True
    split = ppsplit.split_model(traced, 1, aux="eagle3", **options)
    if a.eager:
        step = RaggedStep.lockstep(batch, tokens, pos, CacheLayout.of(split.plan)).to("cuda")
        x, _, aux = stage_inputs(split, 0, batch, tokens, pos, "cuda")
        meta = step.tensors()
        with torch.no_grad():
            for i in range(3):
                split.stages[0](x.flatten(0, 1), meta[0], aux.flatten(1, 2), *meta[1:])
                torch.cuda.synchronize()
                print(f"second split, eager call {i}", flush=True)
    else:
        run = stage_runs(split, batch, tokens, pos, "cuda")
        torch.cuda.synchronize()
        print(f"second split ({a.second}) captured", flush=True)
        for _ in range(5):
            run()
            torch.cuda.synchronize()
        print("second split replayed 5 times", flush=True)
    print(f"DONE in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
