"""``ppsplit serve``: a live server on 127.0.0.1 (the demo model in 2 stages with its tokenizer, a random EAGLE-3
drafter, -k 2; one process, or one per stage with --ranks 2) driven with the real ``openai`` client and raw HTTP,
against the engine called in this process."""
import asyncio
import http.client
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import ppsplit
from ppsplit.artifact.tokenizer import FolderTokenizer
from ppsplit.serve.engine import Engine
from ppsplit.serve.sampling import SamplingParams

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "demo-serve"
K = 2
MAX_LEN = 128
PROMPTS = ["Hello world", "The pipeline splits the model into stages.", "Once upon a time there was a",
           "Write a story about a small boy", "cache", "Many people think that the sea", "1 2 3 4 5",
           "What is the answer?"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from ppsplit.compile.demo import demo_config
    from tests.support import drafter_config, random_drafter_tensors, write_drafter

    root = tmp_path_factory.mktemp("serve")
    cfg = drafter_config(demo_config(), aux_ids=[1, 3, 4])
    drafter = write_drafter(str(root / "drafter"), cfg, random_drafter_tensors(cfg))
    return ppsplit.compile_model("demo", str(root / MODEL), pp=2, drafter=drafter,
                                 cache=ppsplit.CacheConfig(batch_size=8, max_len=MAX_LEN))


class Live:
    """A ``ppsplit serve`` process; its log lines are collected by a thread (so its pipe never fills)."""

    def __init__(self, folder: str, *extra: str):
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.folder = folder
        self.proc = subprocess.Popen([sys.executable, "-m", "ppsplit.cli", "serve", folder, "--port", "0",
                                      "--served-model-name", MODEL, *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(120) or self.proc.poll() is not None:
            self.proc.kill()
            pytest.fail("the server did not start:\n" + "".join(self.lines))
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=120)

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            if "serving" in line and "http://" in line:
                self.port = int(line.split("http://", 1)[1].split(" ")[0].rsplit(":", 1)[1])
                self.ready.set()
        self.ready.set()

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def post(self, path: str, body) -> tuple[int, dict]:
        conn = self.connection()
        conn.request("POST", path, body=body if isinstance(body, bytes) else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        status, data = response.status, json.loads(response.read())
        conn.close()
        return status, data

    def metrics(self) -> dict:
        conn = self.connection()
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                key = name.split("{")[0]
                if "finished_reason" in name:
                    key += "." + name.split('finished_reason="')[1].split('"')[0]
                if "_bucket" not in key:
                    values[key] = float(value)
        return values

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail("the server did not exit after SIGTERM:\n" + "".join(self.lines))


@pytest.fixture(scope="module")
def live(folder):
    server = Live(folder, "-k", str(K))
    yield server
    assert server.stop() == 0, "".join(server.lines)


@pytest.fixture(scope="module")
def oracle(folder):
    """The engine in this process over the same folder: ``outputs(prompt ids, max tokens)``."""
    torch.set_num_threads(1)
    split = ppsplit.load(folder)
    engine = Engine(split, drafter=split.drafter, num_draft_tokens=K)
    tok = FolderTokenizer(folder)

    def outputs(prompts, max_tokens):
        return engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])

    outputs.engine = engine
    return outputs, tok


def text_of(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def stream_completion(client, **kw):
    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(pieces), finish, usage


def test_completions_greedy_equal_the_engine(live, oracle):
    outputs, tok = oracle
    lengths = [5, 9, 14, 20]
    refs = outputs([tok.encode(p) for p in PROMPTS[:4]], lengths)
    for prompt, n, ref in zip(PROMPTS, lengths, refs):
        got = live.client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
        assert got.choices[0].text == text_of(tok, ref.token_ids), prompt
        assert got.choices[0].finish_reason == ref.finish_reason
        assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == \
            (len(tok.encode(prompt)), len(ref.token_ids), len(tok.encode(prompt)) + len(ref.token_ids))
        text, finish, usage = stream_completion(live.client, prompt=prompt, max_tokens=n, temperature=0)
        assert (text, finish, usage.completion_tokens) == (text_of(tok, ref.token_ids), ref.finish_reason,
                                                           len(ref.token_ids))
    ids = tok.encode(PROMPTS[4])  # a prompt of token ids
    got = live.client.completions.create(model=MODEL, prompt=ids, max_tokens=7, temperature=0)
    assert got.choices[0].text == text_of(tok, outputs([ids], [7])[0].token_ids)
    assert [m.id for m in live.client.models.list().data] == [MODEL]


def test_chat_completions_use_the_chat_template(live, oracle):
    outputs, tok = oracle
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    assert ids[0] == 1 and "<|assistant|>" in tok.decode(ids, skip_special_tokens=False)
    ref = outputs([ids], [11])[0]
    got = live.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=11, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == text_of(tok, ref.token_ids)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    chunks = list(live.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=11, temperature=0,
                                                      stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text_of(tok, ref.token_ids)
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason and chunks[-1].usage is None


def _stop_case(tok, ids):
    """A stop string of clean text that spans a token boundary of what ``ids`` decode to, or None."""
    for i in range(2, len(ids) - 1):
        before, after = text_of(tok, ids[:i]), text_of(tok, ids[:i + 1])
        piece = after[len(before):]
        stop = before[-2:] + piece[:2]
        if after.startswith(before) and len(before) >= 2 and len(piece) >= 2 and "\ufffd" not in stop \
                and piece.strip() and before[-2:].strip():
            return stop
    return None


def test_stop_strings_cut_across_token_boundaries(live, oracle, folder):
    from transformers import PreTrainedTokenizerFast

    from ppsplit.compile.demo import demo_model

    outputs, tok = oracle
    hf_model = demo_model()
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"), bos_token="<s>",
                                     eos_token="</s>")
    tried = 0
    for prompt, ref in zip(PROMPTS, outputs([tok.encode(p) for p in PROMPTS], [40] * len(PROMPTS))):
        stop = _stop_case(tok, ref.token_ids)
        if stop is None:
            continue
        # Hugging Face's stop_strings rule: generation ends at the first token whose text completes the string.
        end = next(j for j in range(1, len(ref.token_ids) + 1) if stop in text_of(tok, ref.token_ids[:j]))
        full = text_of(tok, ref.token_ids[:end])
        assert stop not in text_of(tok, ref.token_ids[end - 1:end])  # no single token holds it
        assert end < len(ref.token_ids)  # the engine stops the request early
        want = full[:full.index(stop)]
        ids = tok.encode(prompt)
        with torch.no_grad():
            hf = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, stop_strings=[stop],
                                   tokenizer=hf_tok)[0, len(ids):].tolist()
        assert hf == ref.token_ids[:end], (stop, hf, ref.token_ids)  # Hugging Face stops at the same token
        got = live.client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                             stop=[stop, "never-in-the-output"])
        assert (got.choices[0].text, got.choices[0].finish_reason, got.usage.completion_tokens) == (want, "stop", end)
        text, finish, usage = stream_completion(live.client, prompt=prompt, max_tokens=40, temperature=0, stop=stop)
        assert (text, finish, usage.completion_tokens) == (want, "stop", end)
        tried += 1
    assert tried >= 2


