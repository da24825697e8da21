"""Circuit breaker over engine steps.

    closed --(failure_threshold consecutive failed steps)--> open
    open   --(cooldown_s passed)--> half_open: ONE probe request is let in
    half_open --(a step succeeds)--> closed;  --(a step fails)--> open again

While open (or half_open with the probe taken) new requests get UNAVAILABLE at once with a
retry hint. A probe that never reaches a step (rejected later, cancelled) frees its slot
after another cooldown_s, so the breaker cannot get stuck.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        assert failure_threshold >= 1, failure_threshold
        self.failure_threshold, self.cooldown_s, self.clock = failure_threshold, cooldown_s, clock
        self._failures = 0
        self._opened_s: float | None = None
        self._probe_s: float | None = None
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        with self._lock:
            return self._state(self.clock())

    def _state(self, now: float) -> str:
        if self._opened_s is None:
            return "closed"
        return "open" if now - self._opened_s < self.cooldown_s else "half_open"

    def allow(self) -> int | None:
        """None if a new request may go on; else the retry-after hint in ms."""
        with self._lock:
            now = self.clock()
            state = self._state(now)
            if state == "closed":
                return None
            if state == "open":
                return max(1, math.ceil(1000 * (self._opened_s + self.cooldown_s - now)))
            if self._probe_s is None or now - self._probe_s >= self.cooldown_s:
                self._probe_s = now
                return None
            return max(1, math.ceil(1000 * (self._probe_s + self.cooldown_s - now)))

    def record_success(self) -> None:
        with self._lock:
            self._failures, self._opened_s, self._probe_s = 0, None, None

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            now = self.clock()
            if self._opened_s is not None or self._failures >= self.failure_threshold:
                self._opened_s, self._probe_s = now, None
