"""What structured output costs on the host for one tokenizer: building xgrammar's vocabulary (once per server), compiling
each kind of grammar (once per distinct grammar: cached), and filling one bitmask row (per grammar request and row of
each step), against the same tokenizer's vocabulary size.

    python bench/grammar_compile.py FOLDER_WITH_TOKENIZER_JSON [--vocab N] [--repeat 200]
"""
from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--vocab", type=int, default=None, help="the model's vocabulary (default: the tokenizer's)")
    p.add_argument("--repeat", type=int, default=200)
    args = p.parse_args()
    import xgrammar

    from ppsplit.serve.structured import Grammars

    with open(os.path.join(args.folder, "tokenizer.json")) as f:
        text = f.read()
    from tokenizers import Tokenizer

    vocab = args.vocab or Tokenizer.from_str(text).get_vocab_size()
    grammars = Grammars(text, vocab, [])
    start = time.perf_counter()
    grammars.compiler()
    print(f"vocabulary of {vocab} ids: {time.perf_counter() - start:.3f}s to build xgrammar's tokenizer info")
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
              "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                             "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
    large = {"type": "object", "properties": {f"field_{i:04d}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1}}}"}
                                              for i in range(900)}}
    cases = [("json", json.dumps(schema)), ("json_object", ""), ("regex", r"[A-Z][a-z]{2,8} [0-9]{2,4}"),
             ("choice", json.dumps(["red", "green", "blue"])), ("json", json.dumps(large))]
    print(f"{'grammar':<28} {'compile s':>10} {'cached s':>10} {'fill row us':>12}")
    for kind, source in cases:
        start = time.perf_counter()
        grammar = grammars.compile(kind, source)
        first = time.perf_counter() - start
        start = time.perf_counter()
        grammars.compile(kind, source)
        cached = time.perf_counter() - start
        matcher = xgrammar.GrammarMatcher(grammar.compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        start = time.perf_counter()
        for _ in range(args.repeat):
            matcher.fill_next_token_bitmask(bitmask)
        fill = (time.perf_counter() - start) / args.repeat
        name = f"{kind} ({len(source):,} chars)"
        print(f"{name:<28} {first:>10.4f} {cached:>10.6f} {fill * 1e6:>12.1f}")


if __name__ == "__main__":
    main()
