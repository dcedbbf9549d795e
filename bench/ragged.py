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
    python bench/ragged.py --device cpu --small --layers 2 --rounds 1 --max-len 256 --chunk 32   # a smoke run
"""
import argparse
import random
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import banner, build_model, stage_runs  # noqa: E402
from fp8 import SMALL, copy_bandwidth, step_ms  # noqa: E402

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
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/ragged.py times CUDA graphs: run it on a CUDA machine (or --device cpu --small for a smoke run)")
    print(banner(args.device), flush=True)
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
    paged = ppsplit.split_model(ppsplit.trace_model(model, cache=CacheConfig(b, span, block_size=block,
                                                                             num_blocks=pool)), pp=1)
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
    ms = {name: step_ms(run, args.device, args.rounds) for name, run in rows.items()}
    live = {"ragged decode": sum(n + 1 for n in lengths), "lockstep decode (mean length)": b * (mean + 1)}
    print(f"\n{b} sequences of {lengths[0]}..{lengths[-1]} positions (mean {mean}), {args.layers} layers; copy "
          f"bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'step':<32} {'ms':>9} {'x roofline':>10}")
    for name, t in ms.items():
        roof = (weights + live[name] * kv_per_token) / bw * 1e3 if name in live else float("nan")
        print(f"{name:<32} {t:>9.3f} {t / roof:>10.2f}")
    print(f"ragged / lockstep: {ms['ragged decode'] / ms['lockstep decode (mean length)']:.3f} (goal <= 1.05)")
    apart = ms["decodes alone"] + ms["chunk alone"]
    print(f"mixed / (decodes + chunk apart): {ms['mixed: decodes + chunk'] / apart:.3f} (goal < 1)")
    full = b * args.max_len * kv_per_token
    print(f"cache held: paged pool {cache_bytes(stage) / 2**20:,.1f} MiB ({pool} blocks of {block}) against "
          f"batch x max_len {full / 2**20:,.1f} MiB ({b} x {args.max_len}): {cache_bytes(stage) / full:.2f}x")


if __name__ == "__main__":
    main()
