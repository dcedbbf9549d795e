"""Balance policies on full-size shapes: how even is each policy's split under the decode cost model, and, on a
GPU, how even are the measured stage times of the `layers` split against the `time` split.

    python bench/balance.py                  # meta device, CPU: Llama-3.1-8B, Qwen3-30B-A3B, Gemma-2-9B, pp=4 and 8
    python bench/balance.py --gpu            # one CUDA GPU: Llama-3.1-8B random bf16, pp=4, captured decode steps
    python bench/balance.py --gpu --tiny     # the GPU section's code on a small model on the CPU (checks the script)

Half layers (``half_layers=True``: stages may also end between a layer's attention and MLP blocks) are planned
beside whole layers in both modes: rows marked ``+half`` in meta mode, and the ``time+half`` / ``flops+half`` splits
in GPU mode, whose per-half times are measured in the same run (one half layer per stage, captured).

Meta mode: each shape is traced once on the meta device (20-35 s each here; the per-region costs are cached in
--cache, so a rerun only plans), then split with every policy that needs no weights. Each split's imbalance
(slowest stage over the mean) is evaluated in the flops cost model of a decode step at batch 1 (context 1024) and
at batch 64 (context 4096), and its largest stage in weight bytes.

GPU mode: per batch size, the `time` policy times every layer (one layer per stage, captured) for a decode step at
position 512, then the `layers`, `flops` and `time` splits at pp=4 are captured and timed stage by stage in the
same run, interleaved. Implied pipeline throughput = batch / slowest stage (one micro-batch in flight per stage).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import transformers

import ppsplit
from ppsplit import CacheConfig, CostModel, ModelCosts, RegionCosts
from ppsplit.passes.plan import make_plan
from ppsplit.compile.measure import stage_timer
from ppsplit.core.plan import imbalance

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import config  # noqa: E402

warnings.filterwarnings("ignore")
META_SHAPES = ("llama-3.1-8b", "qwen3-30b-a3b", "gemma-2-9b")
WORKLOADS = {"b=1": CostModel(batch=1, context=1024), "b=64": CostModel(batch=64, context=4096)}


def versions() -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}, "
            f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, {gpu}")


# ---------------------------------------------------------------------------------------------------- meta mode

def shape_costs(name: str, cache_path: str) -> dict:
    """ModelCosts and the decode flops per region of one shape, traced on the meta device (cached on disk)."""
    key = f"{name} torch {torch.__version__} transformers {transformers.__version__} halves"
    cached = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    if key not in cached:
        from ppsplit.passes.planning.costs import count_flops
        from ppsplit.passes.planning.halves import half_costs
        from ppsplit.compile.source import skeleton

        start = time.perf_counter()
        model, _ = skeleton(config(name), torch.bfloat16)
        annotated = ppsplit.trace_model(model)
        counts = count_flops(annotated)
        # With the half-layer fields (mid points, attention halves): whole-layer plans ignore them.
        cached[key] = {"costs": vars(half_costs(annotated)) | {}, "trace_s": time.perf_counter() - start,
                       "flops": {w: vars(counts.workload(m, halves=True)) for w, m in WORKLOADS.items()},
                       "uncounted": list(counts.uncounted)}
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        with open(cache_path, "w") as f:
            json.dump(cached, f)
    entry = cached[key]
    return {"costs": ModelCosts(**{k: tuple(v) if isinstance(v, list) else v for k, v in entry["costs"].items()}),
            "flops": {w: RegionCosts(**{k: tuple(v) if isinstance(v, list) else v for k, v in r.items()})
                      for w, r in entry["flops"].items()},
            "trace_s": entry["trace_s"], "uncounted": entry["uncounted"]}


def meta_mode(args):
    print(versions())
    print("imbalance = slowest stage / mean stage, in the flops cost model of one decode step "
          "(b=1: batch 1, context 1024; b=64: batch 64, context 4096); 1.000 is perfectly even")
    print("+half: half_layers=True, stage boundaries may also fall between a layer's attention and MLP blocks "
          "(x.5 layers per stage)")
    print(f"{'shape':<14} {'pp':>2} {'policy':<15} {'layers per stage':<40} {'b=1':>6} {'b=64':>6} "
          f"{'max GiB':>8} {'weights':>8}")
    for name in args.shapes.split(","):
        entry = shape_costs(name, args.cache)
        costs, flops = entry["costs"], entry["flops"]
        policies = {"layers": ("layers", None), "params": ("params", None), "memory": ("memory", None),
                    "flops b=1": ("flops", flops["b=1"]), "flops b=64": ("flops", flops["b=64"])}
        for pp in (4, 8):
            for halves in (False, True):
                for label, (policy, region) in policies.items():
                    plan = make_plan(costs, pp, balance=policy, region_costs=region, half_layers=halves)
                    sizes = "/".join(f"{n:g}" for n in plan.sizes)
                    held = [s.bytes / 2**30 for s in plan.stages]
                    print(f"{name:<14} {pp:>2} {label + (' +half' if halves else ''):<15} {sizes:<40} "
                          f"{imbalance(flops['b=1'].span_costs(plan.bounds)):>6.3f} "
                          f"{imbalance(flops['b=64'].span_costs(plan.bounds)):>6.3f} {max(held):>8.2f} "
                          f"{imbalance(held):>8.3f}", flush=True)
        print(f"  {name}: {len(costs.mid_layers)} of {costs.num_layers} layers have a mid point")
        f1, f64 = flops["b=1"], flops["b=64"]
        print(f"  {name}: traced in {entry['trace_s']:.0f}s; decode b=1 GFLOP: layer {statistics.median(f1.layers) / 1e9:.3f}, "
              f"head {f1.head / 1e9:.3f}, embed {f1.embed / 1e9:.3f}; b=64: layer "
              f"{statistics.median(f64.layers) / 1e9:.1f}, head {f64.head / 1e9:.1f}"
              + (f"; {len(entry['uncounted'])} matmuls uncounted" if entry["uncounted"] else ""))


# ----------------------------------------------------------------------------------------------------- GPU mode


def gpu_mode(args):
    device = "cpu" if args.tiny else "cuda"
    print(versions())
    overrides = dict(num_hidden_layers=12, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=4, vocab_size=32000) if args.tiny else {}
    start = time.perf_counter()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config("llama-3.1-8b", **overrides),
                                                              dtype=torch.bfloat16 if device == "cuda" else None).eval()
    batches = [int(b) for b in args.batches.split(",")]
    traced = ppsplit.trace_model(model, cache=CacheConfig(max(batches), 1024))
    print(f"built and traced Llama-3.1-8B{' (tiny)' if args.tiny else ''} with a {max(batches)} x 1024 KV cache in "
          f"{time.perf_counter() - start:.0f}s on {device}", flush=True)
    position = 512
    for batch in batches:
        try:
            gpu_batch(traced, batch, position, device, args)
        except Exception as e:  # report and go on with the next batch size
            print(f"batch {batch}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()


def gpu_batch(traced, batch, position, device, args):
    workload = CostModel(batch=batch, tokens=1, context=position)
    start = time.perf_counter()
    splits = {"time": ppsplit.split_model(traced, 4, balance="time", cost_model=workload)}
    measured = time.perf_counter() - start
    splits["layers"] = ppsplit.split_model(traced, 4)
    splits["flops"] = ppsplit.split_model(traced, 4, balance="flops", cost_model=workload)
    region = splits["time"].plan.region_costs
    print(f"\n== batch {batch}, decode step at position {position}: per-layer times measured in {measured:.0f}s: "
          f"layer median {statistics.median(region.layers) * 1e3:.1f} us (min {min(region.layers) * 1e3:.1f}, max "
          f"{max(region.layers) * 1e3:.1f}), embedding {region.embed * 1e3:.1f} us, head {region.head * 1e3:.1f} us, "
          f"per stage {region.stage * 1e3:.1f} us", flush=True)
    if not args.no_halves:
        start = time.perf_counter()
        splits["time+half"] = ppsplit.split_model(traced, 4, balance="time", cost_model=workload, half_layers=True)
        measured = time.perf_counter() - start
        splits["flops+half"] = ppsplit.split_model(traced, 4, balance="flops", cost_model=workload, half_layers=True)
        half = splits["time+half"].plan.region_costs
        mlp = [c - a for c, a in zip(half.layers, half.attention)]
        print(f"   per-half times measured in {measured:.0f}s: attention half median "
              f"{statistics.median(half.attention) * 1e3:.1f} us, MLP half median "
              f"{statistics.median(mlp) * 1e3:.1f} us, "
              f"layer median {statistics.median(half.layers) * 1e3:.1f} us, embedding {half.embed * 1e3:.1f} us, head "
              f"{half.head * 1e3:.1f} us, per stage {half.stage * 1e3:.1f} us", flush=True)
    repeat = 50 if device == "cuda" else 3  # replays per sample on a GPU, eager calls on the CPU
    timers = {(name, k): stage_timer(stage, batch, 1, position, repeat)
              for name, split in splits.items() for k, stage in enumerate(split.stages)}
    samples = {key: [] for key in timers}
    for _ in range(args.rounds):
        for key, run in timers.items():
            samples[key].append(run())
    ms = {key: statistics.median(v) for key, v in samples.items()}
    print(f"{'split':<10} {'stage':>5} {'layers':>13} {'predicted us':>12} {'measured us':>11} {'spread':>7}")
    summary = {}
    for name, split in splits.items():
        # Predicted from the run's own per-layer (or, for half-layer splits, per-half) times.
        model = splits["time+half"].plan.region_costs if split.plan.half_layers or name.endswith("+half") else region
        predicted = model.span_costs(split.plan.bounds)
        times = [ms[(name, k)] for k in range(split.plan.pp)]
        for k, s in enumerate(split.plan.stages):
            v = samples[(name, k)]
            print(f"{name:<10} {k:>5} {split.plan.layer_range(k):>13} {predicted[k] * 1e3:>12.1f} "
                  f"{times[k] * 1e3:>11.1f} {(max(v) - min(v)) / statistics.median(v) * 100:>6.1f}%")
        summary[name] = (times, predicted, split.plan.sizes)
    print(f"{'split':<10} {'layers per stage':<20} {'slowest us':>10} {'mean us':>8} {'slowest/mean':>12} "
          f"{'predicted':>9} {'tokens/s':>9} {'vs layers':>9}")
    base = max(summary["layers"][0])
    for name, (times, predicted, sizes) in summary.items():
        slowest, mean = max(times), sum(times) / len(times)
        print(f"{name:<10} {'/'.join(f'{n:g}' for n in sizes):<20} {slowest * 1e3:>10.1f} {mean * 1e3:>8.1f} "
              f"{slowest / mean:>12.3f} {imbalance(predicted):>9.3f} {batch / slowest * 1e3:>9.0f} "
              f"{base / slowest:>8.3f}x", flush=True)
    for name in ("time", "time+half"):
        if name not in summary:
            continue
        times = summary[name][0]
        goal = max(times) / (sum(times) / len(times))
        print(f"{name} split: slowest stage {100 * (goal - 1):+.1f}% over the mean (goal: within 5%); the best "
              f"contiguous split under its measured {'half-layer' if 'half' in name else 'layer'} times is "
              f"{100 * (splits[name].plan.imbalance - 1):+.1f}% over it")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true", help="measured stage times on one CUDA GPU")
    ap.add_argument("--tiny", action="store_true", help="with --gpu: a small model on the CPU (checks the script)")
    ap.add_argument("--shapes", default=",".join(META_SHAPES))
    ap.add_argument("--batches", default="1,32", help="with --gpu: decode batch sizes")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-halves", action="store_true", help="with --gpu: whole layers only (no half-layer splits)")
    ap.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "ppsplit", "bench_balance.json"))
    args = ap.parse_args()
    gpu_mode(args) if args.gpu else meta_mode(args)


if __name__ == "__main__":
    main()
