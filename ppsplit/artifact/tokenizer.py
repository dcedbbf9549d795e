"""Artifact: the tokenizer a compiled folder carries, read as data only.

``tokenizer.json`` goes to the ``tokenizers`` library (a Rust parser of the JSON); ``tokenizer_config.json``,
``special_tokens_map.json`` and ``generation_config.json`` are read as JSON; a chat template (``chat_template.jinja``,
``chat_template.json`` or the config's ``chat_template``) is rendered the way transformers renders it, in Jinja's
immutable sandbox. No Python file is ever imported from a folder and nothing asks for ``trust_remote_code``; the
serving path needs neither transformers nor sentencepiece.

Example::

    tok = FolderTokenizer("demo-pp4")
    ids = tok.encode("Hello")
    text = tok.decode(ids)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
"""
from __future__ import annotations

import json
import os
from datetime import datetime

from ppsplit.artifact.folder import read_json_object
from ppsplit.core.checked import FolderError
from ppsplit.core.errors import ConfigError

TOKENIZER = "tokenizer.json"


def has_tokenizer(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, TOKENIZER))


class FolderTokenizer:
    """A folder's tokenizer: ``encode``, ``decode``, the special tokens, the end-of-sequence ids and the chat
    template (see the module docstring)."""

    def __init__(self, folder: str):
        from tokenizers import Tokenizer

        path = os.path.join(folder, TOKENIZER)
        if not os.path.isfile(path):
            raise FolderError(f"{folder} has no {TOKENIZER}; pass token ids instead, or compile from a checkpoint "
                              "folder that has a (fast) tokenizer")
        try:
            self.backend = Tokenizer.from_file(path)
        except Exception as e:  # the library's own parse errors
            raise FolderError(f"{path} is not a tokenizer the tokenizers library reads ({str(e)[:120]})") from None
        config = read_json_object(os.path.join(folder, "tokenizer_config.json"), missing_ok=True)
        special = read_json_object(os.path.join(folder, "special_tokens_map.json"), missing_ok=True)
        self.tokens = {name: _content(config.get(name, special.get(name)))
                       for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.add_bos = bool(config.get("add_bos_token", False))
        self.chat_template = _chat_template(folder, config)
        generation = read_json_object(os.path.join(folder, "generation_config.json"), missing_ok=True)
        eos = generation.get("eos_token_id", self.token_id(self.tokens["eos_token"]))
        eos = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
        self.eos_token_ids = tuple(i for i in eos if isinstance(i, int) and not isinstance(i, bool))
        self.vocab_size = self.backend.get_vocab_size()

    def token_id(self, token: str | None) -> int | None:
        return self.backend.token_to_id(token) if token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.token_id(self.tokens["bos_token"])
        if add_special_tokens and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` under the folder's chat template (Jinja's immutable sandbox)."""
        if self.chat_template is None:
            raise FolderError("the folder's tokenizer has no chat template; send a completion prompt instead")
        import jinja2

        try:
            return _compiled(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                        **{k: v or "" for k, v in self.tokens.items()})
        except jinja2.exceptions.TemplateError as e:  # raise_exception() in the template, or a sandbox refusal
            raise ConfigError(f"the chat template refused these messages: {str(e)[:200]}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of ``messages`` under the chat template (no tokenizer specials added: the template writes
        its own)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

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


def _content(token) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(folder: str, config: dict) -> str | None:
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path) as f:
            return f.read()
    template = read_json_object(os.path.join(folder, "chat_template.json"), missing_ok=True).get("chat_template",
                                                                             config.get("chat_template"))
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


_TEMPLATES: dict = {}


def _compiled(source: str):
    """The template compiled as transformers compiles chat templates: an immutable sandbox, ``trim_blocks`` and
    ``lstrip_blocks``, and its helpers ``raise_exception``, ``tojson`` and ``strftime_now``."""
    if source not in _TEMPLATES:
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
            _TEMPLATES[source] = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise FolderError(f"the folder's chat template does not parse ({str(e)[:120]})") from None
    return _TEMPLATES[source]
