"""Serving: ``ppsplit serve``, the OpenAI HTTP API (FastAPI + uvicorn) over the engine loop.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the folder's chat template), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text). The engine runs in one thread (``ppsplit.serve.loop``); each
handler submits its request there and awaits its events on an asyncio queue the loop's thread fills. A full queue
answers 503 at once; a client that goes away (mid-stream or while waiting) aborts its request, which frees its
blocks. SIGTERM (or Ctrl-C) stops accepting connections, lets the requests in flight finish, then the process
exits 0; a failed engine step ends the server with the error logged and exit code 1.

The event loop only moves bytes: a body is read up to ``max_request_bytes`` (413 beyond, from its Content-Length
before any is read), then parsed, checked, templated and tokenised on a worker thread, the template and tokenizer
in child processes under their budget (``ppsplit.artifact.sandbox``), so a large or slow request delays only itself.
Every error is OpenAI's JSON body; one nobody expected is logged in one line and answered 500, never a traceback.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.responses import StreamingResponse

from ppsplit.core.errors import ConfigError
from ppsplit.serve.detokenize import TextStream
from ppsplit.serve.loop import EngineLoop, QueueFull
from ppsplit.serve.openai_api import (ApiError, choice_body, chunk_body, completion_body, default_max_request_bytes,
                                      detokenize_body, logprobs_body, now, parse, read_json, sse, tokenize_body,
                                      tool_calls_of, usage)

log = logging.getLogger("ppsplit")


class _Events:
    """A request's events, moved from the loop's thread onto the event loop's queue."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def __call__(self, kind, payload) -> None:  # on the engine loop's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))

    async def get(self):
        return await self.queue.get()


@dataclass
class Choice:
    """One sequence of a request (a prompt of a batch, one of its ``n``): its engine request and events."""

    index: int
    request_id: str
    events: _Events
    tokens: int = 0  # generated so far
    offset: int = 0  # characters of text sent so far (completions' logprobs text_offset)


@dataclass
class Delta:
    """What one engine step gave a choice: the text that became final (maybe none), the new tokens and their
    logprobs entries; ``finish`` on the last one."""

    text: str
    finish: str | None
    num_tokens: int
    token_ids: list
    logprobs: list
    prompt_logprobs: list  # with echo and logprobs


