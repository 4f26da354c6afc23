"""Running totals of tokens and latencies, for readers that difference them between two looks.

The live dashboard samples these a few times a second and plots each interval's mean. They are plain
counters written by the engine thread only; a reader on another thread may see a count one ahead of
its sum, which moves one interval's mean by one observation's share.
"""

from __future__ import annotations

from kvserve.engine.stats import EngineSnapshot


class Totals:
    """A MetricsSink that keeps count and sum of each latency and the tokens served, and ignores the rest."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = 0
        self.ttft_count = 0
        self.ttft_sum = 0.0
        self.itl_count = 0
        self.itl_sum = 0.0

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_sum += seconds
        self.ttft_count += 1

    def observe_itl(self, seconds: float) -> None:
        self.itl_sum += seconds
        self.itl_count += 1

    def observe_finished(self, reason: str, e2e: float, queue_time: float | None, prompt_tokens: int,
                         generation_tokens: int) -> None:
        self.finished += 1

    def add_tokens(self, prompt: int, generation: int) -> None:
        self.prompt_tokens += prompt
        self.generation_tokens += generation

    def set_snapshot(self, snapshot: EngineSnapshot, new_preemptions: int) -> None:
        pass


class FanOut:
    """A MetricsSink that hands every observation to each of several sinks, in order."""

    def __init__(self, *sinks) -> None:
        self.sinks = sinks

    def observe_ttft(self, seconds: float) -> None:
        for s in self.sinks:
            s.observe_ttft(seconds)

    def observe_itl(self, seconds: float) -> None:
        for s in self.sinks:
            s.observe_itl(seconds)

    def observe_finished(self, reason: str, e2e: float, queue_time: float | None, prompt_tokens: int,
                         generation_tokens: int) -> None:
        for s in self.sinks:
            s.observe_finished(reason, e2e, queue_time, prompt_tokens, generation_tokens)

    def add_tokens(self, prompt: int, generation: int) -> None:
        for s in self.sinks:
            s.add_tokens(prompt, generation)

    def set_snapshot(self, snapshot: EngineSnapshot, new_preemptions: int) -> None:
        for s in self.sinks:
            s.set_snapshot(snapshot, new_preemptions)
