"""`kvserve serve [MODEL]`: the OpenAI-compatible HTTP server.

SIGINT/SIGTERM: uvicorn stops accepting connections, lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, then cancels the rest (which aborts them in the engine); the
engine thread stops and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

from kvserve.entrypoints.cli import add_engine_args, engine_kwargs
from kvserve.entrypoints.openai.reasoning import REASONING_PARSERS
from kvserve.entrypoints.openai.tool_parsers import PARSERS as TOOL_PARSERS

logger = logging.getLogger("kvserve.server")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="HF model folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: derived from MODEL)")
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KVSERVE_API_KEY, or none)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="waiting requests beyond which new ones get 429 at once")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGINT/SIGTERM")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls (default: recognised from its chat template)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="'think': text in <think>...</think> goes to reasoning_content, the rest to content")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.entrypoints.llm import engine_config
    from kvserve.entrypoints.openai.app import ServerOptions, build_app
    from kvserve.entrypoints.openai.models import default_served_name
    from kvserve.model.loader import resolve_model_path

    kwargs = engine_kwargs(args)
    if args.model_path and kwargs.get("model") and args.model_path != kwargs["model"]:
        raise ValueError(f"MODEL {args.model_path!r} and --model {kwargs['model']!r} disagree; give one")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} must be in [1, 65535]")
    kwargs["model"] = args.model_path or kwargs.get("model")
    config = engine_config(**kwargs)
    resolve_model_path(config.model)  # a wrong path fails here, not after the port is open
    names = tuple(args.served_model_name or [default_served_name(kwargs["model"])])
    address = f"http://{args.host}:{args.port}"
    options = ServerOptions(names, args.api_key, args.max_queue, address, freeze_gc=True,
                            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("kvserve %s: loading %s; listening on %s", names[0], kwargs["model"] or "the default model", address)
    server = uvicorn.Server(uvicorn.Config(build_app(config, options), host=args.host, port=args.port,
                                           log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout,
                                           access_log=args.log_level == "debug"))
    _exit_quietly_after_shutdown()
    server.run()
    return 0 if server.started else 1


def _exit_quietly_after_shutdown() -> None:
    """uvicorn handles SIGINT/SIGTERM itself, then re-raises the signal once it has shut down
    gracefully; these no-op handlers receive that re-raise, so a clean shutdown exits 0."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
