"""`kvserve bench ...`: benchmarks that print figures (speed lives here, not in tests)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from kvserve.bench import offline, roofline

    p = sub.add_parser("bench", help="benchmarks: offline, serve, ...")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    offline.add_parser(bench_sub)
    roofline.add_parser(bench_sub)
    try:
        from kvserve.bench import serving
    except ImportError:  # the HTTP load generator lands with the server
        return
    serving.add_parser(bench_sub)
