"""Admission control: request limits, and the bounded waiting queue in front of the engine.

Everything here runs on the gRPC handler thread of the arriving request (the queue is also
popped by the engine thread), so a rejection is decided within milliseconds of arrival:

  check_limits(cfg, prompt, sampling)   -> InvalidRequestError (field, value, limit)
  WaitingQueue.offer(item)              -> Rejected(reason, retry_after_ms) when the queue is
                                           full by count or tokens, when the estimated
                                           completion (queue wait + own prefill + max_tokens
                                           decode steps, serving/frontend/capacity_model.py) is past
                                           the request's deadline ("deadline"), or the
                                           estimated wait is past the queue timeout
                                           ("queue_timeout", whatever the deadline)
  WaitingQueue.pop()                    -> highest effective priority: class + waited / aging_s,
                                           so a LOW request waiting 2 * aging_s ranks with HIGH
                                           (no starvation); FIFO among equals

With a capacity model (issue 34), the estimate counts only the queued requests pop() takes
before this one (a flood of lower priorities does not count against a higher one), is held
against the deadline x the measured margin (`margin()`: the `confidence` quantile of actual
/ predicted finish, serving/frontend/capacity_calibration.py), and admission also refuses a
request that would make an admitted one of its class or above miss its deadline (the batch
it joins grows, its prefill stalls them). Each admitted request's prediction is kept and
updated as later admissions grow its batch; the engine thread settles it when the request ends
(`settle_prediction`: the predicted-vs-actual histograms). Queued lower-priority requests
that a higher one would make late leave the queue at once ("displaced": rejected{priority}
with Retry-After, via `expire()`).

The drain rate (DrainMeter: requests and tokens the saturated engine lets through per second,
recorded by the engine thread) turns queue length into an estimated wait and a
`retry-after-ms` hint; until it has measured one, the capacity model (seeded at start-up)
gives a modelled drain rate, so the first burst is judged as well as later ones.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling.params import MAX_STOP_TOKEN_IDS, SamplingParams
from serving.frontend.capacity_calibration import PredictionTracker
from serving.frontend.capacity_model import CapacityModel, Estimate
from serving.frontend.prefix_shadow import PrefixShadow


@dataclasses.dataclass(frozen=True)
class AdmissionConfig:
    max_prompt_tokens: int = 8192
    max_tokens: int = 4096  # largest max_tokens a request may ask for
    default_max_tokens: int = 256
    max_model_len: int = 8192  # prompt + max_tokens must fit; the server takes the engine's
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    max_prompt_bytes: int = 262_144  # UTF-8 bytes of text / chat content, checked before tokenizing
    max_chat_messages: int = 1024
    max_queue_requests: int = 256
    max_queue_tokens: int = 2_000_000  # sum of prompt + max_tokens over queued requests
    queue_timeout_s: float = 60.0
    aging_s: float = 10.0  # each aging_s waited raises a request one priority class
    drain_window_s: float = 10.0
    min_retry_after_ms: int = 10
    max_retry_after_ms: int = 60_000
    default_retry_after_ms: int = 1_000  # when no drain rate has been measured yet
    # With a capacity model, a request is admitted only if its estimated completion x this
    # fits its deadline: estimates err, and a timed-out request wasted its whole run.
    # NOTE: the prior until the model's own error is measured (a first start; a restart
    # loads the measured ratios). 1.2 held a cold mock burst to 3 of the 4 waves that
    # finish in 15 s (0.75 of capacity); the model's measured p90 actual / predicted is
    # 1.01-1.07 on the virtual-time bursts (tests/test_capacity_prediction.py) and 1.05 on
    # the mock server's, and no admitted request of those bursts was late at 1.05.
    deadline_margin: float = 1.05
    # Once the model's own error is measured (serving/frontend/capacity_calibration.py), the margin
    # is the `confidence` quantile of actual / predicted finish, within margin_bounds.
    # NOTE: never below 1: the margin lags the model (its window holds the ratios of
    # earlier predictions), and ratios a pessimistic model left behind (prompts charged
    # whole before cached hits were credited) scaled its later, right predictions down:
    # at a floor of 0.8 a virtual-time burst of one chat admitted 108 for a capacity of
    # 105 and 44 ran late. A model found pessimistic stays so (safe); its error is a metric.
    confidence: float = 0.9
    margin_bounds: tuple[float, float] = (1.0, 2.0)
    # The deadline of a call that brings none (and whose tenant sets none):
    # serving/frontend/deadlines.py
    default_request_timeout_s: float | None = None

    def __post_init__(self):
        assert self.max_queue_requests >= 0, self.max_queue_requests
        assert self.max_model_len >= 2, self.max_model_len
        assert self.aging_s > 0 and self.queue_timeout_s > 0
        assert self.default_request_timeout_s is None or self.default_request_timeout_s > 0


class Rejected(Exception):
    """Admission said no; maps to RESOURCE_EXHAUSTED with trailing `retry-after-ms`."""

    def __init__(self, reason: str, retry_after_ms: int, message: str):
        self.reason, self.retry_after_ms = reason, retry_after_ms
        super().__init__(message)


def check_limits(cfg: AdmissionConfig, num_prompt_tokens: int, sp: SamplingParams) -> None:
    """The limits checked before queueing; raises InvalidRequestError naming the field."""
    checks = [
        ("prompt", num_prompt_tokens, num_prompt_tokens >= 1, "at least 1 token"),
        (
            "prompt",
            num_prompt_tokens,
            num_prompt_tokens <= cfg.max_prompt_tokens,
            f"at most {cfg.max_prompt_tokens} prompt tokens",
        ),
        ("max_tokens", sp.max_tokens, sp.max_tokens <= cfg.max_tokens, f"at most {cfg.max_tokens}"),
        (
            "max_tokens",
            sp.max_tokens,
            num_prompt_tokens + sp.max_tokens <= cfg.max_model_len,
            f"prompt ({num_prompt_tokens}) + max_tokens <= max_model_len ({cfg.max_model_len})",
        ),
        (
            "stop",
            len(sp.stop),
            len(sp.stop) <= cfg.max_stop_strings,
            f"at most {cfg.max_stop_strings} stop strings",
        ),
        (
            "stop",
            max(map(len, sp.stop), default=0),
            all(len(s) <= cfg.max_stop_string_chars for s in sp.stop),
            f"each stop string at most {cfg.max_stop_string_chars} characters",
        ),
    ]
    for field, value, ok, limit in checks:
        if not ok:
            raise InvalidRequestError(field, value, limit)


class DrainMeter:
    """How fast the engine frees room while it is saturated: requests (and their reserved
    tokens) leaving the engine per second of saturated time, over the last `window_s`.

    Saturated = the engine holds `max_inflight` requests, so every departure lets one queued
    request in: this is the queue's drain rate. Time when the engine had free slots does not
    count (departures then say nothing about how fast a backlog drains), so a burst after an
    idle spell is not misjudged. rate = departures / saturated seconds in the window; None
    until `min_events` departures are in the window. The engine thread records, handler
    threads read.
    """

    def __init__(self, window_s: float, min_events: int = 4):
        self.window_s, self.min_events = window_s, min_events
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._busy: collections.deque[tuple[float, float]] = collections.deque()
        self._busy_since: float | None = None
        self._lock = threading.Lock()

    @property
    def saturated(self) -> bool:
        return self._busy_since is not None

    def set_saturated(self, now: float, saturated: bool) -> None:
        with self._lock:
            if saturated and self._busy_since is None:
                self._busy_since = now
            elif not saturated and self._busy_since is not None:
                self._busy.append((self._busy_since, now))
                self._busy_since = None

    def record(self, now: float, num_tokens: int) -> None:
        """A request left the saturated engine, freeing room for `num_tokens` queued tokens."""
        with self._lock:
            self._events.append((now, num_tokens))

    def rates(self, now: float) -> tuple[float, float] | None:
        """(requests/s, tokens/s) of saturated time, or None when too few were seen."""
        with self._lock:
            start = now - self.window_s
            while self._events and self._events[0][0] < start:
                self._events.popleft()
            while self._busy and self._busy[0][1] < start:
                self._busy.popleft()
            busy_s = sum(end - max(begin, start) for begin, end in self._busy)
            if self._busy_since is not None:
                busy_s += now - max(self._busy_since, start)
            if len(self._events) < self.min_events or busy_s <= 0:
                return None
            return len(self._events) / busy_s, sum(t for _, t in self._events) / busy_s


@dataclasses.dataclass
class QueuedRequest:
    request_id: str
    num_tokens: int  # prompt + max_tokens: what it may occupy
    priority: int  # class: larger = more important
    enqueued_s: float
    deadline_s: float | None = None  # absolute, time.monotonic()
    payload: Any = None
    seq: int = 0  # FIFO tie-break, set by the queue
    prompt_tokens: int = 0  # for the capacity model (0: unknown, num_tokens counts as prompt)
    max_tokens: int = 0
    estimate: Estimate | None = None  # set by offer when a capacity model judged it
    cached_tokens: int = 0  # of its prompt, expected from the prefix cache (prefix_shadow.py)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens it is expected to compute (the capacity model times prefill per
        computed token)."""
        return max(1, (self.prompt_tokens or self.num_tokens) - self.cached_tokens)


