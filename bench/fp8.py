"""FP8 block-scaled weights against bf16: bytes per decode step and the captured decode step time, Llama-3.1-8B
shape with random weights (quantised here in 128x128 blocks, as DeepSeek-V3 / Qwen3-FP8 ship them), on a CUDA GPU.

The bf16 split (ppsplit's defaults) is timed first; then a second split's linears are rewritten by the compile's
own pass (``ppsplit.passes.quantize``) onto FP8 weights + ``weight_scale_inv``, what stays bf16 (``lm_head``) routed
through the GEMV as ``load`` routes it, and timed again, at every batch (paged cache, as compiled folders hold). Each step
is one replay of the stage's captured CUDA graph (``bench.common.stage_runs``), median of ``--rounds`` rounds of
``triton.testing.do_bench``. "roofline" = the bytes a step must read (the stage's weights and scales as stored,
plus the live KV prefix) over the device copy bandwidth measured in the same run.

Third, with ``--hf-kernel``, "HF fp8 (W8A8 Triton)": Hugging Face's own model (the same random weights) with each
decoder-layer projection on the same FP8 bytes (``quantize``), run as transformers 4.57's ``FP8Linear.forward`` runs
it (``act_quant`` then ``w8a8_block_fp8_matmul_triton``: activations quantised per 128-wide group). The step is HF's
StaticCache decode step (``peer.hf_step``, eager) captured as one CUDA graph (``common.graphed``), not torch.compile:
the graph drops the launch overhead without Inductor tracing the kernels' Python wrappers. Before the timing, the
logits of one step (one token per sequence at position 0) are compared with ppsplit FP8's (CUDA only; W8A8 rounds the
activations too, so they differ). transformers 5.x fetches these kernels from the hub
(``kernels-community/finegrained-fp8``), which the GPU machine cannot reach; 4.57.1 shipped them in-tree, and
``--hf-kernel`` takes an unmodified copy of that module, made with

    pip download transformers==4.57.1 --no-deps -d /tmp/tf457
    mkdir -p .hfref && unzip -p /tmp/tf457/*.whl transformers/integrations/finegrained_fp8.py > .hfref/hf_fp8_457.py

On the CPU (the Triton kernels need a GPU) the HF variant runs a torch reference of the same W8A8 arithmetic
(``w8a8_reference``); the check of the logits runs on CUDA only.

    python bench/fp8.py                       # batch 1 and 32, 32 layers, KV prefix 512
    python bench/fp8.py --hf-kernel .hfref/hf_fp8_457.py   # and HF's FP8 path beside them
    python bench/fp8.py --layers 4 --batch 1  # a quicker look
    python bench/fp8.py --device cpu --small --layers 2 --rounds 1   # a smoke run of the script itself (no timing claims)
    python bench/fp8.py --sweep               # the kernels alone per fused projection shape (--shapes all: also
                                              # q/k/v/gate/up): every tile configuration against bf16 cuBLAS and
                                              # the FP8 bytes' roofline
    python bench/fp8.py --sweep --batch 1 32 --save-tiles out/tiles.json   # and keep the fastest tiles per shape
    python bench/fp8.py --tiles out/tiles.json   # the step again on those tiles, beside linear_config's
    python bench/fp8.py --sweep --batch 1 --l2-resident   # and each shape's fastest tile on a weight already in L2
    python bench/fp8.py --batch 1 --prefetch 0 1 4   # and with none or more of the next weights prefetched into L2
    python bench/fp8.py --batch 1 --decode-chunks 64 128 256   # the FP8 step with the decode attention's keys in
                                              # fewer, longer chunks than the plan's (its combine has less to read)
"""
import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import traceback
from unittest import mock

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import banner, build_model, graphed, stage_runs  # noqa: E402

import ppsplit  # noqa: E402
from ppsplit import CacheConfig  # noqa: E402
from ppsplit.core.fx_utils import set_tensor  # noqa: E402
from ppsplit.core.options import StageOptions  # noqa: E402
from ppsplit.passes.quantize import QuantizedWeight, quantize_linears  # noqa: E402
from ppsplit.passes.rewrites import apply_rewrites  # noqa: E402
from ppsplit.triton_kernels.common import programmatic_launch  # noqa: E402

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


