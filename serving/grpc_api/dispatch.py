"""Outcomes for Generate calls that never reach their handler.

gRPC hands an arriving call to a handler thread; if the call's deadline passes or the client
cancels while it waits for one, gRPC drops it without running the handler, so nothing in
service.py could record its outcome. This interceptor notes every Generate call as it
arrives (on gRPC's polling thread) and the handler claims the note when it starts. Notes
left unclaimed for `timeout_s` are recorded as cancelled{before_dispatch}; a call that does
start after its note was reaped is answered UNAVAILABLE without a second outcome. So every
call that reaches the server's Python code gets exactly one outcome (the dropped ones within
timeout_s), and `pagedjax_generate_calls_total` counts those calls, so at rest the outcome
counters sum to it.

NOTE: a call whose deadline passes before gRPC's polling thread even surfaces it (possible
only with deadlines of a few ms on a starved host) is dropped inside gRPC core: the
application never sees it, and the client gets DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable

import grpc

from serving.frontend.request_state import RequestLedger


@dataclasses.dataclass
class _Arrival:
    key: int
    arrival_s: float


class DispatchLedger(grpc.ServerInterceptor):
    def __init__(
        self,
        ledger: RequestLedger,
        method: str,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        calls_counter=None,
    ):
        self.ledger, self.method, self.timeout_s, self.clock = ledger, method, timeout_s, clock
        self.calls_counter = calls_counter  # incremented for every call seen
        self._pending: dict[int, _Arrival] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method != self.method:
            return handler
        arrival = _Arrival(next(self._keys), self.clock())
        if self.calls_counter is not None:
            self.calls_counter.inc()
        with self._lock:
            self._pending[arrival.key] = arrival
        behavior = handler.unary_stream

        def claimed_behavior(request, context):
            if not self._claim(arrival):
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no handler thread picked the call up within {self.timeout_s}s",
                )
            yield from behavior(request, context)

        return grpc.unary_stream_rpc_method_handler(
            claimed_behavior, handler.request_deserializer, handler.response_serializer
        )

    def _claim(self, arrival: _Arrival) -> bool:
        with self._lock:
            return self._pending.pop(arrival.key, None) is not None

    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def reap(self) -> int:
        """Record the calls still unclaimed after timeout_s; returns how many."""
        now = self.clock()
        with self._lock:
            late = [a for a in self._pending.values() if now - a.arrival_s >= self.timeout_s]
            for a in late:
                del self._pending[a.key]
        for a in late:
            self.ledger.reject(
                f"undispatched-{a.key}",
                "?",
                "before_dispatch",
                grpc.StatusCode.CANCELLED,
                "call ended before a handler thread picked it up",
                a.arrival_s,
                outcome="cancelled",
            )
        return len(late)
