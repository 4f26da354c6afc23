"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence

from kvserve.config import engine_config, engine_options
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.runtime.heap import collection_paused, frozen_heap
from kvserve.types import RequestOutput, SamplingParams

Prompt = str | list[int]


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    ``model`` is a Hugging Face folder, a .gguf file, or None for the bundled SmolLM2-135M-Instruct.
    The other keywords are the engine options of kvserve/config.py (``engine_options()``), the same
    as ``kvserve serve``'s flags: e.g. ``dtype="bfloat16"``, ``max_num_seqs=32``,
    ``speculative_method="ngram"``, ``quantization="int8"``, ``kv_cache_dtype="int8"``.
    """

    def __init__(self, model: str | None = None, **options) -> None:
        with collection_paused():  # loading makes objects that live for good: see runtime/heap.py
            self.engine = LLMEngine(engine_config(model=model, **options))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Every prompt is validated before any is queued, so a bad one raises ValueError and the
        engine is left exactly as it was. A request that makes a step raise raises RequestFailedError
        (the rest of the batch is aborted; the engine stays usable).
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        encoded = []  # each prompt's token ids, text encoded once here
        for i, prompt in enumerate(prompts):
            try:
                if isinstance(prompt, str) and not prompt:
                    raise ValueError("prompt is empty: give a non-empty string or token ids")
                encoded.append(self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt))
                self.engine.core.validate_prompt(params[i].truncate(encoded[-1], self.engine.core.max_model_len))
                self.engine.core.validate_params(params[i])
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p, token_ids in zip(ids, prompts, params, encoded):
            self.engine.add_request(rid, prompt, p, encoded=token_ids)
        return self._run(ids, use_tqdm if use_tqdm is not None else len(prompts) >= 16)

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm  # here, not at the top: `kvserve serve` imports this module, not tqdm.auto

        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not show_progress, unit="req")
        try:
            with frozen_heap():  # full garbage collections would walk every start-up object: see runtime/heap.py
                while len(done) < len(ids):
                    for out in self.engine.step(finished_only=True):
                        done[out.request_id] = out
                        bar.update(1)
                    failed = self.engine.take_failed()
                    if failed:  # the others are aborted below: generate() returns all outputs or raises
                        raise failed[0]
        except BaseException:
            for rid in ids:  # leave no half-finished request holding KV blocks
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]


def _init_signature() -> inspect.Signature:
    """``LLM.__init__``'s keywords as help() and editors show them: the engine options."""
    kind = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature([
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        *(inspect.Parameter(o.name, kind, default=o.default) for o in engine_options() if o.name != "model")])


LLM.__init__.__signature__ = _init_signature()


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
