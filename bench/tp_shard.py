"""Tensor parallelism inside a stage: what one TP rank holds, and how fast its shard runs.

    python bench/tp_shard.py                                         # CPU: 2 layers of each shape, vocab 8192, fp32
    python bench/tp_shard.py --device cuda --layers 8 --tp 2         # one GPU: rank 0's shard vs the whole stage
    python bench/tp_shard.py --layouts --shapes llama-3.3-70b,deepseek-v3,kimi-k2 --grid 2x8,1x16,4x4

Shards (the default): a published shape (``bench/shapes.py``, random weights, its first ``--layers`` layers) split at
pp=1 with a paged cache, whole and cut over ``--tp`` ranks (``split_model(tp=)``, which proves every rank equal to the
whole stage by running them in lockstep). Checked, independently of the TP pass's own report: each rank's weights
(bytes of its parameters and buffers, caches apart) equal the plan's per-rank figure, and the ranks hold the whole
stage's weights exactly once over (the pieces they cut sum to the whole, what they keep whole is the same on each).
Timed: TP rank 0's shard alone, its collectives a local no-op (torch's fake process group of --tp ranks), against the
whole stage, for a decode step (``--batch`` sequences, 1 token) and a prefill chunk (1 sequence, ``--chunk``
tokens); on CUDA each as a CUDA graph replay, the median of ``--iters``. The ratio is the shard's compute share,
before any communication; the all-reduces are the multi-GPU issue's to measure.

Layouts (``--layouts``): the full-size model on the meta device (no weights) planned for each ``PPxTP`` of
``--grid``: weights per GPU (the largest stage's rank), cache per GPU, and per token the pipeline hops (pp - 1
sends of the hidden state); per step (any number of tokens) the all-reduces, summed over the stages.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import banner, build_model, stage_runs  # noqa: E402
from shapes import SHAPES, cut  # noqa: E402

import ppsplit  # noqa: E402
from ppsplit.core.fx_utils import is_cache_buffer  # noqa: E402

warnings.filterwarnings("ignore")

# Full-size shapes for --layouts only (published configs; never built with weights here).
LAYOUTS = {
    "llama-3.3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "deepseek-v3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
                        first_k_dense_replace=3, n_group=8, topk_group=4, kv_lora_rank=512, q_lora_rank=1536,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840),
    "kimi-k2": dict(model_type="deepseek_v3", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
                    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
                    n_shared_experts=1, n_routed_experts=384, num_experts_per_tok=8, first_k_dense_replace=1,
                    n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=131072),
}


def held_bytes(stage) -> tuple[int, int]:
    """(weight bytes, cache bytes) of a stage's own tensors, each tensor counted once."""
    seen, weights, cache = set(), 0, 0
    named = list(stage.named_parameters(remove_duplicate=False)) + list(stage.named_buffers(remove_duplicate=False))
    for name, t in named:
        key = id(t) if t.device.type == "meta" else (t.data_ptr(), tuple(t.shape), t.dtype)  # meta: no addresses
        if key in seen:
            continue
        seen.add(key)
        if is_cache_buffer(name):
            cache += t.numel() * t.element_size()
        else:
            weights += t.numel() * t.element_size()
    return weights, cache


def check_bytes(whole, sharded, tp: int) -> list[str]:
    """The independent byte check of one stage (see the module docstring); the report's lines."""
    report = sharded.plan.sharded[0]
    whole_w, whole_c = held_bytes(whole.stages[0])
    ranks = [held_bytes(split.stages[0]) for split in sharded.ranks]
    for r, (w, c) in enumerate(ranks):
        if abs(w - report.rank_bytes) > 8 * 16:  # the vocab-parallel start offsets (8 bytes each) aside
            raise SystemExit(f"FAIL: tp rank {r} holds {w} weight bytes, the plan says {report.rank_bytes}")
    cut_sum = sum(w - report.whole_bytes for w, _ in ranks)
    if abs(cut_sum - (whole_w - report.whole_bytes)) > 8 * 16 * tp:
        raise SystemExit(f"FAIL: the ranks' cut pieces sum to {cut_sum} bytes, the whole stage's cut tensors to "
                         f"{whole_w - report.whole_bytes}")
    return [f"  weights: whole {whole_w / 2**20:9.2f} MiB, per rank {ranks[0][0] / 2**20:9.2f} MiB "
            f"({ranks[0][0] / whole_w:.3f} of it; {report.whole_bytes / 2**20:.2f} MiB held whole on every rank)",
            f"  cache:   whole {whole_c / 2**20:9.2f} MiB, per rank {ranks[0][1] / 2**20:9.2f} MiB "
            f"({ranks[0][1] / max(1, whole_c):.3f})",
            "  " + "; ".join(report.lines()[:1]) + "  [bytes check: OK]"]