def test_concurrent_streaming_clients_all_complete(live, oracle):
    outputs, tok = oracle
    n = 32
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(n)]
    lengths = [3 + (i * 5) % 14 for i in range(n)]
    refs = outputs([tok.encode(p) for p in prompts], lengths)
    before = live.metrics()
    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(lambda a: stream_completion(live.client, prompt=a[0], max_tokens=a[1], temperature=0),
                            zip(prompts, lengths)))
    for (text, finish, usage), ref in zip(got, refs):
        assert (text, finish, usage.completion_tokens) == (text_of(tok, ref.token_ids), ref.finish_reason,
                                                           len(ref.token_ids))
    after = live.metrics()
    done = sum(after[k] - before[k] for k in after if k.startswith("ppsplit_request_success_total."))
    assert done == n
    assert after["ppsplit_generation_tokens_total"] - before["ppsplit_generation_tokens_total"] >= \
        sum(len(r.token_ids) for r in refs)
    assert after["ppsplit_time_to_first_token_seconds_count"] - before["ppsplit_time_to_first_token_seconds_count"] == n
    assert after["ppsplit_kv_blocks_in_use"] == 0 and after["ppsplit_num_requests_running"] == 0


def _wait_for(condition, seconds: float = 20):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def _open_stream(live, max_tokens: int, chunks: int = 2, **extra):
    """A raw streaming request; returns the connection after ``chunks`` events arrived."""
    conn = live.connection()
    conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "Hello", "stream": True,
                                                             "max_tokens": max_tokens, "temperature": 0} | extra),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(chunks):
        assert response.readline().startswith(b"data: ")
        response.readline()
    return conn, response


def test_a_dropped_client_aborts_its_request_and_frees_its_blocks(live):
    aborted = live.metrics()["ppsplit_request_success_total.abort"]
    conn, _ = _open_stream(live, max_tokens=MAX_LEN - 10)
    assert live.metrics()["ppsplit_kv_blocks_in_use"] > 0
    conn.sock.shutdown(2)
    conn.close()
    assert _wait_for(lambda: live.metrics()["ppsplit_request_success_total.abort"] == aborted + 1)
    assert _wait_for(lambda: live.metrics()["ppsplit_kv_blocks_in_use"] == 0)
    # A client that leaves while waiting for a whole (non-streamed) answer is aborted too.
    conn = live.connection()
    conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "Hi", "temperature": 0,
                                                             "max_tokens": MAX_LEN - 10}))
    assert _wait_for(lambda: live.metrics()["ppsplit_kv_blocks_in_use"] > 0)
    conn.sock.shutdown(2)
    conn.close()
    assert _wait_for(lambda: live.metrics()["ppsplit_request_success_total.abort"] == aborted + 2)
    assert _wait_for(lambda: live.metrics()["ppsplit_kv_blocks_in_use"] == 0)


