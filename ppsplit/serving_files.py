"""The files beside the weights that make a compiled folder a complete serving unit: tokenizer and generation
settings (end-of-sequence ids, chat template). Copied unchanged from the source checkpoint when present."""
from __future__ import annotations

import glob
import os
import shutil

SERVING_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "generation_config.json")
SERVING_GLOBS = ("chat_template*",)  # chat_template.jinja / .json, chat_templates/


def copy_serving_files(source: str, out: str) -> list[str]:
    """Copy the tokenizer files, chat templates and ``generation_config.json`` of checkpoint folder ``source``
    into ``out``; returns the names copied (none is an error: the demo model has no tokenizer).

    Example::

        copy_serving_files("Llama-3.1-8B", "llama-pp4")   # ['tokenizer.json', ..., 'generation_config.json']
    """
    names = [n for n in SERVING_FILES if os.path.isfile(os.path.join(source, n))]
    names += sorted(os.path.basename(p) for pattern in SERVING_GLOBS for p in glob.glob(os.path.join(source, pattern)))
    for name in names:
        src, dst = os.path.join(source, name), os.path.join(out, name)
        if os.path.isdir(src):
            shutil.copytree(src, dst)
        else:
            shutil.copyfile(src, dst)
    return names


def has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, n)) for n in ("tokenizer.json", "tokenizer.model", "vocab.json"))
