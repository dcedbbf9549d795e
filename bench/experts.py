"""Quantised MoE experts: one layer's routed experts as a stage runs them, against bf16, on a CUDA GPU.

- FP8, DeepSeek-V3's shape: 256 experts, ``gate_up_proj [2 x 2048, 7168]`` and ``down_proj [7168, 2048]``, top-8,
  128x128 block scales; "quantised" is ``ppsplit::fp8_grouped_mm``.
- MXFP4, gpt-oss-120b's shape: 128 experts, ``gate_up_proj [2 x 2880, 2880]`` and ``down_proj [2880, 2880]``,
  top-4, E2M1 values with an E8M0 scale per 32; "quantised" is ``ppsplit::mxfp4_grouped_mm``.

Tokens are routed uniformly at random (fixed seed). Per batch, in one run, each variant is captured as a CUDA graph
and timed by ``triton.testing.do_bench`` (median of ``--rounds``): the up projection, SiLU-and-multiply, the down
projection, with

- "quantised": ppsplit's kernel over the stored bytes (what a quantised stage runs where a bf16 compile traced
  ``torch._grouped_mm``);
- "bf16 grouped_mm": ``torch._grouped_mm`` over the same experts dequantised to bf16 (what a stage ran when the
  compile dequantised them);
- "roofline": the bytes the step must read (every routed expert's stored weights and scales, once) over the
  device's copy bandwidth, measured in the same run.

Before timing, the quantised output is compared with the bf16 one (the same dequantised weights; a bf16-sized
difference is expected from the accumulation order).

    python bench/experts.py                       # both formats, batches 1, 8, 32, 128
    python bench/experts.py --sweep               # and each kernel on the other tiles of TILES
    python bench/experts.py --format mxfp4 --experts 32   # fewer experts (less memory; the same per-token work)
    python bench/experts.py --device cpu --small --rounds 1   # a smoke run of the script (no timing claims)
"""
import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import banner  # noqa: E402
from fp8 import copy_bandwidth, quantize, step_ms  # noqa: E402

from ppsplit.triton_kernels.fp8 import dequantize, fp8_grouped_mm, launch_fp8_grouped_mm  # noqa: E402
from ppsplit.triton_kernels.mxfp4 import dequantize_mxfp4, launch_mxfp4_grouped_mm, mxfp4_grouped_mm  # noqa: E402

# --sweep: the tiles timed beside the defaults (the first of each), (BLOCK_M, BLOCK_N[, BLOCK_K], warps, stages);
# their sm_90 instruction counts are in bench/RESULTS.md section 33
TILES = {"fp8": [(16, 64, 4, 3), (16, 128, 4, 3), (16, 128, 8, 3), (16, 256, 8, 3), (16, 64, 4, 4)],
         "mxfp4": [(16, 64, 128, 4, 3), (16, 64, 64, 4, 2), (16, 128, 128, 4, 2), (16, 128, 256, 8, 2),
                   (16, 64, 128, 4, 2), (16, 64, 64, 4, 3),
                   # the input range split over 2-6 programs (fp32 partials, a second kernel adds them): at decode only
                   # the top-k experts have rows, and more, shorter programs keep more bytes in flight
                   (16, 64, 128, 4, 3, 2), (16, 64, 128, 4, 3, 4), (16, 32, 128, 4, 3, 3), (16, 64, 64, 4, 3, 6)]}
# format: (experts, hidden, intermediate, top-k), full size and --small
SHAPES = {"fp8": ((256, 7168, 2048, 8), (16, 256, 128, 8)), "mxfp4": ((128, 2880, 2880, 4), (16, 256, 128, 4))}


