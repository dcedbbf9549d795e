"""Artifact: a folder's chat template and tokenizer, run on request text in child processes under a budget.

A chat template is a program (Jinja compiles it to Python) and a tokenizer's regexes can backtrack: the folder
decides what they do, the text decides what they do it to. Jinja's sandbox bounds what a template may touch, not how
long it runs or how much it allocates, and a tokenizer that hits its regex engine's limit panics. So both run in
child processes (``python -m ppsplit.artifact.sandbox``, which imports jinja2 and tokenizers only), each with an
address-space limit; a call has a time limit and a rendered prompt a length limit (``Budget``). A call past its
budget kills its child (the next call starts a fresh one) and raises ``BudgetError``; the calling thread only waits
on a pipe, so signals, other threads and an event loop go on meanwhile.

Messages are length-prefixed JSON both ways, never pickle: the child runs what the folder wrote.
"""
from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass

from ppsplit.core.errors import ConfigError

_HEADER = struct.Struct(">I")
_START_S = 120.0  # a child's start (imports, parsing tokenizer.json) is not part of a call's budget


@dataclass(frozen=True)
class Budget:
    """What one call into a folder's template or tokenizer may take: ``seconds`` of wall time (rendering and
    tokenising together), ``max_chars`` characters of rendered prompt, ``max_memory`` bytes of address space per
    child process, and ``workers`` child processes at most (calls in parallel)."""

    seconds: float = 10.0
    max_chars: int = 16 << 20
    max_memory: int = 4 << 30
    workers: int = 2

    def __post_init__(self):
        for name in ("seconds", "max_chars", "max_memory", "workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"Budget.{name} must be a positive number, but got {value!r}")


class BudgetError(ConfigError):
    """A chat template or tokenizer call failed on its input: it raised, ran past its time, its output or memory
    limit, or its process died."""


class Sandbox:
    """Child processes that hold one tokenizer (``tokenizer.json`` text) and chat template (Jinja source or
    ``None``); ``call(op, **args)`` runs ``op`` in an idle one (``"encode"``, ``"render"``, ``"encode_chat"``).

    Example::

        box = Sandbox({"tokenizer": text, "template": source, "specials": {...}, "add_bos": True}, Budget())
        ids = box.call("encode_chat", messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    """

    def __init__(self, setup: dict, budget: Budget):
        self.setup = dict(setup, max_chars=budget.max_chars)
        self.budget = budget
        self._idle: list[_Child] = []
        self._count = 0
        self._lock = threading.Condition()
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_all, self._idle)

    def call(self, op: str, **args):
        child = self._take()
        try:
            result = child.ask({"op": op, **args}, self.budget.seconds)
        except BaseException:
            child.kill()
            self._release(None)
            raise
        self._release(child)
        if "error" in result:
            raise BudgetError(result["error"])
        return result["ok"]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle[:] = list(self._idle), []
        for child in idle:
            child.stop()

    def _take(self) -> "_Child":
        with self._lock:
            while not self._idle and self._count >= self.budget.workers:
                self._lock.wait()
            if self._idle:
                return self._idle.pop()
            self._count += 1
        try:
            return _Child(self.setup, self.budget)
        except BaseException:
            self._release(None)
            raise

    def _release(self, child: "_Child | None") -> None:
        with self._lock:
            if child is None or self._closed:
                self._count -= 1
            else:
                self._idle.append(child)
            self._lock.notify()
        if child is not None and self._closed:
            child.stop()


def _close_all(idle: list) -> None:
    for child in list(idle):
        child.stop()


