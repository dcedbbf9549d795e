"""Load on ``ppsplit serve`` against the engine called in process: the cost of the HTTP layer.

    python bench/serve_load.py DIR [--requests 64] [--levels 1,8,32] [-k K]

DIR: a compiled folder with a paged cache and a tokenizer (e.g. ``ppsplit compile demo --pp 1 --max-batch 8
--max-len 256 -o demo-serve``). A seeded trace of ``--requests`` requests (prompts of 8 to 48 random token ids,
8 to 32 new tokens, greedy) runs at each concurrency level closed-loop: ``C`` clients, each sending its next
request when the last one ended. Through the server the clients are ``openai`` streaming clients in threads; in
process, the same requests go to an ``Engine`` that keeps ``C`` of them added. Both run in this run, one after the
other (the server is stopped before the engine is timed); both engines use one torch thread. Printed per level and system: requests/s, output
tokens/s, time to first token (TTFT) and inter-token latency (ITL: the gaps between a request's streamed steps)
p50/p99, and the ratios server / in process.
"""
import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def trace(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randrange(8, 49))], rng.randrange(8, 33)) for _ in range(n)]


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def summary(wall, records):
    """``records``: per request ``(submitted, [times of its streamed steps], tokens)``."""
    ttft = [steps[0] - t0 for t0, steps, _ in records if steps]
    itl = [b - a for _, steps, _ in records for a, b in zip(steps, steps[1:])]
    tokens = sum(n for _, _, n in records)
    return {"req/s": len(records) / wall, "tok/s": tokens / wall, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "tokens": tokens}


class Server:
    def __init__(self, folder, extra):
        self.proc = subprocess.Popen([sys.executable, "-m", "ppsplit.cli", "serve", folder, "--port", "0",
                                      "--served-model-name", "bench", *extra], stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                if "http://" in line and "serving" in line:
                    self.port = int(line.split("http://", 1)[1].split(" ")[0].rsplit(":", 1)[1])
                    ready.set()
                elif "error" in line.lower():
                    print(line, end="", file=sys.stderr)
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300) or self.proc.poll() is not None:
            raise SystemExit("the server did not start")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)


def run_http(port, requests, concurrency):
    import openai

    clients = [openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
               for _ in range(concurrency)]
    local = threading.local()
    ids = iter(range(concurrency))
    lock = threading.Lock()

    def one(request):
        if not hasattr(local, "client"):
            with lock:
                local.client = clients[next(ids)]
        prompt, n = request
        t0, steps, tokens = time.perf_counter(), [], 0
        for chunk in local.client.completions.create(model="bench", prompt=prompt, max_tokens=n, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                steps.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return t0, steps, tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        records = list(pool.map(one, requests))
    return summary(time.perf_counter() - start, records)


def run_engine(engine, requests, concurrency):
    from ppsplit.serve.sampling import SamplingParams

    pending, live, records = list(enumerate(requests)), {}, {}
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(live) < concurrency:
            i, (prompt, n) = pending.pop(0)
            live[engine.add_request(prompt, SamplingParams(max_tokens=n))] = i
            records[i] = (time.perf_counter(), [], 0)
        for out in engine.step():
            now = time.perf_counter()
            t0, steps, _ = records[live[out.request_id]]
            if out.new_token_ids or out.finished:
                steps.append(now)
            records[live[out.request_id]] = (t0, steps, len(out.token_ids))
            if out.finished:
                del live[out.request_id]
    return summary(time.perf_counter() - start, [records[i] for i in range(len(requests))])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--levels", default="1,8,32")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=None)
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    import torch
    import transformers

    import ppsplit
    from ppsplit.serve.engine import Engine, stage_vocab

    torch.set_num_threads(1)  # as the server's engine (OMP_NUM_THREADS=1): the clients need the other core
    split = ppsplit.load(args.folder)
    requests = trace(args.requests, stage_vocab(split.stages[0]))
    extra = ["-k", str(args.num_draft_tokens)] if args.num_draft_tokens else []
    print(f"ppsplit serve load: {args.folder}, {args.requests} requests per level, greedy"
          f"{f', K={args.num_draft_tokens}' if extra else ''}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    server = Server(args.folder, extra)
    run_http(server.port, requests[:2], 1)  # warm-up
    http = {c: run_http(server.port, requests, c) for c in levels}
    code = server.stop()
    engine = Engine(split, drafter=split.drafter if extra else None, num_draft_tokens=args.num_draft_tokens or 0)
    run_engine(engine, requests[:2], 1)
    local = {c: run_engine(engine, requests, c) for c in levels}
    print(f"{'C':>3} {'system':<11} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'tokens':>7}")
    for c in levels:
        for name, r in (("server", http[c]), ("in process", local[c])):
            print(f"{c:>3} {name:<11} {r['req/s']:>7.2f} {r['tok/s']:>8.1f} {r['ttft_p50'] * 1e3:>7.1f}ms "
                  f"{r['ttft_p99'] * 1e3:>7.1f}ms {r['itl_p50'] * 1e3:>6.1f}ms {r['itl_p99'] * 1e3:>6.1f}ms "
                  f"{r['tokens']:>7}")
        h, e = http[c], local[c]
        print(f"{c:>3} {'ratio':<11} {h['req/s'] / e['req/s']:>7.2f} {h['tok/s'] / e['tok/s']:>8.2f} "
              f"{h['ttft_p50'] / e['ttft_p50']:>9.2f} {'':>9} {h['itl_p50'] / e['itl_p50']:>8.2f}")
    print(f"server exit code after SIGTERM: {code}")


if __name__ == "__main__":
    main()
