"""AsyncEngineClient: asyncio request handlers on one side, the engine on its own thread on the other.

The LLMEngine lives on ONE dedicated thread that owns it exclusively: loading, add, abort and
step all happen there, fed by a thread-safe command queue. The thread steps while there is work
and blocks on the queue when idle. After each step it hands all outputs to the event loop in one
``call_soon_threadsafe``, so neither side ever waits on the other: a slow client cannot stall a
step, and a long step cannot stall the HTTP layer (torch releases the GIL while it computes).

The engine hands out delta outputs (only what each step added) and each request's stream adds them
into one cumulative output, updated in place: the engine thread's work per output does not grow
with the length of the text, and a consumer that falls behind finds everything in the one output
instead of a growing queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from kvserve.config import EngineConfig
from kvserve.engine.core import RequestFailedError
from kvserve.engine.stats import EngineSnapshot
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.metrics.stats import StatsCollector
from kvserve.runtime.heap import collection_paused
from kvserve.types import RequestOutput, SamplingParams

logger = logging.getLogger("kvserve.client")

# An idle engine that receives a request waits until no other has come for BURST_QUIET_S and none
# is on its way through the HTTP layer (``incoming``), at most BURST_MAX_WAIT_S in all, before its
# first step, so that a burst is scheduled as one. Once two have come it is a burst, and the quiet
# window widens to BURST_GAP_S. A burst's requests reach the engine over tens of milliseconds (the
# client encoding, the event loop parsing bodies), and a step started on the first ones delays every
# other first token by that whole step.
# The first request's own window grows with the step it would start alone, to BURST_STEP_FRACTION of
# that step's time (estimated from the prefill rate the engine's warm-up measured, which a 64-token
# prefill understates), at most BURST_GAP_S: otherwise a long first prompt runs alone while the rest
# of its burst waits. A lone request pays at most ~5% more.
BURST_QUIET_S = 0.004
BURST_GAP_S = 0.02
BURST_MAX_WAIT_S = 0.1
BURST_STEP_FRACTION = 0.05
# While someone watches (the live dashboard), a snapshot carries the KV block map at most this often.
BLOCK_MAP_PERIOD_S = 0.25


@dataclass(frozen=True)
class AddRequest:
    """Engine-thread command: start generating for a request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float  # time.perf_counter() when the HTTP layer submitted it
    priority: int = 0  # lower runs first (the scheduler's order within the waiting queue)


@dataclass(frozen=True)
class AbortRequest:
    """Engine-thread command: stop a request and free its KV (a no-op if it has finished)."""

    request_id: str


@dataclass(frozen=True)
class Refresh:
    """Engine-thread command: publish a snapshot now (one with the block map, if someone watches)."""


@dataclass(frozen=True)
class Stop:
    """Engine-thread command: abort everything and end the thread."""


Command = AddRequest | AbortRequest | Refresh | Stop


class IncomingRequests:
    """Generation requests the HTTP layer has taken in but not yet submitted to the engine (nor
    answered). Changed on the event loop only; the engine thread reads ``count``."""

    def __init__(self) -> None:
        self.count = 0

    def arrived(self) -> Arrival:
        self.count += 1
        return Arrival(self)


class Arrival:
    """One request of IncomingRequests: ``handed_over`` once it is submitted or refused (idempotent)."""

    def __init__(self, incoming: IncomingRequests) -> None:
        self._incoming: IncomingRequests | None = incoming

    def handed_over(self) -> None:
        if self._incoming is not None:
            self._incoming.count -= 1
            self._incoming = None


