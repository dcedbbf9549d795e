"""``ppsplit generate``, ``ppsplit save-drafter`` and ``ppsplit check-drafter`` (imported lazily by ``ppsplit.cli``)."""
from __future__ import annotations

import argparse
import time


def add_parsers(sub) -> None:
    from ppsplit.serve.requests import add_confidence_argument, add_request_arguments, add_runtime_arguments

    p = sub.add_parser("generate", help="decode requests through a compiled folder in this process (the engine: "
                                        "continuous batching; speculatively with -k)")
    p.add_argument("folder", help="a folder written by ppsplit compile")
    add_request_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--drafter", default=None, help="a drafter folder: EAGLE-3, DFlash, DFlash2, DSpark or speculators' "
                   "mtp (default: the one compiled into DIR)")
    p.add_argument("--drafter-convention", choices=("sglang", "vllm"), default=None,
                   help="numbering of the drafter's tap ids (default: its format's own)")
    add_confidence_argument(p)

    p = sub.add_parser("save-drafter", help="write the drafter (EAGLE-3, DFlash, or an MTP layer) of a compiled folder "
                                            "as a checkpoint vLLM (speculators format) or SGLang (SpecForge format) "
                                            "loads")
    p.add_argument("folder", help="a folder compiled with --drafter or --mtp")
    p.add_argument("--format", choices=("speculators", "specforge"), default="speculators",
                   help="speculators: vLLM's format; specforge: SGLang's (default: %(default)s)")
    p.add_argument("--verifier", default=None, help="the target's hub id or folder (recorded by the speculators "
                   "format; required for an MTP layer, whose config is the target's)")
    p.add_argument("-o", "--out", required=True, help="the drafter checkpoint folder to write")

    p = sub.add_parser("check-drafter",
                       help="first-draft agreement of an EAGLE-3 or DFlash drafter under both tap numberings (an MTP "
                            "layer in speculators' mtp layout: under its one numbering)")
    p.add_argument("model", help="the target: 'demo', a checkpoint folder or a hub id")
    p.add_argument("drafter", help="EAGLE-3 drafter folder or hub id")
    p.add_argument("--prompts", type=int, default=4, help="number of sequences the target generates to score on")
    p.add_argument("--tokens", type=int, default=32, help="tokens the target generates per sequence")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)")


def cmd_generate(args: argparse.Namespace) -> int:
    import ppsplit
    from ppsplit.artifact.folder import CompiledFolder
    from ppsplit.core.errors import ConfigError
    from ppsplit.serve.engine import Engine
    from ppsplit.serve.placement import load_placed
    from ppsplit.serve.requests import (PROGRESS_SECONDS, apply_cpu_threads, check_requests, print_outputs,
                                        prompts_of, sampling_params)

    check_requests(args, args.folder)
    apply_cpu_threads(args)
    plan = CompiledFolder(args.folder).plan
    if not plan.paged:
        why = plan.lockstep_reason or "it has no KV cache (compiled with --no-cache); compile it without --no-cache"
        raise ConfigError(f"{args.folder} cannot generate: the engine needs a paged KV cache, and {why}")
    split = load_placed(args.folder, args.device)
    drafter = None
    if args.num_draft_tokens is not None:
        drafter = ppsplit.load_drafter(args.drafter, split=split, aux_convention=args.drafter_convention) \
            if args.drafter else split.drafter
        if drafter is None:
            raise ConfigError(f"{args.folder} holds no drafter: compile it with --drafter or --mtp, or pass "
                              "--drafter DIR")
    if args.confidence_threshold is not None:
        from ppsplit.eagle3.dspark import set_confidence_threshold

        set_confidence_threshold(drafter, args.confidence_threshold)
    prompts, tokenizer = prompts_of(args, args.folder)
    params = [sampling_params(args, i) for i in range(len(prompts))]
    engine = Engine(split, drafter=drafter, num_draft_tokens=args.num_draft_tokens or 0,
                    enforce_eager=args.enforce_eager)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, progress=PROGRESS_SECONDS)
    print_outputs(outputs, tokenizer, time.perf_counter() - start, "1 process")
    return 0


def _tokenizer(folder: str):
    from ppsplit.artifact.tokenizer import FolderTokenizer

    return FolderTokenizer(folder)


