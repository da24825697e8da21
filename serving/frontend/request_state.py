"""One admitted request as the handler thread and the engine thread share it, and the ledger
that gives every request exactly one recorded outcome.

StreamBuffer: the engine thread pushes RequestOutput deltas without ever blocking; when the
buffer already holds `limit` undelivered deltas, push() returns False and the engine thread
cancels the request (slow consumer). The final delta is always accepted. The handler thread
blocks in get() and drains everything buffered into one message.

SlowConsumerPolicy: the buffer bound alone rarely trips, because the handler drains the
buffer into one message whenever the transport lets it, and HTTP/2 windows hold thousands of
tokens. So the engine thread also cancels a request (ABORTED, its KV pages freed at the next
step) when it has generated more than `max_tokens_ahead` tokens beyond what the transport
accepted, or one message has waited more than `stall_timeout_s` for the transport to take it.

An asyncio reader (the HTTP API) passes a `listener`, called (on the engine thread) after
every push and close, to wake its event loop instead of blocking a thread in get().
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable

import grpc

from configs.errors import bounded
from engine.api_types import EngineRequest, RequestOutput
from serving.frontend.tenants import Reservation, TenantLimiter, TenantPolicy

request_log = logging.getLogger("pagedjax.requests")


@dataclasses.dataclass(frozen=True)
class Terminal:
    """How a stream ends when it does not end with a successful final message."""

    code: grpc.StatusCode
    details: str
    retry_after_ms: int | None = None  # sent as trailing metadata `retry-after-ms`


class StreamBuffer:
    def __init__(self, limit: int, listener: Callable[[], None] | None = None):
        self.limit, self.listener = limit, listener
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._terminal: Terminal | None = None
        self._cond = threading.Condition()

    def push(self, out: RequestOutput) -> bool:
        with self._cond:
            if not out.finished and len(self._items) >= self.limit:
                return False
            self._items.append(out)
            self._cond.notify()
        if self.listener is not None:
            self.listener()
        return True

    def close(self, terminal: Terminal) -> None:
        with self._cond:
            if self._terminal is None:
                self._terminal = terminal
            self._cond.notify()
        if self.listener is not None:
            self.listener()

    def get(self, timeout_s: float) -> tuple[list[RequestOutput], Terminal | None]:
        """Everything buffered (maybe nothing after timeout_s), and the terminal if closed."""
        with self._cond:
            if not self._items and self._terminal is None:
                self._cond.wait(timeout_s)
            items = list(self._items)
            self._items.clear()
            return items, self._terminal


@dataclasses.dataclass(frozen=True)
class SlowConsumerPolicy:
    max_tokens_ahead: int = 256  # generated but not yet accepted by the transport
    stall_timeout_s: float = 5.0  # one message not taken by the transport for this long

    def __post_init__(self):
        assert self.max_tokens_ahead >= 1 and self.stall_timeout_s > 0, self

    def violation(self, r: ActiveRequest, now: float) -> str | None:
        """Why `r`'s reader counts as too slow, or None."""
        ahead = r.num_output_tokens - r.tokens_sent
        if ahead > self.max_tokens_ahead:
            return (
                f"{ahead} tokens generated ahead of what the transport accepted "
                f"(limit {self.max_tokens_ahead})"
            )
        started = r.send_started_s
        if started is not None and now - started > self.stall_timeout_s:
            return (
                f"a message waited {now - started:.1f}s for the transport "
                f"(limit {self.stall_timeout_s}s)"
            )
        return None


