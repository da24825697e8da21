"""What the engine can do, known from the first request: step time per concurrency, measured
at start-up and refreshed by every step, turned into each request's estimated completion.

Seed (`probe(engine, sizes)`, before the engine thread starts): for each batch size b, b
synthetic requests are prefilled (timed: prefill tokens/s) and then decoded for a few steps
(timed: seconds per decode step at concurrency b); they end at max_tokens, so nothing stays
in the engine. Each size runs twice and the second run is measured (the first may compile a shape
or fill a cache: a seed of 3 prefill tokens/s from a compiling first pass shed every call of
a SmolLM2 burst). Refresh (`observe_step`, engine thread): every real step's wall time goes into an
exponential average for its concurrency.

Estimate for an arriving request (`estimate`), with c = max_inflight slots:

    ahead       = requests in the engine + queued before it
    wait_s      = 0                                     if ahead < c (a slot is free)
                = slot_wait_s(...)                      else: slots free as the requests in
                                                        the engine finish (their remaining
                                                        max_tokens x step_s(c)), then each
                                                        queued one ahead holds a slot for a
                                                        mean service time (bursts run in
                                                        waves; a uniform drain rate misses
                                                        that). Without the engine's remaining
                                                        tokens: (ahead - c + 1) / drain_per_s
                                                        (measured, DrainMeter, or modelled)
    service_s   = prefill_s(prompt + prefill ahead) + max_tokens * step_s(concurrency)
                  prefill ahead = prompts in the engine without a first token yet, plus the
                  queued ones when a slot is free (they all prefill before this one's first
                  token: 41 chat calls admitted at once into SmolLM2 waited 6.7 s for it)
    completion  = wait_s + service_s,    concurrency = min(c, ahead + 1)

mean service time = mean prompt and max_tokens of the requests in line, through the same
formula: conservative (requests that stop early at EOS finish sooner), and superseded by the
measured drain rate as soon as DrainMeter has one. Admission (admission.WaitingQueue.offer)
sheds a request whose completion passes its deadline, or whose wait passes the queue timeout.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import logging
import threading
import time
import uuid
from collections.abc import Sequence

import numpy as np

from engine.api_types import EngineRequest
from engine.sampling.params import SamplingParams

log = logging.getLogger("pagedjax.serving")


@dataclasses.dataclass(frozen=True)
class Estimate:
    wait_s: float  # until the request gets a slot in the engine
    service_s: float  # its own prefill + max_tokens decode steps
    step_s: float  # expected seconds per decode step at the expected concurrency

    @property
    def completion_s(self) -> float:
        return self.wait_s + self.service_s


class CapacityModel:
    """Thread-safe: the engine thread observes steps, handler threads estimate."""

    def __init__(
        self,
        step_s_by_concurrency: dict[int, float],
        prefill_tokens_per_s: float,
        max_inflight: int,
        smoothing: float = 0.1,
    ):
        assert step_s_by_concurrency and prefill_tokens_per_s > 0, (
            step_s_by_concurrency,
            prefill_tokens_per_s,
        )
        self.max_inflight, self.smoothing = max_inflight, smoothing
        self.max_jump = 2.0  # one observation counts at most this x the current estimate
        self._step_s = dict(step_s_by_concurrency)
        self._prefill_tokens_per_s = prefill_tokens_per_s
        self._lock = threading.Lock()

    def step_s(self, concurrency: int) -> float:
        """Seconds per decode step at `concurrency`: linear between measured points, flat
        beyond them."""
        with self._lock:
            points = sorted(self._step_s.items())
        return self._interpolated(points, concurrency)

    @staticmethod
    def _interpolated(points: list[tuple[int, float]], concurrency: int) -> float:
        sizes = [c for c, _ in points]
        i = bisect.bisect_left(sizes, concurrency)
        if i < len(sizes) and sizes[i] == concurrency:
            return points[i][1]
        if i == 0:
            return points[0][1]
        if i == len(points):
            return points[-1][1]
        (c0, s0), (c1, s1) = points[i - 1], points[i]
        return s0 + (s1 - s0) * (concurrency - c0) / (c1 - c0)

    def prefill_s(self, num_tokens: int) -> float:
        with self._lock:
            return num_tokens / self._prefill_tokens_per_s

    def service_s(self, prompt_tokens: int, max_tokens: int, concurrency: int) -> float:
        return self.prefill_s(prompt_tokens) + max_tokens * self.step_s(concurrency)

    def observe_step(self, concurrency: int, step_s: float) -> None:
        """A real step's wall time, at `concurrency` requests in the engine. One observation
        counts at most `max_jump` x the current estimate (see `_bounded`)."""
        if concurrency < 1 or step_s <= 0:
            return
        # 1, 2, 4, ...: few, well-fed points. NOTE: rounded down: a step of 18 rows filed
        # as 32 made the 32-row estimate optimistic, and the next burst admitted 41 calls
        # that all timed out (benchmarks/RESULTS.md); filed as 16 it errs on the safe side.
        bucket = 1 << (concurrency.bit_length() - 1)
        with self._lock:
            old = self._step_s.get(bucket)
            if old is None:
                old = self._interpolated(sorted(self._step_s.items()), bucket)
                step_s = min(step_s, old * self.max_jump)
                self._step_s[bucket] = step_s
            else:
                self._step_s[bucket] = self._bounded(old, step_s)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A real request's prompt: from entering the engine to its first token (bounded
        as steps are)."""
        if num_tokens < 1 or seconds <= 0:
            return
        with self._lock:
            old_s_per_token = 1.0 / self._prefill_tokens_per_s
            s_per_token = self._bounded(old_s_per_token, seconds / num_tokens)
            self._prefill_tokens_per_s = 1.0 / s_per_token

    def _bounded(self, old: float, observed: float) -> float:
        """The exponential average's next value, with one observation clamped to
        `max_jump` x the current one. NOTE: a step that compiled a new shape (15-30 s for
        SmolLM2 on a loaded CPU, against 0.2 s steps) counted in full made the model shed
        every call of the next burst for an estimated 29 s per request; a lasting slowdown
        still gets through, by up to smoothing x (max_jump - 1) = 10% per step."""
        return old + self.smoothing * (min(observed, old * self.max_jump) - old)

    def estimate(
        self,
        *,
        ahead: int,
        prompt_tokens: int,
        max_tokens: int,
        mean_prompt_tokens: float,
        mean_max_tokens: float,
        drain_per_s: float | None = None,
        prefill_tokens_ahead: int = 0,
        engine_remaining_tokens: Sequence[int] | None = None,
    ) -> Estimate:
        """`prefill_tokens_ahead`: prompt tokens of requests that will prefill before this
        one gets its first token (they share the engine's prefill budget).
        `engine_remaining_tokens`: tokens each request in the engine may still generate;
        given, the wait is `slot_wait_s` (slots freed as those finish, then the queued ones
        ahead each holding one for a mean service time), else the uniform drain."""
        c = self.max_inflight
        concurrency = min(c, ahead + 1)
        step_s = self.step_s(concurrency)
        wait_s = 0.0
        if ahead >= c:
            mean_service_s = self.service_s(round(mean_prompt_tokens), round(mean_max_tokens), c)
            if engine_remaining_tokens is not None:
                step_c = self.step_s(c)
                free_at_s = [r * step_c for r in engine_remaining_tokens]
                wait_s = slot_wait_s(free_at_s, ahead - len(free_at_s), mean_service_s, c)
            else:
                if drain_per_s is None or drain_per_s <= 0:
                    drain_per_s = c / max(mean_service_s, 1e-9)
                wait_s = (ahead - c + 1) / drain_per_s
        service_s = self.prefill_s(prompt_tokens + prefill_tokens_ahead) + max_tokens * step_s
        return Estimate(wait_s, service_s, step_s)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "step_s_by_concurrency": dict(sorted(self._step_s.items())),
                "prefill_tokens_per_s": self._prefill_tokens_per_s,
            }


