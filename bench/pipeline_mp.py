"""Multi-process pipeline (ppsplit.distributed) on two GPUs of one host, NCCL: pp=2 with 2 groups in flight
against pp=1 on one GPU, Llama-3.1-8B shape, bf16 random weights, EAGLE-3 taps (2, 16, 29).

    python bench/pipeline_mp.py                # 2 GPUs (starts its own 2 processes)
    python bench/pipeline_mp.py --tiny         # CPU, gloo, tiny model: checks the script, times nothing real

Each rank builds the same seeded model on its own device, traces it once with a KV cache of 2 x rows sequences,
and keeps its stage of the pp=2 split (``PipelineRank`` over an in-process stage); rank 0 also runs the pp=1
split of the same trace alone (a one-rank process group). Printed, all measured in this run:
  tokens   pp=2 tokens of group 0 == pp=1 tokens of the same prompts (and group 1 == pp=1 of its prompts)
  decode   tokens/s, pp=2 with 2 groups of ``rows`` in flight vs pp=1 with one group of ``rows``: the difference
           of two generate calls (N1 and N2 new tokens) so that prefill and setup cancel out
  bytes    crossing the stage boundary per decoded token: measured (positions + hidden + aux prefix, and the
           token message back) against the minimum (hidden + aux prefix)
  time     where a pp=2 decode round goes: each stage's decode step alone (CUDA-graph replay, events), a
           boundary transfer alone (NCCL send/recv of hidden + aux prefix), and the rest (bubble, argmax, sync)
"""
import argparse
import os
import socket
import statistics
import sys
import time
import warnings

import torch

from ppsplit.core.tensors import model_dtype
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")


def build(args, device):
    from transformers import AutoModelForCausalLM

    from shapes import config

    overrides = dict(num_hidden_layers=8, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512) if args.tiny else {}
    dtype = torch.float32 if args.tiny else torch.bfloat16  # the Triton interpreter has no bf16
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config("llama-3.1-8b", **overrides), dtype=dtype).eval()
    return model


def timed_generate(runner, prompts, new):
    dist.barrier(group=runner.group)
    start = time.perf_counter()
    out = runner.generate(prompts, new)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def decode_rate(runner, prompts, n1, n2, repeats):
    """Tokens/s of decode alone: (N2 - N1) extra steps over the extra time, median over ``repeats``."""
    rates, outs = [], None
    for _ in range(repeats):
        _, t1 = timed_generate(runner, prompts, n1)
        outs, t2 = timed_generate(runner, prompts, n2)
        rates.append(len(prompts or [0]) * args_rows * (n2 - n1) / (t2 - t1))
    return statistics.median(rates), outs, runner.stats


def stage_step_ms(stage, rows, device, repeats=20):
    """One decode step (T=1) of ``stage`` alone: CUDA-graph replay timed with events (GPU), else wall time."""
    import ppsplit

    plan = stage.meta["ppsplit.plan"]
    if device.type != "cuda":
        x = torch.zeros(rows, 1, dtype=torch.long) if stage.meta["ppsplit.stage"] == 0 else \
            torch.zeros(rows, 1, plan.hidden_size, dtype=model_dtype(plan))
        aux = torch.zeros(plan.n_slots, rows, 1, plan.hidden_size, dtype=model_dtype(plan))
        with torch.no_grad():
            stage(x, torch.tensor([7]), aux)
            start = time.perf_counter()
            for _ in range(repeats):
                stage(x, torch.tensor([7]), aux)
        return (time.perf_counter() - start) / repeats * 1e3
    g = ppsplit.cuda_graph(stage, rows, 1)
    g.positions.fill_(7)
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(repeats):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / repeats


def transfer_ms(plan, rows, device, repeats=50):
    """rank 0 -> rank 1: hidden [rows, 1, H] + aux prefix, as the pipeline sends them (NCCL or gloo)."""
    dtype = model_dtype(plan)
    hidden = torch.zeros(rows, 1, plan.hidden_size, dtype=dtype, device=device)
    aux = torch.zeros(plan.filled(0), rows, 1, plan.hidden_size, dtype=dtype, device=device)
    op = dist.isend if dist.get_rank() == 0 else dist.irecv
    peer = 1 - dist.get_rank()
    for _ in range(3):
        for w in [op(hidden, peer), op(aux, peer)]:
            w.wait()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        for w in [op(hidden, peer), op(aux, peer)]:
            w.wait()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3, hidden.nbytes + aux.nbytes


args_rows = 0


