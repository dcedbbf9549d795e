"""ppsplit's stages beside what an engine builder would run otherwise, in one run (Llama-3.1-8B shape, random bf16):

    roofline               weight bytes read per step + live KV bytes, over the copy bandwidth measured here
                           (prefill: the larger of that and FLOPs over the bf16 GEMM rate measured here)
    HF static+compile      Hugging Face StaticCache step under torch.compile(mode="reduce-overhead")
    HF static eager        the same step, eager
    ppsplit pp=1 / pp=4    stages with cache_attention, under ppsplit's CUDA graphs (pp=4: all four stages
                           replayed in a row = the sum of stages); "+compile": split_model(compile=True);
                           no mark: split_model's default projections (on CUDA fused q/k/v and gate/up, unless
                           compile=True); "+fuse" / "-fuse": fuse_projections=True / False (--fuse-projections);
                           "-gemv": split_model(gemv=False) (batch-1 projections on cuBLAS, not ppsplit's GEMV)
    pp=1 traced attention  attention=False: the traced repeat_kv + mask + SDPA (before the attention pass)

Steps: decode (T=1 at position 512, static cache 1024), verify (K=4 drafts: T=5 at position 512), prefill
(T=2048 from position 0, cache 2048), at batch 1 and 32 (prefill: --prefill-batches, default 1). Every variant
runs in its own try/except: a failure prints its error and the run goes on. Variants are timed interleaved
(median of --rounds), and a table with ratios to the roofline and to HF+compile is printed after each step and
at the end, with the top kernels of ppsplit's pp=1 step.

    python bench/peer.py                        # everything, on a CUDA GPU (Inductor compiles take minutes)
    python bench/peer.py --tiny                 # tiny model on the CPU: checks the script, times nothing real

Each Inductor compile (HF's, and ppsplit's per stage and shape) takes a minute or more, so under a 10-minute limit
split the run, e.g.:

    python bench/peer.py --modes decode,verify --compile off
    python bench/peer.py --modes decode --compile on --pp 1,4 --no-traced-baseline
    python bench/peer.py --modes verify --compile on --pp 1 --no-traced-baseline
    python bench/peer.py --modes prefill --compile both --pp 1,4

Sibling projections fused or not, side by side (with --fuse-projections both, every ppsplit variant runs twice):

    python bench/peer.py --modes decode --batches 1,32 --pp 1 --compile off --fuse-projections both --no-traced-baseline
--budget-s (default 560) skips the variants not started by then, and every table is printed as soon as its step
is done, so a run cut short still reports what it measured.
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
from transformers import AutoModelForCausalLM, StaticCache

import ppsplit
from ppsplit import CacheConfig

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import stage_runs  # noqa: E402
from shapes import config  # noqa: E402

warnings.filterwarnings("ignore")
STEPS = {"decode": 1, "verify": 5}  # tokens per step at position POS


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = "cpu" if args.tiny else "cuda"
        self.started = time.perf_counter()
        self.results = []  # (step, batch, variant, ms or None, note)

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.args.budget_s

    def time(self, fn, rep_ms):
        if self.device == "cuda":
            import triton

            return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
        fn()
        start = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - start) / 2 * 1e3

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()


def log(msg):
    print(msg, flush=True)


def build_model(args, device):
    overrides = dict(num_hidden_layers=args.layers)
    if args.tiny:
        overrides.update(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=512, num_hidden_layers=min(args.layers, 4))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config("llama-3.1-8b", **overrides), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").eval()
    return model


def measure_rates(bench):
    """Copy bandwidth (GB/s) and bf16 GEMM rate (TFLOP/s) of this device, measured now."""
    if bench.device != "cuda":
        return 20.0, 0.5
    a = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    bw = 2 * a.numel() * 2 / bench.time(lambda: b.copy_(a), 200) / 1e6
    del a, b
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    flops = 2 * 8192 ** 3 / bench.time(lambda: x @ x, 200) / 1e9
    del x
    torch.cuda.empty_cache()
    return bw, flops


def roofline_us(model, batch, tokens, live, bw, tflops):
    cfg = model.config
    hidden, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    head_dim = hidden // cfg.num_attention_heads
    params = sum(p.numel() for p in model.parameters())
    weights = params * 2 - vocab * hidden * 2  # the embedding reads one row per token
    kv = batch * layers * 2 * cfg.num_key_value_heads * head_dim * 2 * live
    memory = (weights + kv) / bw / 1e3
    attn_flops = 4 * batch * layers * cfg.num_attention_heads * head_dim * tokens * (live - tokens / 2)
    compute = (2 * (params - vocab * hidden) * batch * tokens + attn_flops) / tflops / 1e6
    return max(memory, compute)


# ---- Hugging Face -----------------------------------------------------------------------------------------------

def hf_step(model, batch, tokens, start, max_len, compile_, device):
    cfg = model.config
    try:
        cache = StaticCache(config=cfg, max_cache_len=max_len, max_batch_size=batch, device=device,
                            dtype=torch.bfloat16)
    except TypeError:
        cache = StaticCache(config=cfg, max_cache_len=max_len)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    vocab = cfg.vocab_size
    if start:  # fill the cache up to `start` (also initialises lazily allocated layers)
        with torch.no_grad():
            model(input_ids=torch.randint(0, vocab, (batch, start), device=device),
                  cache_position=torch.arange(start, device=device), **{kw: cache}, use_cache=True)
    ids = torch.randint(0, vocab, (batch, tokens), device=device)
    cpos = torch.arange(start, start + tokens, device=device)
    counters = []  # transformers >= 5.2x: StaticCache writes at its own running length, not at cache_position

    def step():
        if counters:  # back to `start` before every step, in one kernel (a foreach copy)
            torch._foreach_copy_(counters, starts)
        return model(input_ids=ids, cache_position=cpos, position_ids=cpos[None].expand(batch, tokens),
                     **{kw: cache}, use_cache=True).logits

    with torch.no_grad():
        step()  # initialises lazily allocated layers
    counters += [layer.cumulative_length for layer in getattr(cache, "layers", ())
                 if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
    starts = [torch.full_like(c, start) for c in counters]
    fn = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compile_ else step

    def run():
        with torch.no_grad():
            return fn()
    for _ in range(3):
        run()
    return run


# ---- ppsplit ----------------------------------------------------------------------------------------------------

def ppsplit_step(traced, pp, batch, tokens, start, device, *, compile_=False, attention=True, fuse=None,
                 gemv=True):
    """Replay of every stage's CUDA graph in a row (on the CPU: the stages called in a row)."""
    split = ppsplit.split_model(traced, pp, aux="eagle3", compile=compile_, attention=attention,
                                fuse_projections=fuse, gemv=gemv)
    return stage_runs(split, batch, tokens, start, device), split