def slot_wait_s(
    engine_free_at_s: Sequence[float], queued_ahead: int, service_s: float, slots: int
) -> float:
    """When a slot frees for a request with `queued_ahead` queued before it: slots free now
    (slots - len(engine_free_at_s)) and as each request in the engine ends; each queued one
    takes the earliest free slot and holds it `service_s`.

    NOTE: a uniform drain rate (ahead - slots + 1) / (slots / service_s) is right for
    staggered traffic but not for a burst, which runs in waves: 32 slots, 4.5 s per request,
    the 65th of a burst starts at 9 s (when the second wave ends), not at 4.6 s; the uniform
    rate admitted a fourth wave of a mock burst that then timed out (52 of 300)."""
    free = [0.0] * max(0, slots - len(engine_free_at_s)) + sorted(engine_free_at_s)
    heapq.heapify(free)
    for _ in range(max(0, queued_ahead)):
        heapq.heappush(free, heapq.heappop(free) + service_s)
    return free[0]


def probe(
    engine,
    max_inflight: int,
    *,
    sizes: tuple[int, ...] | None = None,
    prompt_tokens: int = 96,
    decode_steps: int = 3,
    token_id: int = 65,
) -> CapacityModel:
    """Measure step times on `engine` (no other thread may use it meanwhile).
    NOTE: 96-token prompts: the context of a one-line chat call (~40 templated tokens) part
    way through its reply, so the probe's decode steps run at the page-table rung such calls
    run at (engine/runner/shapes.py pads the page table; 32-token prompts measured the 4-page rung,
    a cold burst's calls ran at the 32-page one)."""
    sizes = sizes or tuple(sorted({1, max(1, max_inflight // 4), max_inflight}))
    step_s, prefill_rates = {}, []
    for b in sizes:
        # The first pass pays any one-time cost (a shape compiled on first use, caches);
        # the second is measured.
        _probe_batch(engine, b, prompt_tokens, 1, token_id)
        decode_s, prefill_rate = _probe_batch(engine, b, prompt_tokens, decode_steps, token_id)
        step_s[b] = decode_s
        prefill_rates.append(prefill_rate)
    model = CapacityModel(step_s, float(np.median(prefill_rates)), max_inflight)
    log.info("capacity model seeded: %s", model.snapshot())
    return model


def _probe_batch(engine, batch: int, prompt_tokens: int, decode_steps: int, token_id: int):
    ids = [f"capacity-probe-{uuid.uuid4().hex}" for _ in range(batch)]
    # They run to max_tokens on their own: no aborts in the engine's books. NOTE: sampled,
    # not greedy: chat traffic samples (temperature 1 by default), which runs the step's
    # "full" sampler program (engine/runner/shapes.py), ~10-20 ms more per SmolLM2 step at 32 rows
    # than greedy's argmax; a greedy probe seeded 64-token calls ~20% too fast and the
    # calls a cold burst admitted timed out at 56-57 of 64 tokens (benchmarks/RESULTS.md).
    sampling = SamplingParams(max_tokens=decode_steps + 1, temperature=1.0, seed=0, ignore_eos=True)
    produced = dict.fromkeys(ids, 0)
    for i, request_id in enumerate(ids):
        # distinct prompts, so the prefix cache cannot shorten the prefill
        prompt = [token_id + (i + k) % 50 for k in range(prompt_tokens)]
        engine.add_request(EngineRequest(request_id, prompt, sampling, tenant="capacity-probe"))
    try:
        start = time.perf_counter()
        while min(produced.values()) == 0:
            _count(engine.step(), produced)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(decode_steps):
            _count(engine.step(), produced)
        decode_s = (time.perf_counter() - start) / decode_steps
    except BaseException:
        for request_id in ids:
            engine.abort_request(request_id)
        raise
    finally:
        while engine.has_unfinished():
            engine.step()
    return decode_s, batch * prompt_tokens / max(prefill_s, 1e-9)


def _count(outputs, produced: dict[str, int]) -> None:
    for out in outputs:
        if out.request_id in produced:
            produced[out.request_id] += len(out.new_token_ids)
