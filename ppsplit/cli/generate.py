"""``ppsplit generate`` and ``ppsplit check-drafter`` (imported lazily by ``ppsplit.cli``)."""
from __future__ import annotations

import argparse
import time


def add_parsers(sub) -> None:
    p = sub.add_parser("generate", help="decode from a compiled folder (speculatively when it holds a drafter)")
    p.add_argument("folder")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", default=None, help="comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--prompt", default=None, help="text, tokenized with the source model's tokenizer")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("-k", "--num-draft-tokens", type=int, default=4, help="drafts per verify pass")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: lossless speculative sampling")
    p.add_argument("--drafter", default=None, help="EAGLE-3 drafter folder (default: the one compiled into DIR)")
    p.add_argument("--drafter-convention", choices=("sglang", "vllm"), default="sglang")
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("check-drafter", help="first-draft agreement of an EAGLE-3 drafter under both tap numberings")
    p.add_argument("model", help="the target: 'demo', a checkpoint folder or a hub id")
    p.add_argument("drafter", help="EAGLE-3 drafter folder or hub id")
    p.add_argument("--prompts", type=int, default=4, help="number of sequences the target generates to score on")
    p.add_argument("--tokens", type=int, default=32, help="tokens the target generates per sequence")
    p.add_argument("--seed", type=int, default=0)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    import ppsplit
    from ppsplit.core.errors import ConfigError

    split = ppsplit.load(args.folder)
    if not split.plan.max_len:
        raise ConfigError(f"{args.folder} has no KV cache; compile it with --max-batch and --max-len to generate")
    drafter = ppsplit.load_drafter(args.drafter, split=split, aux_convention=args.drafter_convention) \
        if args.drafter else split.drafter
    tokenizer = None
    if args.prompt is not None:
        tokenizer = _tokenizer(args.folder)
        ids = torch.tensor([tokenizer.encode(args.prompt)])
    else:
        try:
            ids = torch.tensor([[int(x) for x in args.prompt_ids.split(",")]])
        except ValueError:
            raise ConfigError(f"--prompt-ids must be comma-separated integers, but got {args.prompt_ids!r}") from None
    if drafter is None and args.temperature:
        raise ConfigError("--temperature needs a drafter (speculative sampling); plain generate is greedy")
    start = time.perf_counter()
    if drafter is not None:
        out, stats = split.generate(ids, args.max_new_tokens, drafter=drafter, num_draft_tokens=args.num_draft_tokens,
                                    temperature=args.temperature,
                                    generator=torch.Generator().manual_seed(args.seed), return_stats=True)
    else:
        out, stats = split.generate(ids, args.max_new_tokens), None
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:].tolist()
    print(tokenizer.decode(new, skip_special_tokens=False) if tokenizer is not None else ",".join(map(str, new)))
    print(f"{len(new)} tokens in {seconds:.2f}s: {len(new) / seconds:.1f} tokens/s")
    if stats is not None:
        print(f"mean acceptance length {stats.mean_acceptance_length:.2f} ({stats.verify_passes} verify passes, "
              f"K={args.num_draft_tokens})")
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
    from ppsplit.eagle3.speculative import draft_agreement

    if args.model == DEMO_NAME:
        model = demo_model()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32).eval()
    num_layers = model.config.num_hidden_layers
    cfg, _ = read_drafter(resolve_drafter(args.drafter))
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
        agree, total = draft_agreement(split, drafter, sequences, start=seed_len)
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
