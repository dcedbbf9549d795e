"""Decode step of hybrid models (recurrent layers beside attention) through ppsplit's stages, against Hugging Face's
own cached decode, in one run. Full-size layer shapes with random bf16 weights, the layer count cut to fit one GPU:

    HF cached eager      the model's forward on one new token with the cache its generate() keeps (its recurrent
                         one-token step for Mamba / Gated DeltaNet layers, its KV cache for attention)
    ppsplit pp=1 / pp=2  the stages with a static cache (K/V, conv inputs and a ring of recurrent states per layer),
                         each replayed from ppsplit's CUDA graph, all stages in a row (pp=2: the sum of stages)

Every variant decodes at position --position after a prompt of that length, batch --batches. Also printed: the
greedy tokens of ppsplit (pp=2, eager) against HF's generate on the same prompt (bf16: a near tie may differ), the
state bytes per sequence and the top kernels of ppsplit's pp=2 step.

    python bench/recurrent.py                                  # nemotron-h-8b (12 layers) and qwen3-next (8 layers)
    python bench/recurrent.py --models nemotron-h-8b --layers 16 --batches 1,32
    python bench/recurrent.py --tiny                           # tiny shapes on the CPU: checks the script only
"""
import argparse
import inspect
import statistics
import sys
import time
import traceback
import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM

import ppsplit
from ppsplit import CacheConfig

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import stage_runs  # noqa: E402
from peer import top_kernels  # noqa: E402
from shapes import config, cut  # noqa: E402

warnings.filterwarnings("ignore")
LAYERS = {"nemotron-h-8b": 12, "qwen3-next-80b-a3b": 8}
TINY = dict(hidden_size=64, intermediate_size=128, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)
TINY_BY_MODEL = {"nemotron-h-8b": dict(mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
                                       chunk_size=16),
                 "qwen3-next-80b-a3b": dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                            linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=32, shared_expert_intermediate_size=32)}


def log(msg):
    print(msg, flush=True)


def timed(fn, device, reps):
    """Median wall time of ``fn`` in microseconds (synchronised per call on the GPU)."""
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def build(name, layers, tiny, device):
    overrides = cut(name, layers)
    if tiny:
        overrides.update(TINY, **TINY_BY_MODEL[name])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config(name, **overrides), dtype=torch.bfloat16).eval()
    return model


def hf_decode(model, prompt, reps):
    """One new token per call on the cache generate() would keep: the prompt prefilled once, then timed steps."""
    accepted = inspect.signature(model.forward).parameters
    key = next(k for k in ("cache", "past_key_values", "cache_params") if k in accepted)
    with torch.no_grad():
        # The prompt in pieces of 64: HF's chunked Mamba-2 scan on 512 tokens at batch 32 asks for 128 GiB at once.
        out, cache = None, None
        for start in range(0, prompt.shape[1], 64):
            out = model(prompt[:, start:start + 64], use_cache=True, **({key: cache} if cache is not None else {}))
            cache = getattr(out, "past_key_values", None) or getattr(out, "cache_params", None)
        token = out.logits[:, -1:].argmax(-1)

        def step():
            model(token, use_cache=True, **{key: cache})
        return timed(step, prompt.device.type, reps)


def ppsplit_decode(traced, pp, batch, position, device, reps, tokens=1):
    """A step of ``tokens`` new tokens at ``position`` (1: decode, K + 1: verify, the prompt: prefill)."""
    split = ppsplit.split_model(traced, pp)
    run = stage_runs(split, batch, tokens, position, device)
    return timed(run, device, reps), split


def check_greedy(model, max_len, device):
    """ppsplit pp=2 against HF on one prompt: the prompt's logits and 8 greedy tokens."""
    ids = torch.randint(3, model.config.vocab_size, (1, 16), device=device, generator=None)
    with torch.no_grad():
        ref_logits = model(ids).logits
        ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=CacheConfig(1, max_len)), 2)
    with torch.no_grad():
        logits, _ = split(ids, torch.arange(16, device=device))
    got = split.generate(ids, 8)
    diff = (logits.float() - ref_logits.float()).abs().max().item()
    same = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    log(f"   {str(model.dtype)[6:]:8s} prompt logits max |diff| {diff:.3g} (logits std {ref_logits.float().std():.3g}), "
        f"top-1 agrees at {same:.0%} of 16 positions; greedy 8 tokens "
        f"{'equal' if torch.equal(got, ref) else 'DIFFER'} ({got[0, 16:].tolist()} vs {ref[0, 16:].tolist()})")


