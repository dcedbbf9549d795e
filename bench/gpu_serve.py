"""``ppsplit serve`` against ``Engine`` in process, and ``ppsplit generate`` from the command line, on one GPU, in one
run: a Llama-3.1-8B-shaped checkpoint (random bf16) written here, compiled with ``ppsplit compile --pp 1``, then

    engine     ``ppsplit.load(DIR)`` + ``Engine`` (its defaults: captured token buckets, async scheduling), the
               requests added at once
    serve      ``ppsplit serve DIR`` (its defaults), the same requests sent at once by threaded HTTP clients
               (``http.client``, streaming ``/v1/completions`` with token-id prompts), timing each request's chunks
    generate   ``ppsplit generate DIR --prompt-ids ...`` of the first requests, the wall time of the command

    python bench/gpu_serve.py [--requests 64] [--new 256] [--layers 32] [--work /tmp/gpu_serve]

Requests as ``bench/gpu_engine.py``'s (prompts of 128..1024 random ids, seeded), greedy, at most ``--new`` tokens;
the end-of-sequence id is honoured by both (the HTTP layer's ``ignore_eos`` is another issue's), so both generate the
same greedy tokens and the counts are compared. The checkpoint's tokenizer is a word-level one over the 128,256 ids
(``t0`` .. ``t128255``): the server detokenizes what it streams. One JSON object a line.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.gpu_engine import LLAMA8B, add_trace_arguments, trace_prompts  # noqa: E402

SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)  # --small: a check on the CPU
DEVICE = "cuda"


def say(**kw):
    print(json.dumps(kw), flush=True)


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def write_checkpoint(path: str, layers: int, small: bool) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    shape = dict(LLAMA8B, **(SMALL if small else {}))
    cfg = LlamaConfig(num_hidden_layers=layers, bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.save_pretrained(path)
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2").save_pretrained(path)


def engine_run(folder, prompts, new):
    import torch

    import ppsplit
    from ppsplit.serve.engine import Engine
    from ppsplit.serve.sampling import SamplingParams

    t = time.perf_counter()
    split = ppsplit.load(folder, [DEVICE])
    engine = Engine(split)
    say(engine_load_and_capture_s=round(time.perf_counter() - t, 1), lag=engine.runner.lag)
    engine.generate(prompts[:8], SamplingParams(max_tokens=8))  # warm-up
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=new))
    sync()
    dt = time.perf_counter() - t
    toks = sum(len(o.token_ids) for o in outs)
    say(system="engine", s=round(dt, 3), out_tokens=toks, tok_s=round(toks / dt))
    engine.close()
    del engine, split
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return toks / dt, [o.token_ids for o in outs]


def serve_run(folder, prompts, new, port):
    import http.client

    def get(path):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", path)
            return conn.getresponse().status
        finally:
            conn.close()

    cmd = [sys.executable, "-m", "ppsplit.cli", "serve", folder, "--port", str(port)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("ppsplit serve exited:\n" + "".join(log[-30:]))
            try:
                if get("/health") == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        say(serve_ready_s=round(time.perf_counter() - t0, 1), log=[line.strip() for line in log][-6:])

        def one(i, prompt, n, out):
            body = {"model": os.path.basename(folder), "prompt": prompt, "max_tokens": n, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            sent, times, usage = time.perf_counter(), [], None
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200, (r.status, r.read()[:300])
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
            conn.close()
            out[i] = (sent, times, usage["completion_tokens"] if usage else 0)

        def wave(ps, n):
            out = [None] * len(ps)
            threads = [threading.Thread(target=one, args=(i, p, n, out)) for i, p in enumerate(ps)]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            return time.perf_counter() - t, out

        wave(prompts[:8], 8)  # warm-up
        dt, out = wave(prompts, new)
        toks = sum(n for _, _, n in out)
        ttft = [times[0] - sent for sent, times, _ in out if times]
        itl = [b - a for _, times, _ in out for a, b in zip(times, times[1:])]
        say(system="serve", s=round(dt, 3), out_tokens=toks, tok_s=round(toks / dt),
            ttft_p50_ms=round(1e3 * pct(ttft, 50), 1), ttft_p99_ms=round(1e3 * pct(ttft, 99), 1),
            itl_p50_ms=round(1e3 * pct(itl, 50), 2), itl_p99_ms=round(1e3 * pct(itl, 99), 2))
        return toks / dt
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def generate_run(folder, prompts, new):
    cmd = [sys.executable, "-m", "ppsplit.cli", "generate", folder, "--max-new-tokens", str(new)]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t
    tail = (res.stdout + res.stderr).strip().splitlines()[-4:]
    say(system="ppsplit_generate_cli", requests=len(prompts), wall_s=round(dt, 1), rc=res.returncode, tail=tail)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_arguments(ap)
    ap.add_argument("--work", default="/tmp/gpu_serve")
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--small", action="store_true", help="hidden 256 (the script checked on a machine without a GPU)")
    a = ap.parse_args()

    import torch
    import transformers

    global DEVICE
    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    say(torch=torch.__version__, transformers=transformers.__version__,
        device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu")
    prompts = trace_prompts(a)
    ckpt, folder = os.path.join(a.work, "ckpt"), os.path.join(a.work, "pp1")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        t = time.perf_counter()
        write_checkpoint(ckpt, a.layers, a.small)
        say(checkpoint_s=round(time.perf_counter() - t, 1))
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "ppsplit.cli", "compile", ckpt, "--pp", "1", "--max-batch",
                          str(a.requests), "--max-len", str(a.max_prompt + a.new + 16), "-o", folder, "--force"],
                         capture_output=True, text=True)
    say(compile_s=round(time.perf_counter() - t, 1), rc=res.returncode, tail=(res.stdout + res.stderr).splitlines()[-3:])
    if res.returncode:
        return 1
    eng, eng_tokens = engine_run(folder, prompts, a.new)
    srv = serve_run(folder, prompts, a.new, a.port)
    say(serve_over_engine=round(srv / eng, 3))
    generate_run(folder, prompts[:1], a.new)
    generate_run(folder, prompts[:8], a.new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