BAD = [
    ({"model": MODEL, "prompt": "a " * MAX_LEN}, "prompt", "a sequence holds 128 tokens"),
    ({"model": MODEL, "prompt": "a", "max_tokens": MAX_LEN}, "max_tokens", "ask for at most"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 0}, "max_tokens", "an integer >= 1"),
    ({"model": MODEL, "prompt": "a", "temperature": 2.5}, "temperature", "from 0 (greedy) to 2"),
    ({"model": MODEL, "prompt": "a", "top_p": 0}, "top_p", "(0, 1]"),
    ({"model": MODEL, "prompt": "a", "suffix": "b"}, "suffix", "unsupported field 'suffix'"),
    ({"model": MODEL, "prompt": "a", "logprobs": 21}, "logprobs", "from 0 to 20"),
    ({"model": MODEL, "prompt": "a", "presence_penalty": 3}, "presence_penalty", "from -2 to 2"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"5": 200}}, "logit_bias", "from -100 to 100"),
    ({"model": MODEL, "prompt": "a", "min_tokens": 20, "max_tokens": 5}, "min_tokens", "to max_tokens"),
    ({"model": MODEL, "prompt": "a", "best_of": 2, "n": 3}, "best_of", "must be at least n (3)"),
    ({"model": MODEL, "prompt": "a", "best_of": 3, "stream": True}, "best_of", "cannot stream"),
    ({"model": MODEL, "prompt": ["a"] * 9, "best_of": 8}, "best_of", "at most 64"),
    ({"model": MODEL, "prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    ({"model": MODEL, "prompt": "a", "n": 0}, "n", "from 1 to 64"),
    ({"model": MODEL, "prompt": ["a"] * 20, "n": 4}, "n", "at most 64"),
    ({"model": MODEL, "prompt": "a", "stop": ["x"] * 5}, "stop", "up to 4"),
    ({"model": MODEL, "prompt": [5, 100000]}, "prompt", "outside the vocabulary"),
    (b'{"model": "demo-serve", "prompt": ', None, "not valid JSON"),
    (b'[1, 2]', None, "must be a JSON object"),
    # Each of these was a plain-text 500 with a traceback in the log.
    (b'{"model": "demo-serve", "prompt": "\\ud800x"}', "prompt", "lone surrogate"),
    (b'{"model": "demo-serve", "prompt": "a", "stop": ["\\udfff"]}', "stop", "lone surrogate"),
    (b'{"model": "demo-serve", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nests JSON too deeply"),
    (b'{"model": "demo-serve", "prompt": "a", "seed": ' + b"7" * 5000 + b"}", None, "not valid JSON"),
    ({"model": MODEL, "prompt": "a", "seed": 2 ** 64}, "seed", "from -2**63 to 2**63 - 1"),
    ({"model": MODEL, "prompt": "a", "user": {}}, "user", "user must be a string"),
    ({"model": MODEL, "prompt": "a", "n": True}, "n", "an integer from 1 to 64"),
    ({"model": MODEL, "prompt": "a", "n": 1.0}, "n", "an integer from 1 to 64"),
]


@pytest.mark.parametrize("body,param,says", BAD, ids=[f"{b[1]}-{b[2]}" for b in BAD])
def test_a_bad_request_gets_a_400_that_says_what_to_change(live, body, param, says):
    status, data = live.post("/v1/completions", body)
    assert status == 400, data
    assert data["error"]["param"] == param and says in data["error"]["message"], data
    assert data["error"]["type"] == "invalid_request_error"


def test_unknown_models_routes_and_methods_are_404_and_405_in_openais_body(live):
    status, data = live.post("/v1/completions", {"model": "other", "prompt": "a"})
    assert status == 404 and data["error"]["code"] == "model_not_found" and data["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        live.client.chat.completions.create(model="other", messages=[{"role": "user", "content": "Hi"}])
    status, data = live.post("/v1/embeddings", {"model": MODEL, "input": "a"})
    assert status == 404 and "Not Found" in data["error"]["message"], data
    conn = live.connection()
    conn.request("GET", "/v1/completions")
    response = conn.getresponse()
    assert response.status == 405 and "Method Not Allowed" in json.loads(response.read())["error"]["message"]
    conn.close()


def test_temperatures_below_the_epsilon_sample_greedily(live, oracle):
    outputs, tok = oracle
    ref = outputs([tok.encode("Once upon a time")], [12])[0]
    for temperature in (1e-45, 1e-6):
        got = live.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                             temperature=temperature, seed=3)
        assert got.choices[0].text == text_of(tok, ref.token_ids), temperature
    assert SamplingParams(temperature=1e-45).greedy and not SamplingParams(temperature=1e-5).greedy


def test_bad_chat_requests_and_the_client_error_then_serving_goes_on(live, oracle):
    status, data = live.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})
    assert status == 400 and data["error"]["param"] == "messages[0]"
    status, data = live.post("/v1/chat/completions", {"model": MODEL, "prompt": "x"})
    assert status == 400 and data["error"]["param"] == "prompt"
    status, data = live.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x",
                                                                                       "name": 5}]})
    assert status == 400 and data["error"]["param"] == "messages[0].name"
    status, data = live.post("/v1/chat/completions", b'{"model": "demo-serve", "messages": [{"role": "user", '
                                                     b'"content": "\\ud83dx"}]}')
    assert status == 400 and data["error"]["param"] == "messages" and "lone surrogate" in data["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="top_k must be"):
        live.client.completions.create(model=MODEL, prompt="a", extra_body={"top_k": -5})
    outputs, tok = oracle
    got = live.client.completions.create(model=MODEL, prompt="Hello world", max_tokens=4, temperature=0,
                                         extra_body={"top_k": 1})
    assert got.choices[0].text == text_of(tok, outputs([tok.encode("Hello world")], [4])[0].token_ids)


def test_seeded_sampling_repeats(live):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    a, b = (live.client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b


def test_vllm_benchmark_bodies_and_nulls_are_answered(live, oracle):
    """The bodies ``vllm bench serve`` sends (completions and chat backends, random dataset: logprobs null,
    repetition_penalty 1.0, ignore_eos), and a body of nulls (each the field's default) answer 200 with the engine's
    greedy output."""
    outputs, tok = oracle
    ids = tok.encode(PROMPTS[1])
    ref = outputs([ids], [9])[0]
    engine_ref = text_of(tok, ref.token_ids)
    for path, body in [
            ("/v1/completions", {"model": MODEL, "prompt": PROMPTS[1], "repetition_penalty": 1.0, "max_tokens": 9,
                                 "logprobs": None, "stream": False, "ignore_eos": False, "temperature": 0}),
            ("/v1/completions", {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 9, "temperature": 0, "n": None,
                                 "top_p": None, "stop": None, "seed": None, "suffix": None, "best_of": None,
                                 "echo": None, "logit_bias": None, "user": None, "presence_penalty": None,
                                 "stream_options": None, "min_tokens": None, "stop_token_ids": None, "top_k": None})]:
        status, data = live.post(path, body)
        assert status == 200, data
        assert data["choices"][0]["text"] == engine_ref
    for chat in (False, True):
        conn = live.connection()
        body = {"model": MODEL, "max_tokens" if not chat else "max_completion_tokens": 12, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}
        body |= {"messages": [{"role": "user", "content": PROMPTS[0]}]} if chat else \
            {"prompt": PROMPTS[0], "repetition_penalty": 1.0, "logprobs": None}
        conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
        conn.close()
        assert response.status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 12  # ignore_eos: every token


def test_penalties_bias_and_stop_ids_through_the_openai_client(live, folder):
    """Greedy with each adjustment equals the engine in this process with the same ``SamplingParams``, and differs
    from plain greedy."""
    tok = FolderTokenizer(folder)
    split = ppsplit.load(folder)
    engine = Engine(split)
    ids = tok.encode(PROMPTS[2])
    plain = engine.generate([ids], SamplingParams(max_tokens=16))[0].token_ids
    cases = [dict(frequency_penalty=1.5, presence_penalty=0.5), dict(repetition_penalty=1.7),
             dict(logit_bias={str(plain[0]): -100}), dict(min_tokens=16, ignore_eos=True),
             dict(stop_token_ids=[plain[3]])]
    for extra in cases:
        fields = dict(extra, logit_bias={int(t): b for t, b in extra.get("logit_bias", {}).items()},
                      stop_token_ids=tuple(extra.get("stop_token_ids", ())))
        want = engine.generate([ids], SamplingParams(max_tokens=16, **fields))[0]
        got = live.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                             **{k: v for k, v in extra.items() if k in ("frequency_penalty",
                                                                                        "presence_penalty",
                                                                                        "logit_bias")},
                                             extra_body={k: v for k, v in extra.items()
                                                         if k not in ("frequency_penalty", "presence_penalty",
                                                                      "logit_bias")})
        assert got.choices[0].text == text_of(tok, want.token_ids), extra
        assert got.usage.completion_tokens == len(want.token_ids)
        assert want.token_ids != plain or "min_tokens" in extra, extra
    stopped = engine.generate([ids], SamplingParams(max_tokens=16, stop_token_ids=(plain[3],)))[0]
    assert stopped.token_ids == plain[:plain.index(plain[3]) + 1] and stopped.finish_reason == "stop"


def test_logprobs_equal_hugging_face_log_softmax(live, oracle):
    """Completions (``logprobs: 3``) and chat (``logprobs: true, top_logprobs: 2``), whole and streamed: each
    token's logprob and its alternatives equal ``log_softmax`` of the Hugging Face model's logits."""
    from ppsplit.compile.demo import demo_model

    outputs, tok = oracle
    model = demo_model()
    ids = tok.encode(PROMPTS[3])
    got = live.client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0, logprobs=3)
    out = outputs([ids], [8])[0].token_ids
    lp = got.choices[0].logprobs
    assert got.choices[0].text == text_of(tok, out) and len(lp.token_logprobs) == len(out)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].float(), -1)
    for i, token in enumerate(out):
        assert lp.tokens[i] == tok.decode([token], skip_special_tokens=False)
        assert abs(lp.token_logprobs[i] - ref[i, token].item()) < 1e-4
        top = torch.topk(ref[i], 3)
        want = {tok.decode([t], skip_special_tokens=False): v for t, v in zip(top.indices.tolist(),
                                                                               top.values.tolist())}
        assert set(want) <= set(lp.top_logprobs[i]) and all(abs(lp.top_logprobs[i][k] - v) < 1e-4
                                                            for k, v in want.items())
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    streamed = [c.choices[0].logprobs for c in live.client.completions.create(
        model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0, logprobs=3, stream=True) if c.choices]
    assert sum((c.token_logprobs for c in streamed if c), []) == lp.token_logprobs
    messages = [{"role": "user", "content": PROMPTS[3]}]
    chat_ids = tok.encode_chat(messages)
    chat_out = outputs([chat_ids], [6])[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([chat_ids + chat_out])).logits[0, len(chat_ids) - 1:-1], -1)
    for stream in (False, True):
        kw = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
        if stream:
            content = sum((c.choices[0].logprobs.content for c in live.client.chat.completions.create(stream=True, **kw)
                           if c.choices and c.choices[0].logprobs), [])
        else:
            content = live.client.chat.completions.create(**kw).choices[0].logprobs.content
        assert len(content) == len(chat_out)
        for i, (entry, token) in enumerate(zip(content, chat_out)):
            assert abs(entry.logprob - ref[i, token].item()) < 1e-4 and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].token == tok.decode([int(ref[i].argmax())], skip_special_tokens=False)
    assert live.client.completions.create(model=MODEL, prompt="a", max_tokens=2).choices[0].logprobs is None