def timed(run, device: str, iters: int) -> float:
    """Median microseconds of ``run()``."""
    times = []
    for _ in range(max(3, iters // 10)):
        run()
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def local_group(tp: int) -> None:
    """Register a TP group of ``tp`` ranks whose collectives do nothing (torch's fake process group, this process
    its rank 0): rank 0's shard runs alone, its all-reduces and gathers a local no-op of the right shapes."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ppsplit.distributed.tensor_parallel import use_group

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    use_group(dist.group.WORLD)


def shards(args) -> None:
    device, dtype = args.device, (torch.bfloat16 if args.device == "cuda" else torch.float32)
    local_group(args.tp)
    cache = ppsplit.CacheConfig(max(args.batch, 1), args.max_len)
    print(banner(device))
    vocab = f", vocab {args.vocab}" if args.vocab else ""
    print(f"pp=1, tp={args.tp}, {args.layers} layers{vocab}, {dtype}, cache {cache.batch_size} x {cache.max_len}; decode "
          f"{args.batch} x 1, prefill 1 x {args.chunk}; median of {args.iters} (us)")
    for shape in args.shapes.split(","):
        torch.manual_seed(0)
        overrides = cut(shape, args.layers) | ({"vocab_size": args.vocab} if args.vocab else {})
        model = build_model(shape, device, dtype, **overrides)
        whole = ppsplit.split_model(model, pp=1, cache=cache, fuse_projections=False)
        sharded = ppsplit.split_model(model, pp=1, tp=args.tp, cache=cache, fuse_projections=False)
        print(f"{shape}:")
        for line in check_bytes(whole, sharded, args.tp):
            print(line)
        if device == "cuda":  # the stages as served (projections fused), rank 0 only
            whole = ppsplit.split_model(model, pp=1, cache=cache)
            rank0 = ppsplit.split_model(model, pp=1, tp=args.tp, tp_rank=0, cache=cache)
        else:
            rank0 = sharded.ranks[0]
        del sharded
        for what, batch, tokens, position in (("decode", args.batch, 1, args.position),
                                               ("prefill", 1, args.chunk, 0)):
            a = timed(stage_runs(whole, batch, tokens, position, device), device, args.iters)
            b = timed(stage_runs(rank0, batch, tokens, position, device), device, args.iters)
            print(f"  {what:<8} whole {a:10.1f}   tp rank 0 {b:10.1f}   ratio {b / a:.3f}")
        del model, whole, rank0
        if device == "cuda":
            torch.cuda.empty_cache()


def layouts(args) -> None:
    from transformers import AutoConfig

    from ppsplit.compile.source import skeleton

    print(banner("cpu"))
    print(f"planned on the meta device, cache {args.cache_seqs} x {args.max_len}, bf16; weights and cache per GPU are "
          f"the largest stage's TP rank")
    print(f"{'model':<16} {'pp x tp':>8} {'GPUs':>5} {'weights/GPU':>12} {'cache/GPU':>10} {'hops/token':>11} "
          f"{'all-reduces/step':>17}")
    for shape in args.shapes.split(","):
        kw = dict(LAYOUTS.get(shape) or SHAPES[shape])
        config = AutoConfig.for_model(kw.pop("model_type"), **kw)
        for cell in args.grid.split(","):
            pp, tp = (int(v) for v in cell.lower().split("x"))
            model = skeleton(config, torch.bfloat16)[0]
            start = time.perf_counter()
            split = ppsplit.split_model(model, pp=pp, tp=tp, cache=ppsplit.CacheConfig(args.cache_seqs, args.max_len))
            plan = split.plan
            if tp > 1:
                per = [(s.rank_bytes, s.rank_cache_bytes, s.all_reduces) for s in plan.sharded]
            else:
                per = [(*held_bytes(stage), 0) for stage in split.stages]
            weights, cache_b = max(p[0] for p in per), max(p[1] for p in per)
            print(f"{shape:<16} {pp:>4}x{tp:<3} {pp * tp:>5} {weights / 2**30:>10.1f}Gi {cache_b / 2**30:>8.1f}Gi "
                  f"{pp - 1:>11} {sum(p[2] for p in per):>17}   ({time.perf_counter() - start:.0f}s to plan)")
            del split, model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help="comma-separated names: " + ", ".join([*SHAPES, *LAYOUTS]))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2, help="the shape's first layers (shards only)")
    ap.add_argument("--vocab", type=int, default=None, help="shards: a smaller vocabulary (default: the shape's on "
                    "CUDA, 8192 on the CPU)")
    ap.add_argument("--batch", type=int, default=8, help="decode: sequences of one token each")
    ap.add_argument("--position", type=int, default=512, help="decode: live keys per sequence")
    ap.add_argument("--chunk", type=int, default=256, help="prefill: tokens of one sequence")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=None, help="timed runs (default: 200 on CUDA, 5 on the CPU)")
    ap.add_argument("--layouts", action="store_true", help="plan full-size models instead (meta device)")
    ap.add_argument("--grid", default="2x8,1x16,4x4", help="--layouts: PPxTP cells")
    ap.add_argument("--cache-seqs", type=int, default=64, help="--layouts: sequence slots of the cache")
    args = ap.parse_args()
    if args.layouts:
        args.shapes = args.shapes or "llama-3.3-70b,deepseek-v3,kimi-k2"
        args.max_len = max(args.max_len, 8192) if args.max_len == 1024 else args.max_len
        layouts(args)
        return
    args.shapes = args.shapes or ("llama-3.1-8b,qwen3-8b,qwen3-30b-a3b" if args.device == "cuda" else "llama-3.1-8b,qwen3-8b")
    args.iters = args.iters or (200 if args.device == "cuda" else 5)
    if args.device == "cpu" and args.vocab is None:
        args.vocab = 8192
    if args.device == "cpu":
        torch.set_num_threads(1)
    with torch.no_grad():
        shards(args)


if __name__ == "__main__":
    main()
