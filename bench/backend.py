"""Decode speed of ``torch.compile(model, backend=ppsplit.backend(...))`` against plain Inductor (issue 12).

    python bench/backend.py                  # one CUDA GPU: Llama-3.1-8B shape, random bf16, batch 1 and 32
    python bench/backend.py --tiny           # CPU: a 4-layer toy Llama, proves the script runs end to end

Each variant compiles the same model with ``mode="reduce-overhead"`` (CUDA graphs; on CPU the default mode) and
decodes with Hugging Face's ``StaticCache`` one token per step, greedy, tokens fed back on the device (no host
sync inside the loop). Variants, side by side in one process:

- ``inductor``      ``backend="inductor"``: no taps, the baseline;
- ``ppsplit-3taps`` ``backend=ppsplit.backend(aux=[2, 16, 29], aux_out=buf)``: the three EAGLE-3 taps written
  into ``buf[3, B, 1, H]`` inside the compiled graph.

Printed per batch: ms per decode step (median of the repeats), the ratio to the baseline, Inductor's count of
CUDA-graph skips (0 means the taps buffer did not stop the graph from being captured), the first step's max
logits difference against the baseline, and whether every tap slot was written (finite, non-zero).
"""
import argparse
import statistics
import sys
import time

import torch

import ppsplit


def build(tiny: bool, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if tiny:
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        dtype = torch.float32
    else:  # Llama-3.1-8B's shape; random weights (nothing is downloaded)
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                          rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
        dtype = torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return model, cfg


def decode(model, cfg, compiled, batch, prompt, steps, repeats, device, sync):
    """Per-step seconds of ``repeats`` timed runs of ``steps`` decode steps, and the first step's logits."""
    from transformers import StaticCache

    cache = StaticCache(config=cfg, max_cache_len=prompt + (repeats + 1) * steps + 8)
    torch.manual_seed(batch)  # the same prompt for every variant
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt), device=device)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)  # eager prefill fills the cache
    tok = out.logits[:, -1:].argmax(-1)
    first = None
    times = []
    with torch.no_grad():
        for r in range(repeats + 1):  # run 0: compile, CUDA-graph warm-up and capture
            sync()
            start = time.perf_counter()
            for i in range(steps):
                pos = torch.full((1,), prompt + r * steps + i, device=device, dtype=torch.long)
                if hasattr(torch.compiler, "cudagraph_mark_step_begin"):
                    torch.compiler.cudagraph_mark_step_begin()
                logits = compiled(input_ids=tok, position_ids=pos.expand(batch, 1), cache_position=pos,
                                  past_key_values=cache, use_cache=True).logits
                if first is None:
                    first = logits.float().clone()
                tok = logits[:, -1:].argmax(-1)
            sync()
            if r:
                times.append((time.perf_counter() - start) / steps)
    return times, first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU toy model: checks that the script works")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,32; tiny: 1,4)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=None)
    args = ap.parse_args()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.tiny:
        sys.exit("no CUDA GPU: run with --tiny on a CPU")
    batches = [int(b) for b in (args.batches or ("1,4" if args.tiny else "1,32")).split(",")]
    steps = args.steps or (8 if args.tiny else 100)
    repeats = args.repeats or (3 if args.tiny else 5)
    prompt = args.prompt or (16 if args.tiny else 512)
    mode = None if device == "cpu" else "reduce-overhead"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    model, cfg = build(args.tiny, device)
    taps = [1, 2, 3] if args.tiny else [2, 16, 29]
    print(f"# torch {torch.__version__}, device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
          f"layers {cfg.num_hidden_layers}, hidden {cfg.hidden_size}, dtype {next(model.parameters()).dtype}, "
          f"mode {mode}, prompt {prompt}, {steps} steps x {repeats} repeats, taps {taps}")
    print("| batch | variant | ms / step | vs inductor | cudagraph skips | max abs logits diff | taps written |")
    print("|---|---|---|---|---|---|---|")
    for batch in batches:
        base = None
        for name in ("inductor", "ppsplit-3taps"):
            torch._dynamo.reset()
            from torch._dynamo.utils import counters
            counters.clear()
            buf = None
            if name == "inductor":
                backend = "inductor"
            else:
                buf = torch.zeros(len(taps), batch, 1, cfg.hidden_size, dtype=next(model.parameters()).dtype,
                                  device=device)
                backend = ppsplit.backend(aux=taps, aux_out=buf)
            compiled = torch.compile(model, backend=backend, mode=mode, fullgraph=True)
            times, first = decode(model, cfg, compiled, batch, prompt, steps, repeats, device, sync)
            ms = statistics.median(times) * 1e3
            skips = sum(counters["inductor"].get(k, 0) for k in counters["inductor"] if "cudagraph_skip" in k)
            if base is None:
                base = (ms, first)
            diff = (first - base[1]).abs().max().item()
            written = "-" if buf is None else str(bool(torch.isfinite(buf).all() and (buf != 0).flatten(1).any(1).all()))
            print(f"| {batch} | {name} | {ms:.3f} | {ms / base[0]:.4f} | {skips} | {diff:.3g} | {written} |", flush=True)


if __name__ == "__main__":
    main()
