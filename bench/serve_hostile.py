"""Hostile input against ``ppsplit serve``: how long each attack takes to be answered, and what it costs the clients
beside it (issue 56's probe, as a measurement).

    python bench/serve_hostile.py DIR [--ranks 2] [--max-request-bytes 6000000] [--prompt-timeout 10]

DIR: a compiled folder with a paged cache and a tokenizer (e.g. ``ppsplit compile demo --pp 2 -o demo-serve``). The
script serves a copy of DIR whose chat template loops forever on the message ``LOOP`` and whose pre-tokenizer regex
backtracks past the regex engine's limit on 60 a's. While each attack runs, one client streams completions back to
back and another polls ``/health``; printed per attack: the HTTP status, seconds until it was answered, the largest
gap between the streamed events, the slowest ``/health``, and the server's RSS growth. With ``--ranks 2`` it ends by
stopping (SIGSTOP) the follower rank: seconds until the stream in flight gets its error and until the server exits.
"""
import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

MODEL = "bench"


class Server:
    def __init__(self, folder, extra):
        self.proc = subprocess.Popen([sys.executable, "-m", "ppsplit.cli", "serve", folder, "--port", "0",
                                      "--served-model-name", MODEL, *extra], stderr=subprocess.PIPE, text=True)
        self.lines, ready = [], threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                if "http://" in line and "serving" in line:
                    self.port = int(line.split("http://", 1)[1].split(" ")[0].rsplit(":", 1)[1])
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300) or self.proc.poll() is not None:
            sys.exit("the server did not start:\n" + "".join(self.lines))

    def connection(self, timeout=120):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def post(self, path, body: bytes, headers=None):
        conn = self.connection()
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        status = response.status
        response.read()
        conn.close()
        return status

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class Traffic:
    """A client streaming completions back to back and one polling /health, while an attack runs."""

    def __init__(self, server):
        self.server, self.done = server, threading.Event()
        self.gaps, self.health = [0.0], [0.0]
        self.threads = [threading.Thread(target=self._stream, daemon=True),
                        threading.Thread(target=self._poll, daemon=True)]
        for t in self.threads:
            t.start()

    def _stream(self):
        body = json.dumps({"model": MODEL, "prompt": "Hello", "stream": True, "max_tokens": 64, "temperature": 0})
        while not self.done.is_set():
            try:
                conn = self.server.connection()
                last = time.monotonic()
                conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
                for line in conn.getresponse():
                    if line.startswith(b"data: "):
                        now = time.monotonic()
                        self.gaps.append(now - last)
                        last = now
                conn.close()
            except OSError:
                return

    def _poll(self):
        while not self.done.is_set():
            start = time.monotonic()
            try:
                conn = self.server.connection()
                conn.request("GET", "/health")
                conn.getresponse().read()
                conn.close()
            except OSError:
                return
            self.health.append(time.monotonic() - start)
            time.sleep(0.05)

    def finish(self):
        self.done.set()
        for t in self.threads:
            t.join(130)
        return max(self.gaps), max(self.health)


def hostile_copy(folder: str, out: str) -> str:
    shutil.copytree(folder, out)
    path = os.path.join(out, "tokenizer_config.json")
    config = json.load(open(path))
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% set x = i * j %}{% endfor %}{% endfor %}"
    config["chat_template"] = (f"{{% if messages[-1]['content'] == 'LOOP' %}}{loop}{{% endif %}}"
                               + (config.get("chat_template") or "{{ messages[-1]['content'] }}"))
    json.dump(config, open(path, "w"))
    path = os.path.join(out, "tokenizer.json")
    tok = json.load(open(path))
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(a|aa)+b"}, "behavior": "Isolated", "invert": False},
        tok["pre_tokenizer"]]}
    json.dump(tok, open(path, "w"))
    return out


def attacks(limit: int):
    text = "Hello world, the pipeline serves a request. "
    near = text * (int(limit * 0.97) // len(text))
    chat = [{"role": "user", "content": text * 400}] * (int(limit * 0.97) // 18100)
    yield "chat template loops", "/v1/chat/completions", {"messages": [{"role": "user", "content": "LOOP"}]}
    yield "tokenizer regex backtracks", "/v1/completions", {"prompt": "a" * 60}
    yield "50 MiB body (Content-Length)", "/v1/completions", None
    yield f"{len(near) / 1e6:.1f} MB prompt text", "/v1/completions", {"prompt": near}
    yield f"{sum(len(m['content']) for m in chat) / 1e6:.1f} MB chat", "/v1/chat/completions", {"messages": chat}
    yield "lone surrogate", "/v1/completions", b'{"model": "bench", "prompt": "\\ud800x"}'
    yield "JSON 100,000 deep", "/v1/completions", b'{"model": "bench", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    yield "5,000-digit seed", "/v1/completions", b'{"model": "bench", "prompt": "a", "seed": ' + b"7" * 5000 + b"}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--max-request-bytes", type=int, default=6_000_000)
    parser.add_argument("--prompt-timeout", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = hostile_copy(args.folder, os.path.join(tmp, "hostile"))
        server = Server(folder, ["--ranks", str(args.ranks), "--max-request-bytes", str(args.max_request_bytes),
                                 "--prompt-timeout", str(args.prompt_timeout), "--rank-stall-timeout", "5"])
        print(f"{'attack':<30} {'status':>6} {'answer s':>9} {'max gap s':>10} {'max /health s':>14} {'RSS +MB':>8}")
        try:
            for name, path, body in attacks(args.max_request_bytes):
                rss, traffic = server.rss(), Traffic(server)
                time.sleep(0.5)
                start = time.monotonic()
                if body is None:
                    conn = server.connection()
                    conn.putrequest("POST", path)
                    conn.putheader("Content-Length", str(50 << 20))
                    conn.endheaders()
                    response = conn.getresponse()
                    status = response.status
                    conn.close()
                else:
                    raw = body if isinstance(body, bytes) else json.dumps({"model": MODEL, "max_tokens": 4,
                                                                           **body}).encode()
                    status = server.post(path, raw)
                took = time.monotonic() - start
                time.sleep(0.3)
                gap, health = traffic.finish()
                print(f"{name:<30} {status:>6} {took:>9.2f} {gap:>10.2f} {health:>14.3f} "
                      f"{(server.rss() - rss) / 1e6:>8.0f}", flush=True)
            if args.ranks > 1:
                frozen(server)
        finally:
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
                try:
                    server.proc.wait(60)
                except subprocess.TimeoutExpired:
                    server.proc.kill()


def frozen(server):
    rank = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(p) == server.proc.pid
                and "server_ranks" in open(f"/proc/{p}/cmdline").read())
    conn = server.connection()
    conn.request("GET", "/v1/models")
    longest = json.loads(conn.getresponse().read())["data"][0]["max_model_len"] - 16
    conn.close()
    conn = server.connection()
    conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "Hello", "stream": True,
                                                             "max_tokens": longest, "temperature": 0}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    response.readline()
    os.kill(rank, signal.SIGSTOP)
    start = time.monotonic()
    events = [line for line in response.read().split(b"\n") if line.startswith(b"data: ")]
    errored = time.monotonic() - start
    code = server.proc.wait(120)
    print(f"frozen rank (--rank-stall-timeout 5): the stream's error after {errored:.2f} s "
          f"({json.loads(events[-2][6:]).get('error', {}).get('message', '')[:60]!r}), exit {code} after "
          f"{time.monotonic() - start:.2f} s")


def _parent(pid: str) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return -1


if __name__ == "__main__":
    main()
