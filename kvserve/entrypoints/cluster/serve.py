"""`kvserve serve --data-parallel-size N`: start N replicas, then serve the front end until stopped."""

from __future__ import annotations

import logging

from kvserve.entrypoints.cluster.proxy import Cluster, build_cluster_app
from kvserve.entrypoints.cluster.replicas import start_replicas, stop_replicas
from kvserve.entrypoints.cluster.router import make_router

logger = logging.getLogger("kvserve.cluster")

# The front end's own flags, which replicas do not get (each listens on a port of its own).
FRONT_END_FLAGS = ("--host", "--port", "--data-parallel-size", "--distributed-backend", "--ray-address", "--router")


def replica_argv(argv: list[str]) -> list[str]:
    """``serve``'s arguments without the front end's flags (``--flag value`` or ``--flag=value``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in FRONT_END_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in FRONT_END_FLAGS)):
            out.append(arg)
    return out


def serve_cluster(args, argv: list[str], config, names: tuple[str, ...]) -> int:
    import uvicorn

    from kvserve.frontend.tokenizer import load_tokenizer
    from kvserve.model.loader import resolve_model_path

    n = args.data_parallel_size
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    tokenizer = load_tokenizer(resolve_model_path(config.model), config.chat_template)
    router = make_router(args.router, n, config.cache.block_size)
    logger.info("starting %d replicas (%s backend), %s routing", n, args.distributed_backend, args.router)
    replicas = start_replicas(args.distributed_backend, n, replica_argv(argv), args.ray_address)
    try:
        logger.info("replicas ready: %s; listening on http://%s:%d", ", ".join(r.url for r in replicas),
                    args.host, args.port)
        app = build_cluster_app(Cluster(replicas, router, tokenizer, args.api_key), names, args.max_request_bytes,
                                args.metrics_require_key)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                               timeout_graceful_shutdown=args.shutdown_timeout, access_log=False))
        server.run()
        return 0 if server.started else 1
    finally:
        stop_replicas(replicas)
        if args.distributed_backend == "ray":
            import ray

            ray.shutdown()
