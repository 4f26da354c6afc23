"""Perplexity of a model on a text, through the engine itself (so weight and KV-cache quantization,
chunked prefill and the attention kernels are all in the measurement).

Sliding window (the Hugging Face recipe): windows of ``window`` tokens start every ``stride``
tokens; each scores only the tokens the previous window did not, so every token after the first is
scored once, with up to ``window - stride`` tokens of context before the scored span. Scores come
from prompt logprobs (log p(token | everything before it in the window)).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    start: int  # first token of the window
    end: int  # one past its last token
    first_scored: int  # first position scored (absolute), >= start + 1


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float
    tokens_scored: int
    tokens_processed: int  # forward-pass tokens, counting window overlaps again
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_processed / self.seconds


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """Windows covering ``num_tokens`` tokens; positions 1 .. num_tokens - 1 are each scored once."""
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"window={window}, stride={stride}: need window >= 2 and 1 <= stride <= window")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} tokens; perplexity needs at least 2")
    out, scored_to = [], 1
    for start in range(0, num_tokens, stride):
        end = min(start + window, num_tokens)
        out.append(Window(start, end, max(scored_to, start + 1)))
        scored_to = end
        if end == num_tokens:
            break
    return out


def perplexity(llm, token_ids: list[int], window: int = 1024, stride: int = 512) -> PerplexityResult:
    """Score ``token_ids`` with ``llm`` (a kvserve.LLM); every window is one request, batched together."""
    from kvserve import SamplingParams

    spans = sliding_windows(len(token_ids), window, stride)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
    llm.generate([token_ids[:2]], params, use_tqdm=False)  # warm-up: kernels, allocator
    start = time.perf_counter()
    outs = llm.generate([token_ids[w.start:w.end] for w in spans], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    nll, scored = 0.0, 0
    for w, out in zip(spans, outs):
        for scored_lp in out.prompt_logprobs[w.first_scored - w.start:]:
            nll -= scored_lp.logprob
            scored += 1
    mean = nll / scored
    return PerplexityResult(math.exp(mean), mean, scored, sum(w.end - w.start for w in spans), seconds)
