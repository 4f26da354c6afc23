"""`kvserve serve [MODEL]`: the OpenAI-compatible HTTP server.

SIGINT/SIGTERM: uvicorn stops accepting connections, lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, then cancels the rest (which aborts them in the engine); the
engine thread stops and the process exits 0.

A request that makes a step raise fails alone (HTTP 500 naming it); a failure that is not one
request's (the model fails to load, every request keeps failing) answers every open request with
an error, shuts the server down and exits 3, so that a supervisor (systemd, Kubernetes) restarts it
rather than keeping a process that answers 503 forever.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

from kvserve.entrypoints.cli import add_engine_args, engine_kwargs
from kvserve.entrypoints.cluster.replicas import BACKENDS
from kvserve.entrypoints.cluster.router import ROUTERS
from kvserve.entrypoints.openai.guard import DEFAULT_MAX_REQUEST_BYTES
from kvserve.entrypoints.openai.reasoning import REASONING_PARSERS
from kvserve.entrypoints.openai.tool_parsers import PARSERS as TOOL_PARSERS
from kvserve.runtime.heap import collection_paused

logger = logging.getLogger("kvserve.server")
EXIT_FATAL = 3  # the engine died: not a usage error (2) nor a failed start (1)
SHUTDOWN_MARGIN_S = 1.0  # after --shutdown-timeout, for the error events to go out before uvicorn cancels


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API", allow_abbrev=False)
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
                   help="seconds in-flight requests may take to finish after SIGINT/SIGTERM; then each gets an "
                        "error (a stream: an error event and [DONE])")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted (413 beyond it)")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="require the API key on /metrics too (/health, /version, /docs and /openapi.json stay open)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls (default: recognised from its chat template)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="'think': text in <think>...</think> goes to reasoning_content, the rest to content")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas behind one front end (each a whole kvserve server with its own KV cache)")
    p.add_argument("--distributed-backend", choices=BACKENDS, default="mp",
                   help="how replicas start: mp = processes on this machine; ray = Ray actors (pip install "
                        "'kvserve[ray]'), on a Ray cluster with --ray-address")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (e.g. auto, or HOST:6379); default: a local Ray instance")
    p.add_argument("--router", choices=ROUTERS, default="prefix-aware",
                   help="which replica takes a request: the one holding its longest prompt prefix (prefix-aware, "
                        "yielding to the least loaded when they drift apart), least-load, or round-robin")
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    with collection_paused():  # the web stack's imports (see runtime/heap.py); the model loads paused too
        import uvicorn

        from kvserve.entrypoints.llm import engine_config
        from kvserve.entrypoints.openai.app import ServerOptions, build_app
        from kvserve.entrypoints.openai.models import default_served_name
        from kvserve.frontend.tokenizer import read_chat_template
        from kvserve.model.loader import resolve_model_path

    kwargs = engine_kwargs(args)
    if args.model_path and kwargs.get("model") and args.model_path != kwargs["model"]:
        raise ValueError(f"MODEL {args.model_path!r} and --model {kwargs['model']!r} disagree; give one")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} must be in [1, 65535]")
    kwargs["model"] = args.model_path or kwargs.get("model")
    config = engine_config(**kwargs)
    resolve_model_path(config.model)  # a wrong path fails here, not after the port is open
    if config.chat_template is not None:
        read_chat_template(config.chat_template)  # so does a bad template
    names = tuple(args.served_model_name or [default_served_name(kwargs["model"])])
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} must be >= 1")
    if args.data_parallel_size > 1:
        from kvserve.entrypoints.cluster.serve import serve_cluster

        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        _exit_quietly_after_shutdown()
        return serve_cluster(args, args.argv, config, names)
    address = f"http://{args.host}:{args.port}"
    options = ServerOptions(names, args.api_key, args.max_queue, address, freeze_gc=True,
                            max_request_bytes=args.max_request_bytes, metrics_require_key=args.metrics_require_key,
                            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("kvserve %s: loading %s; listening on %s", names[0], kwargs["model"] or "the default model", address)
    fatal: list[BaseException] = []

    def stop_on_fatal(error: BaseException) -> None:
        logger.critical("the engine stopped (%r): shutting down with exit code %d for a restart", error, EXIT_FATAL)
        fatal.append(error)
        server.should_exit = True

    app = build_app(config, options, stop_on_fatal)
    # uvicorn cancels what is still running a little after our own deadline, by which time every open
    # request has been answered with an error (streams: an error event and [DONE]).
    server = _make_server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                         timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_MARGIN_S,
                                         access_log=args.log_level == "debug"),
                          app.state.kvserve.client, args.shutdown_timeout)
    _exit_quietly_after_shutdown()
    server.run()
    if fatal:
        return EXIT_FATAL
    return 0 if server.started else 1


def _make_server(config, client, shutdown_timeout: float):
    """uvicorn's server, which also ends every open request with an error at the shutdown deadline."""
    import uvicorn

    from kvserve.frontend.client import EngineDeadError

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                client.fail_open_requests_after(shutdown_timeout, EngineDeadError(
                    f"the server is shutting down and this request did not finish within --shutdown-timeout "
                    f"{shutdown_timeout:g} s"))
            super().handle_exit(sig, frame)

    return Server(config)


def _exit_quietly_after_shutdown() -> None:
    """uvicorn handles SIGINT/SIGTERM itself, then re-raises the signal once it has shut down
    gracefully; these no-op handlers receive that re-raise, so a clean shutdown exits 0."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
