"""Ragged decode over a paged cache against a lockstep decode, Llama-3.1-8B shape with random bf16 weights.

Three steps, each one replay of the stage's captured CUDA graph (median of ``--rounds`` rounds of
``triton.testing.do_bench``), with the same weights:

- ragged: ``--batch`` sequences at *different* lengths (spread evenly from ``--min-len`` to ``--max-len``), one decode
  token each, over a paged cache whose blocks are shuffled across the pool;
- lockstep: the same number of sequences, all at the mean length, over a ``batch x max_len`` cache (``paged=False``);
- mixed: ``batch - 1`` decodes plus one ``--chunk``-token prefill chunk of a longer prompt in one step, against the
  decodes and the chunk run as two steps.

"roofline" = the bytes a decode step must read (the stage's weights but the embedding, plus every live key and value
of the step) over the device copy bandwidth measured in the same run. The cache bytes each layout holds are printed
too (the paged pool sized to the sequences' blocks, against ``batch x max_len``).

    python bench/ragged.py                                   # CUDA: 32 layers, 32 sequences of 128..4096
    python bench/ragged.py --layers 8                        # a quicker look
    python bench/ragged.py --layers 8 --profile              # and the two decodes' kernels by GPU time
    python bench/ragged.py --layers 8 --plans                # and the ragged decode under other attention plans,
                                                             # and with the rotations and KV writes apart
    python bench/ragged.py --device cpu --small --layers 2 --rounds 1 --max-len 256 --chunk 32   # a smoke run
    python bench/ragged.py --sweep                           # one layer's attention kernels alone, launch plans swept:
                                                             # the ragged decode, a 2048-token prefill, the mixed chunk
"""
import argparse
import random
import sys
from unittest import mock

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import banner, build_model, stage_runs  # noqa: E402
from fp8 import SMALL, copy_bandwidth, profile, step_ms  # noqa: E402

import ppsplit  # noqa: E402
from ppsplit import CacheConfig  # noqa: E402
from ppsplit.core.fx_utils import is_cache_buffer  # noqa: E402
from ppsplit.core.ragged import CacheLayout, RaggedStep, Segment  # noqa: E402
from ppsplit.serve.cuda_graphs import CapturedStage  # noqa: E402


def cache_bytes(stage) -> int:
    return sum(b.numel() * b.element_size() for n, b in stage.named_buffers() if is_cache_buffer(n))


def fill_cache(stage, seed: int) -> None:
    """Random keys and values: a step over zeros can run faster than over real data."""
    torch.manual_seed(seed)
    for name, buf in stage.named_buffers():
        if is_cache_buffer(name) and buf.is_floating_point():
            buf.normal_()


def ragged_run(stage, segments, tables, layout, device):
    """The captured step of ``segments`` (one bucket of exactly their token count) on CUDA, the stage call elsewhere."""
    step = RaggedStep.build(segments, tables, layout).to(device)
    n = step.num_tokens
    ids = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n)).to(device)
    if device != "cuda":
        aux = torch.empty(stage.meta["ppsplit.plan"].n_slots, n, stage.meta["ppsplit.plan"].hidden_size,
                          dtype=next(stage.parameters()).dtype)

        def run():
            with torch.no_grad():
                stage(ids, step.positions, aux, *step.tensors()[1:])
        return run
    g = CapturedStage(stage, 0, n)
    g.x.copy_(ids)
    for static, value in zip(g.meta, step.tensors()):
        static.copy_(value)
    return g.replay


# The ragged decode step again under the attention plan overridden so (``--plans``): the sweep's variants, measured in
# the whole step, where the other kernels share the GPU's caches with the attention.
STEP_PLANS = {"3 stages": dict(stages=3), "three key loops": dict(phases=True), "forward order": dict(reverse=False),
              "block_n 32": dict(block_n=32)}


def plan_overridden(over: dict):
    """``attention_plan`` returns its plan updated by ``over`` while the block runs (a capture bakes the plan in)."""
    from ppsplit.triton_kernels import paged

    planned = paged.attention_plan
    return mock.patch.object(paged, "attention_plan", lambda *args, **kwargs: {**planned(*args, **kwargs), **over})


def rope_write_off():
    """Splits made while the block runs keep each layer's rotations and key and value writes apart (three kernels,
    the fold into ``ppsplit::rope_write`` off): the step before that fold, to time against."""
    from ppsplit.passes.rewrites import pointwise

    return mock.patch.object(pointwise, "_fuse_rope_write", lambda pair, order: False)


