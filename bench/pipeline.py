"""Llama-3.1-8B-shaped pipeline stages on one GPU (random bf16 weights): decode latency eager vs CUDA graph,
the cost of splitting, and the cost of taps in decode and prefill.

    python bench/pipeline.py                     # all sections, on a CUDA GPU
    python bench/pipeline.py --smoke             # tiny model on the CPU: checks the script, times nothing real

Sections (each prints a table; every ratio is measured in this run, variants interleaved):
  split   pp=4 (EAGLE-3 taps 2,16,29): per-stage decode step eager vs CUDA graph at batch 1 and 32, and the sum
          over stages against the unsplit model (pp=1, same taps) under the same capture.
  taps    stage 1 (layers 8-15) with 3 taps (10, 13, 16) against the same stage without taps, decode under a
          CUDA graph (batch 1 and 32) and kernels launched per step; also with a separate copy per tap
          (fuse="norms") and with no fusion at all (fuse=False).
  prefill the same stage variants at T=8192 (batch 1), against the taps' bytes over the copy bandwidth.
"""
import argparse
import statistics
import sys
import time
import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM

import ppsplit
from ppsplit import CacheConfig

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from shapes import config  # noqa: E402

warnings.filterwarnings("ignore")
TAPS = (10, 13, 16)


def timer(device):
    if device == "cuda":
        import triton

        return lambda fn, rep=200: triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")

    def cpu(fn, rep=200):
        fn()
        start = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - start) / 3 * 1e3
    return cpu


