"""``ppsplit serve`` (imported lazily by ``ppsplit.cli``): the OpenAI HTTP API over a compiled folder."""
from __future__ import annotations

import argparse
import logging


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a compiled folder over the OpenAI HTTP API (/v1/completions, "
                                     "/v1/chat/completions; needs ppsplit[serve])")
    p.add_argument("folder", help="a folder written by ppsplit compile, with a tokenizer")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s; 0.0.0.0: every "
                   "interface)")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the log line says which)")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=None,
                   help="speculative decoding with K drafts per verify pass (the folder's drafter)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences in flight (default: the cache's slots)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one engine step")
    p.add_argument("--max-queue", type=int, default=256,
                   help="unfinished requests admitted at most; more are answered 503 at once")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: DIR's name)")
    p.add_argument("--ranks", type=int, default=1, help="processes: 1, or one per stage of DIR (per stage and TP "
                   "rank with --tp: pp x tp; rank 0 serves HTTP and schedules; the others run their stage)")
    from ppsplit.serve.requests import add_confidence_argument, add_runtime_arguments

    add_runtime_arguments(p)
    add_confidence_argument(p)
    p.add_argument("--rank-timeout", type=float, default=None,
                   help="seconds a rank waits on a peer (--ranks > 1; default: a day, as followers wait while idle)")
    p.add_argument("--rank-stall-timeout", type=float, default=None,
                   help="seconds without a heartbeat after which a rank counts as stalled: the server then fails its "
                        "requests and exits 1 (--ranks > 1; default: 60)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body; larger ones are answered 413 (default: 64 bytes per token of the "
                        "context length, at least 1 MiB)")
    p.add_argument("--prompt-timeout", type=float, default=None,
                   help="seconds a request's chat template and tokenizer may take; longer is a 400 (default: 10)")


def cmd_serve(args: argparse.Namespace) -> int:
    from ppsplit.core.errors import ConfigError

    _require_serve_dependencies()
    from ppsplit.artifact.folder import CompiledFolder
    from ppsplit.artifact.tokenizer import FolderTokenizer, has_tokenizer
    from ppsplit.serve.openai_api import default_max_request_bytes, prompt_budget

    if args.max_queue < 1:
        raise ConfigError(f"--max-queue must be >= 1, but got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be from 0 to 65535, but got {args.port}")
    for flag, value in (("--max-request-bytes", args.max_request_bytes), ("--prompt-timeout", args.prompt_timeout),
                        ("--rank-stall-timeout", args.rank_stall_timeout)):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} must be positive, but got {value}")
    from ppsplit.serve.requests import apply_cpu_threads, check_folder

    check_folder(args.folder)
    apply_cpu_threads(args)
    if not has_tokenizer(args.folder):
        raise ConfigError(f"{args.folder} has no tokenizer (tokenizer.json), which serving text needs; compile from a "
                          "checkpoint folder that has one (the demo has one)")
    plan = CompiledFolder(args.folder).plan  # checks the folder before any process starts
    if plan.tp > 1 and args.ranks != plan.pp * plan.tp:
        raise ConfigError(f"{args.folder} has {plan.pp} stages of {plan.tp} TP ranks: serve it with --ranks "
                          f"{plan.pp * plan.tp} (one process per stage and TP rank), not {args.ranks}")
    if args.ranks != 1 and args.ranks != plan.pp * plan.tp:
        raise ConfigError(f"--ranks must be 1 or the folder's {plan.pp} stages (one process per stage), but got "
                          f"{args.ranks}")
    _check_servable(plan, args)
    max_request = args.max_request_bytes or default_max_request_bytes(plan.max_len)
    tokenizer = FolderTokenizer(args.folder, prompt_budget(max_request, args.prompt_timeout))
    try:
        logging.getLogger("ppsplit").info("%s", tokenizer.check())  # as inspect checks it, before anything loads
        return _serve(args, tokenizer, max_request)
    finally:
        tokenizer.close()


def _serve(args, tokenizer, max_request: int) -> int:
    """Bind, load, serve until SIGTERM or a failure; the exit code."""
    from ppsplit.serve.loop import EngineLoop
    from ppsplit.serve.server import Server, bind, model_name, run

    sock = bind(args.host, args.port)  # a taken port fails before the model loads
    watcher = None
    if args.ranks > 1:
        from ppsplit.distributed import server_ranks as ranks

        args.rank_timeout = args.rank_timeout or ranks.DEFAULT_RANK_TIMEOUT
        args.rank_stall_timeout = args.rank_stall_timeout or ranks.DEFAULT_STALL_TIMEOUT
        engine, watcher = ranks.start(args, args.ranks)
        loop = EngineLoop(engine, max_queue=args.max_queue, close=engine.close)
        watcher.on_failure = loop.fail
    else:
        from ppsplit.serve.placement import load_placed

        loop = EngineLoop(_engine(load_placed(args.folder, args.device), args), max_queue=args.max_queue)
    server = Server(loop.start(), tokenizer, args.served_model_name or model_name(args.folder),
                    loop.engine.scheduler.layout.max_len, loop.engine.scheduler.k, max_request_bytes=max_request,
                    root=args.folder, grammars=_grammars(loop.engine, tokenizer))
    if watcher is not None:
        watcher.on_failure = server.fail
    code = run(server, sock)
    if watcher is not None:
        import logging
        import os
        import sys

        code = code or watcher.finish()
        # No process-group teardown at exit: after a rank died or froze, tearing gloo's down can abort this process
        # (exit -6 instead of 1, seen under load); the OS closes the sockets, as ppsplit run's ranks do.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code


def _grammars(engine, tokenizer):
    """What compiles requests' structured output, or ``None`` where it cannot run (xgrammar missing, stages on
    ranks): those requests are then refused by name."""
    from ppsplit.serve.structured import Grammars

    if not getattr(getattr(engine, "runner", None), "structured", False) or not Grammars.available():
        return None
    scheduler = engine.scheduler
    return Grammars(tokenizer.backend.to_str(), scheduler.vocab, scheduler.eos or tokenizer.eos_token_ids)


def _check_servable(plan, args) -> None:
    from ppsplit.core.errors import ConfigError
    from ppsplit.serve.requests import check_confidence, has_drafter

    check_confidence(args)
    if args.ranks > 1:
        from ppsplit.distributed.transport import backend_for

        backend_for(args.device)

    if not plan.paged:
        why = plan.lockstep_reason or "it has no KV cache: compile it without --no-cache"
        raise ConfigError(f"{args.folder} cannot be served: the engine needs a paged cache, and {why}")
    if args.num_draft_tokens is not None:
        from ppsplit.serve.speculative import check_num_draft_tokens

        check_num_draft_tokens(args.num_draft_tokens)
        if not has_drafter(args.folder):
            raise ConfigError(f"-k needs a drafter, and {args.folder} holds none: compile it with --drafter or "
                              "--mtp")


def _engine(split, args):
    from ppsplit.serve.engine import Engine

    drafter = split.drafter if args.num_draft_tokens is not None else None
    if args.confidence_threshold is not None:
        from ppsplit.eagle3.dspark import set_confidence_threshold

        set_confidence_threshold(drafter, args.confidence_threshold)
    return Engine(split, drafter=drafter, num_draft_tokens=args.num_draft_tokens or 0,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  enforce_eager=args.enforce_eager)


def _require_serve_dependencies() -> None:
    import importlib.util

    from ppsplit.core.errors import ConfigError

    for name in ("fastapi", "uvicorn"):
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"ppsplit serve needs {name}: pip install 'ppsplit[serve]'")