class Server:
    """What the handlers share: the engine loop, the tokenizer, the model's name, the cache's limits, the largest
    request body, and the threads that prepare requests."""

    def __init__(self, loop: EngineLoop, tokenizer, model: str, max_len: int, draft_positions: int,
                 max_request_bytes: int | None = None, threads: int = 8, root: str | None = None, grammars=None):
        self.loop, self.tokenizer, self.model, self.root = loop, tokenizer, model, root or model
        self.grammars = grammars  # compiles structured output (ppsplit.serve.structured.Grammars), or None
        self.max_len, self.draft_positions = max_len, draft_positions
        self.max_request_bytes = max_request_bytes or default_max_request_bytes(max_len)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="ppsplit-request")
        self.draining = False
        self.live: weakref.WeakSet = weakref.WeakSet()  # the events of requests in flight (event loop's thread)
        self._aio: asyncio.AbstractEventLoop | None = None

    def fail(self, message: str) -> None:
        """End the server from another thread (a rank that stopped answering): ``/health`` fails, and every request
        in flight gets its error now rather than when (if ever) the engine's wait on that rank ends."""
        self.loop.fail(message)
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self._fail_live, message)

    def _fail_live(self, message: str) -> None:
        for events in list(self.live):
            events.queue.put_nowait(("error", message))

    def prepare(self, raw: bytes, chat: bool):
        """Parse, check, template and tokenise a body (on a worker thread): the ``Parsed`` request."""
        return parse(read_json(raw), chat=chat, model=self.model, tokenizer=self.tokenizer, max_len=self.max_len,
                     draft_positions=self.draft_positions, grammars=self.grammars)

    async def read(self, request: Request) -> bytes:
        """The body, refused (413) past ``max_request_bytes``: by its Content-Length before any of it is read, else
        as soon as it passes the limit."""
        limit = self.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(f"{int(declared):,} bytes", limit)
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(f"more than {limit:,} bytes", limit)
            parts.append(chunk)
        return b"".join(parts)

    async def start(self, raw: bytes, chat: bool):
        """Check the body ``raw``, submit its sequences and wait until the engine took them: ``(parsed, choices)``.
        If one is refused, those already submitted are aborted."""
        self._aio = asyncio.get_running_loop()
        parsed = await self._aio.run_in_executor(self.pool, self.prepare, raw, chat)
        choices = []
        try:
            for index, params in enumerate(parsed.params):
                events = _Events()
                self.live.add(events)
                # A prompt's other sequences share the prompt blocks of its first (the engine prefills it once).
                parent = choices[index - index % parsed.per].request_id if index % parsed.per else None
                try:
                    request_id = self.loop.submit(parsed.prompt_of(index), params, events, parent=parent)
                except QueueFull as e:
                    raise ApiError(str(e), status=503, kind="server_error", code="queue_full") from None
                choices.append(Choice(index, request_id, events))
            for choice in choices:
                kind, payload = await choice.events.get()
                if kind == "error":
                    raise ApiError(payload, param="messages" if chat else "prompt")
        except BaseException:
            for choice in choices:
                self.loop.abort(choice.request_id)
            raise
        return parsed, choices

    async def run(self, function, *args):
        """``function(*args)`` on a worker thread (what tokenises or templates never runs on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, function, *args)

    async def deltas(self, parsed, choice: Choice):
        """A ``Delta`` for each engine step that gave the choice tokens; the last one has a finish reason. A stop
        string ends the request at once."""
        text = TextStream(self.tokenizer, parsed.stop)
        while True:
            kind, out = await choice.events.get()
            if kind == "error":
                raise ApiError(f"the engine failed: {out}", status=500, kind="server_error", code="engine_failed")
            before = text.num_tokens
            try:
                piece = text.feed(out.new_token_ids)
                rest = text.flush() if out.finished and not text.stopped else ""
            except ConfigError as e:  # the folder's decoder failed on these tokens
                if not out.finished:
                    self.loop.abort(choice.request_id)
                raise ApiError(str(e), status=500, kind="server_error", code="detokenize_failed") from None
            new = out.new_token_ids[:text.num_tokens - before]  # none past a stop string
            logprobs = out.new_logprobs[:len(new)]
            choice.tokens = text.num_tokens
            if text.stopped:
                if not out.finished:
                    self.loop.abort(choice.request_id)
                yield Delta(piece, "stop", text.num_tokens, new, logprobs, out.prompt_logprobs)
                return
            if out.finished:
                finish = "stop" if out.finish_reason == "stop" else "length"
                yield Delta(piece + rest, finish, text.num_tokens, new, logprobs, out.prompt_logprobs)
                return
            if out.new_token_ids:  # held-back text still makes a (empty) chunk: clients see every step, as vLLM's
                yield Delta(piece, None, text.num_tokens, new, logprobs, out.prompt_logprobs)


class Stream(StreamingResponse):
    """Closes its generator however the response ends, so an early end aborts the request at once."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(f"the request body has {size}, more than this server takes ({limit:,} bytes, "
                    "--max-request-bytes); send a shorter prompt", status=413, code="request_too_large")


