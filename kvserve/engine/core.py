"""EngineCore: the token-level loop. schedule -> execute -> update, once per ``step()``.

It knows token ids only; text (tokenizing, detokenizing, stop strings) is the frontend's job.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from kvserve.config import EngineConfig
from kvserve.engine.stats import EngineSnapshot
from kvserve.kv_cache.groups import KVLayout, kv_layout
from kvserve.kv_cache.hybrid import make_kv_cache
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_cache.sizing import KVCacheInfo, max_sequence_blocks, max_window_blocks, size_kv_cache
from kvserve.model.attention.backend import get_backend
from kvserve.model.loader import load_model, resolve_auto, resolve_model_path
from kvserve.model.quant.registry import describe_quantization, weight_bytes
from kvserve.model.sharding import TensorShard
from kvserve.request import Request, RequestStatus
from kvserve.runtime.allocator import keep_freed_memory
from kvserve.runtime.host_memory import check_fits
from kvserve.sample.device_tokens import SampledTokens
from kvserve.sample.grammar import GrammarCompiler
from kvserve.scheduler.output import ScheduledRequest, SchedulerOutput
from kvserve.scheduler.scheduler import Scheduler
from kvserve.spec_decode.controller import SpeculativeController
from kvserve.spec_decode.proposer import make_proposer
from kvserve.types import FinishReason, SamplingParams, TokenLogprob
from kvserve.worker.model_runner import ModelRunner, RunnerOutput
from kvserve.worker.tensor_parallel import RankFailedError, TensorParallelRunner

log = logging.getLogger(__name__)

# Consecutive steps in which every request failed, beyond which the fault is the engine's, not theirs.
MAX_FAILED_STEPS = 3


class RequestFailedError(RuntimeError):
    """A step raised for this request alone; it was taken out and the others carried on."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"request {request_id} failed inside the engine ({type(cause).__name__}: {cause}); "
                         "the other requests were not affected")
        self.request_id, self.cause = request_id, cause


class EngineFatalError(RuntimeError):
    """A failure that is not one request's fault: the engine cannot go on (a server exits, to be restarted)."""


@dataclass
class StepUpdate:
    """What one step did to one request."""

    request: Request
    new_token_ids: list[int]
    finished: bool


@dataclass
class InFlightStep:
    """A launched step not read yet (async scheduling): its requests as they were when it was
    scheduled (a request id can come back as another request), and what the runner returned."""

    requests: dict[str, Request]
    result: RunnerOutput

    def sampled_ids(self):
        result = self.result
        return result.pending.request_ids if result.pending is not None else result.token_ids.keys()


