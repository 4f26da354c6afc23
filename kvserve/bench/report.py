"""`--report DIR` of the `kvserve bench` commands: PNG plots and one self-contained HTML page.

The shared parts: ``Page`` (tables, plots, the figures as JSON) and ``write_page``, which writes the
page with its PNGs embedded (a single file to send around) next to the PNGs themselves, and two
plot helpers (``bar_chart``, ``line_chart``). Each command builds its own Page from its results.

`bench serve`'s report (``write_report``) covers one or more servers (one per ``--base-url``), each
run at one or more load points (``--max-concurrency`` or ``--request-rate`` values): throughput
against the load, and TTFT and ITL distributions, the servers side by side.
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path


def _pyplot():
    """matplotlib, imported when a plot is drawn (not by every `kvserve` command that builds the parser)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, whatever the machine has
    import matplotlib.pyplot as plt

    return plt


def add_report_argument(parser, plots: str) -> None:
    """``--report DIR`` on a bench command; ``plots`` says what the page shows."""
    parser.add_argument("--report", default=None, metavar="DIR",
                        help=f"write PNG plots and a self-contained report.html there ({plots})")


@dataclass
class Table:
    head: tuple[str, ...]
    rows: list[tuple]  # cells, shown with str(); the first column left-aligned (names), the rest right
    title: str = ""


@dataclass
class Page:
    """What one report shows: ``plots`` are (file name in the report folder, caption), drawn before
    ``write_page`` is called; ``data`` is saved beside the page as ``data_file``."""

    title: str
    description: str
    tables: list[Table] = field(default_factory=list)
    plots: list[tuple[str, str]] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    data_file: str = "results.json"


def write_page(page: Page, out_dir: Path) -> Path:
    """report.html and the data file in ``out_dir`` (which holds the plots); returns the HTML's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / page.data_file).write_text(json.dumps(page.data, indent=2, default=str))
    path = out_dir / "report.html"
    path.write_text(_html(page, out_dir), encoding="utf-8")
    return path


def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def bar_chart(path: Path, title: str, ylabel: str, groups: list[str], series: dict[str, list[float | None]]) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series in each."""
    fig, ax = _pyplot().subplots(figsize=(11, 4))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [math.nan if v is None else v for v in values], width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.set(title=title, ylabel=ylabel)
    ax.grid(alpha=0.3, axis="y")
    if len(series) > 1:
        ax.legend(fontsize=8)
    _save(fig, path)


def line_chart(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]],
               log2_x: bool = False) -> None:
    """One line per series, each given as (xs, ys)."""
    fig, ax = _pyplot().subplots(figsize=(11, 4))
    for name, (xs, ys) in series.items():
        ax.plot(xs, [math.nan if y is None else y for y in ys], "o-", label=name)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if log2_x:
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def _table_html(table: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in table.head)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in table.rows)
    title = f"<h2>{html.escape(table.title)}</h2>" if table.title else ""
    return f"{title}<table><tr>{head}</tr>{rows}</table>"


def _html(page: Page, out_dir: Path) -> str:
    images = "".join(
        f'<h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" src="data:image/png;base64,'
        f'{base64.b64encode((out_dir / name).read_bytes()).decode()}">' for name, title in page.plots)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(page.title)} report</title>
<style>body{{font:14px system-ui,sans-serif;margin:24px;color:#222}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td:first-child{{text-align:left}}
img{{max-width:100%}}</style></head><body>
<h1>{html.escape(page.title)}</h1>
<p>{html.escape(page.description)}</p>
{"".join(_table_html(t) for t in page.tables)}
{images}
</body></html>
"""


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
    fig, axes = _pyplot().subplots(1, 2, figsize=(11, 4))
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
    _save(fig, path)


def plot_distribution(runs: list[Run], field: str, title: str, path: Path) -> None:
    """Empirical CDFs of one latency, one line per server and load point."""
    fig, ax = _pyplot().subplots(figsize=(11, 4))
    for run in runs:
        values = sorted(1000 * v for v in getattr(run, field))
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                    label=f"{run.server}, {run.load}")
    ax.set(title=title, xlabel="ms", ylabel="fraction of samples at or below")
    ax.set_xscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    _save(fig, path)


PLOTS = (("throughput.png", "Throughput and TTFT against the load"),
         ("ttft.png", "Time to first token: distribution"),
         ("itl.png", "Inter-token latency: distribution"))


def write_report(runs: list[Run], out_dir: Path, workload: dict) -> Path:
    """`bench serve`'s PNGs and report.html (plus runs.json) in ``out_dir``; returns the HTML's path."""
    if not runs:
        raise ValueError("no runs to report")
    plot_throughput(runs, out_dir / PLOTS[0][0])
    plot_distribution(runs, "ttfts", PLOTS[1][1], out_dir / PLOTS[1][0])
    plot_distribution(runs, "itls", PLOTS[2][1], out_dir / PLOTS[2][0])
    rows = []
    for r in runs:
        s = r.summary
        rows.append((r.server, r.load, f"{s['completed']}/{s['completed'] + s['failed']}", fmt(s["output_throughput"]),
                     fmt(s["total_token_throughput"]), fmt(s["ttft"]["p50_ms"]), fmt(s["ttft"]["p99_ms"]),
                     fmt(s["itl"]["p50_ms"]), fmt(s["itl"]["p99_ms"]), fmt(s["e2e"]["p50_ms"])))
    head = ("server", "load", "ok", "output tok/s", "total tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
            "ITL p99 ms", "E2E p50 ms")
    data = {"workload": workload, "runs": [{"server": r.server, "max_concurrency": r.concurrency,
                                            "request_rate": str(r.rate) if math.isinf(r.rate) else r.rate,
                                            **r.summary} for r in runs]}
    return write_page(Page("kvserve bench serve", ", ".join(f"{k} {v}" for k, v in workload.items()),
                           [Table(head, rows)], list(PLOTS), data, data_file="runs.json"), out_dir)
