"""Batch-1 projections (GEMV): ppsplit's Triton ``launch_gemv`` beside cuBLAS (``torch.nn.functional.linear``),
Llama-3.1-8B's shapes in bf16 (q/k/v fused, o_proj, gate/up fused, down, lm_head), on a CUDA GPU.

Each variant is captured in a CUDA graph and its replays timed interleaved (median of --rounds of
``triton.testing.do_bench``); GB/s = weight bytes over the time; "x cuBLAS" = time over cuBLAS's time.

    python bench/gemv.py              # the configuration ppsplit::linear picks per shape, against cuBLAS
    python bench/gemv.py --sweep      # also a sweep of (BLOCK_N, BLOCK_K, warps, stages)
"""
import argparse
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from attention import gpu_banner, timed  # noqa: E402

from ppsplit.triton_kernels.gemv import launch_gemv, pick_config  # noqa: E402

SHAPES = {"qkv 4096->6144": (4096, 6144), "o_proj 4096->4096": (4096, 4096), "gate_up 4096->28672": (4096, 28672),
          "down 14336->4096": (14336, 4096), "lm_head 4096->128256": (4096, 128256)}
SWEEP = [(8, 512, 4, 4), (16, 512, 4, 3), (16, 512, 4, 4), (16, 1024, 8, 3), (32, 256, 4, 4), (32, 512, 8, 3),
         (8, 1024, 4, 3), (16, 256, 4, 6), (4, 1024, 4, 4), (16, 512, 8, 4)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    gpu_banner("bench/gemv.py")
    for name, (K, N) in SHAPES.items():
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        ref = (x.float() @ w.float().T)
        variants = {"cuBLAS (F.linear)": lambda x=x, w=w: F.linear(x, w)}
        chosen = pick_config(N, K)
        configs = [chosen] + ([c for c in SWEEP if c != chosen] if args.sweep else [])
        for cfg in configs:
            label = "triton " + "n{} k{} w{} s{}".format(*cfg) + (" (op's choice)" if cfg == chosen else "")
            try:
                y = launch_gemv(x, w, config=cfg)
                diff = (y.float() - ref).abs().max().item()
                if diff > 5e-2:
                    print(f"  {name} {label}: differs from fp32 by {diff:.3g}", flush=True)
                    continue
                variants[label] = lambda x=x, w=w, cfg=cfg: launch_gemv(x, w, config=cfg)
            except Exception as e:  # noqa: BLE001
                print(f"  {name} {label}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        med = timed(variants, args.rounds, 100)
        base = med["cuBLAS (F.linear)"]
        print(f"\n== {name}: {N * K * 2 / 1e6:.0f} MB of weight", flush=True)
        for label, us in sorted(med.items(), key=lambda kv: kv[1]):
            print(f"  {label:<34} {us:8.2f} us {N * K * 2 / us / 1e3:6.0f} GB/s {us / base:6.2f} x cuBLAS", flush=True)


if __name__ == "__main__":
    main()
