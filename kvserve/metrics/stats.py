"""Per-request latency bookkeeping, kept apart from how the figures are exported.

``StatsCollector`` runs on the engine thread. It sees every step's outputs and turns them into
observations (time to first token, inter-token latency, end-to-end latency, queue time, token
counts, finish reasons) that it hands to a ``MetricsSink``, e.g. the Prometheus exporter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvserve.engine.stats import EngineSnapshot
from kvserve.types import RequestOutput


class MetricsSink(Protocol):
    def observe_ttft(self, seconds: float) -> None: ...
    def observe_itl(self, seconds: float) -> None: ...
    def observe_finished(self, reason: str, e2e: float, queue_time: float | None, prompt_tokens: int,
                         generation_tokens: int) -> None: ...
    def add_tokens(self, prompt: int, generation: int) -> None: ...
    def set_snapshot(self, snapshot: EngineSnapshot, new_preemptions: int) -> None: ...


@dataclass
class _Live:
    arrival: float
    num_prompt_tokens: int
    num_generated: int = 0
    first_token: float | None = None
    last_token: float | None = None


class StatsCollector:
    """Engine-thread bookkeeping of live requests; every figure is measured from the client's arrival time."""

    def __init__(self, sink: MetricsSink) -> None:
        self.sink = sink
        self._live: dict[str, _Live] = {}
        self._preemptions = 0

    def on_added(self, request_id: str, arrival: float, num_prompt_tokens: int) -> None:
        self._live[request_id] = _Live(arrival, num_prompt_tokens)

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is not None:
                self._on_output(live, out, now)

    def _on_output(self, live: _Live, out: RequestOutput, now: float) -> None:
        """``out`` is a delta output: the tokens it holds are the new ones."""
        new = sum(len(c.token_ids) for c in out.outputs)
        if new > 0:
            if live.first_token is None:
                live.first_token = now
                self.sink.observe_ttft(now - live.arrival)
                self.sink.add_tokens(live.num_prompt_tokens, 0)
            else:
                self.sink.observe_itl(now - live.last_token)
            live.last_token = now
            live.num_generated += new
            self.sink.add_tokens(0, new)
        if out.finished:
            reasons = [c.finish_reason or "stop" for c in out.outputs]
            queue_time = None if out.metrics.first_scheduled is None else out.metrics.first_scheduled - live.arrival
            self._finish(out.request_id, reasons[0], now, queue_time)

    def on_aborted(self, request_id: str, now: float) -> None:
        self._finish(request_id, "abort", now, None)

    def on_failed(self, request_id: str, now: float) -> None:
        """A step raised for this request and the engine took it out (frontend RequestFailedError)."""
        self._finish(request_id, "error", now, None)

    def _finish(self, request_id: str, reason: str, now: float, queue_time: float | None) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            self.sink.observe_finished(reason, now - live.arrival, queue_time, live.num_prompt_tokens,
                                       live.num_generated)

    def on_snapshot(self, snapshot: EngineSnapshot) -> None:
        new = snapshot.num_preemptions - self._preemptions
        self._preemptions = snapshot.num_preemptions
        self.sink.set_snapshot(snapshot, new)
