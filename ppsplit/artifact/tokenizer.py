"""Artifact: the tokenizer a compiled folder carries, read as data only.

``tokenizer.json`` goes to the ``tokenizers`` library (a Rust parser of the JSON); ``tokenizer_config.json``,
``special_tokens_map.json`` and ``generation_config.json`` are read as JSON; a chat template (``chat_template.jinja``,
``chat_template.json`` or the config's ``chat_template``) is rendered the way transformers renders it, in Jinja's
immutable sandbox. No Python file is ever imported from a folder and nothing asks for ``trust_remote_code``; the
serving path needs neither transformers nor sentencepiece. Every file is a regular file inside the folder
(``ppsplit.artifact.folder.read_file``). Rendering and encoding run in child processes under a ``Budget`` (time,
output length, memory: ``ppsplit.artifact.sandbox``); decoding runs here.

Example::

    tok = FolderTokenizer("demo-pp4")
    ids = tok.encode("Hello")
    text = tok.decode(ids)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
"""
from __future__ import annotations

import os

from ppsplit.artifact.folder import MAX_JSON_BYTES, read_file, read_json_object
from ppsplit.artifact.sandbox import Budget, BudgetError, Sandbox
from ppsplit.core.checked import FolderError
from ppsplit.core.errors import ConfigError

TOKENIZER = "tokenizer.json"
MAX_TEMPLATE_BYTES = 1 << 20  # chat templates are kilobytes; a larger one is refused before it is compiled
# What ``check_tokenizer`` (``ppsplit inspect``, ``ppsplit serve`` at start) renders: one user turn, which every chat
# template must take.
SAMPLE_CONVERSATION = ({"role": "user", "content": "Hello! What is a pipeline?"},)


def has_tokenizer(folder: str) -> bool:
    return os.path.lexists(os.path.join(folder, TOKENIZER))


