"""Serving throughput on one GPU, in one process and one run: ppsplit's ``Engine`` (its defaults: captured token
buckets, async scheduling, sampling on the device) against Hugging Face's own continuous batching
(``model.generate_batch``: transformers' paged attention and CUDA graphs) on the same Llama-3.1-8B-shaped model
(random bf16) and the same requests, and against a lower bound from the hardware measured here.

    python bench/gpu_engine.py [--requests 64] [--new 256] [--layers 32] [--rounds 2] [--skip-hf]

Requests: ``--requests`` prompts of ``--min-prompt`` .. ``--max-prompt`` random ids (seeded), ``--new`` new tokens
each, greedy, ``ignore_eos``, all added at once. Printed (one JSON object a line):

    lower_bound_s    prefill flops over the bf16 matmul rate measured here, plus every decode step's weights and
                     live KV bytes over the copy bandwidth measured here (steps of all requests at once)
    tok_s, x_bound   output tokens/s of each system and its wall time over the lower bound, per round
    idle             the device's idle share over --profile-steps decode steps of the engine (torch.profiler: the
                     span from the first kernel to the last, less the union of the kernels' intervals)
    single           one request alone (a 512-token prompt): ms per token, over the captured 1-token stage step
                     replayed at the same context length (CUDA events)
"""
import argparse
import json
import random
import time
import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

warnings.filterwarnings("ignore")
LLAMA8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5)


def say(**kw):
    print(json.dumps(kw), flush=True)


def copy_bw():
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t)
    del x, y
    return bw


def mm_rate():
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * 10 / (time.perf_counter() - t)


def bound(prompts, new, weight_bytes, params, kv_per_tok, bw, flops):
    """Prefill: 2 flops per parameter per prompt token; decode: each step reads the weights once plus each live
    sequence's KV."""
    t = 2 * params * sum(len(p) for p in prompts) / flops
    lens = [len(p) for p in prompts]
    for s in range(new):
        t += (weight_bytes + kv_per_tok * sum(n + s for n in lens)) / bw
    return t


def hf_run(model, prompts, new, cbc):
    gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gc, continuous_batching_config=cbc,
                               persistent_manager=True)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return dt, sum(len(o.generated_tokens) for o in out.values()), out


def pp_run(engine, prompts, new):
    from ppsplit.serve.sampling import SamplingParams

    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return dt, sum(len(o.token_ids) for o in outs), outs


