"""Prometheus exporter: vLLM's metric set under the ``kvserve:`` namespace.

Each server owns its own ``CollectorRegistry`` (no process-global state), so two apps in one
process, or tests, never see each other's counts. Every metric carries a ``model_name`` label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvserve.engine.stats import EngineSnapshot

CONTENT_TYPE = CONTENT_TYPE_LATEST
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))


class PrometheusMetrics:
    """Implements ``MetricsSink``; ``render()`` gives the text exposition for ``GET /metrics``."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}
        ns = "kvserve:"

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(ns + name, doc, buckets=buckets, **label).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time waiting before first scheduled", _LATENCY_BUCKETS)
        self.request_prompt = hist("request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS)
        self.request_generation = hist("request_generation_tokens", "Generated tokens per request", _TOKEN_BUCKETS)
        self.prompt_tokens = Counter(ns + "prompt_tokens", "Prefill tokens processed", **label).labels(model_name)
        self.generation_tokens = Counter(ns + "generation_tokens", "Tokens generated", **label).labels(model_name)
        self.preemptions = Counter(ns + "num_preemptions", "Preemptions", **label).labels(model_name)
        self._success = Counter(ns + "request_success", "Finished requests by finish reason",
                                labelnames=["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name
        self.running = Gauge(ns + "num_requests_running", "Requests in the running batch", **label).labels(model_name)
        self.waiting = Gauge(ns + "num_requests_waiting", "Requests waiting to run", **label).labels(model_name)
        self.kv_usage = Gauge(ns + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1)",
                              **label).labels(model_name)
        self.kv_blocks = Gauge(ns + "kv_cache_blocks_in_use", "KV-cache blocks requests hold, by the kind of "
                               "layers they serve (full attention, sliding window)",
                               labelnames=["model_name", "kind"], registry=self.registry)
        # Cumulative engine counters, exported as the deltas between snapshots.
        self._counters = {
            field: Counter(ns + name, doc, **label).labels(model_name) for field, name, doc in (
                ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
                ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens served from the prefix cache"),
                ("prefix_cache_evictions", "prefix_cache_evictions", "Cached KV blocks evicted"),
                ("spec_proposed_tokens", "spec_decode_num_draft_tokens", "Speculative tokens proposed"),
                ("spec_accepted_tokens", "spec_decode_num_accepted_tokens", "Speculative tokens accepted"),
                ("spec_verify_steps", "spec_decode_num_verify_steps", "Request-steps that verified proposals"),
                ("spec_emitted_tokens", "spec_decode_num_emitted_tokens", "Tokens emitted by verifying steps"),
                ("num_steps", "engine_steps", "Engine steps run"),
                ("num_batched_tokens", "computed_tokens",
                 "Tokens computed by engine steps: prompt chunks (again after a preemption), decodes, proposals"),
                ("num_prefill_tokens", "computed_prefill_tokens", "Computed tokens that were prompt chunks"),
                ("num_decode_tokens", "computed_decode_tokens", "Computed tokens that were one-token decodes"),
                ("num_spec_tokens", "computed_spec_tokens", "Computed tokens that were speculative proposals"),
            )}
        self.prefix_hit_rate = Gauge(ns + "prefix_cache_hit_rate", "Prefix-cache hits / queries since start (tokens)",
                                     **label).labels(model_name)
        self.spec_acceptance = Gauge(ns + "spec_decode_acceptance_rate", "Accepted / proposed speculative tokens",
                                     **label).labels(model_name)
        self.spec_mean_len = Gauge(ns + "spec_decode_mean_tokens_per_step",
                                   "Tokens emitted per verifying request-step (accepted + 1)", **label).labels(model_name)
        # Memory, fixed at start-up: weight bytes, KV bytes per token and KV capacity in tokens.
        self.memory = {field: Gauge(ns + name, doc, **label).labels(model_name) for field, name, doc in (
            ("weight_bytes", "model_weight_bytes", "Bytes of the loaded model weights (after quantization)"),
            ("kv_bytes_per_token", "kv_cache_bytes_per_token", "KV-cache bytes per token, all layers"),
            ("kv_cache_tokens", "kv_cache_capacity_tokens", "Tokens the KV cache holds (every layer's KV kept)"),
            ("kv_cache_blocks", "kv_cache_blocks", "Blocks in the KV pool"))}
        self._last = EngineSnapshot()

    # ---- MetricsSink ----------------------------------------------------------------------------
    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_finished(self, reason: str, e2e: float, queue_time: float | None, prompt_tokens: int,
                         generation_tokens: int) -> None:
        self._success.labels(self._model_name, reason).inc()
        self.e2e.observe(e2e)
        if queue_time is not None:
            self.queue_time.observe(queue_time)
        self.request_prompt.observe(prompt_tokens)
        self.request_generation.observe(generation_tokens)

    def add_tokens(self, prompt: int, generation: int) -> None:
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generation:
            self.generation_tokens.inc(generation)

    def set_snapshot(self, snapshot: EngineSnapshot, new_preemptions: int) -> None:
        self.running.set(snapshot.num_running)
        self.waiting.set(snapshot.num_waiting)
        self.kv_usage.set(snapshot.kv_cache_usage)
        for kind, blocks in snapshot.kv_blocks_in_use.items():
            self.kv_blocks.labels(self._model_name, kind).set(blocks)
        if new_preemptions > 0:
            self.preemptions.inc(new_preemptions)
        for field, counter in self._counters.items():
            delta = getattr(snapshot, field) - getattr(self._last, field)
            if delta > 0:
                counter.inc(delta)
        self._last = snapshot
        for field, gauge in self.memory.items():
            gauge.set(getattr(snapshot, field))
        s = snapshot
        self.prefix_hit_rate.set(s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0)
        self.spec_acceptance.set(s.spec_accepted_tokens / s.spec_proposed_tokens if s.spec_proposed_tokens else 0.0)
        self.spec_mean_len.set(s.spec_emitted_tokens / s.spec_verify_steps if s.spec_verify_steps else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