def test_batched_prompts_and_n_choices(live, oracle):
    outputs, tok = oracle
    refs = outputs([tok.encode(p) for p in PROMPTS[:3]], [6] * 3)
    got = live.client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=6, temperature=0)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [text_of(tok, r.token_ids) for r in refs]
    assert got.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS[:3])
    assert got.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    kw = dict(model=MODEL, prompt=[PROMPTS[0], PROMPTS[5]], max_tokens=10, temperature=1.0, seed=11, n=4)
    first = live.client.completions.create(**kw)
    again = live.client.completions.create(**kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == list(range(8))
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts[:4])) == 4 and len(set(texts[4:])) == 4  # four distinct sequences per prompt
    pieces = {}
    for chunk in live.client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + c.text
    assert [pieces[i] for i in range(8)] == texts
    chat = live.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3,
                                               max_tokens=5, temperature=1.0, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    echo = live.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPTS[0] + text_of(tok, outputs([tok.encode(PROMPTS[0])], [4])[0].token_ids)


def test_n_choices_share_the_prompt_and_best_of_returns_the_most_likely(live, oracle):
    """n=4 seeded (a prompt over two blocks: the choices share its full blocks): four distinct sequences, repeated,
    each equal to the n=1 request with seed + j; best_of=4, n=2: the two of those four with the highest cumulative
    logprob, best first, usage counting all four. The blocks all return, also after a client drops an n=4 stream."""
    outputs, tok = oracle
    prompt = " ".join(PROMPTS)
    assert len(tok.encode(prompt)) > 33
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0)
    shared = live.metrics()["ppsplit_prompt_tokens_shared_total"]
    four = live.client.completions.create(n=4, seed=21, logprobs=0, **kw)
    full_blocks = (len(tok.encode(prompt)) - 1) // 16  # before the prompt's last token: choices 1..3 take them
    assert live.metrics()["ppsplit_prompt_tokens_shared_total"] == shared + 3 * full_blocks * 16
    again = live.client.completions.create(n=4, seed=21, logprobs=0, **kw)
    texts = [c.text for c in four.choices]
    assert [c.index for c in four.choices] == [0, 1, 2, 3] and len(set(texts)) == 4
    assert [c.text for c in again.choices] == texts
    alone = [live.client.completions.create(seed=21 + j, logprobs=0, **kw).choices[0] for j in range(4)]
    assert [c.text for c in alone] == texts
    cumulative = [sum(c.logprobs.token_logprobs) for c in four.choices]
    assert all(abs(sum(a.logprobs.token_logprobs) - c) < 1e-4 for a, c in zip(alone, cumulative))
    best = live.client.completions.create(n=2, best_of=4, seed=21, **kw)
    order = sorted(range(4), key=lambda j: -cumulative[j])[:2]
    assert [(c.index, c.text) for c in best.choices] == [(0, texts[order[0]]), (1, texts[order[1]])]
    assert best.choices[0].logprobs is None
    assert best.usage.completion_tokens == four.usage.completion_tokens
    assert best.usage.prompt_tokens == four.usage.prompt_tokens == len(tok.encode(prompt))
    # With a penalty the ranking is by the adjusted logits' logprobs (vLLM's old best_of), which it then returns.
    penalised = [SamplingParams(max_tokens=8, temperature=1.0, seed=21 + j, frequency_penalty=1.5,
                                presence_penalty=1.0, logprobs=0, logprobs_adjusted=True) for j in range(4)]
    ref = outputs.engine.generate([tok.encode(prompt)] * 4, penalised)
    ranked = sorted(range(4), key=lambda j: -sum(lp for lp, _ in ref[j].logprobs))[:2]
    best = live.client.completions.create(n=2, best_of=4, seed=21, frequency_penalty=1.5, presence_penalty=1.0,
                                          logprobs=0, **kw)
    assert [c.text for c in best.choices] == [text_of(tok, ref[j].token_ids) for j in ranked]
    assert [sum(c.logprobs.token_logprobs) for c in best.choices] == \
        pytest.approx([sum(lp for lp, _ in ref[j].logprobs) for j in ranked], abs=1e-4)
    conn, _ = _open_stream(live, max_tokens=60, chunks=3, prompt=prompt, n=4, temperature=1.0, seed=2)
    assert live.metrics()["ppsplit_kv_blocks_in_use"] > 0
    conn.sock.shutdown(2)
    conn.close()
    assert _wait_for(lambda: live.metrics()["ppsplit_kv_blocks_in_use"] == 0)


