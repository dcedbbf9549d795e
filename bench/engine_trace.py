"""The engine on a seeded request trace: Poisson arrivals, prompt and output lengths drawn uniformly from stated
ranges, the same trace for every system in one run.

    python bench/engine_trace.py --cpu                       # demo model, fp32: engine vs HF generate one at a time
    python bench/engine_trace.py                             # CUDA: Llama-3.1-8B shape, random bf16, pp=1, captured
    torchrun --nproc-per-node 2 bench/engine_trace.py --pp 2 # two GPUs (NCCL): pp=2 PipelineEngine vs pp=1 alone

Printed per system: requests, output tokens, makespan (first arrival to last token), output tokens/s, time to first
token (TTFT, from arrival) and inter-token latency (ITL: the gap between a request's outputs, shared among the
tokens of that output) at p50/p99. Systems (every one serves the trace as it arrives, in wall-clock time):

  engine        ``ppsplit.Engine`` over an in-process split with a paged cache (continuous batching, chunked
                prefill); on CUDA every token-count bucket is captured as a CUDA graph
  engine-1      the same engine with ``max_num_seqs=1``: one request at a time through the same stages
  hf            (CPU) ``model.generate`` of one request at a time, greedy, in arrival order (a queue)
  pp=N          (torchrun) ``PipelineEngine``, one rank per stage, N micro-steps in flight, against ``engine`` pp=1
                on rank 0's GPU alone
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import ppsplit  # noqa: E402
from ppsplit import CacheConfig  # noqa: E402
from ppsplit.serve.engine import Engine  # noqa: E402
from ppsplit.serve.sampling import SamplingParams  # noqa: E402


def make_trace(n: int, seed: int, rate: float, prompts: tuple[int, int], outputs: tuple[int, int], vocab: int):
    """``n`` requests ``(arrival_s, prompt_ids, max_tokens)``: exponential gaps of mean ``1/rate`` seconds."""
    rng = random.Random(seed)
    t, trace = 0.0, []
    for _ in range(n):
        trace.append((t, [rng.randrange(3, vocab) for _ in range(rng.randint(*prompts))], rng.randint(*outputs)))
        t += rng.expovariate(rate)
    return trace


class Timings:
    """Per request: arrival, the time and size of every output that carried tokens."""

    def __init__(self):
        self.arrival, self.outputs = {}, {}

    def add(self, rid, arrival: float):
        self.arrival[rid], self.outputs[rid] = arrival, []

    def tokens(self, rid, count: int, now: float):
        if count:
            self.outputs[rid].append((now, count))

    def report(self, name: str, start: float) -> dict:
        ttft, itl, total, end = [], [], 0, start
        for rid, outs in self.outputs.items():
            if not outs:
                continue
            ttft.append(outs[0][0] - self.arrival[rid])
            for (t0, _), (t1, c) in zip(outs, outs[1:]):
                itl.extend([(t1 - t0) / c] * c)
            total += sum(c for _, c in outs)
            end = max(end, outs[-1][0])
        span = end - start
        row = dict(system=name, requests=len(ttft), tokens=total, makespan_s=span, tokens_per_s=total / span,
                   ttft_p50_ms=1e3 * pct(ttft, 50), ttft_p99_ms=1e3 * pct(ttft, 99),
                   itl_p50_ms=1e3 * pct(itl, 50), itl_p99_ms=1e3 * pct(itl, 99))
        print(f"{name:10s} {row['requests']:4d} req {total:6d} tok {span:8.2f} s {row['tokens_per_s']:9.1f} tok/s  "
              f"TTFT p50 {row['ttft_p50_ms']:8.1f} p99 {row['ttft_p99_ms']:8.1f} ms  "
              f"ITL p50 {row['itl_p50_ms']:7.2f} p99 {row['itl_p99_ms']:7.2f} ms", flush=True)
        return row


def pct(values, q):
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def serve_trace(engine, trace, name: str, device, close=None) -> dict:
    """Replay ``trace`` against ``engine`` (``add_request``/``step``/``has_unfinished``) in wall-clock time."""
    timings, pending = Timings(), list(trace)
    sync(device)
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            arrival, prompt, max_tokens = pending.pop(0)
            rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            timings.add(rid, start + arrival)
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - start)))
            continue
        outputs = engine.step()
        sync(device)
        now = time.perf_counter()
        for out in outputs:
            timings.tokens(out.request_id, len(out.new_token_ids), now)
    if close is not None:
        close()
    return timings.report(name, start)


def serve_hf(model, trace, device) -> dict:
    """HF ``generate`` of one request at a time, in arrival order; a streamer stamps every token."""
    from transformers.generation.streamers import BaseStreamer

    timings = Timings()

    class Stamp(BaseStreamer):
        def __init__(self, rid):
            self.rid, self.first = rid, True

        def put(self, value):
            if self.first:  # generate puts the prompt first
                self.first = False
                return
            timings.tokens(self.rid, value.numel(), time.perf_counter())

        def end(self):
            pass

    start = time.perf_counter()
    for i, (arrival, prompt, max_tokens) in enumerate(trace):
        time.sleep(max(0.0, arrival - (time.perf_counter() - start)))
        timings.add(i, start + arrival)
        ids = torch.tensor([prompt], device=device)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                       do_sample=False, streamer=Stamp(i), pad_token_id=0)
    return timings.report("hf", start)


def build(args, device):
    from common import build_model
    from ppsplit.compile.demo import demo_model

    if args.cpu:
        return demo_model().to(torch.float32)
    torch.manual_seed(0)
    return build_model("llama-3.1-8b", device)


def cache_of(args):
    longest = args.prompt_max + args.output_max
    return CacheConfig(batch_size=args.max_num_seqs, max_len=longest, block_size=16,
                       num_blocks=args.num_blocks or None)


def engine_over(model, args, device, pp=1, max_num_seqs=None):
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=cache_of(args)), pp, aux="eagle3")
    if device != "cpu":
        split.place([device] * pp)
        split.capture(0, buckets(args.budget))
    return Engine(split, max_num_batched_tokens=args.budget, max_num_seqs=max_num_seqs)


def buckets(budget: int):
    from ppsplit.distributed import buckets_up_to

    return buckets_up_to(budget)


def main_single(args):
    device = "cpu" if args.cpu else "cuda"
    from common import banner

    print(f"# {banner(device)}; {args.requests} requests, rate {args.rate}/s, prompts {args.prompt_min}.."
          f"{args.prompt_max}, outputs {args.output_min}..{args.output_max}, seed {args.seed}, budget {args.budget} "
          f"tokens, {args.max_num_seqs} sequences", flush=True)
    model = build(args, device)
    trace = make_trace(args.requests, args.seed, args.rate, (args.prompt_min, args.prompt_max),
                       (args.output_min, args.output_max), model.config.vocab_size)
    rows = []
    engine = engine_over(model, args, device)
    serve_trace(engine, trace[:8], "(warm-up)", device)
    rows.append(serve_trace(engine, trace, "engine", device))
    if args.cpu or args.serial:
        rows.append(serve_trace(engine_over(model, args, device, max_num_seqs=1), trace, "engine-1", device))
    if args.cpu:
        rows.append(serve_hf(model, trace, device))
    base = rows[-1]["tokens_per_s"]
    for row in rows:
        print(f"  {row['system']:10s} {row['tokens_per_s'] / base:6.2f}x {rows[-1]['system']} tokens/s")


def main_pipeline(args):
    import torch.distributed as dist

    from ppsplit.distributed import PipelineEngine

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    from common import banner

    if rank == 0:
        print(f"# {banner('cuda')}; pp={world} over NCCL; {args.requests} requests, rate {args.rate}/s, prompts "
              f"{args.prompt_min}..{args.prompt_max}, outputs {args.output_min}..{args.output_max}, seed {args.seed}",
              flush=True)
    torch.manual_seed(0)
    model = build(args, "cpu")  # every rank builds the same seeded weights, keeps its stage
    split = ppsplit.split_model(ppsplit.trace_model(model, cache=cache_of(args)), world, aux="eagle3")
    stage = split.stages[rank].to(device)
    engine = PipelineEngine(stage, max_num_batched_tokens=args.budget, cuda_graphs=True, device=device,
                            eos_token_id=split.eos_token_id)
    trace = make_trace(args.requests, args.seed, args.rate, (args.prompt_min, args.prompt_max),
                       (args.output_min, args.output_max), model.config.vocab_size)
    if rank == 0:
        row = serve_trace(engine, trace, f"pp={world}", device, close=engine.close)
    else:
        engine.follow()
    del engine, stage, split
    torch.cuda.empty_cache()
    dist.barrier()
    if rank == 0:
        single = engine_over(model.to(torch.device(device)), args, device)
        serve_trace(single, trace[:8], "(warm-up)", device)
        base = serve_trace(single, trace, "pp=1", device)
        print(f"  pp={world} {row['tokens_per_s'] / base['tokens_per_s']:.2f}x pp=1 tokens/s (goal 1.8x)")
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="the demo model on the CPU, against HF generate")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (run under torchrun, one GPU per rank)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (default: 20 CPU, 16 CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-min", type=int, default=None)
    p.add_argument("--prompt-max", type=int, default=None)
    p.add_argument("--output-min", type=int, default=None)
    p.add_argument("--output-max", type=int, default=None)
    p.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=0, help="block pool (default: every sequence slot full)")
    p.add_argument("--serial", action="store_true", help="also run engine-1 on CUDA")
    args = p.parse_args()
    cpu_defaults = dict(rate=20.0, prompt_min=4, prompt_max=64, output_min=8, output_max=48)
    gpu_defaults = dict(rate=16.0, prompt_min=32, prompt_max=1024, output_min=32, output_max=256)
    for name, value in (cpu_defaults if args.cpu else gpu_defaults).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.pp > 1:
        main_pipeline(args)
    else:
        main_single(args)


if __name__ == "__main__":
    main()
