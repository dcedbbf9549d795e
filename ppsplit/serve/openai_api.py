"""Serving: the OpenAI request fields ppsplit takes, checked, and the response bodies it writes.

Every refusal is an ``ApiError`` that becomes an HTTP error with the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``; the message says what to change. A field the server does not
implement is refused by name, never ignored. Types are OpenAI's: an integer field takes no ``true`` and no ``1.0``.
``read_json`` and ``parse`` run on a worker thread (the body may be megabytes), never on the event loop.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, replace

from ppsplit.artifact.sandbox import Budget
from ppsplit.core.errors import ConfigError
from ppsplit.serve.sampling import MAX_LOGPROBS, SamplingParams

# vLLM's OpenAI server takes these too (its benchmark client sends repetition_penalty, ignore_eos, logprobs: null).
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
           "user", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids",
           "ignore_eos", "logit_bias", "logprobs", "response_format", "structured_outputs", "guided_json",
           "guided_regex", "guided_choice", "guided_grammar"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls"}
MAX_TOOLS = 128
MAX_STOP = 4
MAX_CHOICES = 64  # prompts x n of one request
LOGPROB_FLOOR = -9999.0  # a -inf logprob (a token ruled out) as JSON can carry it, as vLLM writes it
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
    """A checked request: its prompts (token ids, and the text ``echo`` repeats), ``n`` choices per prompt and how
    each samples (``params[i * per + j]``: prompt ``i``'s sequence ``j``; ``choices[].index`` ``i * n + j`` as vLLM),
    the stop strings, how to answer; ``logprobs``: alternatives per token (``None``: no logprobs). With ``best_of``
    above ``n``, ``per = best_of`` sequences are generated per prompt and the ``n`` of the highest cumulative logprob
    returned."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    chat: bool
    n: int = 1
    texts: tuple[str, ...] = ()
    echo: bool = False
    logprobs: int | None = None
    continuous_usage: bool = False
    tool_call: tuple | None = None  # ("function", name) or ("required",): the output is tool calls (chat)
    best_of: int = 0  # 0: n

    @property
    def per(self) -> int:
        """Sequences generated per prompt."""
        return max(self.best_of, self.n)

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompts[0]

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.per]


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