@dataclasses.dataclass
class ActiveRequest:
    request_id: str
    tenant: TenantPolicy
    reservation: Reservation
    engine_request: EngineRequest
    arrival_s: float  # time.monotonic() when the call arrived
    stream: StreamBuffer
    # Written by the engine thread:
    added_s: float | None = None  # handed to the engine
    identity: object | None = None  # the ModelIdentity of the engine that ran it
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    expected_cached_tokens: int = 0  # what admission expected the prefix cache to serve
    prefix_keys: list[int] = dataclasses.field(default_factory=list)  # its pages' (shadow)
    spec_drafted_tokens: int = 0  # speculative decoding, from the final output's metrics
    spec_accepted_tokens: int = 0
    engine_queue_s: float | None = None
    timings: dict | None = None  # queue_s, ttft_s, tpot_s, e2e_s once finished
    finish_reason: str | None = None
    outcome: str | None = None
    # True: success is recorded by the transport once the final message was sent (gRPC, and
    # the HTTP API: serving/http/delivery.py); False: when the engine finishes (direct use).
    success_on_delivery: bool = False
    log_extra: dict = dataclasses.field(default_factory=dict)  # more fields for its log line
    # Written by the handler thread (read by the engine thread for the slow-consumer policy):
    tokens_sent: int = 0  # tokens in messages the transport has accepted
    send_started_s: float | None = None  # a message is waiting for the transport since
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times_s)

    def claim_settlement(self) -> bool:
        """True exactly once: for whoever records this request's outcome."""
        with self._lock:
            if self.outcome is not None:
                return False
            self.outcome = "pending"
            return True

    def compute_timings(self, now: float) -> dict:
        t, a = self.token_times_s, self.arrival_s
        queue_s = None
        if self.added_s is not None:
            queue_s = self.added_s - a + (self.engine_queue_s or 0.0)
        return {
            "queue_s": queue_s,
            "ttft_s": t[0] - a if t else None,
            "tpot_s": (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None,
            "e2e_s": now - a,
            "itl_s": [y - x for x, y in itertools.pairwise(t)],
        }


class RequestLedger:
    """Records outcomes (metrics + tenant refund + one JSON log line). Thread-safe."""

    tracer = None  # serving/frontend/request_trace.py RequestTrace (--trace_requests), else None

    def __init__(self, metrics, limiter: TenantLimiter, versions: dict):
        self.metrics, self.limiter, self.versions = metrics, limiter, versions

    def reject(
        self,
        request_id: str,
        tenant: str,
        reason: str,
        status: grpc.StatusCode,
        details: str,
        arrival_s: float,
        outcome: str = "rejected",
        extra: dict | None = None,
    ) -> None:
        """A request that never got admitted (its only outcome)."""
        self.metrics.record_outcome(outcome, reason)
        self._log(
            {
                "request_id": request_id,
                "tenant": tenant,
                "outcome": outcome,
                "reason": reason,
                "status": status.name,
                "details": bounded(details),
                "e2e_s": time.monotonic() - arrival_s,
                **(extra or {}),
            }
        )

    def settle(
        self,
        r: ActiveRequest,
        outcome: str,
        reason: str,
        status: grpc.StatusCode,
        details: str = "",
    ) -> bool:
        """Record the outcome of an admitted request, once; False if already recorded."""
        if not r.claim_settlement():
            return False
        now = time.monotonic()
        if r.timings is None:
            r.timings = r.compute_timings(now)
        r.outcome = outcome
        self.limiter.release(
            r.tenant, r.reservation, r.num_output_tokens, refund_all=r.added_s is None
        )  # never reached the engine
        self.metrics.record_outcome(outcome, reason)
        self.metrics.record_finish_reason(r.finish_reason)
        if outcome == "success":
            self.metrics.observe_finished(
                **{k: r.timings[k] for k in ("ttft_s", "tpot_s", "e2e_s", "queue_s", "itl_s")},
                prompt_tokens=r.num_prompt_tokens,
                generation_tokens=r.num_output_tokens,
            )
        record = {
            "request_id": r.request_id,
            "tenant": r.tenant.name,
            "outcome": outcome,
            "reason": reason,
            "status": status.name,
            "finish_reason": r.finish_reason,
            "prompt_tokens": r.num_prompt_tokens,
            "cached_tokens": r.num_cached_tokens,
            "completion_tokens": r.num_output_tokens,
        }
        record.update({k: v for k, v in r.timings.items() if k != "itl_s"})
        record.update(r.log_extra)
        if details:
            record["details"] = bounded(details)
        self._log(record)
        if self.tracer is not None:
            self.tracer.request(r, outcome, now)
        return True

    def _log(self, record: dict) -> None:
        record = {"event": "request_end", **record, **self.versions}
        request_log.info(json.dumps(record, default=str))
