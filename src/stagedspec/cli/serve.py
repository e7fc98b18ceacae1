"""`stagedspec serve` and `stagedspec bench-serve`: the HTTP server and its load generator.

Kept apart from `cli/commands.py` so the core CLI never imports fastapi, uvicorn or
openai: they are imported only when one of these commands runs, and a
missing extra is a one-line error naming the extra to install.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

from stagedspec.cli.args import (add_model_args, add_quant_arg, add_speculation_args, add_threads_arg,
                                 pass_options_from, positive_int, speculation_from)
from stagedspec.errors import StagedSpecError


def add_commands(sub: Any) -> None:
    def _positive_float(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, exact "
                                         "speculation per request; needs the 'serve' extra)")
    add_model_args(serve)
    add_quant_arg(serve)
    add_threads_arg(serve)
    add_speculation_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=positive_int, default=8000)
    serve.add_argument("--max-batch", type=positive_int, default=8, metavar="N",
                       help="requests decoding at once; more wait in a queue (default 8)")
    serve.add_argument("--max-memory", default=None, metavar="SIZE",
                       help="memory budget, e.g. 2G: requests whose KV cache would not fit wait (default: the "
                            "models + KV for --max-batch sequences at full context)")
    serve.add_argument("--batch-passes", action=argparse.BooleanOptionalAction, default=True,
                       help="run the running requests' model passes together, one ragged pass per model per "
                            "step (default); --no-batch-passes interleaves their steps, one pass at a time")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' (default: $STAGEDSPEC_API_KEY, else none)")
    serve.add_argument("--model-name", default=None, metavar="NAME",
                       help="the model id clients send (default: derived from --oracle)")
    serve.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                       help="also answer requests whose Host header names NAME (repeatable; '*' for any). "
                            "Loopback names and the --host address are always answered; other names are "
                            "refused, against DNS rebinding")
    serve.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                       help="answer browser requests from ORIGIN, e.g. http://localhost:3000, with CORS headers "
                            "(repeatable; '*' for any). Requests carrying any other Origin header are refused")
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench-serve", help="drive a running server with the openai client at several "
                                               "concurrencies, speculation on vs off")
    bench.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 base URL")
    bench.add_argument("--api-key", default=None, metavar="KEY", help="default: $STAGEDSPEC_API_KEY")
    bench.add_argument("--model", default=None, help="model id (default: the server's first)")
    bench.add_argument("--prompts", nargs="*", default=None, metavar="FILE",
                       help="prompt files: one prompt per file, or .jsonl with a 'prompt' per line "
                            "(default: HumanEval prompts)")
    bench.add_argument("--concurrency", default="1,2,4,8", help="comma-separated concurrencies")
    bench.add_argument("--requests", type=positive_int, default=None, metavar="N",
                       help="requests per concurrency level (default: 2 x concurrency)")
    bench.add_argument("--max-tokens", type=positive_int, default=128)
    bench.add_argument("--methods", default=None,
                       help="comma-separated speculation methods to compare (default: the server's own, then ar)")
    bench.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--llamacpp", default=None, metavar="MODEL",
                       help="also run the same levels against llama.cpp's llama-server on MODEL's GGUF ('default', "
                            "a named model such as qwen2.5-coder-1.5b, or a .gguf path), started here with -np = the "
                            "top concurrency (build it with scripts/llamacpp/build.sh)")
    bench.add_argument("--llamacpp-draft", default=None, metavar="DRAFT",
                       help="with --llamacpp: also llama-server's draft-model speculation (-md) with this GGUF draft")
    bench.add_argument("--llamacpp-threads", type=positive_int, default=None, metavar="N",
                       help="llama-server's threads (default: the CPUs this process may use)")
    bench.add_argument("--llamacpp-context", type=positive_int, default=4096, metavar="N",
                       help="llama-server's context per request (slot)")
    bench.add_argument("--soak-minutes", type=_positive_float, default=None, metavar="M",
                       help="instead of the levels: keep the top concurrency busy for M minutes, count errors and "
                            "check that the server's resident memory stays flat after a warm-up (exit 1 if not)")
    bench.add_argument("--soak-sample", type=_positive_float, default=10.0, metavar="S",
                       help="seconds between resident-memory readings in a soak")
    bench.add_argument("--soak-tolerance", type=_positive_float, default=0.05, metavar="F",
                       help="allowed growth of resident memory after the warm-up, as a fraction")
    bench.set_defaults(func=cmd_bench_serve)


def _check_port(host: str, port: int) -> None:
    """Fail with one line, before loading anything, when the address cannot be bound."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise StagedSpecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        # deferred: optional dependency (the server needs fastapi and uvicorn), loaded only when serve runs
        from stagedspec.server.app import create_app
        from stagedspec.server.guard import startup_warning
    except ImportError as e:
        raise StagedSpecError(f"stagedspec serve needs the 'serve' extra ({e.name} is missing): "
                              "pip install 'stagedspec[serve]'") from None
    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.heap import freeze_loaded
    from stagedspec.server.engine import Engine, parse_size

    oracle, drafts, spec = speculation_from(args)
    max_memory = parse_size(args.max_memory) if args.max_memory else None
    api_key = args.api_key or os.environ.get("STAGEDSPEC_API_KEY") or None
    warning = startup_warning(args.host, api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    _check_port(args.host, args.port)

    def load() -> Engine:
        engine = Engine.load(oracle, drafts, spec, dtype=args.dtype, device=args.device, quant=args.quant,
                             draft_weights=args.draft_weights, draft_vocab=args.draft_vocab, bit_exact=args.bit_exact,
                             model_name=args.model_name,
                             pass_options=pass_options_from(args))
        engine.threads = args.threads
        freeze_loaded()  # the models stay until the server exits
        return engine

    server: uvicorn.Server | None = None

    def on_load_error(message: str) -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(loader=load, api_key=api_key, max_batch=args.max_batch, max_memory=max_memory,
                     on_load_error=on_load_error, batch_passes=args.batch_passes, host=args.host,
                     allowed_hosts=args.allowed_host, allowed_origins=args.allow_origin)
    print(f"stagedspec serve: http://{args.host}:{args.port}/v1 (method {spec.method}"
          f"{', batched passes' if args.batch_passes else ', interleaved steps'}"
          f"{', API key required' if api_key else ''}); loading the model...", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           access_log=False))
    server.run()
    error = app.state.stagedspec.load_error
    if error:
        raise StagedSpecError(error)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401
        import openai  # noqa: F401
    except ImportError as e:
        raise StagedSpecError(f"stagedspec bench-serve needs the openai client and httpx ({e.name} is missing): "
                              "pip install -e '.[bench]'") from None
    # deferred: cli.commands builds every subcommand's parser; each command loads only its own stack
    from stagedspec.bench.serve import run_bench_serve

    return run_bench_serve(args)