def parse(body: dict, *, chat: bool, model: str, tokenizer, max_len: int, draft_positions: int,
          grammars=None) -> Parsed:
    """The request ``body`` of ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions``, checked;
    ``grammars``: what compiles its structured output (``ppsplit.serve.structured.Grammars``; ``None``: refused)."""
    body = {k: v for k, v in body.items() if v is not None}  # a null field is an absent one (OpenAI's default)
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise ApiError(f"unsupported field {unknown[0]!r}: this server takes {', '.join(sorted(allowed))}; drop the "
                       "others", param=unknown[0], code="unsupported_field")
    if body.get("model") != model:
        raise ApiError(f"model {json.dumps(body.get('model'))[:80]} is not served here; this server serves "
                       f"{model!r} (see /v1/models)", param="model", code="model_not_found", status=404)
    n = _number(body, "n", 1, 1, MAX_CHOICES, True, f"an integer from 1 to {MAX_CHOICES}")
    best_of = _number(body, "best_of", n, 1, MAX_CHOICES, True, f"an integer from n ({n}) to {MAX_CHOICES}")
    if best_of < n:
        raise ApiError(f"best_of ({best_of}) must be at least n ({n}): it is how many sequences the n are chosen "
                       "from", param="best_of")
    if not isinstance(body.get("user", ""), str):
        raise ApiError(f"user must be a string, but got {json.dumps(body['user'])[:40]}", param="user")
    tools, tool_call, tool_schema = _tools(body) if chat else (None, None, None)
    if chat:
        prompts, texts = [_chat_prompt(body, tokenizer, tools)], ()
    else:
        prompts, texts = _completion_prompts(body, tokenizer)
    if len(prompts) * best_of > MAX_CHOICES:
        what = f"n={n}" if best_of == n else f"best_of={best_of}"
        raise ApiError(f"{len(prompts)} prompts x {what} is {len(prompts) * best_of} sequences; one request makes at "
                       f"most {MAX_CHOICES}", param="best_of" if best_of > n else "n")
    stream = _flag(body, "stream")
    if stream and best_of > n:
        raise ApiError("best_of above n cannot stream (the best are known at the end, as in vLLM); drop stream or "
                       "best_of", param="best_of")
    options = body.get("stream_options", {})
    if "stream_options" in body and not stream:
        raise ApiError("stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ApiError(f"stream_options takes include_usage and continuous_usage_stats (true or false), but got "
                       f"{options!r}", param="stream_options")
    options = {k: v for k, v in options.items() if v is not None}
    include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    continuous = _flag(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    longest = max(len(p) for p in prompts)
    room = max_len - longest - draft_positions
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    default = 16 if not chat else max(1, room)  # OpenAI's completions default; chat: what the cache leaves
    logprobs = _logprobs(body, chat)
    echo = _flag(body, "echo")
    base = _params(body, key, default, logprobs)
    grammar = _grammar(body, grammars)
    if tool_call is not None:
        if grammar is not None:
            raise ApiError("tool_choice asks for tool calls, and the request also asks for structured output; send one "
                           "of them", param="tool_choice")
        if stream and logprobs is not None:
            raise ApiError("a streamed tool call comes whole, without logprobs; send stream: false for them",
                           param="logprobs")
        grammar = _grammar({"guided_json": tool_schema}, grammars, "tool_choice")
    if grammar is not None:
        base = replace(base, grammar=grammar)
    if echo and logprobs is not None:  # the prompt's logprobs too, as lm-evaluation-harness reads them
        base = replace(base, prompt_logprobs=logprobs)
    if longest + base.max_tokens + draft_positions > max_len:
        raise ApiError(f"the prompt has {longest} tokens and {key} is {base.max_tokens}"
                       + (f" (+ {draft_positions} draft positions)" if draft_positions else "")
                       + f", but a sequence holds {max_len} tokens; shorten the prompt or ask for at most "
                       f"{max(0, room)} tokens", param=key if room > 0 else ("messages" if chat else "prompt"),
                       code="context_length_exceeded")
    if best_of > n:  # ranked by the tokens' logprobs under the adjusted logits (returned only if asked for)
        base = replace(base, logprobs=0 if base.logprobs is None else base.logprobs, logprobs_adjusted=True)
    # Sequence j samples with seed + j (as vLLM's parallel sampling), so n seeded choices differ and repeat.
    params = [base if base.seed is None or best_of == 1 else replace(base, seed=base.seed + j)
              for _ in prompts for j in range(best_of)]
    return Parsed(prompts, params, _stop(body), stream, include_usage, chat, n, texts, echo, logprobs, continuous,
                  tool_call, best_of if best_of > n else 0)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token, or ``None``: completions' ``logprobs`` (an integer), chat's ``logprobs`` (true or
    false) with ``top_logprobs``."""
    if not chat:
        if "logprobs" not in body:
            return None
        return _number(body, "logprobs", None, 0, MAX_LOGPROBS, True, f"an integer from 0 to {MAX_LOGPROBS}")
    wanted = _flag(body, "logprobs")
    top = _number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, True, f"an integer from 0 to {MAX_LOGPROBS}")
    if "top_logprobs" in body and not wanted:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    return top if wanted else None


def _flag(body: dict, key: str, name: str | None = None) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise ApiError(f"{name or key} must be true or false, but got {repr(value)[:60]}", param=name or key)
    return value


def _completion_prompts(body: dict, tokenizer) -> tuple[list[list[int]], tuple[str, ...]]:
    """Prompt (a string, a list of token ids, or a list of either) as token ids, with the text ``echo`` repeats."""
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    prompts = prompt if batch else [prompt]
    if len(prompts) > MAX_CHOICES:
        raise ApiError(f"prompt holds {len(prompts)} prompts; one request takes at most {MAX_CHOICES}",
                       param="prompt")
    ids = [_completion_prompt(p, tokenizer) for p in prompts]
    return ids, tuple(p if isinstance(p, str) else tokenizer.decode(i, skip_special_tokens=True)
                      for p, i in zip(prompts, ids))


def _completion_prompt(prompt, tokenizer) -> list[int]:
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
        raise ApiError("prompt must be a string, a list of token ids, or a list of those (a batch), but got "
                       f"{json.dumps(prompt)[:80]}", param="prompt")
    if not ids:
        raise ApiError("prompt is empty; send at least one token", param="prompt")
    return ids


def _chat_prompt(body: dict, tokenizer, tools: list | None = None) -> list[int]:
    plain = _chat_prompt_messages(body)
    if tokenizer.chat_template is None:
        raise ApiError("this model's folder has no chat template; use /v1/completions with a prompt",
                       param="messages")
    try:
        return tokenizer.encode_chat(plain, add_generation_prompt=True, tools=tools)
    except ConfigError as e:  # the template refused, failed or ran past its budget (time, output, memory)
        raise ApiError(str(e), param="messages") from None


def _chat_prompt_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content} objects", param="messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool") \
                or set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"}:
            raise ApiError(f"messages[{i}] must be {{role: system|user|assistant|developer|tool, content, name?, "
                           f"tool_calls? (assistant), tool_call_id? (tool)}}, but got {json.dumps(m)[:80]}",
                           param=f"messages[{i}]")
        calls, call_id = m.get("tool_calls"), m.get("tool_call_id")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls)):
            raise ApiError(f"messages[{i}].tool_calls must be an assistant's list of {{id, type, function: {{name, "
                           "arguments}}}}", param=f"messages[{i}].tool_calls")
        if call_id is not None and (m["role"] != "tool" or not isinstance(call_id, str)):
            raise ApiError(f"messages[{i}].tool_call_id must be a tool message's string", param=f"messages[{i}]")
        content = "" if calls is not None and m.get("content") is None else _content(m.get("content"), i)
        message = {"role": m["role"], "content": content}
        message |= ({"tool_calls": calls} if calls is not None else {}) | (
            {"tool_call_id": call_id} if call_id is not None else {})
        if m.get("name") is not None:  # transformers hands the template each message as the client sent it
            if not isinstance(m["name"], str):
                raise ApiError(f"messages[{i}].name must be a string, but got {json.dumps(m['name'])[:40]}",
                               param=f"messages[{i}].name")
            message["name"] = m["name"]
        plain.append(message)
    return plain


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


def _params(body: dict, key: str, default: int, logprobs: int | None) -> SamplingParams:
    max_tokens = _number(body, key, default, 1, None, True, "an integer >= 1")
    temperature = _number(body, "temperature", 1.0, 0, 2, False, "a number from 0 (greedy) to 2")
    top_p = _number(body, "top_p", 1.0, 0, 1, False, "a number in (0, 1]")
    if top_p == 0:
        raise ApiError("top_p must be a number in (0, 1], but got 0", param="top_p")
    top_k = _number(body, "top_k", 0, -1, None, True, "an integer >= 1, or 0 or -1 for no cut")
    seed = _number(body, "seed", None, *SEED_RANGE, True, "an integer from -2**63 to 2**63 - 1") \
        if "seed" in body else None
    stop_ids = body.get("stop_token_ids", [])
    if not isinstance(stop_ids, list) or len(stop_ids) > 64:
        raise ApiError(f"stop_token_ids must be a list of up to 64 token ids, but got {json.dumps(stop_ids)[:80]}",
                       param="stop_token_ids")
    bias = body.get("logit_bias", {})
    if not isinstance(bias, dict):
        raise ApiError(f"logit_bias must be an object mapping token ids to biases, but got {json.dumps(bias)[:80]}",
                       param="logit_bias")
    fields = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(0, top_k), seed=seed,
                  stop_token_ids=tuple(stop_ids), ignore_eos=_flag(body, "ignore_eos"), logit_bias=bias,
                  logprobs=logprobs)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if name in body:
            fields[name] = body[name]
    try:
        return SamplingParams(**fields)
    except ConfigError as e:
        message = str(e)
        raise ApiError(message, param=next((f for f in fields if message.startswith(f)), None)) from None


def _grammar(body: dict, grammars, field: str | None = None):
    """The compiled grammar of the request's structured output, or ``None``: OpenAI's ``response_format``
    (``json_object``, ``json_schema``), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar`` and its ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``); one of them at most."""
    given = [(name, body[name]) for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                             "guided_choice", "guided_grammar") if name in body]
    if len(given) > 1:
        raise ApiError(f"{given[0][0]} and {given[1][0]} both ask for structured output; send one of them",
                       param=given[1][0])
    if not given:
        return None
    name, value = given[0]
    if name == "response_format":
        spec = _response_format(value)
    elif name == "structured_outputs":
        if not isinstance(value, dict):
            raise ApiError(f"structured_outputs must be an object like {{\"json\": schema}}, but got "
                           f"{json.dumps(value)[:80]}", param=name)
        value = {k: v for k, v in value.items() if v is not None and v is not False}
        if len(value) != 1 or not set(value) <= {"json", "regex", "choice", "grammar", "json_object"}:
            raise ApiError(f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object, but "
                           f"got {sorted(value)}", param=name)
        (field, inner), = value.items()
        spec = _guided("json_object" if field == "json_object" else field, inner, f"{name}.{field}")
        name = f"{name}.{field}"
    else:
        spec = _guided(name.split("_", 1)[1], value, name)
    if spec is None:
        return None
    if grammars is None:
        raise ApiError(f"{name}: structured output needs xgrammar (pip install 'ppsplit[structured]') and the stages "
                       "in one process; this server runs them on --ranks or lacks xgrammar", param=name.split(".")[0])
    name = field or name  # the field the user sent (tool_choice's grammar travels as guided_json)
    try:
        return grammars.compile(*spec)
    except ConfigError as e:
        raise ApiError(f"{name}: {e}", param=name.split(".")[0]) from None


def _tools(body: dict) -> tuple[list | None, tuple | None, dict | None]:
    """``(tools, tool_call, schema)``: the tools the chat template sees, and with ``tool_choice`` ``"required"`` or a
    named function, what the output is and the JSON schema it follows (vLLM's: for ``required`` a list of
    ``{"name", "parameters"}``; for a named function its parameters)."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if tools is None:
        if choice != "none":
            raise ApiError("tool_choice needs tools", param="tool_choice")
        return None, None, None
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        raise ApiError(f"tools must be a list of 1 to {MAX_TOOLS} tools", param="tools")
    params = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}",
                                                                                 function["name"]) \
                or not isinstance(function.get("parameters", {}), dict) or function["name"] in params:
            raise ApiError(f"tools[{i}] must be {{type: function, function: {{name (a unique name of letters, digits, "
                           f"_.-), description?, parameters?: a JSON schema}}}}, but got {json.dumps(tool)[:80]}",
                           param="tools")
        params[function["name"]] = function.get("parameters") or {"type": "object"}
    if choice == "none":
        return tools, None, None
    if choice == "required":
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"enum": [name]}, "parameters": p},
             "required": ["name", "parameters"], "additionalProperties": False} for name, p in params.items()]}}
        if body.get("parallel_tool_calls") is False:
            schema["maxItems"] = 1
        return tools, ("required",), schema
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if name is not None and name in params:
        return tools, ("function", name), params[name]
    if choice == "auto":
        raise ApiError("tool_choice auto needs a parser of this model's own tool-call format, which ppsplit does not "
                       "have; send tool_choice required or {type: function, function: {name}}", param="tool_choice")
    raise ApiError(f"tool_choice must be none, required or {{type: function, function: {{name}}}} naming one of the "
                   f"tools ({', '.join(params)[:80]}), but got {json.dumps(choice)[:80]}", param="tool_choice")