def check_fused(traced, device, vocab):
    """Fused projections against separate ones on the same 16-token prompt (eager, the model's dtype)."""
    ids = torch.randint(0, vocab, (1, 16), device=device)
    with torch.no_grad():
        logits = [ppsplit.split_model(traced, 1, fuse_projections=f)(ids, torch.arange(16, device=device))[0]
                  for f in (False, True)]
    diff = (logits[0].float() - logits[1].float()).abs().max().item()
    same = (logits[0].argmax(-1) == logits[1].argmax(-1)).sum().item()
    log(f"fused vs separate projections, prefill of 16 tokens: max |logit diff| {diff:.3g} (logits up to "
        f"{logits[0].float().abs().max().item():.3g}), argmax equal at {same}/16 positions")


def top_kernels(fn, n=10):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            r = rows.setdefault(e.name[:80], [0, 0.0])
            r[0] += 1
            r[1] += getattr(e, "device_time_total", None) or e.cuda_time_total
    total = sum(v[1] for v in rows.values()) or 1.0
    log(f"    {sum(v[0] for v in rows.values())} kernels, {total:.0f} us of device time")
    for name, (count, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:n]:
        log(f"    {us:9.0f} us {100 * us / total:5.1f}% x{count:<4} {name}")


# ---- driver -----------------------------------------------------------------------------------------------------