def test_echo_with_logprobs_gives_the_prompt_logprobs(live, oracle):
    """lm-evaluation-harness's log-likelihood request (echo, logprobs 1, max_tokens 1, temperature 0): every prompt
    token but the first has its logprob (HF's log_softmax) and its top alternative, whole and streamed."""
    from ppsplit.compile.demo import demo_model

    outputs, tok = oracle
    prompt = PROMPTS[6]
    ids = tok.encode(prompt)
    out = outputs([ids], [1])[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(demo_model()(torch.tensor([ids + out])).logits[0, :-1].float(), -1)
    got = live.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                         logprobs=1)
    lp = got.choices[0].logprobs
    assert got.choices[0].text == prompt + text_of(tok, out)
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, token in enumerate((ids + out)[1:]):
        assert abs(lp.token_logprobs[i + 1] - ref[i, token].item()) < 1e-4
        best = tok.decode([int(ref[i].argmax())], skip_special_tokens=False)
        assert abs(lp.top_logprobs[i + 1][best] - ref[i].max().item()) < 1e-4
    streamed = [c.choices[0].logprobs for c in live.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1, stream=True) if c.choices]
    assert sum((c.token_logprobs for c in streamed if c), []) == lp.token_logprobs


def test_tokenize_detokenize_models_and_continuous_usage(live, oracle, folder):
    _, tok = oracle
    status, data = live.post("/tokenize", {"model": MODEL, "prompt": PROMPTS[1]})
    assert status == 200 and data["tokens"] == tok.encode(PROMPTS[1]) and data["count"] == len(data["tokens"])
    assert data["max_model_len"] == MAX_LEN
    messages = [{"role": "user", "content": "Name a colour."}]
    status, data = live.post("/tokenize", {"messages": messages})
    assert status == 200 and data["tokens"] == tok.encode_chat(messages)
    plain = tok.encode(PROMPTS[1], add_special_tokens=False)
    status, data = live.post("/detokenize", {"model": MODEL, "tokens": plain})
    assert status == 200 and data["prompt"] == PROMPTS[1]
    status, data = live.post("/detokenize", {"tokens": [10 ** 9]})
    assert status == 400 and data["error"]["param"] == "tokens"
    model = live.client.models.list().data[0]
    assert model.max_model_len == MAX_LEN and model.root == folder
    chunks = list(live.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens > 0


def test_full_queue_503_then_sigterm_finishes_the_requests_in_flight_and_exits_0(folder):
    server = Live(folder, "--max-queue", "3")
    try:
        streams = [_open_stream(server, max_tokens=24, chunks=1) for _ in range(3)]
        status, data = server.post("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2})
        assert status == 503 and data["error"]["code"] == "queue_full"
        server.proc.send_signal(signal.SIGTERM)
        for conn, response in streams:
            events = [line[6:] for line in response.read().split(b"\n") if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]"
            last = json.loads(events[-2])
            assert last["choices"][0]["finish_reason"] == "length"
            conn.close()
        assert server.proc.wait(60) == 0, "".join(server.lines)
        assert any("finishing 3 request(s) in flight" in line for line in server.lines)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def _children(pid: int, running: str = "") -> list[int]:
    """The child processes of ``pid`` (whose command line holds ``running``)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid and \
                            running in open(f"/proc/{entry}/cmdline").read().replace("\0", " "):
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


RANK = "ppsplit.distributed.server_ranks"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank processes through /proc")
def test_ranks_2_gives_the_same_outputs_and_a_dead_rank_ends_the_server(folder, oracle):
    outputs, tok = oracle
    server = Live(folder, "--ranks", "2", "-k", str(K))
    try:
        refs = outputs([tok.encode(p) for p in PROMPTS[:4]], [6, 10, 3, 12])
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda a: stream_completion(server.client, prompt=a[0], max_tokens=a[1],
                                                            temperature=0), zip(PROMPTS, [6, 10, 3, 12])))
        assert [(t, f, u.completion_tokens) for t, f, u in got] == \
            [(text_of(tok, r.token_ids), r.finish_reason, len(r.token_ids)) for r in refs]
        chat = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=5, temperature=0)
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
        assert chat.choices[0].message.content == text_of(tok, outputs([ids], [5])[0].token_ids)
        long = tok.encode(" ".join(PROMPTS))  # n choices across the ranks share its full blocks
        two = server.client.completions.create(model=MODEL, prompt=long, max_tokens=5, temperature=0, n=2)
        assert [c.text for c in two.choices] == [text_of(tok, outputs([long], [5])[0].token_ids)] * 2
        assert server.metrics()["ppsplit_prompt_tokens_shared_total"] == (len(long) - 1) // 16 * 16
        (follower,) = _children(server.proc.pid, RANK)
        conn, response = _open_stream(server, max_tokens=MAX_LEN - 10)
        os.kill(follower, signal.SIGKILL)
        events = [line[6:] for line in response.read().split(b"\n") if line.startswith(b"data: ")]
        assert json.loads(events[-2])["error"]["code"] == "engine_failed" and events[-1] == b"[DONE]", events[-3:]
        assert server.proc.wait(60) == 1
        assert any("rank 1" in line for line in server.lines), "".join(server.lines)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


# -- hostile input: a folder's template and tokenizer, large bodies, a frozen rank ------------------------------

# What the hostile folder's chat template does when the last message is one of these words (else it renders like the
# demo's, with each message's name).
TRAPS = {
    "LOOP": "{% for i in range(100000) %}{% for j in range(100000) %}{% set x = i * j %}{% endfor %}{% endfor %}",
    "FLOOD": "{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}",
    "DIVIDE": "{{ 1 / 0 }}",
    "RECURSE": "{{ deeper(0) }}",
    "MEMORY": "{{ ([1] * 10 ** 10) | length }}",
    "ESCAPE": "{{ cycler.__init__.__globals__.os.popen('touch MARK') }}",
}
HOSTILE_TEMPLATE = (
    "{% macro deeper(n) %}{{ deeper(n + 1) }}{% endmacro %}{% set last = messages[-1]['content'] %}{% if false %}"
    + "".join(f"{{% elif last == '{word}' %}}{body}" for word, body in TRAPS.items())
    + "{% endif %}{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message.name is defined %}{{ '(' + message.name + ')' }}{% endif %}{{ '\\n' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
BACKTRACKS = "(a|aa)+b"  # a pre-tokenizer regex that hits the regex engine's limit on a run of 60 a's
LIMIT = 4_000_000  # --max-request-bytes of the hostile server
PROMPT_TIMEOUT = 2.0


def hostile_folder(folder: str, out: str, mark: str) -> str:
    """``folder`` with the trapped chat template and a pre-tokenizer regex that backtracks."""
    shutil.copytree(folder, out)
    path = os.path.join(out, "tokenizer_config.json")
    config = json.load(open(path))
    config["chat_template"] = HOSTILE_TEMPLATE.replace("MARK", mark)
    json.dump(config, open(path, "w"))
    path = os.path.join(out, "tokenizer.json")
    tok = json.load(open(path))
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": BACKTRACKS}, "behavior": "Isolated", "invert": False},
        tok["pre_tokenizer"]]}
    json.dump(tok, open(path, "w"))
    return out


@pytest.fixture(scope="module")
def hostile(folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    out = hostile_folder(folder, str(root / MODEL), str(root / "PWNED"))
    server = Live(out, "--prompt-timeout", str(PROMPT_TIMEOUT), "--max-request-bytes", str(LIMIT))
    yield server, root
    if server.proc.poll() is None:
        server.proc.kill()


class Traffic:
    """While a test attacks the server: streams run back to back and /health is polled; records the largest gap
    between a stream's events (its first included), the slowest /health, and anything that went wrong."""

    def __init__(self, live):
        self.live, self.done = live, threading.Event()
        self.gaps, self.health, self.streams, self.bad = [0.0], [0.0], 0, []
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._poll)]
        for t in self.threads:
            t.start()

    def _stream(self):
        while not self.done.is_set():
            conn = self.live.connection()
            last = time.monotonic()
            conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "Hello", "stream": True,
                                                                     "max_tokens": 60, "temperature": 0}),
                         headers={"Content-Type": "application/json"})
            events = []
            for line in conn.getresponse():
                if line.startswith(b"data: "):
                    now = time.monotonic()
                    self.gaps.append(now - last)
                    last = now
                    events.append(line[6:].strip())
            conn.close()
            if events[-1:] != [b"[DONE]"] or b'"error"' in events[-2]:
                self.bad.append(events[-2:])
            self.streams += 1

    def _poll(self):
        while not self.done.is_set():
            start = time.monotonic()
            conn = self.live.connection()
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            conn.close()
            self.health.append(time.monotonic() - start)
            if response.status != 200:
                self.bad.append(("health", response.status))
            time.sleep(0.05)

    def finish(self) -> tuple[float, float]:
        self.done.set()
        for t in self.threads:
            t.join(120)
        return max(self.gaps), max(self.health)


