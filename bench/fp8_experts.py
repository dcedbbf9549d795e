"""FP8 MoE experts: one layer's routed experts as a stage runs them, FP8 against bf16, DeepSeek-V3's shape.

256 experts, ``gate_up_proj [2 x 2048, 7168]`` and ``down_proj [7168, 2048]`` each, top-8 routing of ``B`` tokens
(uniform random, fixed seed), 128x128 block scales. Per batch, in one run, each captured as a CUDA graph and timed
by ``triton.testing.do_bench`` (median of ``--rounds``):

- "ppsplit fp8": ``ppsplit::fp8_grouped_mm`` for the up projection, SiLU-and-multiply, then the down projection
  (what an FP8 stage runs where a bf16 compile traced ``torch._grouped_mm``);
- "bf16 grouped_mm": ``torch._grouped_mm`` over the same experts dequantised to bf16 (what a stage ran before FP8
  experts stayed FP8: the compile dequantised them);
- "roofline": the bytes the step must read (every routed expert's FP8 weights and scales, once) over the device's
  copy bandwidth, measured in the same run.

Before timing, the FP8 output is compared with the bf16 one (the same dequantised weights; a bf16-sized difference
is expected, as the FP8 kernel accumulates each 128-column block in fp32 and scales it).

    python bench/fp8_experts.py                   # batches 1, 8, 32, 128
    python bench/fp8_experts.py --experts 64      # fewer experts (less memory; the same per-token work)
    python bench/fp8_experts.py --device cpu --small --rounds 1   # a smoke run of the script (no timing claims)
"""
import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import banner  # noqa: E402
from fp8 import copy_bandwidth, quantize, step_ms  # noqa: E402

from ppsplit.triton_kernels.fp8 import dequantize, fp8_grouped_mm  # noqa: E402

TOP_K = 8


def experts(e: int, n: int, k: int, device: str):
    """``e`` random experts [n, k] quantised in 128-blocks: (FP8 stack, scales, the stack dequantised to bf16)."""
    q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty(e, -(-n // 128), -(-k // 128), device=device)
    for i in range(e):  # one expert at a time: the fp32 randoms of all of them would not fit
        q[i], s[i] = quantize(torch.randn(n, k, device=device) * 0.02)
    return q, s, dequantize(q, s, 128, 128, torch.bfloat16)


def routing(tokens: int, e: int, device: str):
    """Top-8 of ``e`` experts per token, sorted by expert as transformers' grouped experts sort them:
    (row of each routed pair's token, the experts' row ends, the distinct experts chosen)."""
    gen = torch.Generator().manual_seed(tokens)
    chosen = torch.stack([torch.randperm(e, generator=gen)[:TOP_K] for _ in range(tokens)]).flatten()
    order = chosen.argsort(stable=True)
    ends = torch.bincount(chosen, minlength=e).cumsum(0).to(torch.int32)
    return (order // TOP_K).to(device), ends.to(device), chosen.unique().numel()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="hidden 256, experts of 128 (CPU smoke runs)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --device cpu --small for a smoke run")
    print(banner(args.device))
    hidden, inter = (256, 128) if args.small else (7168, 2048)
    e, dev = args.experts, args.device
    up_q, up_s, up_bf16 = experts(e, 2 * inter, hidden, dev)
    down_q, down_s, down_bf16 = experts(e, hidden, inter, dev)
    per_expert = sum(t[0].numel() * t.element_size() for t in (up_q, up_s, down_q, down_s))
    bw = copy_bandwidth(dev)
    print(f"{e} experts of [{2 * inter}, {hidden}] + [{hidden}, {inter}], top-{TOP_K}; {per_expert / 2**20:.1f} MiB "
          f"FP8 per expert; copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'batch':>5} {'rows':>5} {'experts':>7} {'ppsplit fp8 us':>15} {'bf16 grouped_mm us':>19} "
          f"{'roofline us':>12} {'fp8/bf16':>9} {'fp8/roofline':>13} {'max |fp8-bf16|':>15}")
    for tokens in args.batch:
        rows, ends, used = routing(tokens, e, dev)
        x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)[rows]

        def mlp(up, down):
            gate_up = up(x)
            return down(torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:])

        def fp8():
            return mlp(lambda h: fp8_grouped_mm(h, up_q, up_s, ends, 128, 128),
                       lambda h: fp8_grouped_mm(h, down_q, down_s, ends, 128, 128))

        def bf16():
            return mlp(lambda h: torch._grouped_mm(h, up_bf16.transpose(-2, -1), offs=ends),
                       lambda h: torch._grouped_mm(h, down_bf16.transpose(-2, -1), offs=ends))

        diff = (fp8().float() - bf16().float()).abs().max().item()
        runs = {}
        for name, fn in (("fp8", fp8), ("bf16", bf16)):
            if dev == "cuda":
                fn()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                runs[name] = step_ms(graph.replay, dev, args.rounds) * 1e3
            else:
                runs[name] = step_ms(fn, dev, args.rounds) * 1e3
        roof = used * per_expert / bw * 1e6
        print(f"{tokens:>5} {rows.numel():>5} {used:>7} {runs['fp8']:>15.1f} {runs['bf16']:>19.1f} {roof:>12.1f} "
              f"{runs['fp8'] / runs['bf16']:>9.2f} {runs['fp8'] / roof:>13.2f} {diff:>15.4f}")


if __name__ == "__main__":
    main()
