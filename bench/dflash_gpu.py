"""A DFlash draft step's cost against the target's step, on one GPU, inside ppsplit's ``Engine``.

    python bench/dflash_gpu.py [--layers 32] [--draft-layers 5] [--block 16] [--batches 1,8,32] [--context 1024]

Target: a Llama-3.1-8B-shaped model (random bf16, ``--layers`` layers), split at pp 1 with the five taps a DFlash
drafter of that target reads. Drafter: z-lab's ``DFlashDraftModel`` (the ``dflash`` package's class) with the shape
z-lab ships for 8B targets (``--draft-layers`` Qwen3 layers of the target's width, block ``--block``, five taps),
random weights, saved by its own ``save_pretrained`` and loaded by ``ppsplit.load_drafter``.

For each batch size B: B requests of ``--context`` random prompt ids, greedy, ``ignore_eos``; once every request
decodes, ``--steps`` engine steps are timed, each between two synchronisations, and the drafter's part of each step
(``Proposer.feed``: the step's context rows written into the drafter's paged cache, then one forward over each
request's block) between two more. The same requests without a drafter give the plain decode step. Printed, one
JSON object a line (medians, ms):

    draft_ms          the drafter's part of a speculative step (B blocks of ``--block`` rows + the context rows)
    verify_step_ms    a speculative step less its draft part (the target over B windows of ``--block`` rows)
    decode_step_ms    a plain decode step (the target over B rows), no drafter
    draft_over_decode draft_ms / decode_step_ms (the issue's goal: <= 0.10)
    first_capture_ms  with ``--compare``: the same drafter as first captured (section 55 of bench/RESULTS.md: ATen
                      norms, rotations and activation in the draft layers, greedy picks eager), in the same run
"""
import argparse
import json
import statistics
import tempfile
import time
import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

warnings.filterwarnings("ignore")
LLAMA8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5)


DRAFT = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             vocab_size=LLAMA8B["vocab_size"])
DEVICE = "cuda"


def say(**kw):
    print(json.dumps(kw), flush=True)


def zlab_drafter(folder, layers: int, draft_layers: int, block: int, taps: list[int]):
    """z-lab's ``DFlashDraftModel`` shaped for an 8B target, random weights, saved by its own ``save_pretrained``."""
    import dflash.model as dflash
    from transformers import Qwen3Config

    cfg = Qwen3Config(num_hidden_layers=draft_layers, **DRAFT, max_position_embeddings=131072, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, block_size=block,
                      num_target_layers=layers, dflash_config={"target_layer_ids": taps,
                                                                    "mask_token_id": DRAFT["vocab_size"] - 2})
    cfg.architectures = ["DFlashDraftModel"]
    torch.manual_seed(1)
    with torch.device(DEVICE):
        lib = dflash.DFlashDraftModel(cfg).to(torch.bfloat16).eval()
    lib.save_pretrained(str(folder))
    del lib
    torch.cuda.empty_cache()


