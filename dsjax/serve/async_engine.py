"""The engine on a thread of its own, bridged to asyncio.

LLMEngine is not thread-safe, so every call into it (add, abort, step) happens on the engine thread:
handlers submit commands to a lock-guarded deque, and the thread applies them all before each step.
Outputs go back with one loop.call_soon_threadsafe per step, into a per-request asyncio.Queue. When
there is nothing to do the thread sleeps on a condition variable; a command wakes it.

A step that raises fails the requests in its batch (their streams get EngineStepError, the engine
aborts them and frees their KV blocks); the others keep going.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time

from dsjax.engine.llm_engine import LLMEngine, StepFailedError
from dsjax.engine.outputs import RequestOutput
from dsjax.engine.sampling_params import SamplingParams
from dsjax.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)

UNHEALTHY_AFTER_FAILURES = 3  # consecutive failed steps before /health reports the engine as unhealthy


class EngineStepError(RuntimeError):
    """The step that ran this request raised; the request was aborted (HTTP 500)."""


class QueueFullError(RuntimeError):
    """Too many sequences waiting (HTTP 503)."""


class DrainingError(RuntimeError):
    """The server is shutting down and takes no new requests (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (HTTP 503 for new requests, 500 for those in flight)."""


@dataclasses.dataclass
class _Live:
    """Engine-thread bookkeeping of one request, for metrics and failure handling."""

    n: int
    arrival: float  # time.monotonic() when the HTTP request came in
    first_token_time: float | None = None
    num_output_tokens: int = 0  # over all choices


class RequestStream:
    """One request's outputs in order. Each output holds the whole text so far, so when the consumer falls
    behind, only the newest is worth handing over."""

    def __init__(self, request_id: str, on_abort):
        self.request_id = request_id
        self.finished = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._on_abort = on_abort

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty() and isinstance(item, RequestOutput) and not item.finished:
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """The client is gone: stop the request and free its blocks (a no-op once finished)."""
        if not self.finished:
            self.finished = True
            self._on_abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine, *, max_queue_len: int, metrics: ServeMetrics | None = None):
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.max_num_seqs = engine.config.max_num_seqs
        self.metrics = metrics
        self.draining = False
        self.dead: str | None = None  # why the engine thread stopped, once it has
        self.consecutive_failures = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="dsjax-engine", daemon=True)
        self._streams: dict[str, RequestStream] = {}  # event-loop thread only
        self._live: dict[str, _Live] = {}  # engine thread only
        # Guarded by _cond: the command queue and the admission counters.
        self._cond = threading.Condition()
        self._commands: collections.deque[tuple] = collections.deque()
        self._stopping = False
        self._num_pending = 0  # sequences submitted but not yet added to the engine
        self._num_waiting = 0  # scheduler's waiting sequences as of the last command batch or step
        self._num_running = 0
        self._snapshot: dict = {}
        self._num_step_failures = 0
        if metrics is not None:
            metrics.watch_engine(self.snapshot)

    # ----- event-loop side ------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._publish()
        self._thread.start()

    async def stop(self, timeout: float = 10.0) -> None:
        """Fails whatever is still in flight and joins the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout)

    def begin_drain(self) -> None:
        self.draining = True

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def is_healthy(self) -> bool:
        return self.dead is None and self._thread.is_alive() and self.consecutive_failures < UNHEALTHY_AFTER_FAILURES

    def snapshot(self) -> dict:
        """Engine state as of the last step (any thread; never touches the engine)."""
        with self._cond:
            num_waiting = self._num_waiting + self._num_pending
        return self._snapshot | {"num_waiting": num_waiting, "num_in_flight": len(self._streams),
                                 "healthy": self.is_healthy, "draining": self.draining}

    def _reject(self, reason: str, error: Exception) -> Exception:
        if self.metrics is not None:
            self.metrics.requests_rejected.labels(reason).inc()
        if reason == "queue_full" and not self._queue_full_logged:  # the memory-pressure ladder's last rung
            self._queue_full_logged = True
            log.warning("KV memory pressure, rung %d of %d: answering 503 + Retry-After, the queue is full (%s; "
                        "counted in dsjax_requests_rejected{reason=\"queue_full\"})", len(LLMEngine.LADDER) + 1,
                        len(LLMEngine.LADDER) + 1, error)
        return error

    _queue_full_logged = False

    async def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                          prompt_token_ids: list[int], arrival_time: float | None = None) -> RequestStream:
        """Returns once the engine has accepted the request. Raises ValueError (the engine refused it),
        QueueFullError, DrainingError or EngineDeadError."""
        if self.dead is not None or not self._thread.is_alive():
            raise self._reject("engine_dead", EngineDeadError(f"the engine has stopped: {self.dead}"))
        if self.draining:
            raise self._reject("draining", DrainingError("the server is shutting down"))
        with self._cond:
            # Sequences that would still wait once the free running slots are taken. Optimistic when the KV
            # pool, not max_num_seqs, is what holds admissions back: then up to max_num_seqs more may queue.
            free_slots = max(0, self.max_num_seqs - self._num_running)
            would_wait = self._num_pending + self._num_waiting + params.n - free_slots
            if would_wait > self.max_queue_len:
                raise self._reject("queue_full", QueueFullError(
                    f"{self._num_pending + self._num_waiting} sequences wait for {free_slots} free running slots; "
                    f"{params.n} more would exceed max_queue_len={self.max_queue_len}"))
            self._num_pending += params.n
        stream = RequestStream(request_id, self.abort)
        self._streams[request_id] = stream
        accepted = self._loop.create_future()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._submit(("add", request_id, prompt, params, prompt_token_ids, accepted, arrival))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # after the add in the command queue, so it lands
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._submit(("abort", request_id))

    def _submit(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _deliver(self, deliveries: list[tuple[str, RequestOutput | BaseException]]) -> None:
        for request_id, item in deliveries:
            stream = self._streams.get(request_id)
            if stream is None:  # aborted by its client since
                continue
            stream.put(item)
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]

    @staticmethod
    def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
        if future.done():  # the handler was cancelled meanwhile
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            pass

    # ----- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                        self._cond.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                    stopping = self._stopping
                if stopping:
                    self._refuse_adds(commands, EngineDeadError("the server is shutting down"))
                    self._fail_all(EngineDeadError("the server shut down before the request finished"))
                    self.dead = "stopped"
                    return
                self._apply(commands)
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # a bug in this loop, not in a step: stop serving rather than spin
            log.exception("the engine thread crashed")
            self.dead = f"{type(e).__name__}: {e}"
            with self._cond:
                commands = list(self._commands)
                self._commands.clear()
            self._refuse_adds(commands, EngineDeadError(f"the engine has stopped: {self.dead}"))
            self._fail_all(EngineDeadError(f"the engine has stopped: {self.dead}"))

    def _apply(self, commands: list[tuple]) -> None:
        for command in commands:
            if command[0] == "add":
                _, request_id, prompt, params, ids, accepted, arrival = command
                error = None
                try:
                    self.engine.add_request(request_id, prompt, params, prompt_token_ids=ids)
                except Exception as e:  # ValueError is the request's fault; anything else still only this request's
                    error = e
                else:
                    self._live[request_id] = _Live(params.n, arrival)
                    if self.metrics is not None:
                        self.metrics.prompt_tokens.inc(len(ids))
                with self._cond:
                    self._num_pending -= params.n
                self._call_soon(self._resolve, accepted, error)
            else:
                live = self._live.pop(command[1], None)
                if live is not None:
                    self.engine.abort_request(command[1])
                    self._count_finished("abort", live.n)
        if commands:
            self._publish()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._on_step_failure(e)
            return
        self.consecutive_failures = 0
        now = time.monotonic()
        deliveries = []
        num_new_tokens = 0
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            num_new_tokens += num_tokens - live.num_output_tokens
            live.num_output_tokens = num_tokens
            if live.first_token_time is None and num_tokens:
                live.first_token_time = now
                if self.metrics is not None:
                    self.metrics.time_to_first_token.observe(now - live.arrival)
            if output.finished:
                del self._live[output.request_id]
                self._observe_finished(output, live, now)
            deliveries.append((output.request_id, output))
        if self.metrics is not None and num_new_tokens:
            self.metrics.generation_tokens.inc(num_new_tokens)
        self._publish()
        if deliveries:
            self._call_soon(self._deliver, deliveries)

    def _observe_finished(self, output: RequestOutput, live: _Live, now: float) -> None:
        for completion in output.outputs:
            self._count_finished(completion.finish_reason or "stop", 1)
        if self.metrics is None:
            return
        self.metrics.e2e_latency.observe(now - live.arrival)
        longest = max(len(c.token_ids) for c in output.outputs)
        if longest > 1 and live.first_token_time is not None:
            self.metrics.time_per_output_token.observe((now - live.first_token_time) / (longest - 1))

    def _count_finished(self, reason: str, count: int) -> None:
        if self.metrics is not None:
            self.metrics.requests_finished.labels(reason).inc(count)

    def _on_step_failure(self, error: Exception) -> None:
        log.exception("engine step failed; aborting the requests of its batch")
        self._num_step_failures += 1
        self.consecutive_failures += 1
        # The engine aborted exactly the failed step's requests; an unexpected error (a bug outside the
        # runner) names none, and then nobody's state can be trusted.
        affected = error.request_ids if isinstance(error, StepFailedError) else list(self._live)
        failure = EngineStepError(f"the engine step running this request failed ({type(error).__name__}: {error}); "
                                  "the request was aborted")
        self._fail(affected, failure)
        try:
            self.engine.scheduler.check_invariants()
        except AssertionError as broken:  # aborting did not restore a consistent state: nothing can be trusted
            log.error("engine state is inconsistent after a failed step (%s); failing every request", broken)
            self._fail(list(self._live), failure)
        self._publish()

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        deliveries = []
        for request_id in request_ids:
            live = self._live.pop(request_id, None)
            if live is None:
                continue
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("aborting request %s failed", request_id)
            self._count_finished("error", live.n)
            deliveries.append((request_id, error))
        if deliveries:
            self._call_soon(self._deliver, deliveries)

    def _fail_all(self, error: BaseException) -> None:
        self._fail(list(self._live), error)

    def _refuse_adds(self, commands: list[tuple], error: BaseException) -> None:
        for command in commands:
            if command[0] == "add":
                self._call_soon(self._resolve, command[5], error)

    def _publish(self) -> None:
        """Engine state for /metrics and admission control, from O(1) counters (engine.stats() is O(steps))."""
        engine, bm, scheduler = self.engine, self.engine.block_manager, self.engine.scheduler
        total = bm.num_blocks_total
        self._snapshot = {
            "num_running": scheduler.num_running, "num_blocks_total": total, "num_blocks_used": bm.num_blocks_used,
            "num_blocks_cached": bm.num_blocks_cached, "num_blocks_free": bm.num_blocks_free,
            "kv_cache_usage": bm.num_blocks_used / total if total else 0.0,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate, "num_preemptions": scheduler.num_preemptions,
            "num_steps": engine.num_steps, "num_step_failures": self._num_step_failures,
            "num_useful_tokens": engine.runner.num_useful_tokens, "num_padded_tokens": engine.runner.num_padded_tokens,
            "num_blocks_compressed": bm.num_blocks_compressed, **engine.ladder_counts(),
        }
        with self._cond:
            self._num_waiting = scheduler.num_waiting
            self._num_running = scheduler.num_running