class _Child:
    """One child process and its pipes."""

    def __init__(self, setup: dict, budget: Budget):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above ppsplit/
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1", OMP_NUM_THREADS="1",
                   MALLOC_ARENA_MAX="2", RUST_BACKTRACE="0", PPSPLIT_SANDBOX_MEMORY=str(int(budget.max_memory)))
        # This very ppsplit, whatever the working folder holds; stderr goes nowhere (a panicking tokenizer writes
        # there, and the parent reports every failure itself).
        boot = f"import sys; sys.path.insert(0, {root!r}); from ppsplit.artifact.sandbox import main; main()"
        self.proc = subprocess.Popen([sys.executable, "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, close_fds=True)
        self.ready = select.poll()  # not select(): a server's descriptors pass FD_SETSIZE
        self.ready.register(self.proc.stdout.fileno(), select.POLLIN)
        try:
            ready = self.ask(setup, _START_S, what="starting the tokenizer process")
        except BaseException:
            self.kill()
            raise
        if "error" in ready:
            self.kill()
            raise BudgetError(ready["error"])

    def ask(self, message: dict, seconds: float, what: str | None = None) -> dict:
        what = what or {"render": "rendering the chat template", "encode": "tokenising the text",
                        "encode_chat": "rendering and tokenising the chat"}.get(message.get("op"), "the call")
        deadline = time.monotonic() + seconds
        data = json.dumps(message).encode()
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
            size = _HEADER.unpack(self._read(_HEADER.size, deadline, what, seconds))[0]
            return json.loads(self._read(size, deadline, what, seconds))
        except (BrokenPipeError, ConnectionError, OSError):
            raise BudgetError(f"{what} failed: the tokenizer process died ({self._death()})") from None

    def _read(self, n: int, deadline: float, what: str, seconds: float) -> bytes:
        out, fd = bytearray(), self.proc.stdout.fileno()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not self.ready.poll(max(1, int(left * 1000))):
                raise BudgetError(f"{what} took longer than {seconds:g} s, its time limit; it was stopped")
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise BudgetError(f"{what} failed: the tokenizer process died ({self._death()})")
            out += chunk
        return bytes(out)

    def _death(self) -> str:
        try:
            code = self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            return "it stopped answering"
        if code < 0:
            return f"killed by signal {-code}, likely over its memory limit"
        return f"exit code {code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    def stop(self) -> None:
        """End the child: it exits when its input closes."""
        try:
            self.proc.stdin.close()
            self.proc.wait(2.0)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


# -- the child -----------------------------------------------------------------------------------------------------

def _frame(stream) -> dict | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    return json.loads(stream.read(_HEADER.unpack(header)[0]))


def _send(stream, message: dict) -> None:
    data = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


class _Folder:
    """The child's tokenizer and template (the template compiled at its first render)."""

    def __init__(self, setup: dict):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(setup["tokenizer"])
        self.source, self.template = setup.get("template"), None
        self.specials = {k: v or "" for k, v in setup.get("specials", {}).items()}
        self.bos = setup.get("specials", {}).get("bos_token")
        self.bos_id = self.tokenizer.token_to_id(self.bos) if self.bos else None
        self.add_bos = bool(setup.get("add_bos"))
        self.max_chars = int(setup["max_chars"])

    def run(self, message: dict):
        op = message["op"]
        if op == "encode":
            return self.encode(message["text"], message.get("add_special_tokens", True))
        if op == "render":
            return self.render(message["messages"], message.get("add_generation_prompt", True), message.get("tools"))
        if op == "encode_chat":
            return self.encode(self.render(message["messages"], message.get("add_generation_prompt", True),
                                           message.get("tools")), False)
        raise _Refused(f"unknown operation {op!r}")

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as e:
            raise _Refused(_explain(e, "the tokenizer")) from None
        except BaseException as e:  # a panic: the regex engine's backtracking limit, for one
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise _Refused(_explain(e, "the tokenizer")) from None
        if add_special_tokens and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def render(self, messages: list, add_generation_prompt: bool, tools: list | None = None) -> str:
        if self.template is None:
            self.template = _compile(self.source)
        parts, size = [], 0
        try:
            extra = {} if tools is None else {"tools": tools}  # as transformers hands a template the tools
            for piece in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **extra, **self.specials):
                size += len(piece)
                if size > self.max_chars:
                    raise _Refused(f"the chat template's output passed {self.max_chars:,} characters, its limit; it "
                                   "was stopped")
                parts.append(piece)
        except _Refused:
            raise
        except Exception as e:
            raise _Refused(_explain(e, "the chat template")) from None
        return "".join(parts)


class _Refused(Exception):
    """A refusal whose message is already what the caller should read."""


def _compile(source: str):
    """The template compiled as transformers compiles chat templates: an immutable sandbox, ``trim_blocks`` and
    ``lstrip_blocks``, and its helpers ``raise_exception``, ``tojson`` and ``strftime_now``."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise _Refused(f"the folder's chat template does not parse ({_line(e)})") from None
    except RecursionError:
        raise _Refused("the folder's chat template does not parse (nested too deeply)") from None


def _line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


def _explain(error: BaseException, who: str) -> str:
    import jinja2

    if isinstance(error, jinja2.exceptions.SecurityError):
        return f"{who} tried something its sandbox forbids ({_line(error)})"
    if isinstance(error, jinja2.exceptions.TemplateError):  # raise_exception() in the template, or a bad filter
        return f"{who} refused these messages: {str(error)[:200]}"
    if isinstance(error, MemoryError):
        return f"{who} ran out of memory (its process's limit)"
    if isinstance(error, RecursionError):
        return f"{who} recursed too deeply"
    return f"{who} failed on this input ({_line(error)})"


def _limit_memory() -> None:
    limit = int(os.environ.get("PPSPLIT_SANDBOX_MEMORY", "0"))
    if limit:
        import resource

        try:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ValueError, OSError):  # a lower hard limit already holds
            pass


def _watch_parent() -> None:
    """Exit when the parent is gone, even in the middle of a long render (a closed pipe is seen only between
    calls)."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    import signal

    # Ctrl-C or SIGTERM to the process group is the parent's to handle (it drains): a child ends when its input
    # closes, or its parent is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _limit_memory()
    _watch_parent()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the protocol
    setup = _frame(stdin)
    if setup is None:
        return
    try:
        folder = _Folder(setup)
    except BaseException as e:  # tokenizers panics are BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        _send(stdout, {"error": f"the folder's tokenizer.json cannot be loaded ({_line(e)})"})
        return
    _send(stdout, {"ok": None})
    while (message := _frame(stdin)) is not None:
        try:
            reply = {"ok": folder.run(message)}
        except _Refused as e:
            reply = {"error": str(e)}
        except MemoryError:
            reply = {"error": "the chat template or tokenizer ran out of memory (its process's limit)"}
        except Exception as e:  # jinja2 missing, a malformed message: this call fails, the process goes on
            reply = {"error": f"the tokenizer process failed ({_line(e)})"}
        _send(stdout, reply)


if __name__ == "__main__":
    main()