def sweep(lengths, block: int, bw: float) -> None:
    """One layer's attention alone (Llama-3.1-8B heads), CUDA-graph timed: the paged kernel over shuffled blocks under
    its own plan and under overridden ones, against the lockstep split-KV kernel at the mean length. The metadata
    are int64, as the stages pass them (``RaggedStep``); section 31's sweep passed int32."""
    from triton.testing import do_bench_cudagraph

    from ppsplit.triton_kernels.attention import launch_cache_attention
    from ppsplit.triton_kernels.paged import attention_plan, launch_paged_attention

    hq, hkv, d, b = 32, 8, 128, len(lengths)
    need = [-(-(n + 1) // block) for n in lengths]
    pool = sum(need)
    ids = list(range(pool))
    random.Random(0).shuffle(ids)
    table = torch.full((b, max(need)), -1, dtype=torch.long)
    at = 0
    for s, count in enumerate(need):
        table[s, :count] = torch.tensor(ids[at:at + count])
        at += count
    dev = dict(device="cuda", dtype=torch.bfloat16)
    keys, values = (torch.randn(pool, block, hkv, d, **dev) for _ in range(2))
    q = torch.randn(1, b, hq, d, **dev).transpose(1, 2)
    positions = torch.tensor(lengths, dtype=torch.long, device="cuda")
    seq = torch.arange(b, dtype=torch.long, device="cuda")
    starts, counts, table = seq.clone(), torch.ones_like(seq), table.cuda()
    mean = round(sum(lengths) / b)
    kc, vc = (torch.randn(b, hkv, mean + 8, d, **dev) for _ in range(2))
    ql = torch.randn(b, 1, hq, d, **dev).transpose(1, 2)
    pl = torch.full((1,), mean, dtype=torch.long, device="cuda")
    scale = d ** -0.5

    def timed(fn):
        fn()
        return do_bench_cudagraph(fn, rep=50) * 1e3

    live = sum(n + 1 for n in lengths) * 2 * hkv * d * 2
    lock = timed(lambda: launch_cache_attention(ql, kc, vc, pl, scale))
    print(f"\none layer, {b} decodes of {lengths[0]}..{lengths[-1]}: live KV {live / 2**20:.1f} MiB, roofline "
          f"{live / bw * 1e6:.1f} us; lockstep split-KV at the mean length {lock:.1f} us")
    plan = attention_plan(b, hq, hkv, b, table.shape[1] * block, block, q.device)
    span = table.shape[1] * block
    named = {"plan": {}, "forward order": dict(reverse=False), "three key loops": dict(phases=True),
             "three key loops, 3 stages (section 31's plan)": dict(phases=True, stages=3), "3 stages": dict(stages=3)}
    grid = [dict(block_q=bq, block_n=bn, chunk=c, splits=-(-span // c), warps=w, stages=st)
            for bq in (1, 4) for bn in (32, 64) for c in (512, 1024) for w in (4, 8) for st in (2, 3)]
    run_plans(plan, named, grid, keys, values, lambda over, k, v: timed(lambda: launch_paged_attention(
        q, k, v, positions, seq, table, starts, counts, scale, config=over)),
        lambda us: f"x roofline {us * 1e-6 * bw / live:5.2f}  x lockstep {us / lock:5.2f}")


def run_plans(plan: dict, named: dict, grid: list, keys, values, time, figures) -> None:
    """Times the kernel (``time(overrides, keys, values)``) under ``plan`` overridden by each of ``named`` and
    ``grid``; prints the eight fastest, then every named one (``figures(us)``: the columns after the time). Last,
    the plan over head-major pools (each block's keys of one head contiguous, as FlashInfer's HND layout), read
    through the strides: whether the pools' layout is worth changing."""
    rows = []
    for label, over in list(named.items()) + [("", over) for over in grid]:
        cfg = {**plan, **over}
        try:
            us = time(over, keys, values)
        except Exception as e:  # a tile the compiler refuses (registers, shared memory)
            print(f"  {cfg}: {type(e).__name__}")
            continue
        rows.append((us, label, cfg))
    rows.sort(key=lambda r: r[0])
    for us, label, cfg in rows[:8] + [r for r in rows[8:] if r[1]]:
        print(f"  {label:<26} {cfg}: {us:8.1f} us  {figures(us)}")
    us = time({}, *(t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for t in (keys, values)))
    print(f"  {'plan, head-major pools':<26} {us:8.1f} us  {figures(us)}")


def sweep_prefill(tokens: int, block: int, start: int = 0) -> None:
    """One layer's attention for one ``tokens``-token prefill chunk from position ``start`` (Llama-3.1-8B heads),
    CUDA-graph timed: the paged kernel over shuffled blocks under its own plan and under overridden query tiles, key
    tiles, warps and stages, against SDPA (FlashAttention, ``is_causal`` with GQA) over the chunk's own keys (from
    position 0 only) and ppsplit's lockstep flash kernel."""
    from triton.testing import do_bench_cudagraph

    import torch.nn.functional as F

    from ppsplit.triton_kernels.attention import launch_cache_attention
    from ppsplit.triton_kernels.paged import attention_plan, launch_paged_attention

    hq, hkv, d = 32, 8, 128
    live = start + tokens
    need = -(-live // block)
    ids = list(range(need))
    random.Random(0).shuffle(ids)
    table = torch.tensor([ids], dtype=torch.long, device="cuda")
    dev = dict(device="cuda", dtype=torch.bfloat16)
    keys, values = (torch.randn(need, block, hkv, d, **dev) for _ in range(2))
    q = torch.randn(1, tokens, hq, d, **dev).transpose(1, 2)
    positions = torch.arange(start, live, dtype=torch.long, device="cuda")
    seq = torch.zeros(tokens, dtype=torch.long, device="cuda")
    starts = torch.zeros(1, dtype=torch.long, device="cuda")
    counts = torch.full((1,), tokens, dtype=torch.long, device="cuda")
    scale = d ** -0.5

    def timed(fn):
        fn()
        return do_bench_cudagraph(fn, rep=50) * 1e3

    flops = 4 * hq * d * sum(range(start + 1, live + 1))  # q.k and p.v over each token's visible keys
    base = {}
    kc, vc = (torch.randn(1, hkv, live, d, **dev) for _ in range(2))
    if start == 0:
        qs, ks, vs = q.contiguous(), kc.contiguous(), vc.contiguous()
        base["SDPA (is_causal, GQA)"] = timed(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                                      enable_gqa=True))
    base["lockstep flash kernel"] = timed(lambda: launch_cache_attention(q, kc, vc, positions, scale))
    ref = min(base.values())
    print(f"\none layer, a {tokens}-token prefill chunk from position {start}, blocks of {block}: "
          f"{flops / 1e9:.1f} GFLOP")
    for name, us in base.items():
        print(f"  {name:<32} {us:8.1f} us  {flops / us / 1e6:6.0f} TFLOP/s")
    plan = attention_plan(tokens, hq, hkv, 1, need * block, block, q.device)
    span = need * block
    named = {"plan": {}, "forward order": dict(reverse=False), "one masked loop": dict(phases=False),
             "section 30's plan": dict(block_q=16, block_n=32, warps=4, stages=3, chunk=min(span, 1024),
                                       splits=-(-span // min(span, 1024)))}
    grid = [dict(block_q=bq, block_n=bn, warps=w, stages=st) for bq in (16, 32, 64) for bn in (32, 64, 128)
            for w in (4, 8) for st in (2, 3)]
    run_plans(plan, named, grid, keys, values, lambda over, k, v: timed(lambda: launch_paged_attention(
        q, k, v, positions, seq, table, starts, counts, scale, config=over)),
        lambda us: f"{flops / us / 1e6:6.0f} TFLOP/s  x best baseline {us / ref:5.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk of the mixed step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a small hidden size (CPU smoke runs)")
    ap.add_argument("--sweep", action="store_true", help="one layer's attention kernels alone, launch plans swept")
    ap.add_argument("--profile", action="store_true", help="the ragged and lockstep decodes' kernels by GPU time")
    ap.add_argument("--plans", action="store_true", help="the ragged decode again under each of STEP_PLANS")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/ragged.py times CUDA graphs: run it on a CUDA machine (or --device cpu --small for a smoke run)")
    print(banner(args.device), flush=True)
    if args.sweep:
        lengths = [round(args.min_len + i * (args.max_len - args.min_len) / max(1, args.batch - 1))
                   for i in range(args.batch)]
        sweep(lengths, 16, copy_bandwidth("cuda"))
        sweep_prefill(2048, 16)               # peer.py's prefill step, per layer
        sweep_prefill(args.chunk, 16, args.max_len // 2)  # the mixed step's chunk
        return
    model = build_model("llama-3.1-8b", args.device, num_hidden_layers=args.layers, **(SMALL if args.small else {}))
    cfg = model.config
    b = args.batch
    lengths = [round(args.min_len + i * (args.max_len - args.min_len) / max(1, b - 1)) for i in range(b)]
    mean = round(sum(lengths) / b)
    chunk_at = args.max_len // 2  # the chunk continues a longer prompt: it attends over chunk_at earlier positions
    block = 16
    span = max(args.max_len + 1, chunk_at + args.chunk)
    need = [-(-(n + 1) // block) for n in lengths[:-1]] + [-(-span // block)]
    pool = sum(need)
    traced = ppsplit.trace_model(model, cache=CacheConfig(b, span, block_size=block, num_blocks=pool))
    paged = ppsplit.split_model(traced, pp=1)
    lockstep = ppsplit.split_model(ppsplit.trace_model(model, cache=CacheConfig(b, mean + 8), paged=False), pp=1)
    stage = paged.stages[0]
    layout = CacheLayout.of(paged.plan)
    ids = list(range(pool))
    random.Random(0).shuffle(ids)  # blocks scattered over the pool, as an engine's allocator leaves them
    tables, at = {}, 0
    for slot, count in enumerate(need):
        tables[slot] = ids[at:at + count]
        at += count
    fill_cache(stage, 1)
    fill_cache(lockstep.stages[0], 2)
    bw = copy_bandwidth(args.device)
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) \
        * model.dtype.itemsize
    weights = sum(p.numel() * p.element_size() for n, p in stage.named_parameters() if "embed_tokens" not in n)

    decodes = [Segment(s, lengths[s], 1) for s in range(b)]
    rows = {
        "ragged decode": ragged_run(stage, decodes, tables, layout, args.device),
        "lockstep decode (mean length)": stage_runs(lockstep, b, 1, mean, args.device),
        "mixed: decodes + chunk": ragged_run(stage, decodes[:-1] + [Segment(b - 1, chunk_at, args.chunk)], tables,
                                             layout, args.device),
        "decodes alone": ragged_run(stage, decodes[:-1], tables, layout, args.device),
        "chunk alone": ragged_run(stage, [Segment(b - 1, chunk_at, args.chunk)], tables, layout, args.device),
    }
    if args.plans:
        for name, over in STEP_PLANS.items():
            with plan_overridden(over):
                rows[f"ragged decode, {name}"] = ragged_run(stage, decodes, tables, layout, args.device)
        with rope_write_off():
            apart = ppsplit.split_model(traced, pp=1).stages[0]
        fill_cache(apart, 1)
        rows["ragged decode, rope and writes apart"] = ragged_run(apart, decodes, tables, layout, args.device)
    ms = {name: step_ms(run, args.device, args.rounds) for name, run in rows.items()}
    if args.profile and args.device == "cuda":
        for name in ("ragged decode", "lockstep decode (mean length)"):
            profile(rows[name], name, top=16)
    live = {"lockstep decode (mean length)": b * (mean + 1)}
    live.update({name: sum(n + 1 for n in lengths) for name in ms if name.startswith("ragged decode")})
    print(f"\n{b} sequences of {lengths[0]}..{lengths[-1]} positions (mean {mean}), {args.layers} layers; copy "
          f"bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'step':<40} {'ms':>9} {'x roofline':>10} {'x lockstep':>10}")
    lock = ms["lockstep decode (mean length)"]
    for name, t in ms.items():
        roof = (weights + live[name] * kv_per_token) / bw * 1e3 if name in live else float("nan")
        print(f"{name:<40} {t:>9.3f} {t / roof:>10.2f} {t / lock if name in live else float('nan'):>10.3f}")
    print(f"ragged / lockstep: {ms['ragged decode'] / ms['lockstep decode (mean length)']:.3f} (goal <= 1.05)")
    apart = ms["decodes alone"] + ms["chunk alone"]
    print(f"mixed / (decodes + chunk apart): {ms['mixed: decodes + chunk'] / apart:.3f} (goal < 1)")
    full = b * args.max_len * kv_per_token
    print(f"cache held: paged pool {cache_bytes(stage) / 2**20:,.1f} MiB ({pool} blocks of {block}) against "
          f"batch x max_len {full / 2**20:,.1f} MiB ({b} x {args.max_len}): {cache_bytes(stage) / full:.2f}x")


if __name__ == "__main__":
    main()
