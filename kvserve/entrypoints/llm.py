"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvserve.config import CUDA_TOKEN_BUDGET, CacheConfig, EngineConfig, QuantConfig, SchedulerConfig, SpeculativeConfig
from kvserve.engine.heap import frozen_heap
from kvserve.engine.llm_engine import LLMEngine
from kvserve.types import RequestOutput, SamplingParams

Prompt = str | list[int]


# Flat option name -> (config section, field). LLM(...) and the CLI take these flat names, like vLLM.
_OPTIONS = {
    "block_size": ("cache", "block_size"),
    "num_kv_blocks": ("cache", "num_kv_blocks"),
    "kv_cache_memory_bytes": ("cache", "kv_cache_memory_bytes"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "kv_cache_dtype": ("cache", "kv_cache_dtype"),
    "quantization": ("quant", "quantization"),
    "quantization_group_size": ("quant", "group_size"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "max_model_len": ("scheduler", "max_model_len"),
    "scheduling_policy": ("scheduler", "policy"),
    "speculative_method": ("speculative", "method"),
    "num_speculative_tokens": ("speculative", "num_speculative_tokens"),
    "speculative_model": ("speculative", "model"),
    "speculative_ngram_min": ("speculative", "ngram_min"),
    "speculative_ngram_max": ("speculative", "ngram_max"),
    "speculative_max_batch_size": ("speculative", "max_batch_size"),
}
_SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "speculative": SpeculativeConfig,
             "quant": QuantConfig}


def engine_config(model: str | None = None, dtype: str = "auto", seed: int = 0, device: str = "cpu",
                  attention_backend: str = "auto", enforce_eager: bool = False, **options) -> EngineConfig:
    """The EngineConfig for flat options (see _OPTIONS); `kvserve serve` builds its engine the same way.

    Unknown option names raise ValueError listing the known ones; each value is checked by its section.
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(_OPTIONS)}")
    if options.get("max_num_batched_tokens") is None:  # the device's default token budget
        options["max_num_batched_tokens"] = (CUDA_TOKEN_BUDGET if str(device).startswith("cuda")
                                             else SchedulerConfig.max_num_batched_tokens)
    fields: dict[str, dict] = {name: {} for name in _SECTIONS}
    for name, value in options.items():
        section, field_name = _OPTIONS[name]
        fields[section][field_name] = value
    sections = {name: cls(**fields[name]) for name, cls in _SECTIONS.items()}
    return EngineConfig(model=model, dtype=dtype, seed=seed, device=device, attention_backend=attention_backend,
                        enforce_eager=enforce_eager, **sections)


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    ``model`` is a Hugging Face folder, a .gguf file, or None for the bundled SmolLM2-135M-Instruct.
    ``dtype``: "auto" (bfloat16 for a 16-bit or GGUF checkpoint where the device computes it
    natively, else float32; see model/loader.py auto_dtype), "float32", "bfloat16" or "float16".
    Options (defaults in kvserve/config.py): block_size=16, num_kv_blocks=None (size the pool from
    kv_cache_memory_bytes=1 GiB), enable_prefix_caching=True, max_num_seqs=64,
    max_num_batched_tokens=None (1024 on the CPU, 8192 on CUDA), max_model_len=None,
    scheduling_policy="shortest-first" ("fcfs"), speculative_method=None ("ngram" | "draft"),
    num_speculative_tokens=4, speculative_model, speculative_ngram_min=1, speculative_ngram_max=4,
    speculative_max_batch_size=8, quantization=None (keep a GGUF file's block quantization; "none",
    "int8", "int4"), quantization_group_size=None (32; -1 = one scale per output channel, int8 only),
    kv_cache_dtype="auto" ("int8", "fp8").
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", seed: int = 0, device: str = "cpu",
                 **options) -> None:
        self.engine = LLMEngine(engine_config(model, dtype, seed, device, **options))
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
        from tqdm.auto import tqdm  # here, not at the top: `kvserve serve` imports this module, not tqdm.auto

        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not show_progress, unit="req")
        try:
            with frozen_heap():  # full garbage collections would walk every start-up object: see engine/heap.py
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
