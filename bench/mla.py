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
    python bench/mla.py --chunks 128 256 512 --profile   # also the FP8 step with the attention's keys cut into
                                                # chunks of these many positions (the plan's own chunks: the first row),
                                                # and the FP8 step's kernels by GPU time at the first batch
    python bench/mla.py --grouped-tiles 16,128,4,3 16,32,4,2   # also the two per-head FP8 products alone on these
                                                # grouped-kernel tiles (BLOCK_M, BLOCK_N, warps, stages), per layer
    python bench/mla.py --device cpu --small    # a smoke run of the script (no timing claims)

At one decode token the plan cuts each sequence's keys into chunks until there is one program an SM for latent tiles
(``attention_plan``: 16 heads of 576-wide keys a program fill an SM's registers; eight an SM for GQA tiles), each chunk
with the partial outputs of its 16 heads of 512-wide latents in fp32 for the combine kernel: at 4096 positions 17
chunks of 256 at batch 1, 3 of 2048 at batch 8, none at 32. ``--chunks`` times other chunk lengths beside the plan's in
the same run (at eight programs an SM the plan took 65 chunks of 64 at batch 1, whose partials, 17 MB a layer,
outweighed the 4.7 MB of latents they came from, and twice the time: bench/RESULTS.md section 42).
"""
import argparse
import sys
from typing import Callable, NamedTuple

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import banner, graphed  # noqa: E402
from fp8 import copy_bandwidth, profile, quantize, step_ms  # noqa: E402

from ppsplit.core.ragged import CacheLayout, RaggedStep, Segment  # noqa: E402
from ppsplit.triton_kernels.fp8 import dequantize  # noqa: E402
from ppsplit.triton_kernels.paged import (_per_head, latent_fp8_views, launch_paged_latent_attention,  # noqa: E402
                                          paged_latent_attention)

BLOCK = 64  # cache positions a block


class Layer(NamedTuple):
    """One layer's runs (``layer``) and the bytes its FP8 step reads."""
    bf16: Callable
    fp8: Callable
    fp8_chunked: Callable  # chunk -> the FP8 step with the keys in chunks of that many positions
    products: Callable     # grouped-kernel tiles -> {"W_uk": run, "W_uv": run}
    read: int


def layer(heads, r, dr, dn, dv, batch, context, device):
    """One layer's ragged decode step, pools, query and FP8 weight, as a ``Layer``."""
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

    def fp8_chunked(chunk: int):
        """The FP8 step with each sequence's keys in chunks of ``chunk`` positions (``None``: the plan's); on CUDA."""
        views = latent_fp8_views(w8, s8, 128, 128, heads, dn)
        positions = step.block_table.shape[1] * BLOCK
        config = None if chunk is None else dict(chunk=chunk, splits=-(-positions // chunk))
        return lambda: launch_paged_latent_attention(q, latents, ropes, w8, dn, *args[:-1], config=config, fp8=views)

    o_lat = torch.randn(1, heads, step.num_tokens, r, device=device, dtype=torch.bfloat16)  # an attention output

    def products(config):
        """The FP8 step's two per-head products alone (``W_uk`` absorbing the query, ``W_uv`` expanding the latent
        output), on grouped-kernel tiles ``config`` (``None``: each view's own, ``paged.LATENT_TILES``)."""
        (*uk, uk_tiles), (*uv, uv_tiles) = latent_fp8_views(w8, s8, 128, 128, heads, dn)
        return {"W_uk": lambda: _per_head(q[..., :dn], *uk, config=config or uk_tiles),
                "W_uv": lambda: _per_head(o_lat, *uv, config=config or uv_tiles)}

    read = w8.numel() + s8.numel() * 4 + batch * (context + 1) * (r + dr) * 2
    return Layer(bf16, fp8, fp8_chunked, products, read)


def grouped_tiles(layers, args) -> None:
    """Each of the two per-head FP8 products alone over the layers' weights (captured, weights out of L2), on its
    own grouped-kernel tiles (``paged.LATENT_TILES``) and each of ``--grouped-tiles``, the outputs checked against
    its own tiles'."""
    configs = [None] + [tuple(int(v) for v in t.split(",")) for t in args.grouped_tiles]
    with torch.no_grad():
        for view in ("W_uk", "W_uv"):
            want = [one.products(None)[view]() for one in layers]
            for config in configs:
                runs = [one.products(config)[view] for one in layers]
                try:
                    diff = max((run() - w).abs().max().item() for run, w in zip(runs, want))
                    ms = step_ms(graphed(lambda runs=runs: [run() for run in runs], args.device), args.device,
                                 args.rounds)
                except Exception as e:  # tiles the compiler refuses
                    print(f"       {view} on {config}: {type(e).__name__}", flush=True)
                    continue
                label = "its own" if config is None else str(config)
                print(f"       {view} on {label:>18}: {ms * 1e3 / len(layers):7.2f} us a layer  max |diff| against "
                      f"its own {diff:.3g}", flush=True)


def chunked(layers, args, roof: float) -> None:
    """The FP8 step with the plan's chunk and each of ``--chunks``, in one run, against the plan's: each output
    checked against the plan's first."""
    with torch.no_grad():
        want = [one.fp8_chunked(None)() for one in layers]
        rows = {}
        for chunk in [None] + args.chunks:
            steps = [one.fp8_chunked(chunk) for one in layers]
            diff = max((step() - w).abs().max().item() for step, w in zip(steps, want))
            rows[chunk] = (step_ms(graphed(lambda steps=steps: [s() for s in steps], args.device), args.device,
                                   args.rounds), diff)
    for chunk, (ms, diff) in rows.items():
        label = "the plan's" if chunk is None else str(chunk)
        print(f"       keys in chunks of {label:>10}: {ms * 1e3:8.1f} us  x roofline {ms / roof:6.2f}  "
              f"x plan {ms / rows[None][0]:5.2f}  max |diff| against the plan {diff:.3g}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="4 heads, r 128: a smoke run")
    ap.add_argument("--chunks", type=int, nargs="*", default=[],
                    help="also time the FP8 step with the keys cut into chunks of these many positions (CUDA)")
    ap.add_argument("--profile", action="store_true", help="the FP8 step's kernels by GPU time at the first batch")
    ap.add_argument("--grouped-tiles", nargs="*", default=[], metavar="BM,BN,WARPS,STAGES",
                    help="also time the two per-head FP8 products alone on these grouped-kernel tiles (CUDA)")
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
            diff = max((one.bf16() - one.fp8()).abs().max().item() for one in layers)
            runs = {kind: graphed(lambda kind=kind: [getattr(one, kind)() for one in layers], args.device)
                    for kind in ("bf16", "fp8")}
            ms = {kind: step_ms(run, args.device, args.rounds) for kind, run in runs.items()}
        roof = sum(one.read for one in layers) / bw * 1e3
        print(f"{batch:5d}  {ms['bf16'] * 1e3:17.1f}  {ms['fp8'] * 1e3:16.1f}  {ms['fp8'] / ms['bf16']:10.2f}  "
              f"{ms['fp8'] / roof:14.2f}  {diff:.3g}", flush=True)
        if args.chunks and args.device == "cuda":
            chunked(layers, args, roof)
        if args.grouped_tiles and args.device == "cuda":
            grouped_tiles(layers, args)
        if args.profile and args.device == "cuda" and batch == args.batches[0]:
            profile(runs["fp8"], f"fp8 kv_b_proj, batch {batch}, {args.layers} layers")
        del layers, runs
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
