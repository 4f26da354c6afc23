"""Turns a SchedulerOutput into one forward pass over a flat batch and samples the next tokens.

Owns the device state: the model, the KV-cache tensors, the attention backend and the sampler.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field

import torch

from kvserve.config import ModelConfig
from kvserve.kv_cache.groups import KVLayout, single_layout
from kvserve.model.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.model.attention.mla import allocate_latent_cache
from kvserve.model.models.llama_decode import build_fused_decoder
from kvserve.request import PLACEHOLDER
from kvserve.sample.device_tokens import SampledTokens, fill_placeholders
from kvserve.sample.grammar import MaskFiller, MaskRequest, apply_bitmask
from kvserve.sample.penalties import bad_word_completions
from kvserve.sample.rejection import accept_proposals
from kvserve.sample.sampler import Sampler, SamplingBatch, scored_logprobs
from kvserve.scheduler.output import ScheduledRequest, SchedulerOutput
from kvserve.types import TokenLogprob
from kvserve.worker.block_tables import BlockTableRows
from kvserve.worker.cuda_graphs import capture_decode_graphs

log = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    """What one step produced: the sampled token of every request whose chunk ends its tokens, their
    logprobs where asked, and prompt logprobs as (first prompt position scored, one per position)."""

    token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # Speculative requests: the tokens verification emitted (accepted proposals + one from the target).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # execute(defer=True): the sampled ids, still on the device; token_ids stays empty until read.
    pending: SampledTokens | None = None


def allocate_kv_caches(backend: AttentionBackend, config: ModelConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device, count: int | None = None) -> list[torch.Tensor]:
    """``count`` paged caches (default: one per layer): the backend's K/V layout, or for latent
    attention (MLA) one latent row per token (attention/mla.py), the layout
    ``sizing.mla_kv_bytes_per_token`` counts."""
    count = config.num_layers if count is None else count
    if config.mla is not None:
        return [allocate_latent_cache(num_blocks, block_size, config.mla.latent_width, dtype, device)
                for _ in range(count)]
    return [backend.allocate_kv_cache(num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype, device)
            for _ in range(count)]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, backend: AttentionBackend, num_blocks: int,
                 block_size: int, kv_dtype: torch.dtype, device: torch.device, seed: int = 0,
                 cuda_graphs: tuple[int, int] | None = None, kv_layout: KVLayout | None = None) -> None:
        """``cuda_graphs`` = (max batch, max model length): capture decode steps on CUDA for up to that.
        ``kv_layout``: the KV groups (kv_cache/groups.py); by default one group of every layer."""
        self.model, self.config, self.backend = model, config, backend
        self.block_size, self.device = block_size, device
        self.kv_layout = kv_layout or single_layout(config.num_layers)
        # one tensor per slot of a block; a hybrid model's groups share them, each using its own blocks
        self.kv_tensors = allocate_kv_caches(backend, config, num_blocks, block_size, kv_dtype, device,
                                             self.kv_layout.layers_per_block)
        self.kv_caches = [self.kv_tensors[slot] for slot in self.kv_layout.slot_of_layer()]  # by layer
        self.group_table_rows = [BlockTableRows() for _ in self.kv_layout.groups[1:]]
        if self.kv_layout.is_hybrid:
            if not hasattr(model, "use_kv_groups"):
                raise ValueError(f"{config.architecture} cannot read per-group KV block tables (hybrid KV cache)")
            model.use_kv_groups(self.kv_layout.group_of_layer())
        self.sampler = Sampler(seed)
        self.mask_filler: MaskFiller | None = None  # structured outputs: started with the first constrained request
        self.block_table_rows = BlockTableRows()
        # Pure decode steps in one C++ call where the model and backend allow (bitwise the same result).
        self.fused_decoder = self._build_fused_decoder()
        self.decode_graphs = None
        # (soft-capped attention and MLA's take paths with host values: nothing to capture)
        if cuda_graphs is not None and self.kv_layout.is_hybrid:
            log.info("hybrid KV groups: decode steps run eagerly (the graphs hold one block table per step)")
        elif (cuda_graphs is not None and device.type == "cuda" and backend.supports_cuda_graphs
                and config.attn_logit_softcap is None and config.mla is None):
            self.decode_graphs = capture_decode_graphs(self._eager_forward, *cuda_graphs, block_size, device)

    def _build_fused_decoder(self):
        return build_fused_decoder(self.model, self.kv_caches, self.backend.fused_cache_kind(self.device))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, previous: SampledTokens | None = None, defer: bool = False) -> RunnerOutput:
        """Run the step; sample the next token of every request whose chunk ends its known tokens.

        Async scheduling: a PLACEHOLDER input id is the token ``previous`` sampled for that request,
        taken from the device; ``defer`` leaves this step's sampled ids there too (``pending``)."""
        batch = out.scheduled
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        mask_rows, masks = self._start_masks(batch)  # filled on a worker thread during the forward pass
        placeholders = previous is not None and _point_placeholders(batch, previous.rows)
        input_ids, positions, meta = self._prepare(batch)
        if placeholders:
            input_ids = fill_placeholders(input_ids, previous.token_ids)
        hidden = self._forward(input_ids, positions, meta, _verify_only(batch))
        bitmask = masks.result() if masks is not None else None
        result = RunnerOutput(prompt_logprobs=self._prompt_logprobs(batch, hidden, meta))
        rows = [i for i, s in enumerate(batch) if s.sample and not s.spec_token_ids]
        spec_rows = [i for i, s in enumerate(batch) if s.spec_token_ids]
        if spec_rows:
            result.spec_token_ids = self._verify(batch, spec_rows, hidden, meta, mask_rows, bitmask)
        if not rows:
            return result
        logits = self.model.compute_logits(self._rows_of(hidden, rows, meta))
        chosen = [batch[i] for i in rows]
        sampling = SamplingBatch([s.sampling_params for s in chosen], [s.num_generated for s in chosen],
                                 [s.prompt_token_ids for s in chosen], [s.output_token_ids for s in chosen],
                                 held_back=[_held_back(s) for s in chosen])
        if bitmask is not None:
            sampling.masked_rows = [j for j, i in enumerate(rows) if i in mask_rows]
            if sampling.masked_rows:
                sampling.bitmask = bitmask[[mask_rows[rows[j]] for j in sampling.masked_rows]]
        tokens, logprobs = self.sampler.sample_on_device(logits, sampling)
        if defer:
            result.pending = SampledTokens(tokens, [s.request_id for s in chosen])
        else:
            result.token_ids = dict(zip([s.request_id for s in chosen], tokens.tolist()))
        if logprobs is not None:
            result.logprobs = {s.request_id: lp for s, lp in zip(chosen, logprobs) if lp is not None}
        return result

    @torch.inference_mode()
    def last_logits(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        """Forward a batch and return the logits at each sequence's last position [B, V] (draft models)."""
        input_ids, positions, meta = self._prepare(batch)
        hidden = self._forward(input_ids, positions, meta)
        return self.model.compute_logits(self._rows_of(hidden, range(len(batch)), meta))

    def _rows_of(self, hidden: torch.Tensor, rows, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden state at the last position of each sequence in ``rows`` (all of a pure decode
        step's rows are already that: no gather)."""
        if len(rows) == meta.num_seqs == hidden.shape[0]:
            return hidden
        return hidden[torch.tensor([meta.query_start[i + 1] - 1 for i in rows], device=self.device)]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 verify_only: bool = False) -> torch.Tensor:
        """``verify_only``: every sequence brings its last token plus proposals, no prompt chunk."""
        if verify_only and meta.prefill_seqs and self.fused_decoder is not None:
            return self.fused_decoder.verify(input_ids, positions, meta)
        if not meta.prefill_seqs:
            if self.fused_decoder is not None:
                return self.fused_decoder(input_ids, positions, meta)
            if self.decode_graphs is not None:
                hidden = self.decode_graphs.run(input_ids, positions, meta)
                if hidden is not None:
                    return hidden
        return self._eager_forward(input_ids, positions, meta)

    def _eager_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend)

    def _start_masks(self, batch: list[ScheduledRequest]):
        """Structured outputs: each constrained request that samples this step gets one mask row per
        position it is sampled or verified at. Returns ({batch index: its first mask row}, a future
        of the bitmask), or ({}, None) when no request is constrained (the common case costs nothing)."""
        requests, first_rows, num_rows = [], {}, 0
        for i, s in enumerate(batch):
            if s.grammar is not None and s.sample:
                first_rows[i] = num_rows
                requests.append(MaskRequest(s.grammar, num_rows, list(s.spec_token_ids)))
                num_rows += 1 + len(s.spec_token_ids)
        if not requests:
            return first_rows, None
        if self.mask_filler is None:
            self.mask_filler = MaskFiller(self.config.vocab_size)
        return first_rows, self.mask_filler.start(requests, num_rows)

    def _verify(self, batch: list[ScheduledRequest], rows: list[int], hidden: torch.Tensor, meta: AttentionMetadata,
                mask_rows: dict[int, int], bitmask: torch.Tensor | None) -> dict[str, list[int]]:
        """Score each request's k proposals plus one position in one lm_head call (constrained
        requests' positions masked by their grammar); the acceptance rule is sample/rejection.py's."""
        spans = [(meta.query_start[i + 1] - len(batch[i].spec_token_ids) - 1, meta.query_start[i + 1]) for i in rows]
        index = torch.tensor([p for a, b in spans for p in range(a, b)], device=self.device)
        logits = self.model.compute_logits(hidden[index])
        if bitmask is not None:
            logit_rows, bit_rows, offset = [], [], 0
            for i, (a, b) in zip(rows, spans):
                if i in mask_rows:
                    logit_rows += range(offset, offset + b - a)
                    bit_rows += range(mask_rows[i], mask_rows[i] + b - a)
                offset += b - a
            if logit_rows:
                logits = apply_bitmask(logits, bitmask[bit_rows], logit_rows)
        return accept_proposals(logits, [batch[i] for i in rows], self.sampler.generator)

    def _prompt_logprobs(self, batch: list[ScheduledRequest], hidden: torch.Tensor,
                         meta: AttentionMetadata) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """Score the prompt tokens this step's chunk predicts: position p's logits give token p + 1."""
        result = {}
        for i, s in enumerate(batch):
            k = s.sampling_params.prompt_logprobs
            if k is None:
                continue
            end = min(s.start_pos + len(s.token_ids), len(s.prompt_token_ids) - 1)
            if end <= s.start_pos:
                continue
            first = meta.query_start[i]
            logits = self.model.compute_logits(hidden[first:first + end - s.start_pos])
            targets = s.prompt_token_ids[s.start_pos + 1:end + 1]
            result[s.request_id] = (s.start_pos + 1, scored_logprobs(logits, targets, k))
        return result

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write for forks: duplicate a partly filled block before the child writes to it."""
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_tensors:
            cache[:, dst] = cache[:, src]

    def _prepare(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat token ids, positions and attention metadata."""
        if all(len(s.token_ids) == 1 for s in batch):
            return self._prepare_decode(batch)
        return self._prepare_mixed(batch)

    def _prepare_mixed(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``_prepare`` for any step, built with vectorised ops."""
        dev, bs = self.device, self.block_size
        lens = [len(s.token_ids) for s in batch]
        query_start = [0, *itertools.accumulate(lens)]
        seq_lens = [s.start_pos + n for s, n in zip(batch, lens)]
        input_ids = torch.tensor(list(itertools.chain.from_iterable(s.token_ids for s in batch)), dtype=torch.long)
        seq_of_token = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(lens))
        starts = torch.tensor([s.start_pos for s in batch], dtype=torch.long)
        offsets = torch.arange(query_start[-1]) - torch.tensor(query_start[:-1])[seq_of_token]
        positions = positions_host = starts[seq_of_token] + offsets
        block_tables = self._block_tables(batch)
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        decode_seqs = [i for i, n in enumerate(lens) if n == 1]
        decode_width = -(-max((seq_lens[i] for i in decode_seqs), default=0) // bs)
        host = [input_ids, positions, slot_mapping, block_tables, torch.tensor(seq_lens, dtype=torch.long),
                torch.tensor([query_start[i] for i in decode_seqs], dtype=torch.long),
                block_tables[decode_seqs, :decode_width],
                torch.tensor([seq_lens[i] for i in decode_seqs], dtype=torch.long)]
        (input_ids, positions, slot_mapping, block_tables, seq_lens_t, decode_token_index, decode_block_tables,
         decode_seq_lens) = _to_device(host, dev)
        meta = AttentionMetadata(
            num_seqs=len(batch),
            query_start=query_start,
            seq_lens=seq_lens,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens_t=seq_lens_t,
            decode_seqs=decode_seqs,
            prefill_seqs=[i for i, n in enumerate(lens) if n > 1],
            decode_token_index=decode_token_index,
            decode_block_tables=decode_block_tables,
            decode_seq_lens=decode_seq_lens,
            block_size=bs,
        )
        if self.group_table_rows:
            meta.group_metas = self._group_metas(meta, batch, seq_of_token, positions_host, decode_seqs, decode_width)
        return input_ids, positions, meta

    def _prepare_decode(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``_prepare`` for a step of one token per sequence, from plain lists: the general path's
        ~20 tensor ops are a visible share of a single-stream token."""
        bs, n = self.block_size, len(batch)
        positions = [s.start_pos for s in batch]
        seq_lens = [p + 1 for p in positions]
        decode_width = -(-max(seq_lens) // bs)
        tables = self._block_tables(batch)
        host = [torch.tensor([s.token_ids[0] for s in batch], dtype=torch.long),
                torch.tensor(positions, dtype=torch.long),
                torch.tensor([s.block_table[p // bs] * bs + p % bs for s, p in zip(batch, positions)], dtype=torch.long),
                tables, torch.tensor(seq_lens, dtype=torch.long), torch.arange(n, dtype=torch.long),
                tables if decode_width == tables.shape[1] else tables[:, :decode_width].contiguous()]
        input_ids, positions_t, slots, block_tables, seq_lens_t, token_index, decode_tables = _to_device(host, self.device)
        meta = AttentionMetadata(num_seqs=n, query_start=list(range(n + 1)), seq_lens=seq_lens, slot_mapping=slots,
                                 block_tables=block_tables, seq_lens_t=seq_lens_t, decode_seqs=list(range(n)),
                                 prefill_seqs=[], decode_token_index=token_index, decode_block_tables=decode_tables,
                                 decode_seq_lens=seq_lens_t, block_size=bs)
        if self.group_table_rows:
            meta.group_metas = self._group_metas(meta, batch, torch.arange(n), torch.tensor(positions, dtype=torch.long),
                                                 list(range(n)), decode_width)
        return input_ids, positions_t, meta

    def _block_tables(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        """[len(batch), longest table] int64, each row padded with 0 (see worker/block_tables.py)."""
        width = max(len(s.block_table) for s in batch)
        return torch.from_numpy(self.block_table_rows.gather([s.request_id for s in batch],
                                                             [s.block_table for s in batch], width))

    def _group_metas(self, meta: AttentionMetadata, batch: list[ScheduledRequest], seq_of_token: torch.Tensor,
                     positions: torch.Tensor, decode_seqs: list[int], decode_width: int) -> tuple[AttentionMetadata, ...]:
        """``meta`` for each KV group after the first: the same batch through that group's tables
        (host ``seq_of_token`` and ``positions``, one per token)."""
        bs, ids, host = self.block_size, [s.request_id for s in batch], []
        for j, rows in enumerate(self.group_table_rows):
            tables = [s.group_block_tables[j] for s in batch]
            block_tables = torch.from_numpy(rows.gather(ids, tables, max(len(t) for t in tables)))
            slots = block_tables[seq_of_token, positions // bs] * bs + positions % bs
            host += [slots, block_tables, block_tables[decode_seqs, :decode_width]]
        parts = _to_device(host, self.device)  # one copy for every group
        return tuple(dataclasses.replace(meta, slot_mapping=slots, block_tables=tables, decode_block_tables=decode)
                     for slots, tables, decode in zip(parts[0::3], parts[1::3], parts[2::3]))


def _held_back(s: ScheduledRequest) -> list[int]:
    """The tokens ``s`` may not sample this step: its EOS and stop ids until min_tokens are out, and
    whatever would complete one of its bad words."""
    params = s.sampling_params
    held = [*s.eos_token_ids, *params.stop_token_ids] if s.num_generated < params.min_tokens else []
    if params.bad_words_token_ids:
        held += bad_word_completions(params.bad_words_token_ids, s.output_token_ids)
    return held


def _point_placeholders(batch: list[ScheduledRequest], rows: dict[str, int]) -> bool:
    """Point each PLACEHOLDER input id at its row of the previous step's sampled ids (as -1 - row, for
    ``fill_placeholders``); whether there was any. Only a decode's one input can be pending."""
    found = False
    for s in batch:
        if s.token_ids[-1] <= PLACEHOLDER:  # (already pointed when a failed step is rerun request by request)
            s.token_ids[-1] = -1 - rows[s.request_id]
            found = True
    return found


def _verify_only(batch: list[ScheduledRequest]) -> bool:
    """Every request decodes: one token, or one plus the proposals it verifies (no prompt chunk)."""
    return all(len(s.token_ids) == 1 + len(s.spec_token_ids) for s in batch)


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The step's int64 host tensors on ``device``: one host-to-device copy for all (each copy from
    pageable memory waits for the transfer), split back into views."""
    if device.type == "cpu":
        return tensors
    return _unpack(_pack(tensors).to(device), tensors)


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' values in one flat int64 tensor, each starting at a multiple of 16 bytes: Triton
    specializes a kernel on its pointers' alignment, so unaligned views would compile another variant
    mid-run."""
    flat = torch.zeros(sum(_padded(t) for t in tensors), dtype=torch.long)
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()] = t.reshape(-1)
        offset += _padded(t)
    return flat


def _unpack(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    parts, offset = [], 0
    for t in like:
        parts.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += _padded(t)
    return parts


def _padded(t: torch.Tensor) -> int:
    return t.numel() + t.numel() % 2  # int64 elements: an even count keeps the next part 16-byte aligned