def tool_calls_of(text: str, tool_call: tuple) -> list[dict] | None:
    """The ``tool_calls`` of a finished answer that followed ``tool_call``'s grammar (``None`` if it does not
    parse: the grammar ended early)."""
    import uuid

    def call(name: str, arguments: str) -> dict:
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": name, "arguments": arguments}}

    try:
        value = json.loads(text)
    except ValueError:
        return None
    if tool_call[0] == "function":
        return [call(tool_call[1], text)]
    return [call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]


def _response_format(value) -> tuple[str, str] | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(f"response_format must be {{\"type\": \"text\" | \"json_object\" | \"json_schema\"}}, but "
                       f"got {json.dumps(value)[:80]}", param="response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return "json_object", ""
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict) \
            or not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", False), (bool, type(None))):
        raise ApiError(f"response_format.json_schema must be {{name, schema: {{...}}, strict?}}, but got "
                       f"{json.dumps(spec)[:80]}", param="response_format")
    return "json", json.dumps(spec.get("schema", {}))


def _guided(kind: str, value, name: str) -> tuple[str, str]:
    """``(kind, source)`` of a vLLM structured output field: ``json`` (a schema object or its text), ``regex`` and
    ``grammar`` (text), ``choice`` (a list of strings), ``json_object`` (true)."""
    if kind == "json" and isinstance(value, dict):
        return "json", json.dumps(value)
    if kind == "choice" and isinstance(value, list):
        return "choice", json.dumps(value)
    if kind == "json_object" and value is True:
        return "json_object", ""
    if kind in ("json", "regex", "grammar") and isinstance(value, str):
        return kind, value
    want = {"json": "a JSON schema (an object, or its text)", "regex": "a regular expression (a string)",
            "grammar": "an EBNF grammar (a string)", "choice": "a list of strings", "json_object": "true"}[kind]
    raise ApiError(f"{name} must be {want}, but got {json.dumps(value)[:80]}", param=name.split(".")[0])


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


