"""``ppsplit serve`` (imported lazily by ``ppsplit.cli``): the OpenAI HTTP API over a compiled folder."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a compiled folder over the OpenAI HTTP API (/v1/completions, "
                                     "/v1/chat/completions; needs ppsplit[serve])")
    p.add_argument("folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the log line says which)")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=None,
                   help="EAGLE-3 speculative decoding with K drafts per verify pass (the folder's drafter)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences in flight (default: the cache's slots)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one engine step")
    p.add_argument("--max-queue", type=int, default=256,
                   help="unfinished requests admitted at most; more are answered 503 at once")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: DIR's name)")


def cmd_serve(args: argparse.Namespace) -> int:
    import ppsplit
    from ppsplit.core.errors import ConfigError

    _require_serve_dependencies()
    from ppsplit.artifact.tokenizer import FolderTokenizer, has_tokenizer
    from ppsplit.serve.loop import EngineLoop
    from ppsplit.serve.server import Server, bind, model_name, run

    if args.max_queue < 1:
        raise ConfigError(f"--max-queue must be >= 1, but got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be from 0 to 65535, but got {args.port}")
    if not has_tokenizer(args.folder):
        raise ConfigError(f"{args.folder} has no tokenizer (tokenizer.json), which serving text needs; compile from a "
                          "checkpoint folder that has one (the demo has one)")
    sock = bind(args.host, args.port)  # a taken port fails before the model loads
    split = ppsplit.load(args.folder)
    engine = _engine(split, args)
    loop = EngineLoop(engine, max_queue=args.max_queue).start()
    k = engine.scheduler.k
    server = Server(loop, FolderTokenizer(args.folder), args.served_model_name or model_name(args.folder),
                    split.layout.max_len, k)
    return run(server, sock)


def _engine(split, args):
    from ppsplit.core.errors import ConfigError
    from ppsplit.serve.engine import Engine

    if not split.plan.paged:
        why = split.plan.lockstep_reason or "it has no KV cache"
        raise ConfigError(f"{args.folder} cannot be served: the engine needs a paged cache, and {why}; compile it "
                          "with --max-batch and --max-len")
    drafter = None
    if args.num_draft_tokens is not None:
        from ppsplit.eagle3.speculative import check_num_draft_tokens

        check_num_draft_tokens(args.num_draft_tokens)
        drafter = split.drafter
        if drafter is None:
            raise ConfigError(f"-k needs a drafter, and {args.folder} holds none: compile it with --drafter")
    return Engine(split, drafter=drafter, num_draft_tokens=args.num_draft_tokens or 0,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)


def _require_serve_dependencies() -> None:
    from ppsplit.core.errors import ConfigError

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"ppsplit serve needs {e.name}: pip install 'ppsplit[serve]'") from None
