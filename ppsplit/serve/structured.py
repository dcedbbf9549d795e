"""Serving: structured output. A request's grammar (a JSON schema, any JSON object, a regular expression, one of a
list of strings, an EBNF grammar) is compiled by xgrammar for the model's vocabulary (``Grammars``, off the serving
thread, within a time budget, cached by its text); the request then holds a matcher (``Matcher``) that the scheduler
advances on every committed token and asks, per step, for the bitmask of the tokens allowed next (``fill_bitmask``).

The sampler masks the (adjusted) logits with that bitmask on the device, before temperature, top-k and top-p
(vLLM's order), so greedy, sampling and the rejection rule all use the masked distribution. In a verify window row
``j`` is masked as the grammar stands after the window's first ``j`` drafts (the matcher advanced over them, then
rolled back, as vLLM's ``StructuredOutputManager.grammar_bitmask``): a draft the grammar forbids has probability 0 and
is rejected, and speculative decoding stays lossless. A request whose grammar reaches its end finishes (``"stop"``).
A grammar request is scheduled again only once its last step's tokens are read (the mask needs them), so with async
scheduling it gives up the overlap of its own steps; other requests keep it.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from ppsplit.core.errors import ConfigError

log = logging.getLogger("ppsplit")

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SOURCE_CHARS = 64 * 1024  # a schema, regex or grammar's text (a choice list's joined strings) at most
MAX_CHOICES = 1024
COMPILE_SECONDS = 10.0  # what compiling one grammar may take before the request is refused
COMPILE_WORKERS = 2  # threads that compile (a compile that runs past its budget holds one until it ends)
CACHE_ENTRIES = 256


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar for a vocabulary of ``vocab_size`` ids: ``kind`` (one of ``KINDS``) and ``source`` (its
    text) say what it is; ``compiled`` is xgrammar's ``CompiledGrammar``."""

    kind: str
    source: str
    vocab_size: int
    compiled: object = field(compare=False, repr=False)

    def matcher(self) -> "Matcher":
        return Matcher(self)


class Matcher:
    """One request's place in its grammar (host state): ``advance`` on each committed token, ``fill`` the rows of a
    step's bitmask."""

    def __init__(self, grammar: Grammar):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(grammar.compiled)

    def advance(self, token: int) -> bool:
        """Take a committed token; whether the grammar has ended (the request finishes). A token the grammar refuses
        (it was masked, so only a bug gives one) ends it too, logged."""
        if self.matcher.is_terminated():
            return True
        if not self.matcher.accept_token(int(token)):
            log.warning("a committed token (%d) is outside the request's grammar; ending the request", token)
            return True
        return self.matcher.is_terminated()

    def fill(self, bitmask, row: int, drafts) -> None:
        """Rows ``row .. row + len(drafts)`` of ``bitmask`` (int32 ``[rows, words]``): row ``j`` allows what may follow
        the first ``j`` drafts. Past a draft the grammar refuses (it will be rejected), rows stay as they are."""
        advanced = 0
        for j in range(len(drafts) + 1):
            if self.matcher.is_terminated():
                break
            self.matcher.fill_next_token_bitmask(bitmask, row + j)
            if j == len(drafts) or not self.matcher.accept_token(int(drafts[j])):
                break
            advanced += 1
        if advanced:
            self.matcher.rollback(advanced)


def words(vocab_size: int) -> int:
    """int32 words of one bitmask row."""
    return (vocab_size + 31) // 32


def fill_bitmask(entries, k: int, vocab_size: int):
    """The step's bitmask, int32 ``[D, K + 1, words]`` over its drawing ``(request, work)`` entries in order (``-1``:
    every token allowed, for rows of requests without a grammar), or ``None`` when none has a grammar."""
    if not any(r.matcher is not None for r, _ in entries):
        return None
    import torch

    bitmask = torch.full((len(entries) * (k + 1), words(vocab_size)), -1, dtype=torch.int32)
    for d, (request, work) in enumerate(entries):
        if request.matcher is not None:
            drafts = work.tokens[len(work.tokens) - work.num_drafts:] if work.num_drafts else ()
            request.matcher.fill(bitmask, d * (k + 1), drafts)
    return bitmask.view(len(entries), k + 1, -1)


