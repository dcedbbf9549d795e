"""``ppsplit::cache_attention``'s kernels beside PyTorch's SDPA, one attention call at a time (Llama-3.1-8B heads:
32 query heads, 8 KV heads, head dim 128, bf16), on a CUDA GPU:

    prefill   T tokens from position 0 over a cache of T: ppsplit's Triton flash kernel (default blocks, and a
              sweep of block sizes / warps / stages) against SDPA with ``is_causal=True`` and ``enable_gqa=True`` over
              exactly the T new keys (what a kernel that knows it starts at 0 could run: a lower bound for ours)
    decode    T=1 at position P over a cache of L: the split-KV kernel against SDPA over the live prefix

Every variant is captured in a CUDA graph and its replays timed interleaved (median of --rounds of
``triton.testing.do_bench``); ratios are to SDPA.
The outputs are compared with SDPA's before timing.

    python bench/attention.py                      # prefill T=2048 batch 1, decode batch 1 and 32
    python bench/attention.py --sweep              # also the flash kernel's block-size sweep
"""
import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from ppsplit.triton_kernels.attention import launch_cache_attention

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import graphed  # noqa: E402

HQ, HKV, D = 32, 8, 128


def do_bench(fn, rep):
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3  # us


def timed(variants: dict, rounds: int, rep: int) -> dict:
    variants = {name: graphed(fn) for name, fn in variants.items()}
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(do_bench(fn, rep))
    return {name: statistics.median(ts) for name, ts in times.items()}


def table(title, results, flops=None):
    base = results.get("SDPA")
    print(f"\n== {title}")
    print(f"  {'variant':<44} {'us':>9} {'x SDPA':>7}" + (f" {'TFLOP/s':>8}" if flops else ""))
    for name, us in results.items():
        line = f"  {name:<44} {us:9.1f} {us / base if base else float('nan'):7.2f}"
        if flops:
            line += f" {flops / us / 1e6:8.0f}"
        print(line, flush=True)


def check(name, out, ref):
    diff = (out.float() - ref.float()).abs().max().item()
    print(f"  {name}: max |diff| vs SDPA {diff:.3g}", flush=True)
    if diff > 5e-2:
        raise SystemExit(f"{name} differs from SDPA by {diff:.3g}")


def prefill(args):
    T, B = args.tokens, args.batch
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    k = torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    positions = torch.arange(T, device="cuda")
    scale = D ** -0.5
    out = torch.empty_like(q.transpose(1, 2)).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    variants = {"SDPA": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                               enable_gqa=True)}

    def ours(config=None):
        return lambda: launch_cache_attention(q, k, v, positions, scale, out=out, decode=False, config=config)

    variants["ppsplit Triton flash (default)"] = ours()
    ours()()
    check("ppsplit Triton flash (default)", out, ref)
    if args.sweep:
        for bm, bn, w, st in [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2),
                              (64, 64, 4, 4), (64, 32, 4, 3), (64, 64, 8, 3), (32, 64, 4, 3), (64, 128, 4, 3)]:
            cfg = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
            name = f"ppsplit Triton flash m{bm} n{bn} w{w} s{st}"
            try:
                ours(cfg)()
                torch.cuda.synchronize()
                check(name, out, ref)
                variants[name] = ours(cfg)
            except Exception as e:  # noqa: BLE001  (a config that does not fit: report, go on)
                print(f"  {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    flops = 4 * B * HQ * D * T * T / 2  # causal
    table(f"prefill: batch {B}, T={T} from position 0, cache {T}", timed(variants, args.rounds, 300), flops)


def decode(args, batch):
    L, P = args.max_len, args.position
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    k = torch.randn(batch, HKV, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    positions = torch.tensor([P], device="cuda")
    scale = D ** -0.5
    kl, vl = k[:, :, :P + 1], v[:, :, :P + 1]
    out = torch.empty_like(q.transpose(1, 2)).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, kl, vl, scale=scale, enable_gqa=True)
    launch_cache_attention(q, k, v, positions, scale, out=out)
    check(f"ppsplit split-KV batch {batch}", out, ref)
    variants = {"SDPA": lambda: F.scaled_dot_product_attention(q, kl, vl, scale=scale, enable_gqa=True),
                "ppsplit split-KV": lambda: launch_cache_attention(q, k, v, positions, scale, out=out)}
    table(f"decode: batch {batch}, T=1 at position {P}, cache {L}", timed(variants, args.rounds, 100))


def gpu_banner(script: str) -> None:
    """Exit with a one-line message unless a CUDA GPU is here; print the versions and the device."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} times GPU kernels: run it on a CUDA machine")
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="prefill batch")
    ap.add_argument("--decode-batches", default="1,32")
    ap.add_argument("--position", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    gpu_banner("bench/attention.py")
    prefill(args)
    for b in (int(x) for x in args.decode_batches.split(",") if x):
        decode(args, b)


if __name__ == "__main__":
    main()
