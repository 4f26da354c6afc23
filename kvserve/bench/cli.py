"""`kvserve bench ...`: benchmarks that print figures (speed lives here, not in tests)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from kvserve.bench import cluster, offline, prefix, roofline, serving, soak, spec

    p = sub.add_parser("bench", help="benchmarks: offline, serve, prefix, spec, roofline, soak, cluster")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    for module in (offline, serving, prefix, spec, roofline, soak, cluster):
        module.add_parser(bench_sub)