def _chat(content, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content, **kw}], "max_tokens": 4}


def test_a_hostile_template_or_tokenizer_is_one_400_and_the_server_goes_on(hostile, folder):
    live, root = hostile
    traffic = Traffic(live)
    try:
        for trap, says in (("LOOP", f"took longer than {PROMPT_TIMEOUT:g} s"), ("FLOOD", "characters, its limit"),
                           ("DIVIDE", "ZeroDivisionError"), ("RECURSE", "recursed too deeply"),
                           ("MEMORY", "out of memory"), ("ESCAPE", "sandbox forbids"),
                           ("a" * 60, "retry-limit-in-match")):
            start = time.monotonic()
            status, data = live.post("/v1/chat/completions", _chat(trap))
            assert status == 400 and data["error"]["param"] == "messages", (trap, data)
            assert says in data["error"]["message"], (trap, data)
            assert time.monotonic() - start < PROMPT_TIMEOUT + 5, trap
        status, data = live.post("/v1/completions", {"model": MODEL, "prompt": "a" * 60, "max_tokens": 2})
        assert status == 400 and data["error"]["param"] == "prompt" and "retry-limit" in data["error"]["message"]
    finally:
        gap, health = traffic.finish()
    assert not (root / "PWNED").exists()
    assert traffic.streams >= 1 and len(traffic.gaps) > 20 and not traffic.bad, traffic.bad
    assert gap < 2.0 and health < 2.0, (gap, health)
    # The template still serves, and it gets each message's name as transformers passes it.
    tok = FolderTokenizer(live.folder)
    try:
        for extra in ({}, {"name": "ann"}):
            got = live.client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0,
                                                      messages=[{"role": "user", "content": "Hi", **extra}])
            ids = tok.encode_chat([{"role": "user", "content": "Hi", **extra}])
            assert got.usage.prompt_tokens == len(ids)
            assert ("(ann)" in tok.decode(ids, skip_special_tokens=False)) == bool(extra)
    finally:
        tok.close()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_large_body_delays_only_itself(hostile):
    live, _ = hostile
    # Refused from its Content-Length, before any of it is read.
    conn = live.connection()
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(50 << 20))
    conn.endheaders()
    start = time.monotonic()
    response = conn.getresponse()
    data = json.loads(response.read())
    conn.close()
    assert response.status == 413 and data["error"]["code"] == "request_too_large", data
    assert f"{50 << 20:,} bytes" in data["error"]["message"] and time.monotonic() - start < 2
    # Without a length (chunked): refused once it passes the limit.
    conn = live.connection()
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    chunk = b"x" * (1 << 16)
    try:
        for _ in range(LIMIT // len(chunk) + 8):
            conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    except (BrokenPipeError, ConnectionResetError):  # the server answered and closed
        pass
    response = conn.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    conn.close()
    # Near the limit while streams run: the text's tokenising (in the tokenizer's process) takes seconds, and only
    # this request waits for it.
    rss = _rss(live.proc.pid)
    text = "Hello world, the pipeline serves a request. "
    bodies = [json.dumps({"model": MODEL, "prompt": text * (LIMIT // len(text) - 40), "max_tokens": 4}),
              json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text * 400}] * (LIMIT // 18100),
                          "max_tokens": 4}),
              json.dumps({"model": MODEL, "prompt": list(range(5, 900)) * int(LIMIT * 0.95 / 4400), "max_tokens": 4})]
    traffic = Traffic(live)
    try:
        for body in bodies:
            assert LIMIT * 0.9 < len(body) <= LIMIT, len(body)
            status, data = live.post("/v1/chat/completions" if "messages" in body[:40] else "/v1/completions",
                                     body.encode())
            assert status == 400, data
            assert data["error"]["code"] == "context_length_exceeded" or "took longer than" in data["error"]["message"], \
                data
    finally:
        gap, health = traffic.finish()
    assert traffic.streams >= 1 and len(traffic.gaps) > 20 and not traffic.bad, traffic.bad
    assert gap < 2.0 and health < 2.0, (gap, health)
    assert _rss(live.proc.pid) - rss < 512 << 20


def _descendants(pid: int) -> list[int]:
    out = _children(pid)
    return out + [g for c in out for g in _descendants(c)]


def test_sigterm_while_a_template_loops_drains_and_exits_0(hostile):
    live, _ = hostile
    helpers = _descendants(live.proc.pid)  # the template and tokenizer processes the tests above started
    assert helpers
    answer = {}
    looping = threading.Thread(target=lambda: answer.update(zip(("status", "data"), live.post(
        "/v1/chat/completions", _chat("LOOP")))))
    looping.start()
    time.sleep(0.5)
    start = time.monotonic()
    live.proc.send_signal(signal.SIGTERM)
    assert live.proc.wait(PROMPT_TIMEOUT + 20) == 0, "".join(live.lines)
    looping.join(10)
    assert answer["status"] == 400 and "took longer than" in answer["data"]["error"]["message"]
    assert time.monotonic() - start < PROMPT_TIMEOUT + 20
    assert _wait_for(lambda: not any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"
                                     for p in helpers), 10)
    assert not any("Traceback" in line for line in live.lines), "".join(live.lines)


