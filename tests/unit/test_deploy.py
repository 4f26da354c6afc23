"""deploy/: the Grafana dashboard asks only for metrics the exporter has, and the scrape config parses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from kvserve.metrics.prometheus import PrometheusMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _exported() -> set[str]:
    metrics = PrometheusMetrics("m")
    metrics._success.labels("m", "stop").inc()  # a labelled family shows its samples once one exists
    lines = metrics.render().decode().splitlines()
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in lines if line and not line.startswith("#")}


def test_grafana_dashboard_uses_exported_metrics_only():
    dashboard = json.loads((DEPLOY / "grafana" / "kvserve-dashboard.json").read_text())
    used = {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"kvserve:[a-z0-9_]+", target["expr"])}
    assert len(used) >= 15
    assert used <= _exported(), sorted(used - _exported())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_prometheus_config_scrapes_metrics():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "kvserve" and job["metrics_path"] == "/metrics"
    assert all(":" in t for t in job["static_configs"][0]["targets"])