def cmd_check_drafter(args: argparse.Namespace) -> int:
    import torch

    import ppsplit
    from ppsplit.compile.demo import DEMO_NAME, demo_model
    from ppsplit.eagle3.formats import drafter_taps, read_drafter, resolve_drafter
    from ppsplit.core.errors import ConfigError
    from ppsplit.compile.source import resolve_model
    from ppsplit.eagle3.dflash import block_agreement
    from ppsplit.eagle3.drafter import draft_agreement

    if args.model == DEMO_NAME:
        model = demo_model()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32).eval()
    num_layers = model.config.num_hidden_layers
    folder = resolve_drafter(args.drafter)
    if _speculators_mtp(folder):
        return _check_mtp_drafter(args, model)
    cfg, _ = read_drafter(folder)
    taps = {}
    for convention in ("sglang", "vllm"):
        try:
            taps[convention] = drafter_taps(cfg, num_layers, convention)
        except ConfigError as e:
            print(f"{convention:>7}: not applicable ({e})")
    if not taps:
        raise ConfigError(f"the drafter's tap ids fit this {num_layers}-layer target under no numbering")
    seed_len = 4
    cache = ppsplit.CacheConfig(batch_size=args.prompts, max_len=seed_len + args.tokens + 1)
    split = ppsplit.split_model(model, 1, sorted(set().union(*taps.values())), cache=cache, fuse=False)
    gen = torch.Generator().manual_seed(args.seed)
    seeds = torch.randint(0, model.config.vocab_size, (args.prompts, seed_len), generator=gen)
    sequences = split.generate(seeds, args.tokens)  # scored on the target's own continuations
    scores = {}
    for convention in taps:
        drafter = ppsplit.load_drafter(args.drafter, split=split, aux_convention=convention)
        score = block_agreement if getattr(drafter, "family", None) in ("dflash", "dspark", "dflash2") \
            else draft_agreement
        agree, total = score(split, drafter, sequences, start=seed_len)
        scores[convention] = agree / max(1, total)
        print(f"{convention:>7}: taps {','.join(map(str, taps[convention]))}  first-draft agreement "
              f"{scores[convention]:.3f} ({agree}/{total})")
    best = max(scores, key=scores.get)
    others = ", ".join(f"{scores[c]:.3f} under {c}" for c in scores if c != best)
    if scores[best] < 0.2:
        print(f"neither numbering fits: best {scores[best]:.3f} under {best}; is the drafter trained for this target?")
    else:
        versus = f" vs {others}" if others else ""
        print(f"fits: {best} (--drafter-convention {best}); agreement {scores[best]:.3f}{versus}")
    return 0


def _speculators_mtp(folder: str) -> bool:
    import json
    import os

    from ppsplit.compile.mtp import is_speculators_mtp

    try:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False  # read_drafter says what is wrong
    return isinstance(cfg, dict) and is_speculators_mtp(cfg)


def _check_mtp_drafter(args: argparse.Namespace, model) -> int:
    """An MTP layer reads tap L under any numbering: one agreement, on the target's own continuations."""
    import torch

    import ppsplit
    from ppsplit.eagle3.drafter import mtp_agreement

    seed_len, layers = 4, model.config.num_hidden_layers
    cache = ppsplit.CacheConfig(batch_size=args.prompts, max_len=seed_len + args.tokens + 1)
    split = ppsplit.split_model(model, 1, [layers], cache=cache, fuse=False)
    gen = torch.Generator().manual_seed(args.seed)
    seeds = torch.randint(0, model.config.vocab_size, (args.prompts, seed_len), generator=gen)
    sequences = split.generate(seeds, args.tokens)
    drafter = ppsplit.load_drafter(args.drafter, split=split)
    agree, total = mtp_agreement(split, drafter, sequences, start=seed_len)
    score = agree / max(1, total)
    print(f"    mtp: tap {layers} (the last layer's output, any numbering)  first-draft agreement {score:.3f} "
          f"({agree}/{total})")
    if score < 0.2:
        print(f"low agreement ({score:.3f}): is the MTP layer trained for this target?")
    return 0


def cmd_save_drafter(args: argparse.Namespace) -> int:
    import ppsplit
    from ppsplit.core.errors import ConfigError

    from ppsplit.artifact.folder import CompiledFolder

    if CompiledFolder(args.folder).mtp is not None:
        from ppsplit.compile.mtp import save_speculators_mtp

        if args.format != "speculators" or args.verifier is None:
            raise ConfigError(f"{args.folder}'s drafter is the target's own MTP layer: save it with --format "
                              "speculators --verifier TARGET (the target's checkpoint, whose config speculators' mtp "
                              "layout records and whose embedding and head it reads)")
        save_speculators_mtp(args.folder, args.out, args.verifier)
        print(f"wrote the MTP layer to {args.out} (speculators mtp format, verifier {args.verifier})")
        return 0
    split = ppsplit.load(args.folder)
    if split.drafter is None:
        raise ConfigError(f"{args.folder} holds no drafter: compile it with --drafter or --mtp")
    split.drafter.save(args.out, format=args.format, verifier=args.verifier)
    print(f"wrote the drafter to {args.out} ({args.format} format, taps {','.join(map(str, split.drafter.taps))})")
    return 0