def completion_body(rid: str, model: str, created: int, choices: list[dict], use: dict, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
            "choices": choices, "usage": use}


def choice_body(index: int, text: str, finish: str, logprobs: dict | None, chat: bool,
                tool_calls: list | None = None) -> dict:
    if tool_calls is not None:
        return {"index": index, "message": {"role": "assistant", "content": None, "tool_calls": tool_calls},
                "logprobs": logprobs, "finish_reason": finish}
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chunk_body(rid: str, model: str, created: int, chat: bool, *, index: int = 0, text: str | None = None,
               finish: str | None = None, role: bool = False, use: dict | None = None, include_usage: bool = False,
               logprobs: dict | None = None, running: dict | None = None, tool_calls: list | None = None) -> dict:
    """One streamed chunk; ``use`` makes it the final usage chunk (no choices); ``running``: the usage so far
    (``continuous_usage_stats``); ``tool_calls``: a chat delta of whole calls (each with its ``index``)."""
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model}
    if use is not None:
        return body | {"choices": [], "usage": use}
    if chat:
        delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text is not None else {})
        if tool_calls is not None:
            delta["tool_calls"] = [{"index": i} | call for i, call in enumerate(tool_calls)]
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return body | {"choices": [choice]} | ({"usage": running} if running is not None else
                                           {"usage": None} if include_usage else {})


