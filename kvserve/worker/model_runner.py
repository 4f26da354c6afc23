"""Turns a SchedulerOutput into one forward pass over a flat batch and samples the next tokens.

Owns the device state: the model, the KV-cache tensors, the attention backend and the sampler.
"""

from __future__ import annotations

import itertools

import torch

from kvserve.config import ModelConfig
from kvserve.model.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.sample.sampler import Sampler, SamplingBatch
from kvserve.scheduler.output import ScheduledRequest, SchedulerOutput


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, backend: AttentionBackend, num_blocks: int,
                 block_size: int, kv_dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        self.model, self.config, self.backend = model, config, backend
        self.block_size, self.device = block_size, device
        self.kv_caches = [
            backend.allocate_kv_cache(num_blocks, block_size, config.num_kv_heads, config.head_dim, kv_dtype, device)
            for _ in range(config.num_layers)
        ]
        self.sampler = Sampler(seed)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run the step; returns {request_id: sampled token} for requests whose chunk ends their tokens."""
        batch = out.scheduled
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        rows = [i for i, s in enumerate(batch) if s.sample]
        if not rows:
            return {}
        last = torch.tensor([meta.query_start[i + 1] - 1 for i in rows], device=self.device)
        logits = self.model.compute_logits(hidden[last])
        sampling = SamplingBatch([batch[i].sampling_params for i in rows], [batch[i].num_generated for i in rows])
        tokens = self.sampler(logits, sampling).tolist()
        return {batch[i].request_id: tok for i, tok in zip(rows, tokens)}

    def _prepare(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat token ids, positions and attention metadata, built with vectorised ops."""
        dev, bs = self.device, self.block_size
        lens = [len(s.token_ids) for s in batch]
        query_start = [0, *itertools.accumulate(lens)]
        seq_lens = [s.start_pos + n for s, n in zip(batch, lens)]
        input_ids = torch.tensor(list(itertools.chain.from_iterable(s.token_ids for s in batch)), dtype=torch.long)
        seq_of_token = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(lens))
        starts = torch.tensor([s.start_pos for s in batch], dtype=torch.long)
        offsets = torch.arange(query_start[-1]) - torch.tensor(query_start[:-1])[seq_of_token]
        positions = starts[seq_of_token] + offsets
        width = max(len(s.block_table) for s in batch)
        block_tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in batch], dtype=torch.long)
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        decode_seqs = [i for i, n in enumerate(lens) if n == 1]
        meta = AttentionMetadata(
            num_seqs=len(batch),
            query_start=query_start,
            seq_lens=seq_lens,
            slot_mapping=slot_mapping.to(dev),
            block_tables=block_tables.to(dev),
            seq_lens_t=torch.tensor(seq_lens, device=dev),
            decode_seqs=decode_seqs,
            prefill_seqs=[i for i, n in enumerate(lens) if n > 1],
            decode_token_index=torch.tensor([query_start[i] for i in decode_seqs], dtype=torch.long, device=dev),
            block_size=bs,
        )
        return input_ids.to(dev), positions.to(dev), meta