def idle_share(engine, prompts, steps: int):
    """The device's idle share over ``steps`` engine steps once every request decodes."""
    from torch.profiler import ProfilerActivity, profile

    from ppsplit.serve.sampling import SamplingParams

    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True))
    while any(r.computed < len(r.prompt) for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    span = spans[-1][1] - spans[0][0]
    while engine.has_unfinished():
        for r in list(engine.scheduler.running):
            engine.abort(r.id)
        engine.step()
    return 1 - busy / span, span / steps / 1e3


def single(engine, split, prompt, new):
    """ms per token of one request alone, and the captured 1-token stage step at its context length."""
    from ppsplit.core.ragged import RaggedStep, Segment

    dt, toks, _ = pp_run(engine, [prompt], new)
    graphs = split.graphs.get((0, 1))
    step = RaggedStep.build([Segment(0, len(prompt) + new // 2, 1)],
                            {0: list(range(split.layout.blocks_per_seq))}, split.layout).to("cuda")
    ids = torch.zeros(1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        split.step(ids, step)  # fills the captured graphs' static inputs with this step
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        for g in graphs:
            g.replay()
    stop.record()
    torch.cuda.synchronize()
    return 1e3 * dt / toks, start.elapsed_time(stop) / 50


def add_trace_arguments(ap) -> None:
    """The request trace's options (shared with ``bench/gpu_serve.py``)."""
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=1024)


def trace_prompts(a) -> list[list[int]]:
    """``a.requests`` prompts of ``a.min_prompt`` .. ``a.max_prompt`` random ids, seeded."""
    rng = random.Random(0)
    return [[rng.randrange(1000, 100000) for _ in range(rng.randint(a.min_prompt, a.max_prompt))]
            for _ in range(a.requests)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_arguments(ap)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=int, default=2048, help="the engine's max_num_batched_tokens")
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()

    import ppsplit
    from ppsplit import CacheConfig
    from ppsplit.serve.engine import Engine

    say(torch=torch.__version__, transformers=transformers.__version__, gpu=torch.cuda.get_device_name())
    bw, fl = copy_bw(), mm_rate()
    say(copy_bw_GBs=round(bw / 1e9), matmul_TFLOPs=round(fl / 1e12))
    prompts = trace_prompts(a)
    cfg = LlamaConfig(num_hidden_layers=a.layers, **LLAMA8B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    kv_per_tok = a.layers * 2 * 8 * 128 * 2
    lb = bound(prompts, a.new, 2 * params, params, kv_per_tok, bw, fl)
    say(params=params, prompt_tokens=sum(map(len, prompts)), new_tokens=a.requests * a.new, lower_bound_s=round(lb, 3))

    t = time.perf_counter()
    split = ppsplit.split_model(model, pp=1, aux="eagle3",
                                cache=CacheConfig(batch_size=a.requests, max_len=a.max_prompt + a.new + 16))
    t_split = time.perf_counter() - t
    t = time.perf_counter()
    engine = Engine(split, max_num_batched_tokens=a.budget)
    say(ppsplit_split_s=round(t_split, 1), ppsplit_engine_and_capture_s=round(time.perf_counter() - t, 1),
        buckets=engine.scheduler.buckets, lag=engine.runner.lag, depth=engine.runner.depth)
    pp_run(engine, prompts[:8], 8)  # warm-up

    hf_ok = not a.skip_hf
    if hf_ok:
        from transformers import ContinuousBatchingConfig

        cbc = ContinuousBatchingConfig(max_memory_percent=0.3)
        try:
            t = time.perf_counter()
            hf_run(model, prompts[:8], 8, cbc)
            say(hf_warm_s=round(time.perf_counter() - t, 1), attn=model.config._attn_implementation)
        except Exception as e:  # noqa: BLE001
            say(hf_error=repr(e)[:600])
            hf_ok = False
    rates = {"hf": [], "ppsplit": []}
    for r in range(a.rounds):
        if hf_ok:
            dt, toks, hout = hf_run(model, prompts, a.new, cbc)
            rates["hf"].append(toks / dt)
            say(round=r, system="hf_generate_batch", s=round(dt, 3), out_tokens=toks, tok_s=round(toks / dt),
                x_bound=round(dt / lb, 2))
        dt, toks, pout = pp_run(engine, prompts, a.new)
        rates["ppsplit"].append(toks / dt)
        say(round=r, system="ppsplit_engine", s=round(dt, 3), out_tokens=toks, tok_s=round(toks / dt),
            x_bound=round(dt / lb, 2), steps=engine.steps)
    if hf_ok:
        hf_by_prompt = {tuple(o.prompt_ids): list(o.generated_tokens[:16]) for o in hout.values()}
        same = sum(1 for p, o in zip(prompts, pout) if hf_by_prompt.get(tuple(p)) == list(o.token_ids[:16]))
        say(first16_identical=f"{same}/{len(pout)}", ppsplit_over_hf=round(max(rates["ppsplit"]) / max(rates["hf"]), 2))
        model.destroy_cached_continuous_batching_manager()
    idle, step_ms = idle_share(engine, prompts, a.profile_steps)
    say(idle_share=round(idle, 4), decode_step_ms=round(step_ms, 3), requests=len(prompts))
    ms_tok, replay_ms = single(engine, split, prompts[0][:512], a.new)
    say(single_ms_per_token=round(ms_tok, 3), captured_step_ms=round(replay_ms, 3),
        single_over_step=round(ms_tok / replay_ms, 3))


if __name__ == "__main__":
    main()