def run_step(bench, model, traced, step, batch, tokens, start, max_len, roof):
    args, device = bench.args, bench.device
    variants = {}  # name -> zero-argument callable, built lazily so that each can fail on its own

    def hf(compile_):
        return lambda: hf_step(model, batch, tokens, start, max_len, compile_, device)

    def ours(pp, compile_=False, attention=True, fuse=None, gemv=True):
        return lambda: ppsplit_step(traced, pp, batch, tokens, start, device, compile_=compile_,
                                    attention=attention, fuse=fuse, gemv=gemv)[0]

    compiles = {"off": (False,), "on": (True,), "both": (False, True)}[args.compile]
    fuses = {"default": (None,), "off": (False,), "on": (True,), "both": (False, True)}[args.fuse_projections]
    gemvs = {"off": (False,), "on": (True,), "both": (True, False)}[args.gemv]
    for pp in args.pp:
        for c in compiles:
            for f in fuses:
                for g in gemvs:
                    name = (f"ppsplit pp={pp}" + {None: "", True: " +fuse", False: " -fuse"}[f]
                            + (" +compile" if c else "")
                            + ("" if g else " -gemv"))
                    variants[name] = ours(pp, c, fuse=f, gemv=g)
        if pp == args.pp[0] and not args.no_hf_compile:
            variants["HF static+compile"] = hf(True)
        if pp == args.pp[0]:
            variants["HF static eager"] = hf(False)
    if args.traced_baseline and step != "prefill":
        variants["pp=1 traced attention"] = ours(1, False, attention=False)

    fns = {}
    for name, make in variants.items():
        if bench.over_budget():
            log(f"  {name}: skipped (past --budget-s {args.budget_s:.0f} s)")
            bench.results.append((step, batch, name, None, "skipped: time budget"))
            continue
        t0 = time.perf_counter()
        try:
            fns[name] = make()
            bench.sync()
            log(f"  {name}: ready in {time.perf_counter() - t0:.0f} s")
        except Exception as e:  # noqa: BLE001  (report and go on)
            log(f"  {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            if args.verbose:
                traceback.print_exc()
            bench.results.append((step, batch, name, None, f"failed: {type(e).__name__}"))
    rep = 600 if step == "prefill" else 200
    times = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in list(fns.items()):
            try:
                times[name].append(bench.time(fn, rep))
            except Exception as e:  # noqa: BLE001
                log(f"  {name}: timing FAILED {type(e).__name__}: {str(e)[:200]}")
                fns.pop(name)
                bench.results.append((step, batch, name, None, f"failed: {type(e).__name__}"))
    for name, ts in times.items():
        if ts and name in fns:
            bench.results.append((step, batch, name, statistics.median(ts), ""))
    print_table(bench, step, batch, roof)

    if device == "cuda" and batch in args.profile_batches:
        for name in [n for n in fns if n.startswith("ppsplit pp=1") or (args.profile_hf and n == "HF static+compile")]:
            if not args.profile_all and name.endswith("-gemv"):
                continue
            if name in fns:
                log(f"  top kernels, {name}, {step} batch {batch}:")
                try:
                    top_kernels(fns[name], args.top)
                except Exception as e:  # noqa: BLE001
                    log(f"    profiler FAILED {type(e).__name__}: {str(e)[:200]}")
    del fns
    if device == "cuda":
        torch.cuda.empty_cache()


def print_table(bench, step, batch, roof, final=False):
    rows = [r for r in bench.results if final or (r[0] == step and r[1] == batch)]
    base = {(s, b): ms for s, b, name, ms, _ in bench.results if name == "HF static+compile" and ms}
    log(f"  {'step':<8} {'batch':>5} {'variant':<30} {'time us':>10} {'x roofline':>10} {'x HF+compile':>12}  note")
    for s, b, name, ms, note in rows:
        r = bench.roofs.get((s, b))
        if ms is None:
            log(f"  {s:<8} {b:>5} {name:<30} {'-':>10} {'-':>10} {'-':>12}  {note}")
            continue
        hf = base.get((s, b))
        log(f"  {s:<8} {b:>5} {name:<30} {ms * 1e3:>10.0f} {ms * 1e3 / r:>10.2f} "
            f"{(f'{ms / hf:.2f}' if hf else '-'):>12}  {note}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU: checks the script only")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prefill-batches", default="1")
    ap.add_argument("--modes", default="decode,verify,prefill")
    ap.add_argument("--pp", default="1,4")
    ap.add_argument("--compile", choices=("off", "on", "both"), default="both",
                    help="ppsplit variants without and/or with split_model(compile=True)")
    ap.add_argument("--fuse-projections", choices=("default", "off", "on", "both"), default="default",
                    help="ppsplit variants with split_model's default (fused on CUDA, separate under compile=True), "
                         "and/or separate (off) and/or fused (on) sibling projections")
    ap.add_argument("--gemv", choices=("off", "on", "both"), default="on",
                    help="ppsplit variants with (default) and/or without split_model's batch-1 GEMV routing; "
                         "without it the variant's name ends in -gemv")
    ap.add_argument("--profile-all", action="store_true", help="also profile the -gemv variants")
    ap.add_argument("--profile-hf", action="store_true", help="also profile HF static+compile (where the gap is)")
    ap.add_argument("--no-hf-compile", action="store_true")
    ap.add_argument("--no-traced-baseline", dest="traced_baseline", action="store_false")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--position", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--profile-batches", default="1,32")
    ap.add_argument("--top", type=int, default=10, help="kernels listed per profiled variant")
    ap.add_argument("--budget-s", type=float, default=560.0, help="skip variants not started by then")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    args.pp = [int(x) for x in args.pp.split(",")]
    args.profile_batches = [int(x) for x in args.profile_batches.split(",") if x]
    if args.tiny:
        args.max_len, args.position, args.prefill_tokens = 64, 32, 16
        args.batches, args.prefill_batches = args.batches if args.batches != "1,32" else "1,2", args.prefill_batches
    bench = Bench(args)
    bench.roofs = {}
    device = bench.device
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu (--tiny: the script is checked, not timed)'}")
    t0 = time.perf_counter()
    model = build_model(args, device)
    bw, tflops = measure_rates(bench)
    log(f"model ready in {time.perf_counter() - t0:.0f} s; copy {bw:.0f} GB/s, bf16 GEMM {tflops:.0f} TFLOP/s")
    batches = [int(x) for x in args.batches.split(",")]
    modes = args.modes.split(",")

    steps = [(m, b) for m in modes if m in STEPS for b in batches]
    if steps:
        t0 = time.perf_counter()
        traced = ppsplit.trace_model(model, cache=CacheConfig(max(batches), args.max_len))
        log(f"traced with a {max(batches)} x {args.max_len} cache in {time.perf_counter() - t0:.0f} s")
        # the plan only: unfused, so that printing it leaves the model's tensors as they are
        log("pp=1 " + " / ".join(ppsplit.split_model(traced, 1, fuse_projections=False).plan.attention_lines(0)))
        if args.fuse_projections in ("on", "both"):
            try:
                check_fused(traced, device, model.config.vocab_size)
            except Exception as e:  # noqa: BLE001
                log(f"fused projections check FAILED {type(e).__name__}: {str(e)[:300]}")
        for mode, batch in steps:
            tokens = STEPS[mode]
            bench.roofs[(mode, batch)] = roofline_us(model, batch, tokens, args.position + tokens, bw, tflops)
            log(f"\n== {mode}: batch {batch}, T={tokens} at position {args.position}, cache {args.max_len}; "
                f"roofline {bench.roofs[(mode, batch)]:.0f} us")
            run_step(bench, model, traced, mode, batch, tokens, args.position, args.max_len,
                     bench.roofs[(mode, batch)])
        del traced
    if "prefill" in modes:
        pbatches = [int(x) for x in args.prefill_batches.split(",")]
        tokens = args.prefill_tokens
        t0 = time.perf_counter()
        try:
            traced = ppsplit.trace_model(model, cache=CacheConfig(max(pbatches), tokens))
            log(f"traced with a {max(pbatches)} x {tokens} cache in {time.perf_counter() - t0:.0f} s")
            for batch in pbatches:
                bench.roofs[("prefill", batch)] = roofline_us(model, batch, tokens, tokens, bw, tflops)
                log(f"\n== prefill: batch {batch}, T={tokens} from position 0, cache {tokens}; "
                    f"roofline {bench.roofs[('prefill', batch)]:.0f} us")
                run_step(bench, model, traced, "prefill", batch, tokens, 0, tokens, bench.roofs[("prefill", batch)])
        except Exception as e:  # noqa: BLE001
            log(f"prefill FAILED {type(e).__name__}: {str(e)[:300]}")
    log(f"\n== all results ({time.perf_counter() - bench.started:.0f} s)")
    print_table(bench, None, None, None, final=True)


if __name__ == "__main__":
    main()