class Grammars:
    """Compiles grammars for one tokenizer and model vocabulary (``compile``), on threads of its own within
    ``seconds``, caching the last ``CACHE_ENTRIES`` by their text. ``tokenizer_json``: the text of ``tokenizer.json``
    (its vocabulary and how tokens map to bytes); ``stop_token_ids``: the ids that end a finished grammar."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids, *, seconds: float = COMPILE_SECONDS):
        self.tokenizer_json, self.vocab_size, self.seconds = tokenizer_json, vocab_size, seconds
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.workers = threading.Semaphore(COMPILE_WORKERS)
        self.lock = threading.Lock()
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._compiler = None

    @classmethod
    def available(cls) -> bool:
        import importlib.util

        return importlib.util.find_spec("xgrammar") is not None

    def compile(self, kind: str, source: str) -> Grammar:
        """The compiled grammar, or a ``ConfigError`` in one line: text too long, not a valid ``kind``, or compiling
        past the time budget. ``kind`` ``"choice"``: ``source`` is a JSON list of strings."""
        if kind not in KINDS:
            raise ConfigError(f"grammar kind must be one of {', '.join(KINDS)}, but got {kind!r}")
        if len(source) > MAX_SOURCE_CHARS:
            raise ConfigError(f"the {kind} has {len(source):,} characters, more than {MAX_SOURCE_CHARS:,}; send a "
                              "shorter one")
        key = (kind, source)
        with self.lock:
            future = self.cache.get(key)
            if future is None:
                future = self.cache[key] = self._start(kind, source)
                while len(self.cache) > CACHE_ENTRIES:
                    self.cache.popitem(last=False)
            else:
                self.cache.move_to_end(key)
        try:
            return future.result(timeout=self.seconds)
        except FutureTimeout:
            raise ConfigError(f"compiling the {kind} took longer than {self.seconds:g}s; send a simpler one") from None
        except ConfigError:
            with self.lock:
                if self.cache.get(key) is future:  # an error is cheap to find again; keep the cache for grammars
                    del self.cache[key]
            raise

    def _start(self, kind: str, source: str) -> Future:
        """Compile on a thread of its own, ``COMPILE_WORKERS`` at a time. Not a daemon: the process waits for a compile
        at exit (a native compile stopped by the interpreter's shutdown aborts the process)."""
        future: Future = Future()

        def work():
            with self.workers:
                try:
                    future.set_result(self._compile(kind, source))
                except BaseException as e:  # noqa: BLE001 (handed to the waiting request)
                    future.set_exception(e)

        threading.Thread(target=work, name="ppsplit-grammar").start()
        return future

    def _compile(self, kind: str, source: str) -> Grammar:
        import json

        compiler = self.compiler()
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(source, any_whitespace=False)
            elif kind == "json_object":
                # OpenAI's json_object is an object (xgrammar's built-in JSON grammar takes any value)
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(source)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(json.loads(source)))
            else:
                compiled = compiler.compile_grammar(source)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors name where the text went wrong
            raise ConfigError(f"the {kind} is not valid: {_reason(e)}") from None
        return Grammar(kind, source, self.vocab_size, compiled)

    def compiler(self):
        """xgrammar's compiler for this vocabulary, built once (at the first grammar: it reads the vocabulary)."""
        with self.lock:
            if self._compiler is None:
                import xgrammar

                self._compiler = xgrammar.GrammarCompiler(self._info(xgrammar), max_threads=1)
            return self._compiler

    def _info(self, xgrammar):
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(self.tokenizer_json)
        vocab = [""] * self.vocab_size  # an id the tokenizer lacks is an empty token, which no grammar allows
        for token, i in backend.get_vocab(with_added_tokens=True).items():
            if 0 <= i < self.vocab_size:
                vocab[i] = token
        for i, added in backend.get_added_tokens_decoder().items():
            if added.special and 0 <= i < self.vocab_size:
                vocab[i] = ""  # a special token is no text: never inside a grammar's output (xgrammar skips it)
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(self.tokenizer_json)
        return xgrammar.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=self.vocab_size,
                                      stop_token_ids=self.stop_token_ids, add_prefix_space=meta["add_prefix_space"])



def choice_grammar(choices) -> str:
    """EBNF for exactly one of ``choices`` (strings), as vLLM's ``guided_choice``."""
    if not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES \
            or not all(isinstance(c, str) and c for c in choices):
        raise ConfigError(f"a choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _reason(error: BaseException) -> str:
    """The library's message without its source location (``[time] file.cc:line: Check failed: ... is false:``)."""
    import re

    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", lines[0] if lines else type(error).__name__)
    return re.sub(r"^Check failed: .*? is false: ", "", text)[:200]