def profile(run, title: str, top: int = 14) -> None:
    """The step's kernels by GPU time over 5 runs (a captured graph's kernels are traced one by one)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    print(f"\n{title}: kernels over 5 steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70))


def hf_fp8_status() -> str:
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
        return "loaded (not timed by this script yet)"
    except Exception as e:  # no `kernels` package, no network, no build for this torch/CUDA
        return f"unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"


# Llama-3.1-8B's projections, [N, K]: q and o, k and v, gate and up, down; q/k/v and gate/up fused
SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336),
          "qkv": (6144, 4096), "gate_up": (28672, 4096)}
FUSED = ("qkv", "q/o", "gate_up", "down")  # what ppsplit's stages run by default (fused sibling projections)
FP8_APART = "fp8, silu_mul apart"  # the FP8 step without the fold of SiLU-and-multiply into the gate/up GEMV
# without the fold of bench/RESULTS.md section 39: the rotary and cache writes into the q/k/v GEMV
APART = {"bf16": "bf16, rope_write apart", "fp8": "fp8, rope_write apart"}
VARIANTS = ("bf16", "fp8", FP8_APART, APART["bf16"], APART["fp8"])
GEMV_SWEEP = [(bn, 2048, w, st) for bn in (2, 4, 8) for w in (4, 8) for st in (2, 4)]
GEMM_SWEEP = [(bn, 128, 4, st, split) for bn in (32, 64, 128) for st in (3, 4) for split in (1, 2, 4)]
L2_BYTES = 120 << 20  # over twice an H200's 50 MiB L2: the sweep's timed calls read weights from HBM


def folds_off(variant: str):
    """An ``ExitStack`` whose patches hold from now until it is closed: for ``FP8_APART`` the pointwise pass folds no
    SiLU-and-multiply into the FP8 gate/up GEMV; for the ``APART`` rows the rewrites match no q/k/v rotation; other
    variants patch nothing."""
    from ppsplit.passes.rewrites import gemv, pointwise

    stack = contextlib.ExitStack()
    if variant == FP8_APART:
        stack.enter_context(mock.patch.object(pointwise, "_fold_silu_mul", lambda node: None))
    if variant in APART.values():
        for module in (gemv, pointwise):
            stack.enter_context(mock.patch.object(module, "fold_qkv_rotation", lambda node, projection: False))
    return stack


def decode_chunks(chunk: int):
    """A patch under which each decode step's attention cuts every sequence's keys into chunks of ``chunk``
    positions (``attention_plan``'s at one token a sequence: as many as give 8 programs an SM, 32-position chunks at
    this script's 520 positions and batch 1); other plans as planned. The combine kernel's work shrinks with the
    chunk count, each program's loop grows."""
    from ppsplit.triton_kernels import paged

    planned = paged.attention_plan

    def plan(n, hq, hkv, slots, max_positions, *rest, **kw):
        out = planned(n, hq, hkv, slots, max_positions, *rest, **kw)
        if n <= slots:  # a decode step
            out.update(chunk=chunk, splits=-(-max_positions // chunk))
        return out

    return mock.patch.object(paged, "attention_plan", plan)


def prefetched_runs(split, stage, batch: int, args, want, results: dict, variant: str, step_bytes: int) -> None:
    """Time ``variant``'s step again with the L2 prefetches of each ``--prefetch`` budget (MB a point; 0: none) in
    place of the GEMV rewrite's (``passes.rewrites.prefetch``), the logits checked equal to ``want`` first; the stage
    is left with the rewrite's."""
    from ppsplit.passes.rewrites import prefetch

    for mb in args.prefetch:
        if mb:
            placed = prefetch.insert_prefetches(stage, int(mb * (1 << 20)))
        else:
            placed = 0
            prefetch.remove_prefetches(stage)
        run = stage_runs(split, batch, 1, args.prefix, args.device)
        got = run().clone()
        print(f"{variant}, prefetch {mb:g} MB, batch {batch}: {placed} points, logits "
              f"{'equal' if torch.equal(got, want) else 'DIFFER'}", flush=True)
        results[f"{variant}, prefetch {mb:g} MB", batch] = (step_ms(run, args.device, args.rounds), step_bytes)
        del run
    prefetch.insert_prefetches(stage)


def hf_kernel(path: str | None, device: str = "cuda"):
    """transformers' block-FP8 linear as its 4.x releases ran it in-tree (``act_quant`` then
    ``w8a8_block_fp8_matmul_triton``: W8A8, activations quantised per 128-wide group), ``(x, W_q, weight_scale_inv)
    -> y``, from an unmodified copy of 4.57.1's ``finegrained_fp8.py`` at ``path`` (5.x fetches the same kernels from
    the hub, which the GPU machine cannot reach). The copy is loaded as a module of ``transformers.integrations``, so
    that its relative import (``from ..utils import ...``) finds the installed transformers. Off CUDA the copy is
    still loaded (a bad one fails here too), but the linear is ``w8a8_reference``."""
    if not path:
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("transformers.integrations.finegrained_fp8_457", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if device != "cuda":
        return w8a8_reference

    def run(x, q, scale):
        xq, xs = mod.act_quant(x, 128)
        return mod.w8a8_block_fp8_matmul_triton(xq, q, xs, scale, [128, 128], output_dtype=x.dtype)
    return run


def against_kernel(path: str | None):
    """The one-row FP8 linear of another commit's ``triton_kernels/fp8.py`` at ``path`` (``git show
    main:triton_kernels/fp8.py > .hfref/fp8_main.py``, carried), ``(x, W_q, scale, config) -> y``, for the sweep to
    time beside this tree's on the same tiles in one run. Loaded as a module of its own, its ops not registered
    again (this tree's are)."""
    if not path:
        return None
    import importlib.util

    from ppsplit.triton_kernels import common

    spec = importlib.util.spec_from_file_location("ppsplit.triton_kernels.fp8_against", path)
    mod = importlib.util.module_from_spec(spec)
    with mock.patch.object(common, "register", lambda *a, **k: (lambda fn: fn)):
        spec.loader.exec_module(mod)
    return lambda x, q, scale, config: mod.launch_fp8_linear(x, q, scale, None, 128, 128, config=config)


def w8a8_reference(x, q, scale):
    """What ``act_quant`` + ``w8a8_block_fp8_matmul_triton`` compute, in torch (CPU smoke runs): ``x`` quantised per
    128-wide group to FP8 with scale amax / 448, both operands dequantised, one fp32 matmul, ``x``'s dtype out."""
    groups = x.float().unflatten(-1, (-1, 128))
    xs = groups.abs().amax(-1, keepdim=True) / 448.0
    xd = ((groups / xs).to(torch.float8_e4m3fn).float() * xs).flatten(-2)
    n, k = q.shape
    w = q.float() * scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (xd @ w.t()).to(x.dtype)


class HFFP8Linear(torch.nn.Module):
    """A projection as transformers 4.57's ``FP8Linear`` runs it, on ``quantize``'s FP8 weight + ``weight_scale_inv``
    (the bytes ppsplit's FP8 variant runs on). ``forward`` is ``FP8Linear.forward`` without its device context (one
    GPU) and the ``synchronize()`` after the kernels (a host wait, which a CUDA graph cannot hold)."""

    def __init__(self, linear: torch.nn.Linear, w8a8):
        super().__init__()
        q, scale = quantize(linear.weight.data)
        self.weight = torch.nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
        self.bias = linear.bias
        self.w8a8 = w8a8

    def forward(self, x):
        out = self.w8a8(x, self.weight, self.weight_scale_inv)
        if self.bias is not None:
            out = out + self.bias
        return out.to(dtype=x.dtype)


HF_ROW = "HF fp8 (W8A8 Triton)"


def hf_fp8_steps(model, w8a8, args, max_len: int, kv_per_token: int, first, results: dict) -> None:
    """The HF fp8 rows into ``results``, batch by batch: ``model``'s decoder projections (not ``lm_head``) become
    ``HFFP8Linear``s (its bf16 projections are dropped), and each step is HF's StaticCache decode step at position
    ``--prefix`` (``peer.hf_step``, eager) captured as one CUDA graph. ``first``: ``(ids, logits)`` of ppsplit FP8's
    step at position 0, compared with HF's logits for the same ids (CUDA only)."""
    from peer import hf_step

    names = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name.endswith("proj")]
    for name in names:
        model.set_submodule(name, HFFP8Linear(model.get_submodule(name), w8a8))
    print(f"HF: {len(names)} projections on the same FP8 weights, as transformers 4.57's FP8Linear", flush=True)
    if first is not None:
        ids, logits = first
        with torch.no_grad():
            theirs = model(input_ids=ids, use_cache=False).logits
        diff = (theirs.float() - logits.float()).abs().max().item()
        same = (theirs.argmax(-1) == logits.argmax(-1)).sum().item()
        print(f"first step (batch {ids.shape[0]}, position 0), HF fp8 (W8A8) against ppsplit fp8: max |logit diff| "
              f"{diff:.3g} (logits up to {logits.float().abs().max().item():.3g}), argmax equal in {same}/{len(ids)}")
    weights = stored_bytes(model)
    for batch in args.batch:
        run = graphed(hf_step(model, batch, 1, args.prefix, max_len, False, args.device), args.device)
        results[HF_ROW, batch] = (step_ms(run, args.device, args.rounds), weights + batch * args.prefix * kv_per_token)
        if args.profile and args.device == "cuda":
            profile(run, f"{HF_ROW}, batch {batch}")
        del run
        free_memory(args.device)


def programmatic_step(split, run, batch: int, args) -> float | str:
    """The step time of the step captured again with programmatic dependent launch switched on
    (``ppsplit.triton_kernels.common.programmatic_launch``), or why not: any of 50 replays of it that does not give
    the bits of the step without it (``run``; the same kernels on the same tiles, so only a missing wait can change a
    bit)."""
    previous = programmatic_launch(True)
    try:
        pdl = stage_runs(split, batch, 1, args.prefix, args.device)
    finally:
        programmatic_launch(previous)
    want = run().clone()
    for i in range(50):
        got = pdl()
        if not torch.equal(got, want):
            return (f"differs from the step without PDL at replay {i} (max |diff| "
                    f"{(got.float() - want.float()).abs().max().item():.3g})")
        if i % 10 == 9:
            want = run().clone()  # the plain step again between them, so each graph follows the other
    return step_ms(pdl, args.device, args.rounds)


def free_memory(device: str) -> None:
    """Give a dropped variant's GPU memory back (its graphs and modules may sit in reference cycles)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def sweep(batches, bw: float, hf_path: str | None = None, save: str | None = None, shapes=FUSED,
          gemv_tiles=GEMV_SWEEP, against_path: str | None = None, resident: bool = False) -> None:
    """Each FP8 kernel configuration per projection shape and row count, CUDA-graph timed, against bf16 cuBLAS
    (and ppsplit's bf16 GEMV at one row, and transformers' Triton block-FP8 kernels with ``--hf-kernel``): at one row
    the GEMV, at more rows the GEMM. The fastest configuration per shape is printed last. Each timed call
    runs over enough copies of the weights (``L2_BYTES`` and more) that none is in the L2 cache when it is read, as
    in a decode step, where each layer's weights are read once."""
    from triton.testing import do_bench_cudagraph

    from ppsplit.triton_kernels.fp8 import dequantize, launch_fp8_linear
    from ppsplit.triton_kernels.gemv import launch_gemv, pick_config

    def timed(fn, copies):
        """Microseconds per weight copy of ``fn(i)`` over copies ``i``, all in one captured graph."""
        run = lambda: [fn(i) for i in range(copies)]  # noqa: E731
        run()
        return do_bench_cudagraph(run, rep=30) * 1e3 / copies

    hf = hf_kernel(hf_path)
    against = against_kernel(against_path)
    best = {}
    for name in shapes:
        n, k = SHAPES[name]
        copies = max(1, -(-L2_BYTES // (n * k)))  # FP8 bytes; the bf16 copies are twice as large
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        qs = [quantize(w) for w in ws]
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            roof = (n * k + qs[0][1].numel() * 4 + m * (k + n) * 2) / bw * 1e6
            cublas = timed(lambda i: torch.nn.functional.linear(x, ws[i]), copies)
            line = f"{name:<8} [{n}x{k}] m={m:<3} roofline {roof:7.1f} us  bf16 cuBLAS {cublas:7.1f} us"
            if m == 1:
                gemv = timed(lambda i: launch_gemv(x, ws[i], config=pick_config(n, k)), copies)
                line += f"  bf16 GEMV {gemv:7.1f} us"
            if hf is not None:
                line += f"  HF fp8 (W8A8 Triton) {timed(lambda i: hf(x, *qs[i]), copies):7.1f} us"
            print(line, flush=True)
            exact = (x.double() @ dequantize(*qs[0], 128, 128).double().T).float()
            label, configs = ("fp8 GEMV", gemv_tiles) if m == 1 else ("fp8 GEMM", GEMM_SWEEP)
            rows = []
            for cfg in configs:
                try:
                    us = timed(lambda i: launch_fp8_linear(x, *qs[i], None, 128, 128, config=cfg), copies)
                except Exception as e:  # a configuration the compiler refuses (registers, shared memory)
                    print(f"    {label} {cfg}: {type(e).__name__}", flush=True)
                    continue
                rows.append((us, cfg))
            rows.sort()
            for us, cfg in rows[:3]:
                print(f"    {label} {cfg}: {us:7.1f} us  x roofline {us / roof:5.2f}  x bf16 cuBLAS "
                      f"{us / cublas:5.2f}", flush=True)
            if resident and rows and n * k <= L2_BYTES // 4:  # the fastest tile again on one copy, kept in L2
                cfg = rows[0][1]
                us = timed(lambda i: launch_fp8_linear(x, *qs[0], None, 128, 128, config=cfg), 1)
                print(f"    {label} {cfg}, its weight resident in L2: {us:7.1f} us  x roofline {us / roof:5.2f}",
                      flush=True)
            if against is not None and m == 1:  # the other commit's GEMV on every tile, in this run
                theirs = sorted((timed(lambda i: against(x, *qs[i], cfg), copies), cfg) for _, cfg in rows)
                for us, cfg in theirs[:3]:
                    print(f"    {label} of --against {cfg}: {us:7.1f} us  x roofline {us / roof:5.2f}", flush=True)
                if rows and theirs:
                    print(f"    fastest here / fastest of --against: {rows[0][0] / theirs[0][0]:.3f}", flush=True)
            if rows:  # the fastest against the fp64 product
                got = launch_fp8_linear(x, *qs[0], None, 128, 128, config=rows[0][1]).float()
                print(f"    {label} {rows[0][1]} against fp64: max |difference| "
                      f"{(got - exact).abs().max().item():.3g} (outputs up to {exact.abs().max().item():.3g})")
                best[name, m] = rows[0]
                if save:  # after each shape, so that a sweep cut short keeps what it found
                    with open(save, "w") as f:
                        json.dump({tile_key(*SHAPES[s], r): list(cfg) for (s, r), (_, cfg) in best.items()}, f,
                                  indent=1)
    print("\nfastest per shape:")
    for (name, m), (us, cfg) in best.items():
        print(f"  {name:<8} m={m:<3} {cfg} {us:7.1f} us")
    if save:
        print(f"tiles of {len(best)} shapes and row counts -> {save}")


def tile_key(n: int, k: int, m: int) -> str:
    return f"{n}x{k}" if m == 1 else f"{n}x{k}@{m}"


def swept_tiles(path: str) -> contextlib.ExitStack:
    """``linear_config`` answers from ``path`` (``--save-tiles``) for the shapes and row counts it holds while the
    block runs (a capture bakes the tiles in), in the FP8 module and in the q/k/v GEMV's, which imports it; a
    one-row entry may name a GEMM tile."""
    from ppsplit.triton_kernels import fp8, qkv

    with open(path) as f:
        tiles = {key: tuple(cfg) for key, cfg in json.load(f).items()}
    planned = fp8.linear_config
    swept = lambda m, n, k, device=None: tiles.get(tile_key(n, k, m)) or planned(m, n, k, device)  # noqa: E731
    stack = contextlib.ExitStack()
    for module in (fp8, qkv):
        stack.enter_context(mock.patch.object(module, "linear_config", swept))
    return stack


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prefix", type=int, default=512, help="KV positions already filled when the step runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a small hidden size (CPU smoke runs)")
    ap.add_argument("--sweep", action="store_true", help="time the kernels alone, every tile configuration")
    ap.add_argument("--profile", action="store_true", help="print each variant's kernels by GPU time")
    ap.add_argument("--hf-kernel", help="a copy of transformers 4.57.1's finegrained_fp8.py (module docstring): "
                                        "time HF's FP8 path beside ppsplit's (with --sweep: its kernels per shape)")
    ap.add_argument("--gemv-tiles", nargs="+", metavar="BN,BK,WARPS,STAGES",
                    help="with --sweep: these one-row tiles instead of the built-in grid (e.g. 8,1024,4,2 2,2048,4,4)")
    ap.add_argument("--against", metavar="FP8_PY", help="with --sweep: another commit's triton_kernels/fp8.py, whose "
                    "one-row GEMV is timed on the same tiles beside this tree's (against_kernel)")
    ap.add_argument("--l2-resident", action="store_true", help="with --sweep: also time each shape's fastest one-row "
                    "tile on one copy of its weight, which stays in L2 (what prefetching it there ahead would give)")
    ap.add_argument("--save-tiles", help="with --sweep: write the fastest one-row tiles per shape to this JSON file")
    ap.add_argument("--tiles", help="time the FP8 step again on the tiles of this file (--save-tiles)")
    ap.add_argument("--shapes", choices=("fused", "all"), default="fused",
                    help="with --sweep: the fused projections' shapes (what the stages run), or also q/k/v/gate/up")
    ap.add_argument("--decode-chunks", type=int, nargs="*", default=[],
                    help="also time the FP8 step with the decode attention's keys in chunks of these many positions "
                         "(the plan's: as many chunks as give 8 programs an SM)")
    ap.add_argument("--prefetch", nargs="+", type=float, default=[], metavar="MB",
                    help="also time bf16 and FP8 with these many MB of the next projections' weights prefetched into "
                         "L2 at each point (passes.rewrites.prefetch; 0: none) instead of the GEMV rewrite's 2")
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS,
                    help="the steps to time (default: all); bf16 first, the ratios' denominator")
    ap.add_argument("--pdl", action="store_true",
                    help="also time bf16 and FP8 with programmatic dependent launch (the bits checked equal first)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/fp8.py times CUDA graphs: run it on a CUDA machine (or --device cpu --small for a smoke run)")
    print(banner(args.device), flush=True)
    if args.sweep:
        tiles = [tuple(int(v) for v in t.split(",")) for t in args.gemv_tiles] if args.gemv_tiles else GEMV_SWEEP
        return sweep(args.batch, copy_bandwidth("cuda"), args.hf_kernel, args.save_tiles,
                     FUSED if args.shapes == "fused" else tuple(SHAPES), tiles, args.against, args.l2_resident)
    overrides = dict(num_hidden_layers=args.layers, **(SMALL if args.small else {}))
    model = build_model("llama-3.1-8b", args.device, **overrides)
    max_len = args.prefix + 8
    traced = ppsplit.trace_model(model, cache=CacheConfig(max(args.batch), max_len))
    bw = copy_bandwidth(args.device)
    cfg = model.config
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    w8a8 = hf_kernel(args.hf_kernel, args.device)
    first = None  # ppsplit FP8's first step, for the HF variant's check
    results = {}
    for variant in args.variants:
        # Both as ppsplit runs them by default. bf16: a split with its defaults (fused projections, pointwise
        # kernels, the GEMV at one row, SiLU-and-multiply folded into the gate/up GEMV, the rotary and the cache
        # writes into the q/k/v GEMV). FP8: the projections rewritten onto FP8 weights before the GEMV routing, as
        # a compiled FP8 folder is loaded, so the GEMV serves what stays bf16 (lm_head); the pointwise pass runs
        # again, as load runs it on FP8 projections, and folds each SiLU-and-multiply into its gate/up GEMV and
        # each rotation and cache write into its q/k/v GEMV (FP8_APART: no SiLU-and-multiply fold; APART: no rotary
        # fold, RESULTS section 39).
        fp8_weights, n = variant.startswith("fp8"), 0
        off = folds_off(variant)  # patched until off.close(), the captures included
        split = ppsplit.split_model(traced, pp=1, gemv=not fp8_weights)
        stage = split.stages[0]
        if fp8_weights:
            n = to_fp8(stage)
            apply_rewrites(stage, StageOptions(fuse_projections=False, fuse_pointwise=True, gemv=True),
                           torch.device(args.device))
        folded = {op: sum(str(node.target).startswith(f"ppsplit.{op}.") for node in stage.graph.nodes)
                 for op in ("linear_rope_write", "fp8_linear_silu_mul", "linear_silu_mul")}
        print(f"{variant}: {n} projections on FP8 weights (128x128 blocks); "
              f"folded: {folded}", flush=True)
        weights = stored_bytes(stage)
        for batch in args.batch:
            run = stage_runs(split, batch, 1, args.prefix, args.device)
            ms = step_ms(run, args.device, args.rounds)
            if args.profile and args.device == "cuda":
                profile(run, f"{variant}, batch {batch}")
            step_bytes = weights + batch * args.prefix * kv_per_token
            results[variant, batch] = (ms, step_bytes)
            if variant == "fp8" and args.tiles:
                with swept_tiles(args.tiles):
                    run = stage_runs(split, batch, 1, args.prefix, args.device)
                results["fp8, swept tiles", batch] = (step_ms(run, args.device, args.rounds), step_bytes)
            want = run().clone() if args.decode_chunks and variant == "fp8" else None
            for chunk in args.decode_chunks if variant == "fp8" else ():
                with decode_chunks(chunk):  # captured under the patch (on the CPU, run under it)
                    chunked = stage_runs(split, batch, 1, args.prefix, args.device)
                    diff = (chunked().float() - want.float()).abs().max().item()
                    print(f"fp8, keys by {chunk}, batch {batch}: max |logit diff| against the plan's {diff:.3g}")
                    results[f"fp8, keys by {chunk}", batch] = (step_ms(chunked, args.device, args.rounds), step_bytes)
            if args.prefetch and variant in ("bf16", "fp8"):
                prefetched_runs(split, stage, batch, args, run().clone(), results, variant, step_bytes)
            if args.pdl and variant in ("bf16", "fp8"):
                ms = programmatic_step(split, run, batch, args)
                results[f"{variant} + PDL", batch] = ms if isinstance(ms, str) else (ms, step_bytes)
        if variant == "fp8" and w8a8 is not None and args.device == "cuda":
            ids = torch.randint(0, 100, (args.batch[0], 1), generator=torch.Generator().manual_seed(0)).to(args.device)
            with torch.no_grad():
                first = ids, split(ids, torch.zeros(1, dtype=torch.long, device=args.device))[0]
        off.close()
        del split, stage, run
        free_memory(args.device)
    del traced
    if w8a8 is None:
        results.update({(HF_ROW, b): "not run: no --hf-kernel (a copy of transformers 4.57.1's finegrained_fp8.py, "
                                     "see the docstring)" for b in args.batch})
    else:
        try:
            hf_fp8_steps(model, w8a8, args, max_len, kv_per_token, first, results)
        except Exception as e:  # HF's forward or its capture: report it beside the rows that ran
            traceback.print_exc()
            results.update({(HF_ROW, b): f"failed: {type(e).__name__} (traceback above)" for b in args.batch
                            if (HF_ROW, b) not in results})
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; transformers 5.x's hub FP8 kernels: {hf_fp8_status()}")
    print(f"{'variant':<21} {'batch':>5} {'bytes/step':>14} {'step ms':>9} {'x bf16':>7} {'x roofline':>10}")
    for (variant, batch), row in results.items():
        if isinstance(row, str):
            print(f"{variant:<21} {batch:>5}  {row}")
            continue
        ms, step_bytes = row
        roof = step_bytes / bw * 1e3
        print(f"{variant:<21} {batch:>5} {step_bytes:>14,} {ms:>9.3f} {ms / results['bf16', batch][0]:>7.2f} "
              f"{ms / roof:>10.2f}")
    for batch in args.batch:
        both = [results.get((f"{v} + PDL", batch)) for v in ("fp8", "bf16")]
        if all(isinstance(row, tuple) for row in both):
            print(f"batch {batch}: fp8 + PDL / bf16 + PDL = {both[0][0] / both[1][0]:.2f}")


if __name__ == "__main__":
    main()