def logprobs_body(tokenizer, entries, token_ids, chat: bool, offset: int = 0) -> dict | None:
    """``entries`` (``RequestOutput.logprobs``: ``(logprob, [(id, logprob)])`` per token of ``token_ids``) in the
    chat format (``{"content": [{token, logprob, bytes, top_logprobs}]}``) or the completions one (``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset`` from ``offset``). An entry ``None`` (a prompt's first
    token) has no logprob."""
    def text(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)

    def value(lp: float) -> float:
        return max(lp, LOGPROB_FLOOR)

    if chat:
        return {"content": [{"token": text(t), "logprob": value(lp), "bytes": list(text(t).encode()),
                             "top_logprobs": [{"token": text(a), "logprob": value(v), "bytes": list(text(a).encode())}
                                              for a, v in top]} for t, (lp, top) in zip(token_ids, entries)]}
    tokens = [text(t) for t in token_ids]
    offsets = []
    for piece in tokens:
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": [None if e is None else value(e[0]) for e in entries],
            "top_logprobs": [None if e is None else {text(a): value(v) for a, v in [(t, e[0])] + e[1]}
                             for t, e in zip(token_ids, entries)],
            "text_offset": offsets}


def sse(body: dict | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


def now() -> int:
    return int(time.time())


# -- /tokenize and /detokenize (vLLM's) ------------------------------------------------------------------------------

def tokenize_body(body: dict, tokenizer, model: str) -> list[int]:
    """``{prompt, add_special_tokens}`` or ``{messages, add_generation_prompt}`` as token ids."""
    body = _tool_body(body, model, {"prompt", "messages", "add_special_tokens", "add_generation_prompt"})
    if ("prompt" in body) == ("messages" in body):
        raise ApiError("send either prompt (a string) or messages (a chat)", param="prompt")
    try:
        if "messages" in body:
            messages = _chat_prompt_messages(body)
            if tokenizer.chat_template is None:
                raise ApiError("this model's folder has no chat template; tokenize a prompt", param="messages")
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=_flag(body, "add_generation_prompt")
                                                 if "add_generation_prompt" in body else True)
            return tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens"))
        if not isinstance(body["prompt"], str):
            raise ApiError(f"prompt must be a string, but got {json.dumps(body['prompt'])[:80]}", param="prompt")
        special = _flag(body, "add_special_tokens") if "add_special_tokens" in body else True
        return tokenizer.encode(body["prompt"], add_special_tokens=special)
    except ConfigError as e:  # the template or tokenizer failed or ran past its budget
        raise ApiError(str(e), param="messages" if "messages" in body else "prompt") from None


def detokenize_body(body: dict, tokenizer, model: str) -> list[int]:
    body = _tool_body(body, model, {"tokens"})
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            and 0 <= t < tokenizer.vocab_size for t in ids):
        raise ApiError(f"tokens must be a list of token ids from 0 to {tokenizer.vocab_size - 1}, but got "
                       f"{json.dumps(ids)[:80]}", param="tokens")
    return ids


def _tool_body(body: dict, model: str, allowed: set) -> dict:
    body = {k: v for k, v in body.items() if v is not None}
    unknown = sorted(set(body) - allowed - {"model"})
    if unknown:
        raise ApiError(f"unsupported field {unknown[0]!r}: this endpoint takes "
                       f"{', '.join(sorted(allowed | {'model'}))}",
                       param=unknown[0], code="unsupported_field")
    if body.get("model", model) != model:
        raise ApiError(f"model {body['model']!r} is not served here; this server serves {model!r}", param="model",
                       code="model_not_found")
    return body
