"""Serving: the OpenAI request fields ppsplit takes, checked, and the response bodies it writes.

Every refusal is an ``ApiError`` that becomes an HTTP error with the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``; the message says what to change. A field the server does not
implement is refused by name, never ignored. Types are OpenAI's: an integer field takes no ``true`` and no ``1.0``.
``read_json`` and ``parse`` run on a worker thread (the body may be megabytes), never on the event loop.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ppsplit.artifact.sandbox import Budget
from ppsplit.core.errors import ConfigError
from ppsplit.serve.sampling import SamplingParams

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
           "user"}
COMPLETION_FIELDS = _COMMON | {"prompt"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
MAX_STOP = 4
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # a seed travels between ranks as an int64 (vLLM's bounds too)
MIN_REQUEST_BYTES = 1 << 20
REQUEST_BYTES_PER_TOKEN = 64
PROMPT_SECONDS = 10.0  # what a request's chat template and tokenizer may take (--prompt-timeout)
PROMPT_WORKERS = 4  # processes that render and tokenise requests in parallel


def default_max_request_bytes(max_len: int) -> int:
    """The body size a server over a ``max_len``-token cache admits: 64 bytes a token of context (room for JSON
    escapes and token-id lists), at least 1 MiB."""
    return max(MIN_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN * max_len)


def prompt_budget(max_request_bytes: int, seconds: float | None = None) -> Budget:
    """What rendering and tokenising one request may take: ``seconds`` (default ``PROMPT_SECONDS``), and a rendered
    prompt of at most 4 characters per byte the request may hold (more than its messages could fill: the rest would
    be the template's own output). ``ppsplit inspect`` checks a folder's template within the same budget."""
    return Budget(seconds=seconds or PROMPT_SECONDS, max_chars=4 * max_request_bytes, workers=PROMPT_WORKERS)


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Parsed:
    """A checked request: the prompt's token ids, how to sample, the stop strings, how to answer."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    chat: bool


def read_json(raw: bytes) -> dict:
    """The request body as a JSON object whose every string is valid Unicode, or an ``ApiError``."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError("the request body nests JSON too deeply; send a flat JSON object") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise ApiError(f"the request body is not valid JSON ({str(e)[:120]}); send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, but got a JSON {type(body).__name__}")
    _check_text(body)
    return body


def _check_text(body: dict) -> None:
    """JSON may escape half of a UTF-16 surrogate pair (``"\\ud800"``), which is no character: refuse it by field."""
    stack = [(body, "")]
    while stack:
        value, path = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            where = f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]"
            for text in (key, item) if isinstance(key, str) else (item,):
                if isinstance(text, str) and not text.isascii():
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as e:
                        raise ApiError(f"{where.lstrip('.')} holds a lone surrogate ({text[e.start]!r}), which is "
                                       "not a character; send valid UTF-8 (or escape pairs)",
                                       param=where.lstrip(".").split("[")[0].split(".")[0]) from None
            if isinstance(item, (dict, list)):
                stack.append((item, where))


def parse(body: dict, *, chat: bool, model: str, tokenizer, max_len: int, draft_positions: int) -> Parsed:
    """The request ``body`` of ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions``, checked."""
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise ApiError(f"unsupported field {unknown[0]!r}: this server takes {', '.join(sorted(allowed))}; drop the "
                       "others", param=unknown[0], code="unsupported_field")
    body = {k: v for k, v in body.items() if v is not None}  # a null field is an absent one (the client's default)
    if body.get("model") != model:
        raise ApiError(f"model {json.dumps(body.get('model'))[:80]} is not served here; this server serves "
                       f"{model!r} (see /v1/models)", param="model", code="model_not_found", status=404)
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n != 1:
        raise ApiError(f"n must be the integer 1 (one choice per request), but got {json.dumps(n)[:40]}", param="n")
    if not isinstance(body.get("user", ""), str):
        raise ApiError(f"user must be a string, but got {json.dumps(body['user'])[:40]}", param="user")
    prompt_ids = _chat_prompt(body, tokenizer) if chat else _completion_prompt(body, tokenizer)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise ApiError("stream_options is only allowed with stream: true", param="stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise ApiError(f"stream_options takes only include_usage (true or false), but got {options!r}",
                       param="stream_options")
    include_usage = _flag(options or {}, "include_usage", "stream_options.include_usage")
    room = max_len - len(prompt_ids) - draft_positions
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    default = 16 if not chat else max(1, room)  # OpenAI's completions default; chat: what the cache leaves
    params = _params(body, key, default)
    if len(prompt_ids) + params.max_tokens + draft_positions > max_len:
        raise ApiError(f"the prompt has {len(prompt_ids)} tokens and {key} is {params.max_tokens}"
                       + (f" (+ {draft_positions} draft positions)" if draft_positions else "")
                       + f", but a sequence holds {max_len} tokens; shorten the prompt or ask for at most "
                       f"{max(0, room)} tokens", param=key if room > 0 else ("messages" if chat else "prompt"),
                       code="context_length_exceeded")
    return Parsed(prompt_ids, params, _stop(body), stream, include_usage, chat)


def _flag(body: dict, key: str, name: str | None = None) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise ApiError(f"{name or key} must be true or false, but got {repr(value)[:60]}", param=name or key)
    return value


def _completion_prompt(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode(prompt)
        except ConfigError as e:  # the tokenizer failed or ran past its budget on this text
            raise ApiError(str(e), param="prompt") from None
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ApiError(f"token id {bad[0]} in prompt is outside the vocabulary (0 to {tokenizer.vocab_size - 1})",
                           param="prompt")
    else:
        raise ApiError("prompt must be a string or a list of token ids (one prompt per request), but got "
                       f"{json.dumps(prompt)[:80]}", param="prompt")
    if not ids:
        raise ApiError("prompt is empty; send at least one token", param="prompt")
    return ids


def _chat_prompt(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content} objects", param="messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer") \
                or set(m) - {"role", "content", "name"}:
            raise ApiError(f"messages[{i}] must be {{role: system|user|assistant|developer, content, name?}}, but "
                           f"got {json.dumps(m)[:80]}", param=f"messages[{i}]")
        message = {"role": m["role"], "content": _content(m.get("content"), i)}
        if m.get("name") is not None:  # transformers hands the template each message as the client sent it
            if not isinstance(m["name"], str):
                raise ApiError(f"messages[{i}].name must be a string, but got {json.dumps(m['name'])[:40]}",
                               param=f"messages[{i}].name")
            message["name"] = m["name"]
        plain.append(message)
    if tokenizer.chat_template is None:
        raise ApiError("this model's folder has no chat template; use /v1/completions with a prompt",
                       param="messages")
    try:
        return tokenizer.encode_chat(plain, add_generation_prompt=True)
    except ConfigError as e:  # the template refused, failed or ran past its budget (time, output, memory)
        raise ApiError(str(e), param="messages") from None


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(f"messages[{i}].content must be a string or a list of text parts (this model reads text only)",
                   param=f"messages[{i}].content")


def _number(body: dict, key: str, default, low, high, integer: bool, what: str):
    value = body.get(key, default)
    ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
    if not ok or not (low is None or value >= low) or not (high is None or value <= high):
        raise ApiError(f"{key} must be {what}, but got {repr(value)[:60]}", param=key)
    return value


def _params(body: dict, key: str, default: int) -> SamplingParams:
    max_tokens = _number(body, key, default, 1, None, True, "an integer >= 1")
    temperature = _number(body, "temperature", 1.0, 0, 2, False, "a number from 0 (greedy) to 2")
    top_p = _number(body, "top_p", 1.0, 0, 1, False, "a number in (0, 1]")
    if top_p == 0:
        raise ApiError("top_p must be a number in (0, 1], but got 0", param="top_p")
    top_k = _number(body, "top_k", 0, -1, None, True, "an integer >= 1, or 0 or -1 for no cut")
    seed = _number(body, "seed", None, *SEED_RANGE, True, "an integer from -2**63 to 2**63 - 1") \
        if "seed" in body else None
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(0, top_k),
                          seed=seed)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(f"stop must be a non-empty string or a list of up to {MAX_STOP} of them, but got "
                       f"{json.dumps(stop)[:80]}", param="stop")
    return tuple(stop)


# -- response bodies -----------------------------------------------------------------------------------------------

def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(rid: str, model: str, created: int, text: str, finish: str, use: dict, chat: bool) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": use}


def chunk_body(rid: str, model: str, created: int, chat: bool, *, text: str | None = None, finish: str | None = None,
               role: bool = False, use: dict | None = None, include_usage: bool = False) -> dict:
    """One streamed chunk; ``use`` makes it the final usage chunk (no choices)."""
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model}
    if use is not None:
        return body | {"choices": [], "usage": use}
    if chat:
        delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return body | {"choices": [choice]} | ({"usage": None} if include_usage else {})


def sse(body: dict | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


def now() -> int:
    return int(time.time())
