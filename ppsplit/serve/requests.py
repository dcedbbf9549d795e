"""Serving: the requests of a command line. ``ppsplit generate`` (one process) and ``ppsplit run`` (one process per
stage) take the same prompt and sampling options, read and checked here, and print their outputs the same way.

    --prompt TEXT (repeatable) --prompt-ids 1,2,3 (repeatable) --raw --max-new-tokens N --temperature T --top-p P
    --top-k K --seed S --stop-token-ids 2,7 --ignore-eos

Requests keep the command line's order, whichever option gave them. A ``--prompt`` is a user message under the
folder's chat template when it has one (as vLLM's ``chat``; ``--raw`` sends the text as is, as its ``complete``).
Errors name the flags typed, not the API fields behind them.
"""
from __future__ import annotations

import argparse
import os

from ppsplit.core.errors import ConfigError


PROGRESS_SECONDS = 10.0  # a progress line this often while a command generates

# The API field behind each request flag, for errors raised by the engine's checks.
FLAGS = {"max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
         "seed": "--seed", "stop_token_ids": "--stop-token-ids", "num_draft_tokens": "-k/--num-draft-tokens"}


class _InOrder(argparse.Action):
    """``--prompt`` / ``--prompt-ids``: each also appended to ``requests`` as ``(option, value)``, in typed order."""

    def __call__(self, parser, namespace, values, option_string=None):
        getattr(namespace, self.dest).append(values)
        namespace.requests = [*getattr(namespace, "requests", []), (self.dest, values)]


def add_request_arguments(p: argparse.ArgumentParser) -> None:
    p.set_defaults(requests=[])
    p.add_argument("--prompt", action=_InOrder, default=[], help="prompt text (needs a tokenizer in the folder), a "
                   "user message under the folder's chat template when it has one; repeat for several requests")
    p.add_argument("--prompt-ids", action=_InOrder, default=[], help="prompt token ids like 1,2,3, sent as they are; "
                   "repeatable, mixed with --prompt in the order given")
    p.add_argument("--raw", "--no-chat-template", dest="raw", action="store_true",
                   help="send --prompt text as it is, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per request at most (default: "
                                                                  "%(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample (with -k: lossless "
                                                                  "speculative sampling) (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens whose "
                   "probabilities reach P (default: %(default)s: all)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the K most likely tokens (default: %(default)s: "
                   "all)")
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed + i (default: %(default)s)")
    p.add_argument("--stop-token-ids", default=None, help="comma-separated ids that end a request (kept in it)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence ids")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=None,
                   help="EAGLE-3 speculative decoding with K drafts per verify pass (needs a drafter; default: none)")


def check_folder(folder: str) -> None:
    """A missing folder is named as missing, before anything asks it for a tokenizer or a plan."""
    if not os.path.exists(folder):
        raise ConfigError(f"{folder} does not exist; pass a folder written by ppsplit compile")
    if not os.path.isdir(folder):
        raise ConfigError(f"{folder} is not a folder; pass a folder written by ppsplit compile")


def with_flags(error: ConfigError) -> ConfigError:
    """``error`` with the API field it names replaced by the command-line flag the user typed."""
    message = str(error)
    for field, flag in FLAGS.items():
        if message.startswith(field + " ") or message.startswith(field + "="):
            return ConfigError(flag + message[len(field):])
    return error


def add_runtime_arguments(p: argparse.ArgumentParser, ranks: bool = False) -> None:
    """Where the stages run, and whether CUDA graphs are captured (``generate``, ``serve``, ``run``, ``collect``)."""
    if ranks:
        p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                       help="auto: a GPU per rank (NCCL) when the machine has one per stage, else the CPU (gloo); "
                            "cpu / cuda force either (default: %(default)s)")
    else:
        p.add_argument("--device", default="auto", help="auto: CUDA when the machine has a GPU, else the CPU; cpu; "
                       "cuda: all stages on the current GPU if they fit, else spread over the visible GPUs; or a list "
                       "cuda:0,cuda:1 (default: %(default)s)")
    p.add_argument("--enforce-eager", action="store_true", help="run the stages eagerly on CUDA instead of replaying "
                   "CUDA graphs captured for each token bucket (as vLLM's --enforce-eager)")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch's threads for the CPU's work, in each process "
                   "(default: OMP_NUM_THREADS when set, else 1: a decode step's small matmuls run fastest on one, and "
                   "far faster on a busy machine; more pays off for large models on many idle cores)")


def add_confidence_argument(p: argparse.ArgumentParser) -> None:
    """``--confidence-threshold`` (``generate``, ``serve``, ``run``): a DSpark drafter's window trimming."""
    p.add_argument("--confidence-threshold", type=float, default=None,
                   help="DSpark drafters: verify only the leading drafts whose predicted survival reaches this "
                        "(0 to 1; default 0: all)")