class _Guard:
    """An exception no handler expected: one log line, and OpenAI's error body (500) unless the response had
    begun; never a traceback to the client."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        began = False

        async def watched(message):
            nonlocal began
            began = began or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            log.error("%s %s failed unexpectedly: %s", scope.get("method"), scope.get("path"), one_line(e))
            if not began:
                error = ApiError("the server failed on this request unexpectedly (its log says why)", status=500,
                                 kind="server_error", code="internal_error")
                await JSONResponse(error.body(), status_code=500)(scope, receive, send)


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def build_app(server: Server) -> FastAPI:
    app = FastAPI(title="ppsplit", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # no such route or method
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        body = ApiError(f"{request.method} {request.url.path}: {e.detail}", status=e.status_code, kind=kind).body()
        return JSONResponse(body, status_code=e.status_code, headers=getattr(e, "headers", None))

    async def generate(request: Request, chat: bool):
        parsed, choices = await server.start(await server.read(request), chat)
        rid, created = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, now()
        if parsed.stream:
            return Stream(_sse(server, parsed, choices, rid, created),
                          media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        whole = asyncio.ensure_future(asyncio.gather(*(_collect(server, parsed, c) for c in choices)))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({whole, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not whole.done():  # the client left: nobody reads the answer
            whole.cancel()
            for choice in choices:
                server.loop.abort(choice.request_id)
            return Response(status_code=499)
        gone.cancel()
        answers = whole.result()
        use = usage(sum(len(p) for p in parsed.prompts), sum(tokens for _, tokens, _ in answers))  # best_of: all
        return JSONResponse(completion_body(rid, server.model, created, returned_choices(parsed, answers), use, chat))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model, "object": "model", "created": now(),
                                            "owned_by": "ppsplit", "root": server.root, "parent": None,
                                            "max_model_len": server.max_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = read_json(await server.read(request))
        ids = await server.run(tokenize_body, body, server.tokenizer, server.model)
        return {"count": len(ids), "max_model_len": server.max_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        ids = detokenize_body(read_json(await server.read(request)), server.tokenizer, server.model)
        return {"prompt": await server.run(lambda: server.tokenizer.decode(ids, skip_special_tokens=False))}

    @app.get("/health")
    async def health():
        if server.loop.failed:
            return JSONResponse({"status": "failed", "error": server.loop.failed}, status_code=503)
        return {"status": "draining" if server.draining else "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.loop.metrics.text(server.model),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _collect(server: Server, parsed, choice: Choice):
    """A choice's whole answer: ``(choice body, tokens generated, cumulative logprob of its tokens)``."""
    parts, ids, entries, cumulative = [], [], [], 0.0
    async for delta in server.deltas(parsed, choice):
        if parsed.echo and not parts:  # the prompt (and its logprobs) first
            ids, entries = list(parsed.prompt_of(choice.index)), list(delta.prompt_logprobs)
        parts.append(delta.text)
        ids += delta.token_ids
        entries += delta.logprobs
        cumulative += sum(lp for lp, _ in delta.logprobs)
        if delta.finish is not None:
            text = (parsed.texts[choice.index // parsed.per] if parsed.echo else "") + "".join(parts)
            logprobs = None if parsed.logprobs is None else logprobs_body(server.tokenizer, entries, ids, parsed.chat)
            calls = tool_calls_of(text, parsed.tool_call) if parsed.tool_call and delta.finish == "stop" else None
            # OpenAI's finish: "stop" after the call it was told to make, "tool_calls" after calls it chose
            finish = delta.finish if calls is None or parsed.tool_call[0] == "function" else "tool_calls"
            return (choice_body(choice.index, text, finish, logprobs, parsed.chat, calls), delta.num_tokens,
                    cumulative)


def returned_choices(parsed, answers: list) -> list[dict]:
    """The choice bodies returned: with ``best_of`` above ``n``, each prompt's ``n`` sequences of the highest
    cumulative logprob (vLLM's ``best_of``), best first, indexed ``i * n + rank``; else all, in order."""
    if not parsed.best_of:
        return [body for body, _, _ in answers]
    chosen = []
    for i in range(len(parsed.prompts)):
        group = answers[i * parsed.per:(i + 1) * parsed.per]
        ranked = sorted(range(len(group)), key=lambda j: -group[j][2])[:parsed.n]
        chosen += [group[j][0] | {"index": i * parsed.n + rank} for rank, j in enumerate(ranked)]
    return chosen


async def _disconnected(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(server: Server, parsed, choices: list, rid: str, created: int):
    """The OpenAI chunk stream; leaving it early (the client went away) aborts the choices not finished."""
    done: set = set()
    try:
        async for event in _chunks(server, parsed, choices, rid, created, done):
            yield event
    except ApiError as e:  # the engine failed mid-stream: say so in the stream (the status is already sent)
        done.update(c.index for c in choices)
        yield sse(e.body())
        yield sse("[DONE]")
    except Exception as e:  # unexpected: one log line, and the stream still ends as OpenAI's do
        log.error("a stream failed unexpectedly: %s", one_line(e))
        yield sse(ApiError("the server failed on this request unexpectedly (its log says why)", status=500,
                           kind="server_error", code="internal_error").body())
        yield sse("[DONE]")
    finally:
        for choice in choices:
            if choice.index not in done:
                server.loop.abort(choice.request_id)


async def _chunks(server: Server, parsed, choices: list, rid: str, created: int, done: set):
    """The chunks of ``_sse``, the choices' deltas as they come; a choice's index joins ``done`` once it finished.
    A chat choice's first chunk (its role) goes with its first token, as vLLM's."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice):
        try:
            async for delta in server.deltas(parsed, choice):
                queue.put_nowait((choice, delta))
        except ApiError as e:
            queue.put_nowait((choice, e))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    chat, model, started = parsed.chat, server.model, set()
    held: dict[int, str] = {}  # with tool_choice: each choice's text, answered as calls once it is whole
    try:
        while len(done) < len(choices):
            choice, delta = await queue.get()
            if isinstance(delta, ApiError):
                raise delta
            running = usage(len(parsed.prompt_of(choice.index)), delta.num_tokens) \
                if parsed.continuous_usage and parsed.include_usage else None
            kw = dict(index=choice.index, include_usage=parsed.include_usage, running=running)
            text, logprobs = delta.text, None
            ids, entries = delta.token_ids, delta.logprobs
            if parsed.echo and choice.index not in started:  # the prompt (and its logprobs) first
                text = parsed.texts[choice.index // parsed.per] + text
                ids, entries = parsed.prompt_of(choice.index) + ids, delta.prompt_logprobs + entries
            if parsed.logprobs is not None and ids:
                logprobs = logprobs_body(server.tokenizer, entries, ids, chat, choice.offset)
                choice.offset += 0 if chat else sum(len(t) for t in logprobs["tokens"])
            if chat and choice.index not in started:
                yield sse(chunk_body(rid, model, created, True, role=True, **kw))
            started.add(choice.index)
            if parsed.tool_call is not None:
                held[choice.index] = held.get(choice.index, "") + text
                if delta.finish is None:
                    continue
                text = held.pop(choice.index)
                calls = tool_calls_of(text, parsed.tool_call) if delta.finish == "stop" else None
                if calls is not None:
                    yield sse(chunk_body(rid, model, created, True, tool_calls=calls, **kw))
                    finish = "stop" if parsed.tool_call[0] == "function" else "tool_calls"
                    yield sse(chunk_body(rid, model, created, True, finish=finish, **kw))
                    done.add(choice.index)
                    continue
            if chat and delta.finish is not None:  # the text, then the finish reason on an empty delta
                if text or logprobs:
                    yield sse(chunk_body(rid, model, created, True, text=text, logprobs=logprobs, **kw))
                text, logprobs = None, None
            yield sse(chunk_body(rid, model, created, chat, text=text, finish=delta.finish, logprobs=logprobs, **kw))
            if delta.finish is not None:
                done.add(choice.index)
        if parsed.include_usage:
            yield sse(chunk_body(rid, model, created, chat, use=usage(sum(len(p) for p in parsed.prompts),
                                                                      sum(c.tokens for c in choices))))
        yield sse("[DONE]")
    finally:
        for task in tasks:
            task.cancel()


# -- running ---------------------------------------------------------------------------------------------------

def bind(host: str, port: int) -> socket.socket:
    """The listening socket (``port`` 0: any free port); a one-line error when the address is taken."""
    from ppsplit.core.errors import ConfigError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}; pass another --port (0: any free "
                          "one) or --host") from None
    sock.listen(2048)  # connections made before uvicorn runs wait in the backlog
    return sock


def run(server: Server, sock: socket.socket, *, log_level: str = "warning") -> int:
    """Serve on ``sock`` until SIGTERM/SIGINT (then drain) or an engine failure; the exit code."""
    import uvicorn

    class Uvicorn(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal after a graceful shutdown; a drained server exits 0 instead.
            previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        def _on_signal(self, sig, frame):
            if not server.draining:
                log.info("%s: no new connections; finishing %d request(s) in flight",
                         signal.Signals(sig).name, server.loop.admitted)
            server.draining = True
            self.handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if server.loop.failed and not self.should_exit:
                self.should_exit = True
            return await super().on_tick(counter)

    config = uvicorn.Config(build_app(server), log_level=log_level, access_log=False, lifespan="off",
                            timeout_keep_alive=5)
    host, port = sock.getsockname()[:2]
    log.info("serving %s on http://%s:%d (OpenAI API: /v1/completions, /v1/chat/completions)", server.model,
             host, port)
    Uvicorn(config).run(sockets=[sock])
    server.pool.shutdown(wait=False, cancel_futures=True)
    server.loop.stop(timeout=1.0 if server.loop.failed else 10.0)
    if server.loop.failed:
        log.error("the server stopped because the engine failed: %s", server.loop.failed)
        return 1
    log.info("drained; exiting")
    return 0


def model_name(folder: str) -> str:
    return os.path.basename(os.path.normpath(folder))
