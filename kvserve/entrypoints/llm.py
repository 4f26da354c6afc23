"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from typing import Sequence

from tqdm.auto import tqdm

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.types import RequestOutput, SamplingParams

Prompt = str | list[int]


def engine_config(*, model: str | None, dtype: str, block_size: int, num_kv_blocks: int | None, max_num_seqs: int,
                  max_num_batched_tokens: int, seed: int, max_model_len: int | None, kv_cache_memory_bytes: int,
                  device: str, enable_prefix_caching: bool = True) -> EngineConfig:
    """The EngineConfig for LLM(...)'s flat options; `kvserve serve` builds its engine from the same options."""
    return EngineConfig(
        model=model, dtype=dtype, seed=seed, device=device,
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                          kv_cache_memory_bytes=kv_cache_memory_bytes, enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len),
    )


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    ``model`` is a Hugging Face folder, a .gguf file, or None for the bundled SmolLM2-135M-Instruct.
    ``num_kv_blocks`` None sizes the KV cache from ``kv_cache_memory_bytes``.
    """

    def __init__(self, model: str | None = None, dtype: str = "float32", block_size: int = 16,
                 num_kv_blocks: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 seed: int = 0, max_model_len: int | None = None, kv_cache_memory_bytes: int = 1024**3,
                 device: str = "cpu", enable_prefix_caching: bool = True) -> None:
        self.engine = LLMEngine(engine_config(
            model=model, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, seed=seed, max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_memory_bytes, device=device, enable_prefix_caching=enable_prefix_caching))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Every prompt is validated before any is queued, so a bad one raises ValueError and the
        engine is left exactly as it was.
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        for i, prompt in enumerate(prompts):
            token_ids = self.engine.encode(prompt) if isinstance(prompt, str) else prompt
            try:
                if isinstance(prompt, str) and not prompt:
                    raise ValueError("prompt is empty: give a non-empty string or token ids")
                self.engine.core.validate_prompt(token_ids)
                self.engine.core.validate_params(params[i])
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params):
            self.engine.add_request(rid, prompt, p)
        return self._run(ids, use_tqdm if use_tqdm is not None else len(prompts) >= 16)

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not show_progress, unit="req")
        try:
            while len(done) < len(ids):
                for out in self.engine.step(finished_only=True):
                    done[out.request_id] = out
                    bar.update(1)
        except BaseException:
            for rid in ids:  # leave no half-finished request holding KV blocks
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    for i, p in enumerate(prompts):
        if not isinstance(p, str) and not (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            raise ValueError(f"prompts[{i}] must be a string or a list of token ids")
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one, or one per prompt")
    return params
