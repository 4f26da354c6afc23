"""`--report DIR` of `kvserve bench serve`: PNG plots and one self-contained HTML page.

A report covers one or more servers (one per ``--base-url``), each run at one or more load points
(``--max-concurrency`` or ``--request-rate`` values): throughput against the load, and TTFT and
ITL distributions, the servers side by side. The HTML embeds the PNGs, so it is a single file.
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, whatever the machine has
import matplotlib.pyplot as plt  # noqa: E402


@dataclass
class Run:
    """One server at one load point: its summary (serving.summarize) and the raw latencies in seconds."""

    server: str
    concurrency: int | None
    rate: float
    summary: dict
    ttfts: list[float]
    itls: list[float]

    @property
    def load(self) -> str:
        parts = []
        if self.concurrency is not None:
            parts.append(f"concurrency {self.concurrency}")
        if not math.isinf(self.rate):
            parts.append(f"{self.rate:g} req/s")
        return ", ".join(parts) or "all at once"


def _load_axis(runs: list[Run]) -> tuple[str, callable]:
    """What varies between the load points: the concurrency, else the request rate, else nothing."""
    if len({r.concurrency for r in runs}) > 1:
        return "max concurrency", lambda r: r.concurrency if r.concurrency is not None else math.nan
    if len({r.rate for r in runs}) > 1:
        return "request rate (req/s)", lambda r: r.rate
    return "", lambda r: 0


def _servers(runs: list[Run]) -> list[str]:
    return list(dict.fromkeys(r.server for r in runs))


def plot_throughput(runs: list[Run], path: Path) -> None:
    label, x_of = _load_axis(runs)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for server in _servers(runs):
        mine = sorted((r for r in runs if r.server == server), key=x_of)
        xs = [x_of(r) for r in mine]
        axes[0].plot(xs, [r.summary["output_throughput"] for r in mine], "o-", label=server)
        axes[1].plot(xs, [r.summary["ttft"]["p50_ms"] or math.nan for r in mine], "o-", label=f"{server} p50")
        axes[1].plot(xs, [r.summary["ttft"]["p99_ms"] or math.nan for r in mine], "o--", label=f"{server} p99")
    axes[0].set(title="Output throughput", xlabel=label or "run", ylabel="tokens/s")
    axes[1].set(title="Time to first token", xlabel=label or "run", ylabel="ms")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if label == "max concurrency":
            ax.set_xscale("log", base=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_distribution(runs: list[Run], field: str, title: str, path: Path) -> None:
    """Empirical CDFs of one latency, one line per server and load point."""
    fig, ax = plt.subplots(figsize=(11, 4))
    for run in runs:
        values = sorted(1000 * v for v in getattr(run, field))
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                    label=f"{run.server}, {run.load}")
    ax.set(title=title, xlabel="ms", ylabel="fraction of samples at or below")
    ax.set_xscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PLOTS = (("throughput.png", "Throughput and TTFT against the load"),
         ("ttft.png", "Time to first token: distribution"),
         ("itl.png", "Inter-token latency: distribution"))


def write_report(runs: list[Run], out_dir: Path, workload: dict) -> Path:
    """The PNGs and report.html (plus runs.json) in ``out_dir``; returns the HTML's path."""
    if not runs:
        raise ValueError("no runs to report")
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_throughput(runs, out_dir / PLOTS[0][0])
    plot_distribution(runs, "ttfts", PLOTS[1][1], out_dir / PLOTS[1][0])
    plot_distribution(runs, "itls", PLOTS[2][1], out_dir / PLOTS[2][0])
    (out_dir / "runs.json").write_text(json.dumps(
        {"workload": workload, "runs": [{"server": r.server, "max_concurrency": r.concurrency,
                                         "request_rate": str(r.rate) if math.isinf(r.rate) else r.rate,
                                         **r.summary} for r in runs]}, indent=2))
    path = out_dir / "report.html"
    path.write_text(_html(runs, out_dir, workload), encoding="utf-8")
    return path


def _fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _html(runs: list[Run], out_dir: Path, workload: dict) -> str:
    rows = []
    for r in runs:
        s = r.summary
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in (
            r.server, r.load, f"{s['completed']}/{s['completed'] + s['failed']}", _fmt(s["output_throughput"]),
            _fmt(s["total_token_throughput"]), _fmt(s["ttft"]["p50_ms"]), _fmt(s["ttft"]["p99_ms"]),
            _fmt(s["itl"]["p50_ms"]), _fmt(s["itl"]["p99_ms"]), _fmt(s["e2e"]["p50_ms"]))) + "</tr>")
    images = "".join(
        f'<h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" src="data:image/png;base64,'
        f'{base64.b64encode((out_dir / name).read_bytes()).decode()}">' for name, title in PLOTS)
    described = ", ".join(f"{k} {v}" for k, v in workload.items())
    head = ("server", "load", "ok", "output tok/s", "total tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
            "ITL p99 ms", "E2E p50 ms")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvserve bench serve report</title>
<style>body{{font:14px system-ui,sans-serif;margin:24px;color:#222}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td:first-child,td:nth-child(2){{text-align:left}}
img{{max-width:100%}}</style></head><body>
<h1>kvserve bench serve</h1>
<p>{html.escape(described)}</p>
<table><tr>{"".join(f"<th>{h}</th>" for h in head)}</tr>{"".join(rows)}</table>
{images}
</body></html>
"""