@dataclasses.dataclass
class Prediction:
    """What admission predicted for a request it let in (the engine thread compares it with
    the finish it had: `WaitingQueue.settle_prediction`)."""

    enqueued_s: float
    wait_s: float
    prefill_s: float
    step_s: float
    deadline_s: float | None = None
    expected_tokens: float = 0.0  # what it is expected to produce (for its run's span)
    concurrency: float = 1.0  # the mean batch it is expected to decode in
    max_tokens: int = 0
    priority: int = 1

    @property
    def latest_finish_s(self) -> float:
        """Predicted seconds from admission to the end should it run to max_tokens."""
        return self.finish_s(self.max_tokens)

    @property
    def begin_s(self) -> float:
        return self.enqueued_s + self.wait_s

    @property
    def end_s(self) -> float:
        return self.begin_s + self.prefill_s + self.expected_tokens * self.step_s

    def finish_s(self, num_output_tokens: int) -> float:
        """Predicted seconds from admission to the end, for the tokens it produced."""
        return self.wait_s + self.prefill_s + num_output_tokens * self.step_s


class WaitingQueue:
    """Bounded by count and by tokens; thread-safe. `clock` is injectable for tests."""

    def __init__(
        self,
        cfg: AdmissionConfig,
        clock: Callable[[], float] = time.monotonic,
        capacity: CapacityModel | None = None,
    ):
        self.cfg, self.clock, self.capacity = cfg, clock, capacity
        self.num_in_engine = 0  # set by the engine thread
        self.unprefilled_engine_tokens = 0  # prompts in the engine without a first token
        self.unprefilled_engine_prompts = 0  # ... and how many prompts those are
        # (max_tokens, tokens produced, priority) of each request in the engine (set by the
        # engine thread)
        self.engine_progress: list[tuple[int, int, int]] = []
        # Engine slots a higher class may take from a lower one by preemption (the engine
        # loop's priority_overflow): such a slot does not hold it back.
        self.preemptible_slots = 0
        # Expected prefix-cache hits of arriving prompts (set by the server when the engine's
        # prefix cache is on): `expected_cached` looks a prompt up, the engine thread records
        # its pages at its first token.
        self.prefix_shadow: PrefixShadow | None = None
        self._items: dict[str, QueuedRequest] = {}
        self._tokens = 0
        self._prompt_sum = 0
        self._max_tokens_sum = 0
        self._lock = threading.Lock()
        self._counter = itertools.count()
        self.drain = DrainMeter(cfg.drain_window_s)
        self.tracker = PredictionTracker()
        self._predictions: dict[str, Prediction] = {}
        self._displaced: list[QueuedRequest] = []

    def __len__(self) -> int:
        return len(self._items)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def offer(self, item: QueuedRequest) -> None:
        """Enqueue, or raise Rejected at once."""
        with self._lock:
            now = self.clock()
            rates = self._rates(now)
            count, tokens = len(self._items), self._tokens
            if count + 1 > self.cfg.max_queue_requests:
                raise Rejected(
                    "queue_full",
                    self._retry_ms(rates, count + 1 - self.cfg.max_queue_requests, 0),
                    f"waiting queue full ({count} >= {self.cfg.max_queue_requests} requests)",
                )
            if tokens + item.num_tokens > self.cfg.max_queue_tokens:
                excess = tokens + item.num_tokens - self.cfg.max_queue_tokens
                raise Rejected(
                    "queue_tokens",
                    self._retry_ms(rates, 0, excess),
                    f"waiting queue holds {tokens} tokens; +{item.num_tokens} would pass "
                    f"{self.cfg.max_queue_tokens}",
                )
            est = self._check_estimate(item, now, rates)
            prediction, growth = None, []
            if est is not None and self.capacity is not None:
                prediction = Prediction(
                    now,
                    est.wait_s,
                    est.service_s - item.max_tokens * est.step_s,
                    est.step_s,
                    item.deadline_s,
                    self.capacity.expected_tokens(item.max_tokens),
                    est.concurrency,
                    item.max_tokens,
                    item.priority,
                )
                stall_s = self.capacity.prefill_s(item.prefill_tokens)
                growth = self._batch_growth(prediction, stall_s)
                self._check_admitted_stay_in_time(item, now, growth)
            item.seq = next(self._counter)
            item.enqueued_s = now
            item.estimate = est
            if prediction is not None:
                for p, updated in growth:
                    p.wait_s, p.prefill_s, p.concurrency, p.step_s = updated
                self._predictions[item.request_id] = prediction
                self._displace_lower(item, now, est)
            self._items[item.request_id] = item
            self._tokens += item.num_tokens
            self._prompt_sum += item.prefill_tokens
            self._max_tokens_sum += item.max_tokens

    def expected_cached(self, token_ids, salt: tuple) -> tuple[list[int], int]:
        """(page keys, prompt tokens expected from the prefix cache) of an arriving prompt:
        no keys without a prefix shadow and a capacity model; 0 tokens until the model's
        prefill rate was measured on real traffic (CapacityModel.measured_on_traffic)."""
        if self.prefix_shadow is None or self.capacity is None:
            return [], 0
        keys = self.prefix_shadow.keys(token_ids, salt)
        if not self.capacity.measured_on_traffic:
            return keys, 0
        return keys, self.prefix_shadow.expected_cached(keys, len(token_ids))

    def margin(self) -> float:
        """The factor on an estimate before it is held against a deadline: the measured
        `confidence` quantile of actual / predicted finish once known, else the configured
        `deadline_margin` (1.0 without a capacity model: the drain alone is measured)."""
        if self.capacity is None:
            return 1.0
        q = self.tracker.quantile(self.cfg.confidence)
        if q is None:
            return self.cfg.deadline_margin
        low, high = self.cfg.margin_bounds
        return min(max(q, low), high)

    def settle_prediction(
        self, request_id: str, num_output_tokens: int, now: float, finished: bool = True
    ) -> tuple[float, float] | None:
        """The request left the engine: (predicted, actual) seconds from admission to its end
        for the tokens it produced, recorded in the tracker; None without a prediction.
        `finished` False (timed out): the time it had is a lower bound, recorded as such."""
        with self._lock:
            p = self._predictions.pop(request_id, None)
        if p is None or num_output_tokens < 1:
            return None
        predicted, actual = p.finish_s(num_output_tokens), now - p.enqueued_s
        if not finished and p.deadline_s is not None:
            actual = max(actual, p.deadline_s - p.enqueued_s)
        self.tracker.observe(predicted, actual)
        return predicted, actual

    def forget_prediction(self, request_id: str) -> None:
        with self._lock:
            self._predictions.pop(request_id, None)

    def _batch_growth(self, new: Prediction, stall_s: float) -> list[tuple[Prediction, tuple]]:
        """The batch grows as requests arrive: every admitted request whose predicted run
        overlaps `new`'s decodes in a batch larger by the overlapped fraction of its run;
        one running when `new` starts waits for `new`'s prefill (`stall_s`), and one still
        waiting gets its slot that much later. Returns (prediction, (wait_s, prefill_s,
        concurrency, step_s) updated) for those it changes; `offer` applies them once
        `new` is admitted, so the finish histogram compares the prediction as updated by
        everything admitted after a request (without this the first requests of a burst,
        judged by the batch of one they were admitted into, finished up to 40% late)."""
        assert self.capacity is not None
        growth = []
        for p in self._predictions.values():
            wait_s, prefill_s, concurrency, step_s = p.wait_s, p.prefill_s, p.concurrency, p.step_s
            begin = p.enqueued_s + wait_s
            if begin > new.begin_s:  # the slot it waits for frees later
                wait_s += stall_s
                begin += stall_s
            end = begin + prefill_s + p.expected_tokens * step_s
            shared = min(end, new.end_s) - max(begin, new.begin_s)
            if shared > 0 and end > begin:
                concurrency = min(self.capacity.max_inflight, concurrency + shared / (end - begin))
                step_s = self.capacity.step_s(round(concurrency))
                if begin <= new.begin_s:
                    prefill_s += stall_s
            if (wait_s, prefill_s, concurrency, step_s) != (
                p.wait_s,
                p.prefill_s,
                p.concurrency,
                p.step_s,
            ):
                growth.append((p, (wait_s, prefill_s, concurrency, step_s)))
        return growth

    def _check_admitted_stay_in_time(self, item: QueuedRequest, now: float, growth) -> None:
        """Admitting `item` must not make an admitted request of its priority or above miss
        its deadline (run to max_tokens, x margin): else `item` is shed, not them."""
        margin = self.margin()
        for p, (wait_s, prefill_s, _, step_s) in growth:
            if p.deadline_s is None or p.priority < item.priority:
                continue
            finish = p.enqueued_s + (wait_s + prefill_s + p.max_tokens * step_s) * margin
            if finish > p.deadline_s and p.enqueued_s + p.latest_finish_s * margin <= p.deadline_s:
                raise Rejected(
                    "deadline",
                    self._clamp(1000 * (finish - p.deadline_s)),
                    f"admitting it would make admitted requests miss their deadline "
                    f"(one by {finish - p.deadline_s:.3f}s, margin {margin:g})",
                )

    def _displace_lower(self, item: QueuedRequest, now: float, est: Estimate) -> None:
        """Lower priorities are shed first: `item` goes ahead of every queued request of a
        lower effective priority, pushing each one's start back by its service over the
        slots (the mean shift of a c-slot drain); one whose deadline its new prediction x
        margin then passes leaves the queue now ("displaced", with Retry-After) rather than
        timing out in it, so the slot time goes to work that can finish."""
        assert self.capacity is not None
        shift_s = est.service_s / max(1, self.capacity.max_inflight)
        margin = self.margin()
        for other in list(self._items.values()):
            if self._effective(other, now) >= item.priority or other.estimate is None:
                continue
            p = self._predictions.get(other.request_id)
            if p is not None:
                p.wait_s += shift_s
            other.estimate = dataclasses.replace(
                other.estimate, wait_s=other.estimate.wait_s + shift_s
            )
            if other.deadline_s is None:
                continue
            finish = other.enqueued_s + other.estimate.completion_s * margin
            if finish > other.deadline_s:
                self._take(other)
                self._predictions.pop(other.request_id, None)
                self._displaced.append(other)

    def _check_estimate(self, item: QueuedRequest, now: float, rates) -> Estimate | None:
        est = self._estimate(item, rates, now)
        if est is None:
            return None
        margin = self.margin()
        completion_s = est.completion_s * margin
        if item.deadline_s is not None and now + completion_s > item.deadline_s:
            late_s = now + completion_s - item.deadline_s
            raise Rejected(
                "deadline",
                self._clamp(1000 * late_s),
                f"estimated completion {est.completion_s:.3f}s (queue wait {est.wait_s:.3f}s + "
                f"own prefill and {item.max_tokens or '?'} tokens {est.service_s:.3f}s) "
                f"x margin {margin:g} = {completion_s:.3f}s exceeds the deadline "
                f"({item.deadline_s - now:.3f}s left)",
            )
        # NOTE: with a deadline too: expire() takes a request out at the queue timeout
        # whatever its deadline (the openai SDK sends a 600 s one on every call)
        if est.wait_s > self.cfg.queue_timeout_s:
            raise Rejected(
                "queue_timeout",
                self._clamp(1000 * (est.wait_s - self.cfg.queue_timeout_s)),
                f"estimated queue wait {est.wait_s:.3f}s exceeds the queue timeout "
                f"({self.cfg.queue_timeout_s}s)",
            )
        return est

    def _estimate(self, item: QueuedRequest, rates, now: float) -> Estimate | None:
        """Completion estimate for `item` behind everything in the engine and the queued
        requests pop() takes before it (effective priority >= its class: a flood of lower
        priorities does not count against it); without a capacity model, the wait alone
        from the measured drain (None before one)."""
        if self.capacity is None:
            if rates is None:
                return None
            return Estimate(len(self._items) / rates[0], 0.0, 0.0)
        queued = [q for q in self._items.values() if self._effective(q, now) >= item.priority]
        progress = self.engine_progress[: self.num_in_engine]
        if self.preemptible_slots:  # the lowest classes below it give up their slots
            lower = sorted((p for p in progress if p[2] < item.priority), key=lambda p: p[2])
            for gone in lower[: self.preemptible_slots]:
                progress.remove(gone)
        in_engine = self.num_in_engine - (
            len(self.engine_progress[: self.num_in_engine]) - len(progress)
        )
        ahead = in_engine + len(queued)
        n = max(1, len(queued))
        prompt_sum = sum(q.prefill_tokens for q in queued)
        prefill_ahead = self.unprefilled_engine_tokens
        prompts_ahead = self.unprefilled_engine_prompts
        if ahead < self.capacity.max_inflight:  # the queued ones start before or with it
            prefill_ahead += prompt_sum
            prompts_ahead += len(queued)
        mean_max_tokens = sum(q.max_tokens for q in queued) / n if queued else item.max_tokens
        # Those ahead hold their slots for the tokens they are expected to produce (the
        # measured fraction of max_tokens), not their max_tokens: replies end at EOS.
        expected = self.capacity.expected_tokens
        remaining = [round(expected(m, p)) for m, p, _ in progress]
        remaining += [round(expected(mean_max_tokens))] * (in_engine - len(remaining))
        return self.capacity.estimate(
            prefill_tokens_ahead=prefill_ahead,
            prefill_prompts_ahead=prompts_ahead,
            ahead=ahead,
            prompt_tokens=item.prefill_tokens,
            max_tokens=item.max_tokens,
            mean_prompt_tokens=prompt_sum / n if queued else item.prefill_tokens,
            mean_max_tokens=expected(mean_max_tokens),
            drain_per_s=None if rates is None else rates[0],
            engine_remaining_tokens=remaining,
        )

    def estimated_wait_s(self) -> float | None:
        with self._lock:
            rates = self._rates(self.clock())
            return None if rates is None else len(self._items) / rates[0]

    def retry_after_hint_ms(self) -> int:
        """When one more request could get in, from the measured (or modelled) drain."""
        with self._lock:
            return self._retry_ms(self._rates(self.clock()), 1, 0)

    def _rates(self, now: float) -> tuple[float, float] | None:
        """(requests/s, tokens/s) the queue drains at: measured, else modelled, else None."""
        rates = self.drain.rates(now)
        if rates is not None or self.capacity is None or not self._items:
            return rates
        n = len(self._items)
        mean_prompt, mean_max = self._prompt_sum / n, self._max_tokens_sum / n
        c = self.capacity.max_inflight
        per_s = c / max(self.capacity.service_s(round(mean_prompt), round(mean_max), c), 1e-9)
        return per_s, per_s * self._tokens / n

    def pop(self) -> QueuedRequest | None:
        """The request with the highest class + waited / aging_s; FIFO among equals."""
        with self._lock:
            if not self._items:
                return None
            now = self.clock()
            best = max(self._items.values(), key=lambda q: (self._effective(q, now), -q.seq))
            self._take(best)
            self._count_in_engine(best)
            return best

    def pop_above(self, priority: int) -> QueuedRequest | None:
        """The request pop() would take, only if its class is above `priority` (a request
        fed past the engine's inflight limit to preempt a lower one)."""
        with self._lock:
            if not self._items:
                return None
            now = self.clock()
            best = max(self._items.values(), key=lambda q: (self._effective(q, now), -q.seq))
            if best.priority <= priority:
                return None
            self._take(best)
            self._count_in_engine(best)
            return best

    def _count_in_engine(self, item: QueuedRequest) -> None:
        """A popped request is in the engine for every estimate from now on (the engine
        thread sets the true counts after its feed). NOTE: it was counted only once the feed
        ended, so an arrival judged meanwhile missed the requests popped so far: a warm mock
        burst admitted 3 calls into a fifth wave of 64 as if it were the fourth (all 3
        timed out)."""
        self.num_in_engine += 1
        self.engine_progress = [*self.engine_progress, (item.max_tokens, 0, item.priority)]
        self.unprefilled_engine_tokens += item.prefill_tokens
        self.unprefilled_engine_prompts += 1

    def remove(self, request_id: str) -> QueuedRequest | None:
        with self._lock:
            item = self._items.get(request_id)
            if item is not None:
                self._take(item)
                self._predictions.pop(request_id, None)
            return item

    def expire(self) -> list[tuple[QueuedRequest, str]]:
        """Take out requests past their deadline ("timed_out") or the queue timeout, and
        hand over those displaced by higher priorities ("displaced")."""
        with self._lock:
            now = self.clock()
            gone = [(item, "displaced") for item in self._displaced]
            self._displaced.clear()
            taken = len(gone)
            for item in list(self._items.values()):
                if item.deadline_s is not None and now >= item.deadline_s:
                    gone.append((item, "timed_out"))
                elif now - item.enqueued_s >= self.cfg.queue_timeout_s:
                    gone.append((item, "queue_timeout"))
            for item, _ in gone[taken:]:
                self._take(item)
                self._predictions.pop(item.request_id, None)
            return gone

    def _effective(self, q: QueuedRequest, now: float) -> float:
        return q.priority + (now - q.enqueued_s) / self.cfg.aging_s

    def _take(self, item: QueuedRequest) -> None:
        del self._items[item.request_id]
        self._tokens -= item.num_tokens
        self._prompt_sum -= item.prefill_tokens
        self._max_tokens_sum -= item.max_tokens

    def _retry_ms(self, rates, excess_requests: int, excess_tokens: int) -> int:
        """Time for the measured drain to take out the excess."""
        if rates is None:
            return self.cfg.default_retry_after_ms
        per_s, tokens_per_s = rates
        wait_s = max(
            excess_requests / per_s if per_s else math.inf,
            excess_tokens / tokens_per_s if tokens_per_s else 0.0,
        )
        return self._clamp(1000 * wait_s)

    def _clamp(self, ms: float) -> int:
        ms = self.cfg.max_retry_after_ms if math.isinf(ms) else math.ceil(ms)
        return int(min(max(ms, self.cfg.min_retry_after_ms), self.cfg.max_retry_after_ms))