def fp8_experts(e: int, n: int, k: int, device: str):
    """``e`` random experts [n, k] in 128-blocks: (the product over them, their stored bytes each, bf16 stack)."""
    q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty(e, -(-n // 128), -(-k // 128), device=device)
    for i in range(e):  # one expert at a time: the fp32 randoms of all of them would not fit
        q[i], s[i] = quantize(torch.randn(n, k, device=device) * 0.02)
    def run(h, ends, config=None):
        return fp8_grouped_mm(h, q, s, ends, 128, 128) if config is None else \
            launch_fp8_grouped_mm(h, q, s, ends, 128, 128, config=config)

    dense = torch.empty(e, n, k, dtype=torch.bfloat16, device=device)
    for i in range(e):  # one expert at a time: the stack's fp32 intermediate (28 GiB) would not fit an H100
        dense[i] = dequantize(q[i], s[i], 128, 128, torch.bfloat16)
    return run, q[0].numel() + s[0].numel() * 4, dense


def mxfp4_experts(e: int, n: int, k: int, device: str):
    """``e`` random MXFP4 experts [n, k]: random bytes, exponents 2**-10 .. 2**-6 (weights of a trained model's
    size)."""
    gen = torch.Generator(device=device).manual_seed(n + k)
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8, device=device)
    scales = torch.randint(117, 122, (e, n, k // 32), generator=gen, dtype=torch.uint8, device=device)
    def run(h, ends, config=None):
        return mxfp4_grouped_mm(h, blocks, scales, ends) if config is None else \
            launch_mxfp4_grouped_mm(h, blocks, scales, ends, config=config)

    return run, blocks[0].numel() + scales[0].numel(), dequantize_mxfp4(blocks, scales, torch.bfloat16)


def routing(tokens: int, e: int, top_k: int, device: str):
    """Top-k of ``e`` experts per token, sorted by expert as transformers' grouped experts sort them:
    (row of each routed pair's token, the experts' row ends, the distinct experts chosen)."""
    gen = torch.Generator().manual_seed(tokens)
    chosen = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)]).flatten()
    order = chosen.argsort(stable=True)
    ends = torch.bincount(chosen, minlength=e).cumsum(0).to(torch.int32)
    return (order // top_k).to(device), ends.to(device), chosen.unique().numel()


def timed(fn, device: str, rounds: int) -> float:
    """Microseconds a call of ``fn`` takes: captured as a CUDA graph and replayed on CUDA, else called."""
    if device != "cuda":
        return step_ms(fn, device, rounds) * 1e3
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return step_ms(graph.replay, device, rounds) * 1e3


def run_format(fmt: str, args, bw: float) -> None:
    e, hidden, inter, top_k = SHAPES[fmt][args.small]
    e, dev = args.experts or e, args.device
    make = fp8_experts if fmt == "fp8" else mxfp4_experts
    up, up_bytes, up_bf16 = make(e, 2 * inter, hidden, dev)
    down, down_bytes, down_bf16 = make(e, hidden, inter, dev)
    per_expert = up_bytes + down_bytes
    print(f"\n{fmt}: {e} experts of [{2 * inter}, {hidden}] + [{hidden}, {inter}], top-{top_k}; "
          f"{per_expert / 2**20:.1f} MiB stored per expert")
    print(f"{'batch':>5} {'rows':>5} {'experts':>7} {'quantised us':>13} {'bf16 grouped_mm us':>19} "
          f"{'roofline us':>12} {'q/bf16':>7} {'q/roofline':>11} {'max |q-bf16|':>13}")
    for tokens in args.batch:
        rows, ends, used = routing(tokens, e, top_k, dev)
        x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)[rows]

        def mlp(up_fn, down_fn):
            gate_up = up_fn(x)
            return down_fn(torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:])

        def quantised():
            return mlp(lambda h: up(h, ends), lambda h: down(h, ends))

        def bf16():
            return mlp(lambda h: torch._grouped_mm(h, up_bf16.transpose(-2, -1), offs=ends),
                       lambda h: torch._grouped_mm(h, down_bf16.transpose(-2, -1), offs=ends))

        def tiled(config):
            return lambda: mlp(lambda h: up(h, ends, config), lambda h: down(h, ends, config))

        diff = (quantised().float() - bf16().float()).abs().max().item()
        us = {name: timed(fn, dev, args.rounds) for name, fn in (("q", quantised), ("bf16", bf16))}
        roof = used * per_expert / bw * 1e6
        print(f"{tokens:>5} {rows.numel():>5} {used:>7} {us['q']:>13.1f} {us['bf16']:>19.1f} {roof:>12.1f} "
              f"{us['q'] / us['bf16']:>7.2f} {us['q'] / roof:>11.2f} {diff:>13.4f}")
        for config in TILES[fmt] if args.sweep and dev == "cuda" else ():  # the Triton kernels need the GPU
            try:
                t = timed(tiled(config), dev, args.rounds)
                apart = (tiled(config)().float() - quantised().float()).abs().max().item()
            except Exception as e:  # tiles the compiler refuses (registers, shared memory)
                print(f"{'':>19} tiles {str(config):<22} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            print(f"{'':>19} tiles {str(config):<22} {t:>9.1f} us  {t / us['bf16']:>5.2f} of bf16  "
                  f"{t / roof:>5.2f} of roofline  max |diff| from the default tiles {apart:.4f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=["fp8", "mxfp4", "both"], default="both")
    ap.add_argument("--experts", type=int, help="experts a layer (default: the model's)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="small experts (CPU smoke runs)")
    ap.add_argument("--sweep", action="store_true", help="also time the kernels on the tiles of TILES")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --device cpu --small for a smoke run")
    print(banner(args.device))
    bw = copy_bandwidth(args.device)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    for fmt in ("fp8", "mxfp4") if args.format == "both" else (args.format,):
        run_format(fmt, args, bw)
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
