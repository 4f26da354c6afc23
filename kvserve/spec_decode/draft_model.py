"""Draft-model proposals: a smaller model with the same tokenizer guesses k tokens autoregressively.

The draft keeps its own paged KV cache. Each step it first catches up on the tokens the target
accepted since its last turn (one chunk per request, batched), then decodes k - 1 more tokens for
all requests at once. Its KV past the real tokens is dropped logically: the next catch-up simply
overwrites those slots.
"""

from __future__ import annotations

import torch

from kvserve.config import EngineConfig, ModelConfig
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_cache.sizing import size_kv_cache
from kvserve.model.attention.backend import get_backend
from kvserve.model.loader import load_model, resolve_model_path
from kvserve.request import Request
from kvserve.sample.sampler import draw, row_probs, seeded_generator
from kvserve.scheduler.output import ScheduledRequest
from kvserve.spec_decode.proposer import Proposal, register_proposer
from kvserve.types import SamplingParams
from kvserve.worker.model_runner import ModelRunner

_DRAFT_SEED_OFFSET = 104729


@register_proposer("draft")
class DraftModelProposer:
    def __init__(self, draft_model: str, target_config: ModelConfig, engine_config: EngineConfig, **_: object) -> None:
        device = torch.device(engine_config.device)
        model, self.config = load_model(resolve_model_path(draft_model), engine_config.torch_dtype, device,
                                        engine_config.quant, weight_cache_gb=engine_config.weight_cache_gb)
        if abs(self.config.vocab_size - target_config.vocab_size) > 1024:
            raise ValueError(f"draft vocab {self.config.vocab_size} differs from the target's "
                             f"{target_config.vocab_size}: the draft must share the target's tokenizer")
        self.target_vocab = target_config.vocab_size
        info = size_kv_cache(engine_config, self.config)  # the target's sizing rule, for the draft's own pool
        self.kv = KVCacheManager(info.num_blocks, info.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, self.config, get_backend(device, engine_config.cache.kv_cache_dtype,
                                                                       engine_config.attention_backend),
                                  info.num_blocks, info.block_size,
                                  engine_config.torch_dtype, device, engine_config.seed + _DRAFT_SEED_OFFSET)
        self._computed: dict[str, int] = {}

    def propose(self, requests: list[Request], k: int) -> dict[str, Proposal]:
        live = [r for r in requests if self.kv.allocate_slots(r.request_id, r.num_tokens + k)]
        if not live:
            return {}
        tokens: dict[str, list[int]] = {r.request_id: [] for r in live}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in live}
        batch = [self._chunk(r, r.token_slice(self._computed.get(r.request_id, 0), r.num_tokens),
                             self._computed.get(r.request_id, 0)) for r in live]
        for step in range(k):
            logits = self.runner.last_logits(batch)
            for r, row in zip(live, logits):
                tok, q = self._draw(row, r, step)
                tokens[r.request_id].append(tok)
                probs[r.request_id].append(q)
            if step + 1 < k:
                batch = [self._chunk(r, [tokens[r.request_id][-1]], r.num_tokens + step) for r in live]
        for r in live:
            self._computed[r.request_id] = r.num_tokens  # draft KV beyond the real tokens is discarded
        return {r.request_id: Proposal(tokens[r.request_id], self._stack(probs[r.request_id])) for r in live}

    def _chunk(self, r: Request, token_ids: list[int], start: int) -> ScheduledRequest:
        return ScheduledRequest(request_id=r.request_id, token_ids=token_ids, start_pos=start,
                                block_table=self.kv.block_table(r.request_id), sample=True,
                                sampling_params=r.sampling_params)

    def _draw(self, logits: torch.Tensor, r: Request, step: int) -> tuple[int, torch.Tensor | None]:
        """The draft's guess and, when sampling, the distribution it was drawn from."""
        params: SamplingParams = r.sampling_params
        if params.greedy:
            return int(logits.argmax()), None
        q = row_probs(logits[None], [params])[0].cpu()
        if q.shape[0] < self.target_vocab:
            q = torch.cat([q, q.new_zeros(self.target_vocab - q.shape[0])])
        seed = params.seed if params.seed is not None else 0
        gen = seeded_generator(seed, len(r.output_token_ids) + step + _DRAFT_SEED_OFFSET)
        return draw(q, gen), q[:self.target_vocab]

    @staticmethod
    def _stack(probs: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if probs[0] is None else torch.stack(probs)

    def forget(self, request_id: str) -> None:
        self.kv.forget(request_id)
        self._computed.pop(request_id, None)

