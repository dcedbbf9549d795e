"""vLLM's own benchmark client (``vllm bench serve``) against ``ppsplit serve``, and against ``vllm serve`` beside it.

    python bench/serve_vllm_client.py DIR --vllm VENV [--tokenizer HF_DIR] [--vllm-serve HF_DIR] [--num-prompts 16]
        [--levels 1,4,16] [--backends openai,openai-chat] [--input-len 32] [--output-len 16]

DIR: a compiled folder with a paged cache and a tokenizer (e.g. SmolLM2-135M compiled with ``--pp 1``, or the demo).
VENV: a virtual environment with vLLM installed (``vllm bench serve`` runs from it; vLLM is not imported here).
``--tokenizer``: the Hugging Face folder the client counts tokens with (default: DIR). The server is started on
127.0.0.1 on a free port; for each backend (``openai``: ``/v1/completions``, which sends ``logprobs: null`` and
``repetition_penalty: 1.0``; ``openai-chat``: ``/v1/chat/completions``) and concurrency level, the random dataset
(``--ignore-eos``: every request makes ``--output-len`` tokens) runs with ``--num-prompts`` requests. Printed per run:
completed / failed requests, output tokens/s, TTFT and ITL mean and p99 (ms), as vLLM's client measures them.

``--vllm-serve HF_DIR``: also start ``vllm serve HF_DIR`` (float32, from VENV, one compute thread bound to core 0 by
``VLLM_CPU_OMP_THREADS_BIND``; ppsplit gets ``--cpu-threads 1``) and run every (backend, concurrency) against both
servers, one after the other, in the same run; both servers stay up throughout, so the machine's other load falls on
both alike. ``--vllm-eager`` starts it with ``--enforce-eager`` (about 60 s instead of about 220 s on 2 cores).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

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


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_vllm(venv: str, model: str, name: str, eager: bool, log) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0", OMP_NUM_THREADS="1",
               TRANSFORMERS_VERBOSITY="error")
    cmd = [os.path.join(venv, "bin", "python"), "-c", _CLI, "serve", model, "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", name, "--dtype", "float32", "--max-model-len", "2048", "--seed", "0",
           *(["--enforce-eager"] if eager else [])]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited {proc.returncode}; its log: {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            pass
        time.sleep(3)
    proc.kill()
    raise SystemExit(f"vllm serve did not answer in 900 s; its log: {log.name}")


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
    p.add_argument("--serve-args", default="--cpu-threads 1", help="ppsplit serve options (default: one thread)")
    p.add_argument("--vllm-serve", default=None, help="a Hugging Face folder for `vllm serve` beside ppsplit")
    p.add_argument("--vllm-eager", action="store_true", help="vllm serve --enforce-eager (faster start)")
    p.add_argument("--json", default=None, help="write every run's figures to this file")
    args = p.parse_args()
    name = os.path.basename(os.path.normpath(args.folder))
    start = time.monotonic()
    proc, port = start_server(args.folder, name, args.serve_args.split())
    servers = [("ppsplit", port)]
    vllm_proc, rows = None, []
    vllm_log = tempfile.NamedTemporaryFile("w", prefix="vllm-serve-", suffix=".log", delete=False)
    try:
        if args.vllm_serve:
            vllm_proc, vllm_port = start_vllm(args.vllm, args.vllm_serve, name, args.vllm_eager, vllm_log)
            servers.append(("vllm", vllm_port))
            print(f"both servers up after {time.monotonic() - start:.0f} s", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            for backend in args.backends.split(","):
                for level in (int(x) for x in args.levels.split(",")):
                    for server, server_port in servers:
                        r = bench(args.vllm, backend, server_port, name, args.tokenizer or args.folder, args, level,
                                  os.path.join(tmp, f"{server}-{backend}-{level}.json"))
                        rows.append({"server": server, "backend": backend, "concurrency": level,
                                     **{k: r.get(k) for k in ("completed", "failed", "duration", "output_throughput",
                                                              "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                                                              "mean_itl_ms", "median_itl_ms", "p99_itl_ms")}})
                        print(f"{server:8s} {backend:12s} c={level:<3d} completed {r['completed']}/"
                              f"{args.num_prompts} failed {r.get('failed', args.num_prompts - r['completed'])}  "
                              f"output {r['output_throughput']:.1f} tok/s  TTFT mean {r['mean_ttft_ms']:.0f} p99 "
                              f"{r['p99_ttft_ms']:.0f} ms  ITL mean {r['mean_itl_ms']:.0f} p99 {r['p99_itl_ms']:.0f} "
                              f"ms", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        if vllm_proc is not None:
            vllm_proc.send_signal(signal.SIGTERM)
            try:
                vllm_proc.wait(120)
            except subprocess.TimeoutExpired:
                vllm_proc.kill()
        vllm_log.close()
    if vllm_proc is None or vllm_proc.returncode in (0, -signal.SIGTERM):
        os.unlink(vllm_log.name)  # kept only when vllm serve failed
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "wall_s": time.monotonic() - start, "runs": rows}, f, indent=1)
    failed = sum(r["completed"] != args.num_prompts for r in rows if r["server"] == "ppsplit")
    print(f"wall {time.monotonic() - start:.0f} s; ppsplit server exit code {code}; ppsplit runs with a failed "
          f"request: {failed} of {sum(r['server'] == 'ppsplit' for r in rows)}")
    return 1 if failed or code else 0


if __name__ == "__main__":
    sys.exit(main())