def rank_main(rank, args, port):
    global args_rows
    args_rows = args.rows
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)
    import ppsplit
    from ppsplit import distributed as ppd

    if args.stacks:  # a rank still running after --stacks seconds prints where every thread is (then goes on)
        import faulthandler
        faulthandler.dump_traceback_later(args.stacks, repeat=True)
    backend = ppd.init("gloo" if args.tiny else "nccl", timeout=args.timeout)
    device = torch.device(f"cuda:{rank}" if backend == "nccl" else "cpu")
    say = print if rank == 0 else (lambda *a, **k: None)
    start = time.perf_counter()
    model = build(args, device)
    traced = ppsplit.trace_model(model, cache=ppsplit.CacheConfig(2 * args.rows, args.prompt + args.n2 + 8))
    split2 = ppsplit.split_model(traced, 2, aux="eagle3")
    split1 = ppsplit.split_model(traced, 1, aux="eagle3")
    say(f"built, traced and split in {time.perf_counter() - start:.0f}s on {device} ({backend}); "
        f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    say(split2.plan.describe().splitlines()[0])
    graphs = not args.tiny and not args.eager
    solo = dist.new_group([0])  # pp=1 runs on rank 0 alone
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.rows, args.prompt), generator=gen) for _ in range(2)]

    runner2 = ppd.PipelineRank(split2.stages[rank], cuda_graphs=graphs)
    runner2.generate(prompts if rank == 0 else None, 4)  # warm-up (kernels, communicators)
    say(f"pp=2 warm-up generate done at {time.perf_counter() - start:.0f}s", flush=True)
    rate2, out2, stats2 = decode_rate(runner2, prompts if rank == 0 else None, args.n1, args.n2, args.repeats)
    say(f"pp=2 timed runs done at {time.perf_counter() - start:.0f}s", flush=True)
    bytes_rank0 = torch.tensor([stats2.bytes_sent, stats2.payload_bytes, stats2.items, stats2.tokens])
    rate1, out1 = None, None
    if rank == 0:
        runner1 = ppd.PipelineRank(split1.stages[0], cuda_graphs=graphs, group=solo)
        runner1.generate(prompts[:1], 4)
        rate1, out1, _ = decode_rate(runner1, prompts[:1], args.n1, args.n2, args.repeats)
        other = runner1.generate(prompts[1:], args.n2)
        say(f"pp=1 runs done at {time.perf_counter() - start:.0f}s", flush=True)
    dist.barrier()

    step = stage_step_ms(split2.stages[rank], args.rows, device)
    steps = [None, None]
    dist.all_gather_object(steps, step)
    full = stage_step_ms(split1.stages[0], args.rows, device) if rank == 0 else None
    xfer, nbytes = transfer_ms(split2.plan, args.rows, device)
    if rank != 0:
        return
    same = torch.equal(out2[0], out1[0]) and torch.equal(out2[1], other[0])
    print(f"\n== tokens: pp=2 (2 groups of {args.rows}) vs pp=1, {args.n2} new tokens ==")
    print(f"pp=2 group 0 == pp=1: {torch.equal(out2[0], out1[0])}; group 1 == pp=1: {torch.equal(out2[1], other[0])}")
    print(f"\n== decode: prompt {args.prompt}, tokens {args.n1}..{args.n2}, median of {args.repeats}, "
          f"{'CUDA graphs' if graphs else 'eager'} ==")
    if args.tiny:
        print("(--tiny: two processes on shared CPU cores; these times check the script and measure nothing)")
    one, two = ("1 GPU", "2 GPUs") if device.type == "cuda" else ("1 CPU process", "2 CPU processes")
    print(f"{'run':<44} {'tokens/s':>10} {'ratio':>7}")
    print(f"{f'pp=1, {one}, 1 group of {args.rows}':<44} {rate1:>10.0f} {1.0:>7.2f}")
    print(f"{f'pp=2, {two}, 2 groups of {args.rows}':<44} {rate2:>10.0f} {rate2 / rate1:>7.2f}   (goal: >= 1.80)")
    sent, payload, items, tokens = bytes_rank0.tolist()  # the last generate on rank 0 (prompts and decode)
    H, filled = split2.plan.hidden_size, split2.plan.filled(0)
    minimum = (1 + filled) * H * torch.empty((), dtype=split2.dtype).element_size()
    back = args.rows * (1 + runner2.width) * 8 * items
    print(f"\n== bytes crossing the boundary per token, over the last generate (hidden + aux[:{filled}], H={H}) ==")
    print(f"minimum {minimum} B; sent by rank 0 {sent / tokens:.1f} B (payload {payload / tokens:.1f} B, positions "
          f"{(sent - payload) / tokens:.2f} B); tokens back from rank 1 {back / tokens:.1f} B; "
          f"ratio {(sent + back) / tokens / minimum:.3f}")
    round_ms = 1e3 * args.rows * 2 / rate2  # one round: both groups through both stages
    ideal = 2 * max(steps)
    print(f"\n== where a pp=2 decode round goes (2 groups x {args.rows}; per device: 2 stage steps) ==")
    print(f"stage 0 step {steps[0]:.3f} ms, stage 1 step {steps[1]:.3f} ms (alone, "
          f"{'graph replay' if device.type == 'cuda' else 'eager'}); unsplit step {full:.3f} ms")
    print(f"transfer of hidden + aux prefix ({nbytes} B) alone: {xfer:.3f} ms")
    print(f"measured round {round_ms:.3f} ms vs 2 x slowest stage {ideal:.3f} ms: "
          f"{(round_ms / ideal - 1) * 100:+.1f}% (bubble, transfers not hidden, argmax, host); "
          f"pp=1 step measured {1e3 * args.rows / rate1:.3f} ms vs alone {full:.3f} ms")
    print(f"tokens equal: {same}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU, gloo, tiny model (checks the script only)")
    ap.add_argument("--rows", type=int, default=32, help="sequences per group")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--n1", type=int, default=16)
    ap.add_argument("--n2", type=int, default=144)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs for decode steps")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a rank waits for its peer")
    ap.add_argument("--stacks", type=float, default=0, help="print every rank's stacks every S seconds (hangs)")
    args = ap.parse_args()
    if args.tiny:
        args.rows, args.prompt, args.n1, args.n2, args.repeats = 4, 8, 4, 12, 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(args, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
