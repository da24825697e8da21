"""The engine thread: the only thread that touches the engine.

Threads and queues (JetStream orchestrator style):

    gRPC handler threads (one per call, ThreadPoolExecutor)
      | admission on the caller's thread: limits, breaker, tenant budget, WaitingQueue.offer
      |   -> rejected at once (RESOURCE_EXHAUSTED / UNAVAILABLE / ...), never queued
      v
    WaitingQueue  (bounded by count and tokens; priority + aging; thread-safe)
    abort queue   (SimpleQueue of request ids: client cancel / disconnect / deadline)
      |   `wake` Event set on every offer and abort
      v
    engine thread (EngineLoop.run), each iteration:
      1. apply aborts: drop from WaitingQueue, or engine.abort_request (pages freed next step)
      2. expire queued requests past their deadline or the queue timeout (also done every
         20 ms by the queue-reaper thread, and a cancelled call leaves the queue at once)
      3. feed the engine from WaitingQueue while fewer than `max_inflight` are in it
      4. engine.step() -> per-step deltas, routed to each request's StreamBuffer
         (push never blocks; a full buffer cancels that request: slow consumer);
         a raised step fails only its requests and feeds the circuit breaker
      5. every stats_interval_s: engine stats to the Prometheus gauges, the breaker state to
         the health service (NOT_SERVING while open), and outcomes for calls gRPC dropped
         before a handler thread ran them (serving/grpc_api/dispatch.py)
      |
      v
    StreamBuffer per request (bounded) -> its handler thread -> gRPC stream

The handler decides admission and the engine thread never waits on a client, so an
overloaded server answers new calls in milliseconds and a stalled reader cannot hold back
the batch.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time

import grpc

from engine.api_types import RequestOutput
from engine.errors import InvalidRequestError
from engine.lora.refs import request_identity
from serving.frontend.admission import WaitingQueue
from serving.frontend.breaker import CircuitBreaker
from serving.frontend.capacity_model import prefill_tokens_of_step
from serving.frontend.request_state import (
    ActiveRequest,
    RequestLedger,
    SlowConsumerPolicy,
    Terminal,
)

log = logging.getLogger("pagedjax.serving")

# finish_reason -> (outcome, outcome reason, status when not OK)
_FINISH = {
    "stop": ("success", "", grpc.StatusCode.OK),
    "length": ("success", "", grpc.StatusCode.OK),
    "timed_out": ("timed_out", "deadline", grpc.StatusCode.DEADLINE_EXCEEDED),
    "cancelled": ("cancelled", "engine", grpc.StatusCode.CANCELLED),
    "failed": ("failed", "engine_step", grpc.StatusCode.INTERNAL),
    "rejected": ("rejected", "engine", grpc.StatusCode.RESOURCE_EXHAUSTED),
}


class EngineLoop:
    tracer = None  # serving/frontend/request_trace.py RequestTrace (--trace_requests), else None

    def __init__(
        self,
        engine,
        waiting: WaitingQueue,
        ledger: RequestLedger,
        breaker: CircuitBreaker,
        metrics,
        *,
        max_inflight: int,
        stats_interval_s: float = 0.1,
        idle_wait_s: float = 0.05,
        on_breaker_change=None,
        on_tick=None,
        slow_consumer: SlowConsumerPolicy | None = None,
        on_start=None,
        priority_overflow: int = 0,
    ):
        """`priority_overflow`: requests a higher priority class than one in the engine may
        be fed past `max_inflight` (the engine's scheduler, with `priority_preemption`,
        preempts the lowest-priority running one to run them: issue 34)."""
        self.priority_overflow = priority_overflow
        waiting.preemptible_slots = priority_overflow
        self.engine, self.waiting, self.ledger = engine, waiting, ledger
        self.breaker, self.metrics, self.max_inflight = breaker, metrics, max_inflight
        self.stats_interval_s, self.idle_wait_s = stats_interval_s, idle_wait_s
        self._active: dict[str, ActiveRequest] = {}  # admitted, not yet done with the engine
        self._active_lock = threading.Lock()
        self._in_engine: set[str] = set()  # engine thread only
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._last_stats_s = 0.0
        self.last_stats: dict = {}
        self._on_breaker_change = on_breaker_change  # called with the new state's name
        self._on_tick = on_tick  # called every stats_interval_s (reaps undispatched calls)
        self._on_start = on_start  # called once on this thread before serving (warm-up)
        self._breaker_state = "closed"
        self._swap: tuple[object, threading.Event] | None = None  # (new engine, done)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # run_on_engine_thread
        self._first_tokens = 0  # prompt tokens of this step's first tokens
        self._first_token_prompts = 0  # ... of how many prompts
        self._last_prefill_tokens = 0  # prompt tokens the last step computed
        self._last_prefill_prompts = 0  # ... of how many prompts (0: a chunk of one)
        self._last_step: tuple[int, float] | None = None  # (concurrency, start) of the last
        self.on_swap = None  # called on the engine thread with the new engine
        self.on_iteration = None  # called on the engine thread after each iteration (KV events)
        self.slow_consumer = slow_consumer or SlowConsumerPolicy()
        self.thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)
        self.reap_interval_s = 0.02
        self._reaper = threading.Thread(target=self._reap_queue, name="queue-reaper", daemon=True)

    # ---- called from handler threads ------------------------------------------------------
    def register(self, r: ActiveRequest) -> None:
        with self._active_lock:
            self._active[r.request_id] = r

    def unregister(self, request_id: str) -> None:
        with self._active_lock:
            self._active.pop(request_id, None)
        self.waiting.forget_prediction(request_id)

    def is_active(self, request_id: str) -> bool:
        with self._active_lock:
            return request_id in self._active

    def num_active(self) -> int:
        """Admitted requests not yet done with the engine (queued or running)."""
        with self._active_lock:
            return len(self._active)

    def active_requests(self) -> list[ActiveRequest]:
        with self._active_lock:
            return list(self._active.values())

    def request_swap(self, engine) -> threading.Event:
        """Reload: the engine thread stops feeding the current engine, steps it until its
        requests are done, then serves from `engine` (requests queued meanwhile wait in the
        queue). The returned event is set once the swap happened."""
        done = threading.Event()
        self._swap = (engine, done)
        self.wake.set()
        return done

    def run_on_engine_thread(self, fn) -> concurrent.futures.Future:
        """`fn(engine)` runs on the engine thread between two steps (the engine is called
        from one thread only: e.g. a LoRA adapter load); the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, future))
        self.wake.set()
        return future

    def _run_calls(self) -> None:
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:  # the caller reports it
                    future.set_exception(e)

    def abort(self, request_id: str) -> None:
        """Cancel a request whose outcome the caller recorded. A queued one leaves the queue
        now (it must not hold a slot until the engine's next step); one in the engine is
        aborted by the engine thread."""
        if self.waiting.remove(request_id) is not None:
            self._drop_queued(request_id, "cancelled while queued")
            return
        self._aborts.put(request_id)
        self.wake.set()

    def _drop_queued(self, request_id: str, details: str) -> None:
        r = self._lookup(request_id)
        if r is not None:  # its outcome was recorded by whoever aborted it
            r.stream.close(Terminal(grpc.StatusCode.CANCELLED, details))
        self.unregister(request_id)

    def start(self) -> None:
        self.thread.start()
        self._reaper.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self.wake.set()
        self.thread.join(timeout_s)
        self._reaper.join(timeout_s)

    def _reap_queue(self) -> None:
        """Expire queued requests as their time comes, not at the engine's next step (which
        can take seconds): expired entries must not fill the queue."""
        while not self._stop.wait(self.reap_interval_s):
            try:
                self._expire_queued()
            except Exception:
                log.exception("queue reaper failed")

    # ---- the engine thread ----------------------------------------------------------------
    def run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception:
                log.exception("engine loop iteration failed")
                time.sleep(self.idle_wait_s)

    def _iterate(self) -> None:
        self._run_calls()
        self._apply_aborts()
        self._expire_queued()
        if self._swap is not None:
            self._try_swap()
        if self._swap is None:
            self._feed()
        self.waiting.num_in_engine = len(self._in_engine)
        self.waiting.unprefilled_engine_tokens, self.waiting.unprefilled_engine_prompts = (
            self._unprefilled()
        )
        self.waiting.engine_progress = self._progress()
        self.waiting.drain.set_saturated(
            time.monotonic(), len(self._in_engine) >= self.max_inflight
        )
        if self.engine.has_unfinished():
            self._step()
        else:
            self._last_step = None  # idle: the next step does not follow this one
            self.wake.wait(self.idle_wait_s)
            self.wake.clear()
        if self.on_iteration is not None:
            self.on_iteration()
        self._publish_stats()

    def _try_swap(self) -> None:
        if self._in_engine or self.engine.has_unfinished():
            return  # the old engine finishes what it holds first
        engine, done = self._swap
        log.info("engine swapped: %s -> %s", self.engine.identity, engine.identity)
        old, self.engine, self._swap = self.engine, engine, None
        close = getattr(old, "close", None)  # ProcessEngine (serving/engine_host/process.py)
        if close is not None:
            close()  # its child process served its last request
        if self.on_swap is not None:
            self.on_swap(engine)
        done.set()

    def _lookup(self, request_id: str) -> ActiveRequest | None:
        with self._active_lock:
            return self._active.get(request_id)

    def _apply_aborts(self) -> None:
        while True:
            try:
                request_id = self._aborts.get_nowait()
            except queue.Empty:
                return
            if self.waiting.remove(request_id) is not None:
                self._drop_queued(request_id, "cancelled while queued")
            elif request_id in self._in_engine:
                self.engine.abort_request(request_id)

    def _expire_queued(self) -> None:
        for item, why in self.waiting.expire():
            r = self._lookup(item.request_id)
            if r is None:
                continue
            if why == "timed_out":
                self._end(
                    r,
                    "timed_out",
                    "deadline",
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "deadline passed while queued",
                )
            elif why == "displaced":  # a higher priority took its time (admission.py)
                self._end(
                    r,
                    "rejected",
                    "priority",
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "shed for higher-priority requests: it could no longer finish before "
                    "its deadline",
                    self.waiting.retry_after_hint_ms(),
                )
            else:
                self._end(
                    r,
                    "rejected",
                    "queue_timeout",
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"waited {self.waiting.cfg.queue_timeout_s}s in the queue",
                    self.waiting.retry_after_hint_ms(),
                )
            self.unregister(item.request_id)

    def _feed(self) -> None:
        while True:
            if len(self._in_engine) < self.max_inflight:
                item = self.waiting.pop()
            elif len(self._in_engine) < self.max_inflight + self.priority_overflow:
                item = self.waiting.pop_above(self._lowest_priority_in_engine())
            else:
                return
            if item is None:
                return
            r = self._lookup(item.request_id)
            if r is None or r.outcome is not None:  # cancelled while queued
                self.unregister(item.request_id)
                continue
            r.added_s = time.monotonic()
            r.identity = request_identity(self.engine, r.engine_request)  # LoRA: + adapter
            try:
                self.engine.add_request(r.engine_request)
            except InvalidRequestError as e:
                self._end(
                    r, "rejected", "invalid_argument", grpc.StatusCode.INVALID_ARGUMENT, str(e)
                )
                self.unregister(r.request_id)
                continue
            except Exception as e:  # noqa: BLE001 - e.g. the engine process could not start
                log.error("engine.add_request failed: %r", e)
                self.breaker.record_failure()
                self._end(r, "failed", "engine_add", grpc.StatusCode.INTERNAL, repr(e))
                self.unregister(r.request_id)
                continue
            self._in_engine.add(r.request_id)
            self.metrics.prompt_tokens.inc(len(r.engine_request.prompt_token_ids))

    def _lowest_priority_in_engine(self) -> int:
        priorities = [
            r.engine_request.priority for r in map(self._lookup, self._in_engine) if r is not None
        ]
        return min(priorities, default=0)

    def _step(self) -> None:
        concurrency, start = len(self._in_engine), time.monotonic()
        self._observe_iteration(concurrency, start)
        processed = getattr(self.engine, "num_tokens_processed", None)
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the server
            self._fail_step(exc)
            return
        info = getattr(self.engine, "last_step_info", None)
        self.metrics.observe_step(outputs, info)
        if self.tracer is not None:
            self.tracer.step(start, time.monotonic(), info, len(outputs))
        failed = False
        self._first_tokens = self._first_token_prompts = 0
        for out in outputs:
            failed |= out.finish_reason == "failed"
            self._route(out)
        self._last_prefill_tokens = prefill_tokens_of_step(
            outputs,
            processed,
            getattr(self.engine, "num_tokens_processed", None),
            self._first_tokens,
        )
        self._last_prefill_prompts = self._first_token_prompts
        if failed:
            self.breaker.record_failure()
        else:
            self.breaker.record_success()

    def _observe_iteration(self, concurrency: int, start: float) -> None:
        """Back-to-back steps: the time from the previous step's start to this one's is what
        a token costs each running request (the step plus this thread's routing and feeding),
        which is what the capacity model must predict."""
        previous, self._last_step = self._last_step, (concurrency, start)
        if previous is not None and self.waiting.capacity is not None:
            prev_concurrency, prev_start = previous
            if start - prev_start < 10.0:  # not across an idle spell
                self.waiting.capacity.observe_step(
                    prev_concurrency,
                    start - prev_start,
                    self._last_prefill_tokens,
                    self._last_prefill_prompts,
                )

    def _unprefilled(self) -> tuple[int, int]:
        """Prompt tokens (less their expected cache hits) of the requests in the engine that
        have no first token yet, and how many requests those are."""
        total = count = 0
        for request_id in self._in_engine:
            r = self._lookup(request_id)
            if r is not None and not r.token_times_s:
                prompt = len(r.engine_request.prompt_token_ids)
                total += max(1, prompt - r.expected_cached_tokens)
                count += 1
        return total, count

    def _progress(self) -> list[tuple[int, int, int]]:
        """(max_tokens, tokens produced, priority) of each request in the engine."""
        progress = []
        for request_id in self._in_engine:
            r = self._lookup(request_id)
            if r is not None:
                er = r.engine_request
                progress.append((er.sampling.max_tokens, len(r.token_times_s), er.priority))
        return progress

    def _observe_prefill(self, r: ActiveRequest, out: RequestOutput) -> None:
        """Prompt tokens computed for a request whose first token came this step (the
        step's prefill when the engine does not count its tokens)."""
        self._first_tokens += len(r.engine_request.prompt_token_ids) - out.num_cached_tokens
        self._first_token_prompts += 1
        if r.prefix_keys and self.waiting.prefix_shadow is not None:  # its pages are cached now
            self.waiting.prefix_shadow.prefilled(r.prefix_keys)

    def _fail_step(self, exc: Exception) -> None:
        """Fail the requests of the failed step: those named by the engine's exception
        (`request_ids`, already dropped by the engine), else everything in the engine."""
        self.breaker.record_failure()
        named = getattr(exc, "request_ids", None)
        ids = list(named) if named is not None else list(self._in_engine)
        log.error("engine step failed (%s); failing %d request(s)", exc, len(ids))
        for request_id in ids:
            if named is None:
                self.engine.abort_request(request_id)
            self._left_engine(request_id)
            r = self._lookup(request_id)
            if r is not None:
                r.finish_reason = "failed"
                self._end(
                    r,
                    "failed",
                    "engine_step",
                    grpc.StatusCode.INTERNAL,
                    f"engine step failed: {exc}",
                )
                self.unregister(request_id)

    def _left_engine(self, request_id: str) -> None:
        """Room freed in the engine: a departure for the drain rate if it was saturated."""
        if request_id not in self._in_engine:
            return
        self._in_engine.discard(request_id)
        if self.waiting.drain.saturated:
            r = self._lookup(request_id)
            tokens = (
                0
                if r is None
                else (len(r.engine_request.prompt_token_ids) + r.engine_request.sampling.max_tokens)
            )
            self.waiting.drain.record(time.monotonic(), tokens)

    def _route(self, out: RequestOutput) -> None:
        if out.new_token_ids:
            self.metrics.generated_tokens.inc(len(out.new_token_ids))
        if out.finished:
            self._left_engine(out.request_id)
        r = self._lookup(out.request_id)
        if r is None:
            return
        if not r.token_times_s and out.token_times_s and r.added_s is not None:
            self._observe_prefill(r, out)
        r.token_times_s.extend(out.token_times_s)
        r.num_prompt_tokens, r.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
        if out.finished:
            self._finish(r, out)
            return
        if r.outcome is not None:
            return
        why = (
            None
            if r.stream.push(out)
            else f"stream buffer overflowed ({r.stream.limit} undelivered messages)"
        ) or self.slow_consumer.violation(r, time.monotonic())
        if why is not None:
            self.engine.abort_request(r.request_id)
            self._end(
                r,
                "cancelled",
                "slow_consumer",
                grpc.StatusCode.ABORTED,
                f"client reads too slowly: {why}; request cancelled",
            )

    def _finish(self, r: ActiveRequest, out: RequestOutput) -> None:
        if out.finish_reason in ("stop", "length") and self.waiting.capacity is not None:
            max_tokens = r.engine_request.sampling.max_tokens
            self.waiting.capacity.observe_length(len(r.token_times_s), max_tokens)
        if out.finish_reason in ("stop", "length", "timed_out"):
            settled = self.waiting.settle_prediction(
                r.request_id,
                len(r.token_times_s),
                time.monotonic(),
                finished=out.finish_reason != "timed_out",
            )
            if settled is not None:
                self.metrics.observe_prediction(*settled)
        if out.metrics is not None:
            r.engine_queue_s = out.metrics.queue_s
            r.spec_drafted_tokens = out.metrics.spec_drafted_tokens
            r.spec_accepted_tokens = out.metrics.spec_accepted_tokens
        r.finish_reason = out.finish_reason
        r.timings = r.compute_timings(time.monotonic())
        outcome, reason, status = _FINISH.get(out.finish_reason, _FINISH["failed"])
        details = out.error or f"finish_reason={out.finish_reason}"
        if outcome != "success" or not r.success_on_delivery:
            self.ledger.settle(r, outcome, reason, status, details)
        # else: the transport settles success once it has sent the final message
        r.stream.push(out)
        if status != grpc.StatusCode.OK:
            r.stream.close(Terminal(status, details))
        self.unregister(r.request_id)

    def _end(
        self,
        r: ActiveRequest,
        outcome: str,
        reason: str,
        status: grpc.StatusCode,
        details: str,
        retry_after_ms: int | None = None,
    ) -> None:
        """End a request without a final output: record it and close its stream."""
        self.ledger.settle(r, outcome, reason, status, details)
        r.stream.close(Terminal(status, details, retry_after_ms))

    def _publish_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats_s < self.stats_interval_s:
            return
        self._last_stats_s = now
        state = self.breaker.state
        if state != self._breaker_state and self._on_breaker_change is not None:
            self._on_breaker_change(state)
        self._breaker_state = state
        if self._on_tick is not None:
            self._on_tick()
        try:
            self.last_stats = dict(self.engine.stats())
        except Exception:
            log.exception("engine.stats() failed")
            return
        self.metrics.observe_stats(self.last_stats, len(self.waiting))