class FolderTokenizer:
    """A folder's tokenizer: ``encode``, ``decode``, the special tokens, the end-of-sequence ids and the chat
    template (see the module docstring). ``budget``: what one render or encode may take (``Budget``'s defaults)."""

    def __init__(self, folder: str, budget: Budget | None = None):
        from tokenizers import Tokenizer

        self.folder = folder
        path = os.path.join(folder, TOKENIZER)
        if not os.path.lexists(path):
            raise FolderError(f"{folder} has no {TOKENIZER}; pass token ids instead, or compile from a checkpoint "
                              "folder that has a (fast) tokenizer")
        text = read_file(path, MAX_JSON_BYTES, folder).decode("utf-8", errors="replace")
        try:
            self.backend = Tokenizer.from_str(text)
        except BaseException as e:  # the library's parse errors, and its panics (BaseException)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise FolderError(f"{path} is not a tokenizer the tokenizers library reads ({str(e)[:120]})") from None
        config = read_json_object(os.path.join(folder, "tokenizer_config.json"), missing_ok=True, root=folder)
        special = read_json_object(os.path.join(folder, "special_tokens_map.json"), missing_ok=True, root=folder)
        self.tokens = {name: _content(config.get(name, special.get(name)))
                       for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.add_bos = bool(config.get("add_bos_token", False))
        self.chat_template = _chat_template(folder, config)
        generation = read_json_object(os.path.join(folder, "generation_config.json"), missing_ok=True, root=folder)
        eos = generation.get("eos_token_id", self.token_id(self.tokens["eos_token"]))
        eos = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
        self.eos_token_ids = tuple(i for i in eos if isinstance(i, int) and not isinstance(i, bool))
        self.vocab_size = self.backend.get_vocab_size()
        self.budget = budget or Budget()
        # The child processes that render and encode (each started at the first call that needs it).
        self.sandbox = Sandbox({"tokenizer": text, "template": self.chat_template, "specials": self.tokens,
                                "add_bos": self.add_bos}, self.budget)

    def close(self) -> None:
        """End the child processes now (they also end when this object is collected, or the process exits)."""
        self.sandbox.close()

    def token_id(self, token: str | None) -> int | None:
        return self.backend.token_to_id(token) if token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.sandbox.call("encode", text=text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        try:
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except BaseException as e:  # a decoder's regex panics (BaseException)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise ConfigError(f"the folder's tokenizer cannot decode these tokens ({str(e)[:120]})") from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The prompt text of ``messages`` under the folder's chat template (Jinja's immutable sandbox, within the
        budget); a template that raises or runs past its budget is a ``BudgetError`` (a ``ConfigError``). ``tools``:
        OpenAI's tool definitions, which the template reads as ``tools`` (as transformers passes them)."""
        self._need_template()
        return self.sandbox.call("render", messages=list(messages), add_generation_prompt=add_generation_prompt,
                                 tools=tools)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """The token ids of ``messages`` (and ``tools``) under the chat template (no tokenizer specials added: the
        template writes its own); one call into the sandbox."""
        self._need_template()
        return self.sandbox.call("encode_chat", messages=list(messages), add_generation_prompt=add_generation_prompt,
                                 tools=tools)

    def encode_reply(self, messages: list[dict], reply: str) -> tuple[list[int], list[int]]:
        """``(prompt ids, reply ids)`` of ``messages`` answered by the assistant with ``reply``: the prompt as
        ``encode_chat`` gives it, then the rest of the rendered conversation (the reply and whatever the template
        closes its turn with), tokenised on its own, as a model generating the reply would have produced it."""
        prompt = self.apply_chat_template(messages, add_generation_prompt=True)
        full = self.apply_chat_template(messages + [{"role": "assistant", "content": reply}],
                                        add_generation_prompt=False)
        if not full.startswith(prompt):
            raise ConfigError("the chat template renders the reply so that the conversation does not continue the "
                              "prompt (it rewrites earlier turns); pass token ids instead")
        return self.encode(prompt, add_special_tokens=False), self.encode(full[len(prompt):], add_special_tokens=False)

    def check(self) -> str:
        """Tokenise a sample text and, if there is a chat template, render and tokenise ``SAMPLE_CONVERSATION``
        within the budget, as serving would (``ppsplit inspect``, ``ppsplit serve`` at start): one line saying what
        was checked, or one ``FolderError``."""
        try:
            self.encode("Hello world")
            line = f"tokenizer: {self.vocab_size:,} tokens, end-of-sequence ids {list(self.eos_token_ids)}"
            if self.chat_template is None:
                return line + "; no chat template"
            prompt = self.encode_chat(list(SAMPLE_CONVERSATION), add_generation_prompt=True)
        except BudgetError as e:
            raise FolderError(f"{self.folder}: {e}; fix or remove the folder's chat template / tokenizer.json") from None
        return line + (f"; the chat template renders a one-turn sample to {len(prompt)} tokens (budget: "
                       f"{self.budget.seconds:g} s, {self.budget.max_chars:,} characters)")

    def _need_template(self) -> None:
        if self.chat_template is None:
            raise FolderError("the folder's tokenizer has no chat template; send a completion prompt instead")


def check_tokenizer(folder: str, budget: Budget | None = None) -> str:
    """``FolderTokenizer(folder, budget).check()``, its processes ended afterwards."""
    tok = FolderTokenizer(folder, budget)
    try:
        return tok.check()
    finally:
        tok.close()


def _content(token) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(folder: str, config: dict) -> str | None:
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.lexists(path):
        return read_file(path, MAX_TEMPLATE_BYTES, folder).decode("utf-8", errors="replace")
    template = read_json_object(os.path.join(folder, "chat_template.json"), missing_ok=True,
                                root=folder).get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if isinstance(template, str) and len(template) > MAX_TEMPLATE_BYTES:
        raise FolderError(f"{folder}'s chat template holds {len(template):,} characters, more than the "
                          f"{MAX_TEMPLATE_BYTES:,} ppsplit compiles; it is not a chat template: compile the folder again")
    return template if isinstance(template, str) else None