def interleaved(bench, fns: dict, rounds: int):
    """Median time per variant over ``rounds`` interleaved measurements, and the spread (max-min)/median."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(bench(fn))
    return {k: (statistics.median(v), (max(v) - min(v)) / statistics.median(v)) for k, v in times.items()}


def stage_inputs(split, k, batch, tokens, start, device):
    if k == 0:
        x = torch.randint(0, 1000, (batch, tokens), device=device)
    else:
        x = torch.randn(batch, tokens, split.plan.hidden_size, device=device, dtype=split.dtype)
    positions = torch.arange(start, start + tokens, device=device)
    return x, positions, split.new_aux(batch, tokens, device)


def count_kernels(stage, inputs):
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        stage(*inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            stage(*inputs)
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def captured(stage, batch, tokens, inputs, device):
    if device != "cuda":
        return lambda: stage(*inputs)
    g = ppsplit.cuda_graph(stage, batch, tokens)
    g.x.copy_(inputs[0])
    g.positions.copy_(inputs[1])
    return g.replay


def section_split(traced, device, bench, rounds, batches):
    print("\n== split: decode step (T=1, position 512), eager vs CUDA graph, pp=4 vs unsplit (pp=1) ==")
    print(f"{'pp':>3} {'stage':>5} {'layers':>7} {'batch':>5} {'eager us':>9} {'graph us':>9} {'eager/graph':>11}")
    sums = {}
    for pp in (4, 1):
        split = ppsplit.split_model(traced, pp, aux="eagle3")
        for batch in batches:
            total_graph = 0.0
            for k, (stage, sp) in enumerate(zip(split.stages, split.plan.stages)):
                inputs = stage_inputs(split, k, batch, 1, 512, device)
                with torch.no_grad():
                    eager = lambda: stage(*inputs)  # noqa: E731
                    graph = captured(stage, batch, 1, inputs, device)
                    t = interleaved(bench, {"eager": eager, "graph": graph}, rounds)
                te, tg = t["eager"][0], t["graph"][0]
                total_graph += tg
                print(f"{pp:>3} {k:>5} {f'{sp.start}-{sp.end - 1}':>7} {batch:>5} {te * 1e3:>9.1f} {tg * 1e3:>9.1f} "
                      f"{te / tg:>11.2f}", flush=True)
            sums[(pp, batch)] = total_graph
        del split
    for batch in batches:
        ratio = sums[(4, batch)] / sums[(1, batch)]
        print(f"batch {batch}: sum of 4 captured stages {sums[(4, batch)] * 1e3:.1f} us vs unsplit captured "
              f"{sums[(1, batch)] * 1e3:.1f} us: x{ratio:.4f} ({(ratio - 1) * 100:+.2f}%)")


VARIANTS = {
    "no taps": dict(aux=None),
    "3 taps fused": dict(aux=TAPS),
    "3 taps, copy per tap": dict(aux=TAPS, fuse="norms"),
    "no taps, fuse=False": dict(aux=None, fuse=False),
    "3 taps, fuse=False": dict(aux=TAPS, fuse=False),
}


def section_taps(traced, device, bench, rounds, batches):
    print(f"\n== taps: stage 1 of pp=4 (layers 8-15), taps {TAPS}, decode T=1 under a CUDA graph ==")
    splits = {name: ppsplit.split_model(traced, 4, **kw) for name, kw in VARIANTS.items()}
    for name, split in splits.items():
        print(f"  {name}: " + "; ".join(split.plan.fused[1]) if split.plan.fused else f"  {name}: (no fusion)")
    print(f"{'variant':<22} {'batch':>5} {'graph us':>9} {'spread':>7} {'vs no taps':>10} {'kernels':>8}")
    for batch in batches:
        fns, kernels = {}, {}
        for name, split in splits.items():
            inputs = stage_inputs(split, 1, batch, 1, 512, device)
            fns[name] = captured(split.stages[1], batch, 1, inputs, device)
            kernels[name] = count_kernels(split.stages[1], inputs) if device == "cuda" else 0
        t = interleaved(bench, fns, rounds)
        for name in splits:
            base = "no taps" if "fuse=False" not in name else "no taps, fuse=False"
            over = (t[name][0] / t[base][0] - 1) * 100
            print(f"{name:<22} {batch:>5} {t[name][0] * 1e3:>9.2f} {t[name][1] * 100:>6.1f}% {over:>+9.2f}% "
                  f"{kernels[name]:>8}", flush=True)


def section_prefill(model, device, bench, rounds, tokens, copy_bw):
    print(f"\n== prefill: stage 1 of pp=4, T={tokens}, batch 1 (eager) ==")
    traced = ppsplit.trace_model(model, cache=CacheConfig(1, tokens))
    splits = {name: ppsplit.split_model(traced, 4, **kw) for name, kw in VARIANTS.items() if "fuse=False" not in name}
    fns = {}
    for name, split in splits.items():
        inputs = stage_inputs(split, 1, 1, tokens, 0, device)
        fns[name] = (lambda st, inp: (lambda: st(*inp)))(split.stages[1], inputs)
    with torch.no_grad():
        t = interleaved(lambda f: bench(f, rep=1000), fns, rounds)
    tap_bytes = len(TAPS) * tokens * model.config.hidden_size * 2
    budget = tap_bytes / copy_bw / 1e6 if copy_bw else 0.0  # ms
    base = t["no taps"][0]
    print(f"{'variant':<22} {'ms':>9} {'spread':>7} {'vs no taps':>10} {'allowed':>9}")
    for name in splits:
        print(f"{name:<22} {t[name][0]:>9.3f} {t[name][1] * 100:>6.1f}% {(t[name][0] / base - 1) * 100:>+9.2f}% "
              f"{(budget / base + 0.02) * 100:>+8.2f}%")
    print(f"taps' bytes {tap_bytes / 1e6:.0f} MB over {copy_bw:.0f} GB/s = {budget * 1e3:.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script only)")
    ap.add_argument("--sections", default="split,taps,prefill")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    overrides = dict(num_hidden_layers=16, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=4, vocab_size=1024) if args.smoke else {}
    bench = timer(device)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    start = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config("llama-3.1-8b", **overrides), torch_dtype=torch.bfloat16).eval()
    print(f"model built in {time.perf_counter() - start:.0f}s")
    copy_bw = 0.0
    if device == "cuda":
        a = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)
        b = torch.empty_like(a)
        copy_bw = 2 * a.numel() * 2 / bench(lambda: b.copy_(a)) / 1e6
        del a, b
        print(f"copy: {copy_bw:.0f} GB/s")
    sections = args.sections.split(",")
    if "split" in sections or "taps" in sections:
        start = time.perf_counter()
        traced = ppsplit.trace_model(model, cache=CacheConfig(32, 1024))
        print(f"traced with a 32 x 1024 KV cache in {time.perf_counter() - start:.0f}s")
        batches = (1, 32)
        if "split" in sections:
            section_split(traced, device, bench, args.rounds, batches)
        if "taps" in sections:
            section_taps(traced, device, bench, args.rounds, batches)
        del traced
        if device == "cuda":
            torch.cuda.empty_cache()
    if "prefill" in sections:
        section_prefill(model, device, bench, args.rounds, 64 if args.smoke else args.prefill_tokens, copy_bw)


if __name__ == "__main__":
    main()