def bench_model(name, args, device):
    layers = args.layers or LAYERS[name]
    t0 = time.perf_counter()
    model = build(name, layers, args.tiny, device)
    params = sum(p.numel() for p in model.parameters())
    log(f"\n== {name}, {layers} layers ({params / 1e9:.2f} B parameters), built in {time.perf_counter() - t0:.0f} s")
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for batch in batches:
        t0 = time.perf_counter()
        traced = ppsplit.trace_model(model, cache=CacheConfig(batch, args.max_len))
        state_bytes = sum(b[0].numel() * b.element_size() // b.shape[1]
                          for n, b in traced.traced.gm.named_buffers() if n.endswith(".states"))
        log(f"   batch {batch}: traced in {time.perf_counter() - t0:.0f} s; recurrent state per sequence "
            f"{state_bytes / 2 ** 20:.1f} MiB (x {traced.traced.cache.state_slots} ring slots in the cache)")
        prompt = torch.randint(3, model.config.vocab_size, (batch, args.position), device=device)
        variants = [("HF cached eager", lambda: hf_decode(model, prompt, args.reps))] + [
            (f"ppsplit pp={pp} captured", lambda pp=pp: ppsplit_decode(traced, pp, batch, args.position, device,
                                                                      args.reps)[0]) for pp in (1, 2)]
        if args.verify:  # a verify pass of K = 4 drafts: 5 tokens, each leaving its state in the ring
            variants.append(("ppsplit pp=2 verify T=5", lambda: ppsplit_decode(
                traced, 2, batch, args.position, device, args.reps, tokens=5)[0]))
        if args.prefill and batch == batches[0]:  # the prompt from position 0: the scans walk it inside the kernel
            long_prompt = torch.randint(3, model.config.vocab_size, (batch, args.prefill), device=device)

            def hf_prefill():
                with torch.no_grad():
                    model(long_prompt)
            variants += [(f"HF prefill T={args.prefill}", lambda: timed(hf_prefill, device, 3)),
                         (f"ppsplit pp=2 prefill T={args.prefill}", lambda: ppsplit_decode(
                             traced, 2, batch, 0, device, 3, tokens=args.prefill)[0])]
        for label, fn in variants:
            try:
                us = fn()
                rows.append((batch, label, us))
                log(f"   batch {batch:3d}  {label:24s} {us:9.1f} us")
            except Exception as e:  # one variant failing must not hide the others
                log(f"   batch {batch:3d}  {label:24s} FAILED: {type(e).__name__}: {str(e)[:300]}")
                if args.verbose:
                    traceback.print_exc()
            if device == "cuda":
                torch.cuda.empty_cache()
    log(f"\n   {name} ({layers} layers), decode step at position {args.position}:")
    log(f"   {'batch':>5} {'variant':24s} {'us':>9} {'vs HF':>7}")
    for batch, label, us in rows:
        hf = next((u for b, lab, u in rows if b == batch and lab.startswith("HF")
                   and ("prefill" in lab) == ("prefill" in label)), None)
        log(f"   {batch:5d} {label:24s} {us:9.1f} {us / hf if hf else float('nan'):7.3f}")
    try:
        if device == "cuda":
            _, split = ppsplit_decode(traced, 2, 1, args.position, device, 1)
            graphs = [ppsplit.cuda_graph(stage, 1, 1) for stage in split.stages]
            log("   top kernels of ppsplit's pp=2 decode step, batch 1:")
            top_kernels(lambda: [g.replay() for g in graphs])
    except Exception as e:
        log(f"   profile FAILED: {type(e).__name__}: {str(e)[:300]}")
    del traced
    for dtype in (torch.bfloat16, torch.float32):  # exactness at full shape: bf16 rounding, then float32
        try:
            check_greedy(model.to(dtype), args.max_len, device)
        except Exception as e:
            log(f"   {dtype} check FAILED: {type(e).__name__}: {str(e)[:300]}")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="nemotron-h-8b,qwen3-next-80b-a3b")
    ap.add_argument("--layers", type=int, default=0, help="layers per model (default: as many as fit, per model)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--position", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--verify", action="store_true", help="also a verify step of 5 tokens (K = 4 drafts)")
    ap.add_argument("--prefill", type=int, default=0, help="also a prefill of this many tokens (first batch)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks the script only")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        args.position, args.max_len, args.reps = 16, 64, 3
        args.batches = "1,2" if args.batches == "1,32" else args.batches
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, ppsplit "
        f"{getattr(ppsplit, '__version__', '?')}, "
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu (--tiny: the script is checked, not timed)'}")
    for name in args.models.split(","):
        try:
            bench_model(name, args, device)
        except Exception as e:
            log(f"== {name} FAILED: {type(e).__name__}: {str(e)[:400]}")
            if args.verbose:
                traceback.print_exc()


if __name__ == "__main__":
    main()