def check_confidence(args) -> None:
    """``--confidence-threshold`` fails before anything loads: it needs ``-k`` and a value from 0 to 1 (whether the
    drafter is DSpark is known once it loads)."""
    value = args.confidence_threshold
    if value is None:
        return
    if args.num_draft_tokens is None:
        raise ConfigError("--confidence-threshold trims a DSpark drafter's verify windows, and without -k no drafter "
                          "runs; pass -k K, or leave it out")
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"--confidence-threshold must be from 0 to 1 (0: verify every draft), but got {value}")


def apply_cpu_threads(args) -> None:
    """``--cpu-threads``, else ``OMP_NUM_THREADS``, else 1, for this process and (through ``OMP_NUM_THREADS``) the
    rank processes it starts. Measured here (SmolLM2-135M, one request, 2 cores with one busy): 8.2 tokens/s on one
    thread, 1.5 on two."""
    import torch

    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise ConfigError(f"--cpu-threads must be at least 1, but got {args.cpu_threads}")
    n = args.cpu_threads
    if n is None:
        given = os.environ.get("OMP_NUM_THREADS", "")
        n = int(given) if given.isdigit() and int(given) >= 1 else 1
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def check_requests(args, folder: str) -> None:
    """Fail fast, before any model loads: at least one prompt, ids that parse, a tokenizer for text, valid
    sampling options."""
    from ppsplit.artifact.tokenizer import has_tokenizer

    check_folder(folder)
    if not args.prompt and not args.prompt_ids:
        raise ConfigError("pass --prompt TEXT or --prompt-ids 1,2,3 (each may be given several times)")
    if args.prompt and not has_tokenizer(folder):
        raise ConfigError(f"{folder} has no tokenizer (tokenizer.json); pass --prompt-ids, or compile from a "
                          "checkpoint folder that has one")
    for text in args.prompt_ids:
        parse_ids(text, "--prompt-ids")
    sampling_params(args, 0)
    check_confidence(args)
    if args.num_draft_tokens is not None:
        from ppsplit.serve.speculative import check_num_draft_tokens

        try:
            check_num_draft_tokens(args.num_draft_tokens)
        except ConfigError as e:
            raise with_flags(e) from None


def parse_ids(text: str, option: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise ConfigError(f"{option} must be comma-separated token ids like 1,2,3, but got {text!r}")
    return ids


def sampling_params(args, index: int):
    """Request ``index``'s ``SamplingParams`` (its seed is ``--seed + index``)."""
    from ppsplit.serve.sampling import SamplingParams

    stop = parse_ids(args.stop_token_ids, "--stop-token-ids") if args.stop_token_ids else ()
    try:
        return SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed + index, stop_token_ids=tuple(stop),
                              ignore_eos=args.ignore_eos)
    except ConfigError as e:
        raise with_flags(e) from None


def prompts_of(args, folder: str):
    """``(prompts, tokenizer)`` in the command line's order: ``--prompt-ids`` as given, ``--prompt`` text as a user
    message under the folder's chat template (as it is with ``--raw``, or without a template). The tokenizer (the
    folder's, when it has one; else ``None``) also prints the outputs as text."""
    from ppsplit.artifact.tokenizer import FolderTokenizer, has_tokenizer

    tokenizer = FolderTokenizer(folder) if has_tokenizer(folder) else None
    prompts = []
    for option, value in args.requests:
        if option == "prompt_ids":
            prompts.append(parse_ids(value, "--prompt-ids"))
        elif tokenizer.chat_template is not None and not args.raw:
            prompts.append(tokenizer.encode_chat([{"role": "user", "content": value}]))
        else:
            prompts.append(tokenizer.encode(value))
    return prompts, tokenizer


def print_outputs(outputs, tokenizer, seconds: float, what: str) -> None:
    """Each request's text (ids without a tokenizer), prefixed ``[i]`` when there are several, then one line of
    throughput: ``N tokens in Ss: T tokens/s (what[, mean acceptance length A at K=k])``."""
    for i, out in enumerate(outputs):
        ids = out.token_ids
        shown = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer else ",".join(map(str, ids))
        print(shown if len(outputs) == 1 else f"[{i}] {shown}", flush=True)
    new = sum(len(o.token_ids) for o in outputs)
    passes = [a for o in outputs for a in o.accepted]
    spec = f", mean acceptance length {1 + sum(passes) / len(passes):.2f}" if passes else ""
    print(f"{new} tokens in {seconds:.2f}s: {new / max(seconds, 1e-9):.1f} tokens/s ({what}{spec})", flush=True)


def has_drafter(folder: str) -> bool:
    from ppsplit.artifact.folder import DRAFTER, MTP

    return any(os.path.isdir(os.path.join(folder, name)) for name in (DRAFTER, MTP))