@dataclass(frozen=True)
class MemoryReport:
    """What the weights and the KV cache occupy: logged at start-up and exported on /metrics."""

    weight_bytes: int
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    kv_cache_bytes: int
    quantization: str
    kv_cache_dtype: str

    @staticmethod
    def of(model: torch.nn.Module, kv: KVCacheInfo, config: EngineConfig) -> MemoryReport:
        return MemoryReport(weight_bytes(model), kv.bytes_per_token, kv.capacity_tokens, kv.pool_bytes,
                            describe_quantization(model), config.cache.kv_cache_dtype)

    def summary(self) -> str:
        return (f"weights {self.weight_bytes / 2**20:.1f} MiB ({self.quantization}); KV cache "
                f"{self.kv_cache_bytes / 2**20:.1f} MiB ({self.kv_cache_dtype}), {self.kv_bytes_per_token} B/token, "
                f"capacity {self.kv_capacity_tokens} tokens")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.model_path = resolve_model_path(config.model)
        device = torch.device(config.device)
        dtype, quant = resolve_auto(config.dtype, config.quant, self.model_path, device)
        if config.dtype == "auto":
            log.info("dtype: %s (auto)", dtype)
        config = dataclasses.replace(config, dtype=dtype, quant=quant)
        self.config = config
        if device.type == "cpu":
            keep_freed_memory()  # large per-step tensors reuse heap memory: see runtime/allocator.py
        tp = config.tensor_parallel_size
        model, self.model_config = load_model(self.model_path, config.torch_dtype, device, config.quant,
                                              config.scheduler.max_model_len,
                                              shard=TensorShard(0, tp) if tp > 1 else None,
                                              weight_cache_gb=config.weight_cache_gb)
        self.kv_layout = self._kv_layout(model, config)
        self.kv_info = size_kv_cache(config, self.model_config, self.kv_layout)
        self.memory = MemoryReport.of(model, self.kv_info, config)
        log.info("memory: %s", self.memory.summary())
        if device.type == "cpu":  # its pages are committed as they are written: refuse now, not under load
            check_fits(self.memory.kv_cache_bytes, "the KV cache",
                       "lower --kv-cache-memory (kv_cache_memory_bytes) or --num-kv-blocks")
        backend = get_backend(device, config.cache.kv_cache_dtype, config.attention_backend)
        self.sinks = config.cache.attention_sinks
        if self.sinks:
            window = self._use_attention_sinks(model, backend, config)
            self.max_model_len = min(self.model_config.max_position, config.scheduler.max_model_len or 1 << 62)
            self.kv_cache = KVCacheManager(self.kv_info.num_blocks, self.kv_info.block_size,
                                           config.cache.enable_prefix_caching, window=window, sinks=self.sinks)
        else:
            self.max_model_len = min(self.model_config.max_position, config.scheduler.max_model_len or 1 << 62,
                                     self._kv_length_limit(config))
            self.kv_cache = make_kv_cache(self.kv_info.num_blocks, self.kv_info.block_size, self.kv_layout,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        graphs = None if config.enforce_eager else (config.scheduler.max_num_seqs, self.max_model_len)
        if tp > 1:  # rank 0 of tp: the other ranks are started here with the same KV block layout
            self.runner = TensorParallelRunner(model, self.model_path, config, backend, self.kv_info.num_blocks,
                                               self.kv_info.block_size)
        else:
            self.runner = ModelRunner(model, self.model_config, backend, self.kv_info.num_blocks,
                                      self.kv_info.block_size, config.torch_dtype, device, config.seed,
                                      cuda_graphs=graphs, kv_layout=self.kv_layout)
        self.num_steps = 0
        self.num_batched_tokens = 0  # tokens computed over all steps (prompt chunks, decodes, proposals)
        self.failed: list[RequestFailedError] = []  # requests a step took out; the caller drains it
        self._failed_steps = 0  # consecutive steps in which every request failed
        self.num_prefill_tokens = self.num_decode_tokens = self.num_spec_tokens = 0  # the same, split
        self.spec = self._make_speculation(config)
        self.overlaps = config.overlap_steps  # async scheduling: see step()
        self._in_flight: InFlightStep | None = None
        self._sync_requests: set[str] = set()  # requests whose every step must be read before the next
        self.grammars: GrammarCompiler | None = None  # structured outputs: set by use_tokenizer()

    def use_tokenizer(self, tokenizer) -> None:
        """Enable structured outputs: grammars are compiled against the model's (HF fast) tokenizer,
        which only the text layer loads."""
        self.grammars = GrammarCompiler(tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)

    def _kv_layout(self, model: torch.nn.Module, config: EngineConfig) -> KVLayout:
        """The KV groups: a hybrid model's local layers keep their own, windowed block tables where the
        runner can read them (one process, a model that reads per-group tables), else one group."""
        hybrid = config.tensor_parallel_size == 1 and hasattr(model, "use_kv_groups")
        return kv_layout(self.model_config.layer_windows, self.model_config.num_layers, hybrid)

    def _kv_length_limit(self, config: EngineConfig) -> int:
        """The longest sequence the KV pool holds: the full groups' share of it once the window groups
        hold their most (max_window_blocks: the window plus a full token budget); no limit when every
        layer slides and that fits (sizing.max_sequence_blocks)."""
        info, groups = self.kv_info, self.kv_layout.groups
        step_tokens = config.scheduler.max_num_batched_tokens  # proposals to verify are cut to the budget too
        windows = {g.window for g in groups if g.window is not None}
        window_blocks = max((max_window_blocks(w, info.block_size, step_tokens) for w in windows), default=0)
        num_full = sum(1 for g in groups if g.window is None)
        blocks = max_sequence_blocks(info.num_blocks, num_full, len(groups) - num_full, window_blocks)
        return 1 << 62 if blocks is None else blocks * info.block_size

    def _use_attention_sinks(self, model: torch.nn.Module, backend, config: EngineConfig) -> int:
        """Turn on attention sinks (``attention_sinks`` N): the model attends to the first N positions
        and the latest max_model_len - N, and the KV cache keeps just those. Returns that window."""
        sinks, context = self.sinks, min(self.model_config.max_position, config.scheduler.max_model_len or 1 << 62)
        if not hasattr(model, "use_attention_sinks"):
            raise ValueError(f"attention_sinks is not supported for {self.model_config.architecture}")
        if any(w is not None for w in self.model_config.layer_windows):
            raise ValueError("attention_sinks: this model has a sliding window of its own; sinks are for "
                             "models that attend fully")
        if config.tensor_parallel_size > 1:
            raise ValueError("attention_sinks does not combine with tensor_parallel_size > 1 yet")
        if backend.name != "torch":
            raise ValueError(f"attention_sinks needs attention_backend='torch'; this engine has {backend.name!r}")
        if config.speculative.method is not None:
            raise ValueError("attention_sinks does not combine with speculative decoding")
        if sinks >= context:
            raise ValueError(f"attention_sinks={sinks} must be below max_model_len={context} (the rest is the window)")
        window, info = context - sinks, self.kv_info
        need = -(-sinks // info.block_size) + max_window_blocks(window, info.block_size,
                                                                config.scheduler.max_num_batched_tokens)
        if need > info.num_blocks:
            raise ValueError(f"attention_sinks: a request holds up to {need} KV blocks ({sinks} sinks, a window of "
                             f"{window}, a step of {config.scheduler.max_num_batched_tokens} tokens); the pool has "
                             f"{info.num_blocks}: add blocks or lower max_model_len / max_num_batched_tokens")
        model.use_attention_sinks(sinks, window)
        return window

    def _make_speculation(self, config: EngineConfig) -> SpeculativeController | None:
        spec = config.speculative
        if spec.method is None:
            return None
        proposer = make_proposer(spec.method, min_n=spec.ngram_min, max_n=spec.ngram_max, draft_model=spec.model,
                                 target_config=self.model_config, engine_config=config)
        return SpeculativeController(spec, proposer, self.max_model_len)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, fork_of: str | None = None) -> Request:
        """Validate and queue a request; raises ValueError naming the problem.

        ``fork_of`` names a sibling with the same prompt whose KV this request shares (n > 1).
        """
        self.validate_prompt(prompt_token_ids)
        self.validate_params(params)
        if params.bad_words and params.bad_words_token_ids is None:
            raise ValueError("bad_words need the tokenizer: give them to LLMEngine or LLM, which tokenize them")
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        if not isinstance(priority, int):
            raise ValueError(f"priority={priority!r} must be an integer (lower runs first)")
        request = Request(request_id, list(prompt_token_ids), params, eos_token_ids=eos, priority=priority,
                          fork_of=fork_of)
        if params.structured_outputs is not None:
            request.grammar = self.grammars.matcher(params.structured_outputs)
        self.scheduler.add_request(request)
        if request.grammar is not None or params.needs_penalties:
            self._sync_requests.add(request_id)
        return request

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(prompt_token_ids) >= self.max_model_len and not self.sinks:  # sinks: any length streams
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; the context window holds "
                             f"{self.max_model_len}, so the prompt must be at most {self.max_model_len - 1}")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:3]}")

    def validate_params(self, params: SamplingParams) -> None:
        """Checks that need the model: logit_bias, allowed_token_ids and bad-word ids must be in the
        vocabulary (bad words once the text layer has tokenized them)."""
        vocab = self.model_config.vocab_size
        bad_word_ids = [t for word in params.bad_words_token_ids or [] for t in word]
        for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or []),
                          ("bad_words", bad_word_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab}); got {bad[:3]}")
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs needs the model's tokenizer: this engine was started without one")
            self.grammars.validate(params.structured_outputs)  # compiles it (cached): a bad schema is a ValueError

    def abort_request(self, request_id: str) -> Request | None:
        request = self.scheduler.requests.get(request_id)
        self.finish(request_id, FinishReason.ABORT)
        return request

    def stats(self, with_block_map: bool = False) -> EngineSnapshot:
        """The gauges and counters now (call on the engine thread); ``with_block_map`` adds the KV
        pool's block map, which costs O(blocks)."""
        kv, spec = self.kv_cache, self.spec.stats if self.spec is not None else None
        return EngineSnapshot(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage, num_preemptions=self.scheduler.num_preemptions,
            kv_cache_tokens=self.kv_info.capacity_tokens, kv_cache_blocks=kv.num_blocks,
            kv_blocks_in_use=kv.held_blocks_by_kind(), weight_bytes=self.memory.weight_bytes,
            kv_bytes_per_token=self.memory.kv_bytes_per_token,
            prefix_cache_queries=kv.prefix_stats.queries, prefix_cache_hits=kv.prefix_stats.hits,
            prefix_cache_evictions=kv.pool.stats.evictions,
            spec_proposed_tokens=spec.proposed if spec else 0, spec_accepted_tokens=spec.accepted if spec else 0,
            spec_verify_steps=spec.verified_requests if spec else 0, spec_emitted_tokens=spec.emitted if spec else 0,
            num_steps=self.num_steps, num_batched_tokens=self.num_batched_tokens,
            num_prefill_tokens=self.num_prefill_tokens, num_decode_tokens=self.num_decode_tokens,
            num_spec_tokens=self.num_spec_tokens, block_map=kv.block_map() if with_block_map else None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- the loop -----------------------------------------------------------------------------
    def warm_up(self, num_tokens: int = 64, first_tokens: int = 8) -> float:
        """Prefill ``first_tokens`` synthetic tokens, then ``num_tokens``; returns the second prefill's
        rate in tokens/s. A fresh process's first steps pay one-time costs (worker threads starting,
        buffers touched for the first time): a server pays them at load rather than in its first
        request's latency, and learns how long a prefill takes here (frontend/client.py sizes its
        burst window by it). The first round is short: it is there for those costs, not to be timed.
        Nothing is left behind: no cached blocks, the step counters as they were."""
        if self.has_unfinished():
            raise RuntimeError("warm_up needs an idle engine")
        limit = min(self.max_model_len - 1, self.config.scheduler.max_num_batched_tokens)
        kv = self.kv_cache
        counters = (self.num_steps, self.num_batched_tokens, self.num_prefill_tokens, self.num_decode_tokens,
                    self.num_spec_tokens)
        caching, kv.enable_prefix_caching = kv.enable_prefix_caching, False
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            for i, n in enumerate((first_tokens, num_tokens)):
                n = max(1, min(n, limit))
                self.add_request(f"warm-up-{i}", [(31 * j + i) % self.model_config.vocab_size for j in range(n)], params)
                start = time.perf_counter()
                while self.has_unfinished():
                    self.step()
                elapsed = time.perf_counter() - start
        finally:
            kv.enable_prefix_caching = caching
            self.num_steps, self.num_batched_tokens = counters[:2]
            self.num_prefill_tokens, self.num_decode_tokens, self.num_spec_tokens = counters[2:]
        return n / elapsed

    def step(self) -> list[StepUpdate]:
        """One step. With async scheduling (``overlaps``) the step launched here is read by the next
        call, and this one returns the previous step's tokens; while a request needs each token
        before the next is scheduled, steps are synchronous (``_needs_sync_steps``)."""
        if self.overlaps and not self._needs_sync_steps():
            return self._step_overlapped()
        updates = self._drain()
        return updates + self._step_sync()

    def _needs_sync_steps(self) -> bool:
        """Speculation proposes from, and grammars and penalties sample by, the tokens so far: the
        step that produced the last one must have been read."""
        return self.spec is not None or bool(self._sync_requests)

    def _step_sync(self) -> list[StepUpdate]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        self._start_step(out)
        sampled = self._execute(out)
        self._record_prompt_logprobs(sampled)
        now, requests, logprobs = time.perf_counter(), self.scheduler.requests, sampled.logprobs
        updates = [self._append_tokens(requests[rid], [tok], now, logprobs.get(rid))
                   for rid, tok in sampled.token_ids.items()]
        if self.spec is not None:
            updates += self._append_verified(out, sampled.spec_token_ids, now)
        # Counters advance after the new tokens are known: the prefix cache hashes full blocks by content.
        accepted = {rid: len(tokens) - 1 for rid, tokens in sampled.spec_token_ids.items()}
        self.scheduler.update_after_step(out, accepted)
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        return updates

    def _start_step(self, out: SchedulerOutput) -> None:
        now = time.perf_counter()
        for s in out.scheduled:
            req = self.scheduler.requests[s.request_id]
            if req.metrics.first_scheduled is None:
                req.metrics.first_scheduled = now
            self._count_kind(s)
        self.num_steps += 1
        self.num_batched_tokens += out.num_batched_tokens

    # ---- async scheduling: schedule and launch step N+1, then read step N ---------------------
    def _step_overlapped(self) -> list[StepUpdate]:
        """Schedule this step from what the host knows: each request the step in flight samples for
        has one more token, pending (``Request.num_pending``), whose id the runner gathers on the
        device. Launch it, then read the step in flight, apply its tokens and stop conditions: a
        request that ended there has computed one token past its end in this step, dropped when this
        step is read (``_read``); its KV was freed when it ended (the device runs steps in order)."""
        previous, self._in_flight = self._in_flight, None
        out = self.scheduler.schedule()
        current = None
        if not out.is_empty:
            self._start_step(out)
            requests = self.scheduler.requests
            current = InFlightStep({s.request_id: requests[s.request_id] for s in out.scheduled},
                                   self._execute(out, previous.result.pending if previous else None, defer=True))
            self.scheduler.advance(out)
            for rid in current.sampled_ids():
                if rid in requests:  # (a request that failed alone was taken out)
                    requests[rid].num_pending += 1
        updates = self._read(previous) if previous is not None else []
        if current is not None:
            self.scheduler.commit(out)  # the tokens its full blocks hold are all known now
            if current.result.pending is None:  # nothing sampled, or run request by request after an error
                updates += self._read(current)
            else:
                self._in_flight = current
        if self._in_flight is not None and not self.scheduler.has_unfinished():
            self._drain()  # every request it computed for has ended: nothing to wait for later
        return updates

    def _read(self, step: InFlightStep) -> list[StepUpdate]:
        """Append a launched step's sampled tokens to the requests that are still there."""
        result = step.result
        if result.pending is not None:
            result.token_ids, result.pending = result.pending.read(), None
        requests, now = self.scheduler.requests, time.perf_counter()
        self._record_prompt_logprobs(result)
        updates = []
        for rid, token in result.token_ids.items():
            request = step.requests[rid]
            request.num_pending -= 1
            if requests.get(rid) is request:  # else it ended (stopped, aborted) before this token
                updates.append(self._append_tokens(request, [token], now, result.logprobs.get(rid)))
        return updates

    def _drain(self) -> list[StepUpdate]:
        """Read the step in flight, if any (before a synchronous step, or when nothing is left)."""
        step, self._in_flight = self._in_flight, None
        return self._read(step) if step is not None else []

    def _execute(self, out: SchedulerOutput, previous: SampledTokens | None = None,
                 defer: bool = False) -> RunnerOutput:
        """Run the step (placeholders from ``previous``; ``defer``: its sampled ids left on the device).
        If it raises, run each request alone: those that fail again are finished and listed in
        ``failed``, the rest keep their results (re-running a chunk rewrites the same KV), read at
        once. EngineFatalError once every request of MAX_FAILED_STEPS steps in a row has failed."""
        try:
            sampled = self._run(out, previous, defer)
        except RankFailedError as error:  # no request's fault: the model is gone
            raise EngineFatalError(str(error)) from error
        except Exception as error:  # noqa: BLE001 - sorted out below: one request's fault, or the engine's
            sampled = self._execute_each(out, error, previous)
        else:
            self._failed_steps = 0
        return sampled

    def _run(self, out: SchedulerOutput, previous: SampledTokens | None, defer: bool) -> RunnerOutput:
        """A synchronous step calls the runner as it always has: ``execute(out)``."""
        if previous is None and not defer:
            return self.runner.execute(out)
        return self.runner.execute(out, previous, defer)

    def _execute_each(self, out: SchedulerOutput, error: Exception, previous: SampledTokens | None) -> RunnerOutput:
        log.warning("a step of %d requests raised %r; running each alone", len(out.scheduled), error)
        merged, failed = RunnerOutput(), []
        for s in out.scheduled:
            try:
                part = self._run(SchedulerOutput([s], block_copies=out.block_copies), previous, False)
            except RankFailedError as e:
                raise EngineFatalError(str(e)) from e
            except Exception as e:  # noqa: BLE001 - this request is the one at fault
                failed.append((s.request_id, e))
                continue
            merged.token_ids.update(part.token_ids)
            merged.logprobs.update(part.logprobs)
            merged.prompt_logprobs.update(part.prompt_logprobs)
            merged.spec_token_ids.update(part.spec_token_ids)
        self._failed_steps = self._failed_steps + 1 if len(failed) == len(out.scheduled) else 0
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise EngineFatalError(f"{self._failed_steps} steps in a row failed for every request: {error!r}") from error
        for request_id, e in failed:
            log.error("request %s failed inside the engine and was taken out: %r", request_id, e)
            self.finish(request_id, FinishReason.ABORT)
            self.failed.append(RequestFailedError(request_id, e))
        return merged

    def take_failed(self) -> list[RequestFailedError]:
        failed, self.failed = self.failed, []
        return failed

    def _count_kind(self, s: ScheduledRequest) -> None:
        """A chunk is speculative proposals at its end, and before them either one decode (a lone token
        past the prompt) or a prefill (prompt tokens, or tokens recomputed after a preemption)."""
        spec = len(s.spec_token_ids)
        rest = len(s.token_ids) - spec
        self.num_spec_tokens += spec
        if rest == 1 and s.start_pos >= len(s.prompt_token_ids):
            self.num_decode_tokens += 1
        else:
            self.num_prefill_tokens += rest

    def _append_verified(self, out: SchedulerOutput, emitted: dict[str, list[int]], now: float) -> list[StepUpdate]:
        updates = []
        for s in out.scheduled:
            if s.request_id in emitted:
                request = self.scheduler.requests[s.request_id]
                self.spec.record(request, len(s.spec_token_ids), len(emitted[s.request_id]))
                updates.append(self._append_tokens(request, emitted[s.request_id], now))
        return updates

    def _record_prompt_logprobs(self, sampled: RunnerOutput) -> None:
        # Slice assignment: a chunk recomputed after preemption overwrites its own positions.
        for rid, (first, scored) in sampled.prompt_logprobs.items():
            request = self.scheduler.requests.get(rid)  # (async scheduling: it may have ended since)
            if request is not None:
                request.prompt_logprobs[first - 1:first - 1 + len(scored)] = scored

    def _append_tokens(self, request: Request, tokens: list[int], now: float,
                       logprob: TokenLogprob | None = None) -> StepUpdate:
        """Append new tokens one by one (produced at ``now``), stopping at the first that ends the request."""
        if logprob is not None:
            request.output_logprobs.append(logprob)
        if request.metrics.first_token is None:
            request.metrics.first_token = now
        request.metrics.last_token = now
        appended = []
        for token in tokens:
            request.output_token_ids.append(token)
            appended.append(token)
            reason = self._stop_reason(request, token)
            if request.grammar is not None and reason is None:
                reason = self._grammar_stop(request, token)
            if reason is not None:
                self.finish(request.request_id, reason)
                return StepUpdate(request, appended, True)
        return StepUpdate(request, appended, False)

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling_params
        if token in request.eos_token_ids or token in params.stop_token_ids:
            return FinishReason.STOP
        if len(request.output_token_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens - request.num_pending >= self.max_model_len and not self.sinks:  # sinks: KV stays bounded
            return FinishReason.LENGTH
        return None

    def _grammar_stop(self, request: Request, token: int) -> FinishReason | None:
        """Advance the request's grammar; a complete grammar ends the request (it allows no more)."""
        if not request.grammar.accept(token):
            # Masked sampling only picks allowed tokens, so this is a bug, not bad input: end the
            # request rather than let it run unconstrained.
            log.error("request %s: token %d rejected by its grammar: %s", request.request_id, token,
                      request.grammar.error)
            return FinishReason.STOP
        return FinishReason.STOP if request.grammar.is_finished else None

    def finish(self, request_id: str, reason: FinishReason) -> None:
        if self.spec is not None:
            self.spec.forget(request_id)
        self._sync_requests.discard(request_id)
        request = self.scheduler.finish_request(request_id, reason)
        if request is not None:
            request.metrics.finished = time.perf_counter()
            request.status = RequestStatus.FINISHED
