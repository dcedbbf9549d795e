"""MLA decode over paged latents with DeepSeek-V3's FP8 ``kv_b_proj`` read as stored, against the same weight in
bf16 (what a compile stored before), on a CUDA GPU.

DeepSeek-V3's attention shape: 128 heads, latent r 512, rotary 64, ``kv_b_proj [128 x (128 + 128), 512]`` in 128x128
blocks. Per batch, ``--layers`` layers (each its own weight and latent pools, so that no weight is still in the L2
cache when the next layer reads it), each ``ppsplit::paged_latent_attention`` over a decode step of ``batch``
sequences at ``--context`` positions, captured as one CUDA graph and timed by ``triton.testing.do_bench`` (median of
``--rounds``):

- "bf16 kv_b_proj": the weight dequantised to bf16, its per-head products as batched matmuls;
- "fp8 kv_b_proj": the FP8 weight and its scales, each head's ``W_uk`` (transposed) and ``W_uv`` through the grouped
  FP8 kernel (``latent_fp8_views``).

Both get the same values (the bf16 weight is the FP8 one dequantised); their outputs are compared first. Roofline:
the weight's bytes plus the latents and rotary keys read, over the copy bandwidth measured in the same run.

    python bench/mla.py                         # batches 1, 8, 32 at 4096 positions, 8 layers
    python bench/mla.py --device cpu --small    # a smoke run of the script (no timing claims)
"""
import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import banner, graphed  # noqa: E402
from fp8 import copy_bandwidth, quantize, step_ms  # noqa: E402

from ppsplit.core.ragged import CacheLayout, RaggedStep, Segment  # noqa: E402
from ppsplit.triton_kernels.fp8 import dequantize  # noqa: E402
from ppsplit.triton_kernels.paged import paged_latent_attention  # noqa: E402

BLOCK = 64  # cache positions a block


def layer(heads, r, dr, dn, dv, batch, context, device):
    """One layer's ragged decode step, pools, query and FP8 weight: ``(run_bf16, run_fp8, bytes the FP8 run
    reads)``."""
    need = -(-(context + 1) // BLOCK)
    layout = CacheLayout(slots=batch, blocks_per_seq=need, block_size=BLOCK, num_blocks=batch * need)
    tables = {s: list(range(s * need, (s + 1) * need)) for s in range(batch)}
    step = RaggedStep.build([Segment(s, context, 1) for s in range(batch)], tables, layout).to(device)
    latents = torch.randn(layout.num_blocks, BLOCK, 1, r, device=device, dtype=torch.bfloat16)
    ropes = torch.randn(layout.num_blocks, BLOCK, 1, dr, device=device, dtype=torch.bfloat16)
    q = torch.randn(1, step.num_tokens, heads, dn + dr, device=device, dtype=torch.bfloat16).transpose(1, 2)
    w8, s8 = quantize(torch.randn(heads * (dn + dv), r, device=device) / r ** 0.5)
    w16 = dequantize(w8, s8, 128, 128, torch.bfloat16)
    args = (step.positions, step.seq, step.block_table, step.seq_start, step.seq_count, (dn + dr) ** -0.5, 0, 0.0,
            None)

    def bf16():
        return paged_latent_attention(q, latents, ropes, w16, dn, *args)

    def fp8():
        return paged_latent_attention(q, latents, ropes, w8, dn, *args, s8, 128, 128)

    read = w8.numel() + s8.numel() * 4 + batch * (context + 1) * (r + dr) * 2
    return bf16, fp8, read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="4 heads, r 128: a smoke run")
    args = ap.parse_args()
    print(banner(args.device))
    shape = (4, 128, 64, 128, 128) if args.small else (128, 512, 64, 128, 128)
    bw = copy_bandwidth(args.device)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; heads, r, dr, dn, dv = {shape}; {args.layers} layers at "
          f"{args.context} positions")
    print(f"{'batch':>5}  {'bf16 kv_b_proj us':>17}  {'fp8 kv_b_proj us':>16}  {'fp8 / bf16':>10}  "
          f"{'fp8 x roofline':>14}  max |fp8 - bf16|")
    for batch in args.batches:
        layers = [layer(*shape, batch, args.context, args.device) for _ in range(args.layers)]
        with torch.no_grad():
            diff = max((bf16() - fp8()).abs().max().item() for bf16, fp8, _ in layers)
            runs = {kind: graphed(lambda i=i: [run[i]() for run in layers], args.device) for i, kind in
                    enumerate(("bf16", "fp8"))}
            ms = {kind: step_ms(run, args.device, args.rounds) for kind, run in runs.items()}
        roof = sum(read for *_, read in layers) / bw * 1e3
        print(f"{batch:5d}  {ms['bf16'] * 1e3:17.1f}  {ms['fp8'] * 1e3:16.1f}  {ms['fp8'] / ms['bf16']:10.2f}  "
              f"{ms['fp8'] / roof:14.2f}  {diff:.3g}", flush=True)
        del layers, runs
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