def timed_steps(engine, prompts, steps: int, feed_times: list | None):
    from ppsplit.serve.sampling import SamplingParams

    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=256, ignore_eos=True))
    while any(r.computed < len(r.prompt) for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    if feed_times is not None:
        feed_times.clear()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished():
        for r in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            engine.abort(r.id)
        engine.step()
    return times


def profile_feed(engine, prompts, feed):
    """Kernels and host time of the drafter's part of 5 speculative steps (``feed`` is the unwrapped one)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    proposer = engine.runner.sampler.proposer
    wrapped = proposer.feed

    def marked(*args, **kw):
        with record_function("draft"):
            return feed(*args, **kw)

    proposer.feed = marked
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_steps(engine, prompts, 5, None)
    proposer.feed = wrapped
    events = prof.key_averages()
    draft = next(e for e in events if e.key == "draft")
    say(profile_draft_calls=draft.count, draft_cpu_ms_each=round(draft.cpu_time_total / draft.count / 1e3, 3))
    print(events.table(sort_by="cuda_time_total", row_limit=25), flush=True)
    print(events.table(sort_by="cpu_time_total", row_limit=25), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", type=int, default=0, metavar="B",
                    help="also profile 5 speculative steps at batch B: the drafter's CUDA kernels and host time")
    ap.add_argument("--compare", action="store_true",
                    help="also time the drafter as first captured (ATen layers, eager greedy picks), side by side")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, times nothing")
    a = ap.parse_args()
    if a.smoke:
        global DEVICE
        DEVICE = "cpu"
        LLAMA8B.update(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                       num_key_value_heads=2)
        DRAFT.update(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     vocab_size=512)
        torch.cuda.synchronize = lambda: None

    import ppsplit
    from ppsplit import CacheConfig
    from ppsplit.serve.engine import Engine

    batches = [int(b) for b in a.batches.split(",")]
    say(torch=torch.__version__, transformers=transformers.__version__,
        device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu")
    from dflash.model import build_target_layer_ids

    zlab_ids = build_target_layer_ids(a.layers, 5)  # z-lab's spread of five taps: layer outputs
    taps = [i + 1 for i in zlab_ids]  # the same tensors in ppsplit's numbering (hidden_states[j])
    cfg = LlamaConfig(num_hidden_layers=a.layers, **LLAMA8B)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    t = time.perf_counter()
    split = ppsplit.split_model(model, pp=1, aux=taps,
                                cache=CacheConfig(batch_size=max(batches), max_len=a.context + 512))
    say(split_s=round(time.perf_counter() - t, 1), taps=taps)
    with tempfile.TemporaryDirectory() as d:
        zlab_drafter(d, a.layers, a.draft_layers, a.block, zlab_ids)
        drafter = ppsplit.load_drafter(d, split=split)
        first = ppsplit.load_drafter(d, split=split) if a.compare else None  # its own paged cache, its own graphs
    say(drafter_params=sum(p.numel() for p in drafter.parameters()), block=a.block, draft_layers=a.draft_layers)

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, LLAMA8B["vocab_size"] - 3, (a.context,), generator=g).tolist() for _ in range(max(batches))]
    plain = Engine(split, async_scheduling=False)
    engines = {"draft": timed(Engine(split, drafter=drafter, num_draft_tokens=a.block - 1, async_scheduling=False))}
    if a.compare:
        engines["first_capture"] = timed(first_capture_engine(split, first, a.block - 1))
    for b in batches:
        ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
        dec = ms(timed_steps(plain, prompts[:b], a.steps, None))
        row = dict(batch=b, context=a.context, decode_step_ms=round(dec, 3))
        for name, (engine, feed_times, feed) in engines.items():
            stp = timed_steps(engine, prompts[:b], a.steps, feed_times)
            draft = ms(feed_times)
            row[f"{name}_ms"] = round(draft, 3)
            row[f"{name}_over_decode"] = round(draft / dec, 3)
            if name == "draft":
                row["verify_step_ms"] = round(ms([s - f for s, f in zip(stp, feed_times)]), 3)
                if b == a.profile:
                    profile_feed(engine, prompts[:b], feed)
        say(**row)


def timed(engine):
    """``(engine, times, feed)``: the engine with its proposer's ``feed`` timed between two synchronisations into
    ``times`` (``feed``: the untimed one)."""
    proposer = engine.runner.sampler.proposer
    times: list = []
    feed = proposer.feed

    def timed_feed(*args, **kw):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = feed(*args, **kw)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        return out

    proposer.feed = timed_feed
    return engine, times, feed


def first_capture_engine(split, drafter, k: int):
    """The drafter as section 55 of bench/RESULTS.md captured it, for a side-by-side figure: the draft layers' ATen
    norms, rotations and activation (no fused kernels) and the greedy picks eager after the captured block."""
    import ppsplit.eagle3.dflash as dflash
    import ppsplit.eagle3.drafter as layers
    from ppsplit.serve.engine import Engine

    fused = layers.fused_kernels
    layers.fused_kernels = dflash.fused_kernels = lambda x: None
    try:
        engine = Engine(split, drafter=drafter, num_draft_tokens=k, async_scheduling=False)
    finally:
        layers.fused_kernels = dflash.fused_kernels = fused
    graphs = engine.runner.sampler.proposer.graphs
    if graphs is not None:  # (none on the CPU of --smoke)
        graphs.greedy = {}  # every step through the rows' graph and the eager picks
    return engine

if __name__ == "__main__":
    main()