class EngineNotReadyError(RuntimeError):
    """The model is still loading (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped, by error or shutdown (HTTP 503)."""


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_queue`` allows (HTTP 429)."""


@dataclass(frozen=True)
class ModelInfo:
    """What the event loop may use of the loaded engine: immutable facts, pure validators, and a
    tokenizer instance of its own (the engine thread's is never shared)."""

    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    vocab_size: int
    kv_cache_tokens: int
    kv_cache_blocks: int
    block_size: int
    max_token_bytes: int  # the longest token's text in UTF-8 bytes: bounds a prompt's text before tokenizing
    validate_prompt: Callable[[list[int]], None]  # raise ValueError naming the problem
    validate_params: Callable[[SamplingParams], None]
    streams_past_context: bool = False  # attention sinks: a request may run past max_model_len


class RequestStream:
    """Async iterator over one request's cumulative output, ending once it has finished. Every item
    is the same RequestOutput, grown in place as deltas arrive: read it when it is handed to you.

    ``close()`` (synchronous, idempotent) aborts the request if it has not finished, so callers
    put it in a ``finally``: a client that goes away frees its KV blocks within one step.
    """

    def __init__(self, client: AsyncEngineClient, request_id: str) -> None:
        self.request_id = request_id
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.event = asyncio.Event()
        self.done = False
        self._client = client

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        await self.event.wait()
        self.event.clear()
        if self.error is not None:
            self.close()
            raise self.error
        out = self.latest
        if out.finished:
            self.done = True
            self._client._streams.pop(self.request_id, None)
        return out

    async def result(self) -> RequestOutput:
        """The final output (closing the stream if this coroutine is cancelled)."""
        try:
            async for out in self:
                last = out
            return last
        finally:
            self.close()

    def close(self) -> None:
        if not self.done:
            self.done = True
            self._client._streams.pop(self.request_id, None)
            self._client.abort(self.request_id)


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, max_queue: int = 1024, stats: StatsCollector | None = None,
                 freeze_gc: bool = False, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """``on_fatal`` is called on the event loop once the engine thread has died (a failure that is
        not one request's: it failed to load, or every request kept failing), after every stream has
        been given the error: a server exits then, so that its supervisor restarts it.

        ``freeze_gc``: the process serves this client alone (``kvserve serve``), so once the model is
        loaded everything alive then is moved out of the cyclic garbage collector's reach until shutdown.
        A full collection otherwise walks ~250K start-up objects (torch, transformers, the model), a
        stall of every stream each time."""
        self.config = config
        self.freeze_gc = freeze_gc
        self.on_fatal = on_fatal
        self._froze_gc = False
        self.max_queue = max_queue
        self.stats = stats
        self.info: ModelInfo | None = None
        self.error: BaseException | None = None
        # The engine thread publishes (snapshot, sequences admitted) as one tuple, so a reader never
        # sees a request counted in neither, which would let --max-queue be exceeded.
        self._published: tuple[EngineSnapshot, int] = (EngineSnapshot(), 0)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._submitted = 0  # sequences submitted; written by the event loop only
        self.incoming = IncomingRequests()  # counted by the HTTP server, read by the burst intake
        self._admitted = 0  # sequences the engine has picked up; engine thread only, published with snapshots
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._prefill_rate: float | None = None  # tokens/s, measured by the engine's warm-up
        self.watchers = 0  # live dashboards connected; changed on the event loop, read by the engine thread
        self._block_map_at = 0.0  # engine thread: when a snapshot last carried the block map

    # ---- lifecycle (event loop side) ---------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; the model loads there, so the server can answer /health at once."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_ready(self) -> bool:
        return self.info is not None

    @property
    def is_healthy(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return self.is_ready and alive and self.error is None and not self._stopping

    def ready_info(self) -> ModelInfo:
        """The loaded model's info, or EngineDeadError / EngineNotReadyError (both a 503)."""
        self._check_alive()
        if self.info is None:
            raise EngineNotReadyError("the model is still loading; retry shortly")
        return self.info

    async def wait_ready(self, poll_s: float = 0.05) -> ModelInfo:
        while self.info is None:
            self._check_alive()
            await asyncio.sleep(poll_s)
        return self.info

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is still running and stop the thread (idempotent)."""
        self._stopping = True
        self._commands.put(Stop())
        if self._thread is not None:
            self._thread.join(timeout)
        if self._froze_gc:  # what the engine leaves behind can be collected again
            self._froze_gc = False
            gc.unfreeze()

    # ---- requests (event loop side) ----------------------------------------------------------
    @property
    def snapshot(self) -> EngineSnapshot:
        return self._published[0]

    @property
    def num_waiting(self) -> int:
        """Requests queued but not yet running, including adds the engine has not picked up yet."""
        snapshot, admitted = self._published
        return snapshot.num_waiting + (self._submitted - admitted)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               priority: int = 0) -> RequestStream:
        """Queue a request now; iterate the returned stream for its cumulative output.

        Raises EngineNotReadyError, EngineDeadError or QueueFullError at once, before queueing.
        The engine's ValueError, if it rejects the request, comes out of the stream.
        """
        self.check_room(params.n)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._submitted += params.n  # each of the n sequences waits for a slot
        self._commands.put(AddRequest(request_id, prompt_token_ids, params, time.perf_counter(), priority))
        return stream

    def check_room(self, sequences: int) -> None:
        """QueueFullError (or not ready / dead) unless ``sequences`` more fit in the waiting queue."""
        self.ready_info()
        if self.num_waiting + sequences > self.max_queue:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting (--max-queue {self.max_queue}); "
                                 "retry later")

    def fail_open_requests_after(self, seconds: float, error: BaseException) -> None:
        """Thread-safe: in ``seconds``, end every open stream with ``error`` (a server's shutdown
        deadline: each client gets an error and its stream's end, not a cut connection)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, seconds, self._deliver_error, None, error)

    def abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))

    def watch(self) -> None:
        """A live dashboard connects: snapshots carry the block map until ``unwatch``; an idle engine
        publishes one at once."""
        self.watchers += 1
        self._commands.put(Refresh())

    def unwatch(self) -> None:
        self.watchers -= 1

    def _check_alive(self) -> None:
        if self.error is not None or self._stopping or (self._thread is not None and not self._thread.is_alive()):
            raise EngineDeadError(f"the engine is not running ({self.error or 'shut down'})")


    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                if stream.latest is None:
                    stream.latest = out  # the engine's lists are fresh: the stream's own from now on
                else:
                    stream.latest.merge(out)
                stream.event.set()

    def _deliver_error(self, request_id: str | None, error: BaseException) -> None:
        targets = self._streams.values() if request_id is None else [self._streams.get(request_id)]
        for stream in targets:
            if stream is not None:
                stream.error = error
                stream.event.set()

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._load()
            self.info = _model_info(engine)
            self._publish(engine)
            while self._handle_commands(engine, block=not engine.has_unfinished()):
                if engine.has_unfinished():
                    outputs = engine.step(delta=True)
                    self._publish(engine, outputs, stepped=True)
                    failed = engine.take_failed()
                    if failed:
                        self._record_failures(failed)
        except BaseException as e:  # any failure must turn health red, not vanish
            logger.exception("engine loop died")
            self.error = e
            self._to_loop(self._deliver_error, None, EngineDeadError(f"the engine loop died: {e!r}"))
            if self.on_fatal is not None:
                self._to_loop(self.on_fatal, e)

    def _load(self) -> LLMEngine:
        """Build and warm up the engine; with ``freeze_gc`` (the process serves this client alone),
        with garbage collection paused meanwhile, and then freeze what is alive. No full collection
        first: at this point there is no garbage to find, and it would lengthen every start; anything
        it would have freed stays."""
        with collection_paused() if self.freeze_gc else contextlib.nullcontext():  # see runtime/heap.py
            engine = LLMEngine(self.config)
            self._prefill_rate = engine.core.warm_up()
        logger.info("warm-up: prefill at %.0f tokens/s", self._prefill_rate)
        if self.freeze_gc:
            gc.freeze()
            self._froze_gc = True
        return engine

    def _handle_commands(self, engine: LLMEngine, block: bool) -> bool:
        """Apply every queued command (waiting for one if ``block``); False once asked to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        changed = False
        # Woken from idle: the rest of a burst is likely on its way. Take it in before the first step,
        # which would otherwise run on the first few requests and starve the HTTP layer of CPU.
        start = time.perf_counter()
        deadline = start + BURST_MAX_WAIT_S if block else 0.0
        first_quiet = self._first_quiet(command)
        taken = 0
        while True:
            if isinstance(command, Stop):
                self._abort_all(engine)
                return False
            changed |= self._apply(engine, command)
            taken += 1
            command = self._next_in_burst(deadline, first_quiet if taken < 2 else BURST_GAP_S)
            if command is None:
                break
        if block:
            logger.debug("woken from idle: took in %d requests in %.1f ms", taken, 1e3 * (time.perf_counter() - start))
        if changed:
            self._publish(engine)
        return True

    def _first_quiet(self, command: Command) -> float:
        """How long a lone request waits for company: BURST_STEP_FRACTION of the prefill it would
        run alone, within [BURST_QUIET_S, BURST_GAP_S]."""
        if not isinstance(command, AddRequest) or not self._prefill_rate:
            return BURST_QUIET_S
        alone_s = len(command.prompt_token_ids) / self._prefill_rate
        return min(BURST_GAP_S, max(BURST_QUIET_S, BURST_STEP_FRACTION * alone_s))

    def _next_in_burst(self, deadline: float, quiet: float) -> Command | None:
        """The next command, waiting (until ``deadline``) while requests are still arriving: one
        came within ``quiet`` seconds, or the HTTP layer holds some not yet submitted."""
        while True:
            wait = min(quiet, deadline - time.perf_counter())
            try:
                return self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()
            except queue.Empty:
                if self.incoming.count <= 0 or time.perf_counter() >= deadline:
                    return None

    def _apply(self, engine: LLMEngine, command: AddRequest | AbortRequest | Refresh) -> bool:
        if isinstance(command, Refresh):
            return True
        if isinstance(command, AbortRequest):
            if engine.has_request(command.request_id):
                engine.abort_request(command.request_id)
                if self.stats is not None:
                    self.stats.on_aborted(command.request_id, time.perf_counter())
                return True
            return False
        self._admitted += command.params.n
        try:
            engine.add_request(command.request_id, command.prompt_token_ids, command.params, command.priority)
        except ValueError as e:
            self._to_loop(self._deliver_error, command.request_id, e)
            return False
        if self.stats is not None:
            self.stats.on_added(command.request_id, command.arrival, len(command.prompt_token_ids))
        return True

    def _record_failures(self, failed: list[RequestFailedError]) -> None:
        """Requests a step took out (engine thread): counted as errors, each stream given its error."""
        for error in failed:
            if self.stats is not None:
                self.stats.on_failed(error.request_id, time.perf_counter())
            self._to_loop(self._deliver_error, error.request_id, error)

    def _abort_all(self, engine: LLMEngine) -> None:
        for request_id in engine.request_ids():
            engine.abort_request(request_id)
        self._publish(engine)
        self._to_loop(self._deliver_error, None, EngineDeadError("the server is shutting down"))

    def _publish(self, engine: LLMEngine, outputs: list[RequestOutput] | None = None, stepped: bool = False) -> None:
        with_map = False
        if self.watchers > 0:
            # An idle engine publishes no more until new work comes, so its last map must be current;
            # under work a map is due every BLOCK_MAP_PERIOD_S, taken after a step (when blocks are
            # held), and idle maps do not count: a load of requests shorter than the period would
            # otherwise only ever show maps taken between them.
            idle = not engine.has_unfinished()
            now = time.perf_counter()
            with_map = idle or (stepped and now - self._block_map_at >= BLOCK_MAP_PERIOD_S)
            if with_map and not idle:
                self._block_map_at = now
        snapshot = engine.core.stats(with_block_map=with_map)
        if not with_map and self.watchers > 0 and self._published[0].block_map is not None:
            # the map stays until the next one is due, so a reader between two always finds one
            snapshot = dataclasses.replace(snapshot, block_map=self._published[0].block_map)
        self._published = (snapshot, self._admitted)
        if self.stats is not None:
            if outputs:
                self.stats.on_outputs(outputs, time.perf_counter())
            self.stats.on_snapshot(snapshot)
        if outputs:
            self._to_loop(self._deliver, outputs)


def _model_info(engine: LLMEngine) -> ModelInfo:
    core = engine.core
    tokenizer = copy.deepcopy(engine.tokenizer)  # its own instance, in half the time of loading one
    return ModelInfo(tokenizer, core.max_model_len, core.model_config.vocab_size,
                     core.kv_info.capacity_tokens, core.kv_info.num_blocks, core.kv_info.block_size,
                     max_token_bytes(tokenizer), core.validate_prompt, core.validate_params, core.sinks > 0)


def max_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """An upper bound on the text bytes one token stands for: its vocabulary string's UTF-8 length
    (which counts a byte-level BPE byte as the 1-2 byte character it is written as, so it errs long)."""
    return max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()), default=1)
