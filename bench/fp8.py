"""FP8 block-scaled weights against bf16: bytes per decode step and the captured decode step time, Llama-3.1-8B
shape with random weights (quantised here in 128x128 blocks, as DeepSeek-V3 / Qwen3-FP8 ship them), on a CUDA GPU.

The bf16 split is timed first; then its linears are rewritten in place by the compile's own pass
(``ppsplit.passes.quantize``) onto FP8 weights + ``weight_scale_inv`` and timed again, at every batch. Each step
is one replay of the stage's captured CUDA graph (``bench.common.stage_runs``), median of ``--rounds`` rounds of
``triton.testing.do_bench``. "roofline" = the bytes a step must read (the stage's weights and scales as stored,
plus the live KV prefix) over the device copy bandwidth measured in the same run. transformers' own FP8 path needs
the ``kernels-community/finegrained-fp8`` hub kernel; where it cannot load (no network), the row says why.

    python bench/fp8.py                       # batch 1 and 32, 32 layers, KV prefix 512
    python bench/fp8.py --layers 4 --batch 1  # a quicker look
    python bench/fp8.py --device cpu --small --layers 2 --rounds 1   # a smoke run of the script itself (no timing claims)
"""
import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import banner, build_model, stage_runs  # noqa: E402

import ppsplit  # noqa: E402
from ppsplit import CacheConfig  # noqa: E402
from ppsplit.core.fx_utils import set_tensor  # noqa: E402
from ppsplit.passes.quantize import QuantizedWeight, quantize_linears  # noqa: E402

SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def quantize(w: torch.Tensor, block: int = 128):
    """``(W_q float8_e4m3fn, weight_scale_inv fp32 [ceil(N/b), ceil(K/b)])``, amax / 448 per block."""
    n, k = w.shape
    gn, gk = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, gk * block - k, 0, gn * block - n))
    blocks = padded.view(gn, block, gk, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(gn * block, gk * block)[:n, :k].contiguous()
    return q, scale


def to_fp8(stage) -> int:
    """Rewrite ``stage``'s projections (not lm_head) onto FP8 weights, as the compile does. Returns how many."""
    weights, real = {}, {}
    for name, p in stage.named_parameters():
        if name.endswith("proj.weight") and p.dim() == 2:
            q, s = quantize(p.data)
            scale_name = name[:-len("weight")] + "weight_scale_inv"
            weights[name] = QuantizedWeight(scale_name, tuple(s.shape), s.dtype, (128, 128))
            real[name], real[scale_name] = q, s
    done = quantize_linears(stage, weights)
    for name, t in real.items():
        set_tensor(stage, name, t, parameter=True, persistent=True)
    return len(done.fp8)


def stored_bytes(stage) -> int:
    """What a decode step reads of the stage's tensors: all of them but the embedding table (one row per token)."""
    return sum(t.numel() * t.element_size() for n, t in stage.named_parameters() if "embed_tokens" not in n)


def copy_bandwidth(device: str) -> float:
    if device != "cuda":
        return float("nan")
    from triton.testing import do_bench

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), rep=200)
    return 2 * a.numel() / (ms * 1e-3)


def step_ms(run, device: str, rounds: int) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return statistics.median(do_bench(run, rep=200) for _ in range(rounds))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def hf_fp8_status() -> str:
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
        return "loaded (not timed by this script yet)"
    except Exception as e:  # no `kernels` package, no network, no build for this torch/CUDA
        return f"unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prefix", type=int, default=512, help="KV positions already filled when the step runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a small hidden size (CPU smoke runs)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/fp8.py times CUDA graphs: run it on a CUDA machine (or --device cpu --small for a smoke run)")
    print(banner(args.device), flush=True)
    overrides = dict(num_hidden_layers=args.layers, **(SMALL if args.small else {}))
    model = build_model("llama-3.1-8b", args.device, **overrides)
    max_len = args.prefix + 8
    traced = ppsplit.trace_model(model, cache=CacheConfig(max(args.batch), max_len), paged=False)  # lockstep steps
    split = ppsplit.split_model(traced, pp=1, gemv=False)
    stage = split.stages[0]
    bw = copy_bandwidth(args.device)
    cfg = model.config
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    results = {}
    for variant in ("bf16", "fp8"):
        if variant == "fp8":
            n = to_fp8(stage)
            print(f"{n} projections on FP8 weights (128x128 blocks)", flush=True)
        weights = stored_bytes(stage)
        for batch in args.batch:
            run = stage_runs(split, batch, 1, args.prefix, args.device)
            ms = step_ms(run, args.device, args.rounds)
            step_bytes = weights + batch * args.prefix * kv_per_token
            results[variant, batch] = (ms, step_bytes)
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; transformers' FP8 kernels: {hf_fp8_status()}")
    print(f"{'variant':<6} {'batch':>5} {'bytes/step':>14} {'step ms':>9} {'x bf16':>7} {'x roofline':>10}")
    for (variant, batch), (ms, step_bytes) in results.items():
        roof = step_bytes / bw * 1e3
        print(f"{variant:<6} {batch:>5} {step_bytes:>14,} {ms:>9.3f} {ms / results['bf16', batch][0]:>7.2f} "
              f"{ms / roof:>10.2f}")


if __name__ == "__main__":
    main()