class _Broken:
    """A tokenizer that fails as nothing should."""

    chat_template = "x"

    def encode(self, text):
        raise RuntimeError("boom\nsecond line")


async def _asgi(app, method: str, path: str, body: bytes):
    """One request through the ASGI app, without a network: ``(status, JSON body)``."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def test_an_unexpected_error_is_one_log_line_and_openais_500_body(caplog):
    from ppsplit.serve.server import Server, build_app

    server = Server(None, _Broken(), MODEL, MAX_LEN, 0)
    try:
        with caplog.at_level(logging.ERROR, logger="ppsplit"):
            status, body = asyncio.run(_asgi(build_app(server), "POST", "/v1/completions",
                                             json.dumps({"model": MODEL, "prompt": "hi"}).encode()))
    finally:
        server.pool.shutdown()
    assert status == 500 and body["error"]["type"] == "server_error" and body["error"]["code"] == "internal_error"
    assert "boom" not in json.dumps(body)  # the client learns nothing of the server's insides
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None, errors
    assert "POST /v1/completions failed unexpectedly: RuntimeError: boom" == errors[0].getMessage()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank processes through /proc")
def test_a_frozen_rank_fails_health_and_its_requests_within_the_stall_timeout(folder):
    stall = 2.0
    server = Live(folder, "--ranks", "2", "--rank-stall-timeout", str(stall))
    try:
        (follower,) = _children(server.proc.pid, RANK)
        assert server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=3).usage.completion_tokens
        conn, response = _open_stream(server, max_tokens=MAX_LEN - 10)
        os.kill(follower, signal.SIGSTOP)
        stopped = time.monotonic()
        events = [line[6:] for line in response.read().split(b"\n") if line.startswith(b"data: ")]
        failed = time.monotonic() - stopped
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_failed" and "rank 1 stopped answering" in error["message"], events[-2:]
        assert events[-1] == b"[DONE]" and failed < stall + 3, failed
        conn.close()

        def health_not_ok():
            try:
                conn = server.connection()
                conn.request("GET", "/health")
                return conn.getresponse().status != 200
            except OSError:  # already gone
                return True
        assert health_not_ok()
        assert server.proc.wait(30) == 1
        assert any("no heartbeat for" in line for line in server.lines), "".join(server.lines)
        assert _wait_for(lambda: not os.path.exists(f"/proc/{follower}")
                         or open(f"/proc/{follower}/stat").read().split()[2] == "Z", 10)  # killed, not left stopped
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        try:
            os.kill(follower, signal.SIGKILL)
        except (OSError, UnboundLocalError):
            pass


# -- without a server ----------------------------------------------------------------------------------------------

def test_the_demo_tokenizer_covers_the_model_and_round_trips(folder):
    from ppsplit.compile.demo import demo_config, demo_tokenizer_json

    tok = FolderTokenizer(folder)
    assert tok.vocab_size == demo_config().vocab_size and tok.eos_token_ids == (2,)
    text = "Hello world, the pipeline serves a request."
    ids = tok.encode(text)
    assert ids[0] == 1 and tok.decode(ids) == text and len(ids) < len(text) // 2  # merges learnt
    assert demo_tokenizer_json() == demo_tokenizer_json()  # the same file on every machine


class _Chars:
    """A tokenizer whose token ``i`` is character ``i`` of a table; ``?`` decodes as an unfinished character."""

    def __init__(self, table):
        self.table = table

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(self.table[i] for i in ids)
        return text.replace("?", "\ufffd")


def test_text_stream_holds_back_what_could_start_a_stop_string():
    from ppsplit.serve.detokenize import TextStream

    tok = _Chars("abcdefgh?")
    stream = TextStream(tok, ("cde", "zz"))
    assert stream.feed([0, 1]) == ""  # the last len("cde") - 1 characters are held back
    assert stream.feed([2]) == "a"
    assert stream.feed([3]) == "b"
    assert stream.feed([4, 5]) == "" and stream.stopped and stream.num_tokens == 5  # "cde" ends at token 4
    assert stream.text == "ab"
    stream = TextStream(tok)
    assert stream.feed([0, 8]) == "a"  # an unfinished character waits
    assert stream.feed([1]) == "\ufffdb" and stream.flush() == ""


def test_serve_refuses_folders_and_options_in_one_line(tmp_path, capsys, folder):
    from ppsplit.cli import main

    plain = ppsplit.compile_model("demo", str(tmp_path / "plain"), pp=1)
    assert main(["serve", plain, "--port", "0"]) == 2
    assert "the engine needs a paged cache" in capsys.readouterr().err
    assert main(["serve", folder, "--ranks", "3"]) == 2
    assert "--ranks must be 1 or the folder's 2 stages" in capsys.readouterr().err
    os.remove(os.path.join(plain, "tokenizer.json"))
    assert main(["serve", plain]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and err.count("\n") == 1
