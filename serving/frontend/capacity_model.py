"""What the engine can do, known from the first request: step time per concurrency, measured
at start-up and refreshed by every step, turned into each request's estimated completion.

Seed (`probe(engine, sizes)`, before the engine thread starts): for each batch size b, b
synthetic requests are prefilled (timed: prefill tokens/s) and then decoded for a few steps
(timed: seconds per decode step at concurrency b); they end at max_tokens, so nothing stays
in the engine. Each size runs twice and the second run is measured (the first may compile a shape
or fill a cache: a seed of 3 prefill tokens/s from a compiling first pass shed every call of
a SmolLM2 burst). Refresh (`observe_step`, engine thread): every real step's wall time goes into an
exponential average for its concurrency, its prefill part into one for its computed tokens
per prompt (prefill tokens/s by that length: short cached tails cost more per token).

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
import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np

from engine.api_types import EngineRequest
from engine.sampling.params import SamplingParams

log = logging.getLogger("pagedjax.serving")

MIN_TRAFFIC_PREFILL_STEPS = 10  # see CapacityModel.measured_on_traffic
PROBE_PROMPT_TOKENS = 96  # the start-up probe's prompts (`probe`); its rate's length


@dataclasses.dataclass(frozen=True)
class Estimate:
    wait_s: float  # until the request gets a slot in the engine
    service_s: float  # its own prefill + max_tokens decode steps
    step_s: float  # expected seconds per decode step at the expected concurrency
    concurrency: float = 1.0  # the mean batch it is expected to decode in

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
        length_fraction: float = 1.0,
        steps_seen: dict[int, int] | None = None,
        prefill_steps_seen: int = 0,
        prefill_rate_by_len: dict[int, float] | None = None,
    ):
        assert step_s_by_concurrency and prefill_tokens_per_s > 0, (
            step_s_by_concurrency,
            prefill_tokens_per_s,
        )
        self.max_inflight, self.smoothing = max_inflight, smoothing
        self.max_jump = 2.0  # one observation counts at most this x the current estimate
        self._step_s = dict(step_s_by_concurrency)
        self._envelope: list[tuple[int, float]] | None = None  # _points, cached
        # steps observed per size (the isotonic weights; kept across restarts)
        self._seen = {c: max(1, int((steps_seen or {}).get(c, 1))) for c in self._step_s}
        # Prefill tokens/s by the computed tokens per prompt row in a step (a power of two):
        # each row carries its own cost, so a step of short tails (cached chats: 9 computed
        # tokens a row) computes fewer tokens a second than one of long prompts. Interpolated
        # in log2 of the length, flat beyond the lengths seen. Seeded at the probe's prompt
        # length. NOTE: one rate for all lengths, learned on a cached chat's tails, charged
        # a restarted server's first wave of whole 41-token prompts ~3x too slow, and its
        # first burst was served at 0.55 of a warm one's (benchmarks/RESULTS.md).
        self._prefill_rate = dict(
            prefill_rate_by_len or {PROBE_PROMPT_TOKENS: prefill_tokens_per_s}
        )
        assert all(r > 0 for r in self._prefill_rate.values()), self._prefill_rate
        # Real steps whose prefill refreshed the rate (the probe's counts none; kept across
        # restarts): see `measured_on_traffic`.
        self._prefill_steps_seen = prefill_steps_seen
        # Mean tokens a request produces / its max_tokens (chat replies end at EOS well
        # before max_tokens): what the requests ahead are expected to hold a slot for.
        self._length_fraction = length_fraction
        self._lock = threading.Lock()

    def step_s(self, concurrency: int) -> float:
        """Seconds per decode step at `concurrency`: linear between measured points, flat
        beyond them, non-decreasing in the batch (a step of more rows is not cheaper: see
        `_points`)."""
        with self._lock:
            points = self._points
        return self._interpolated(points, concurrency)

    @property
    def _points(self) -> list[tuple[int, float]]:
        """The measured sizes, sorted, made non-decreasing (a step of more rows is not
        cheaper) by weighted isotonic regression (pool adjacent violators), each size
        weighing the steps it was seen in (at most `1 / smoothing`: what its average
        remembers). NOTE: a size seen in a few steps keeps what those steps took; after a
        mock server's closed loops sizes 4, 11, 19 and 23 held 0.07 s where 64 held 0.052,
        and a burst's fourth wave (whose first requests decode in a small batch when
        admitted) was judged at 0.07 s a token and shed whole: 0.75 of capacity. Weighted,
        a lasting slowdown seen at one size still moves it past a stale rarer one."""
        if self._envelope is None:
            cap = 1.0 / max(self.smoothing, 1e-9)
            blocks: list[list[float]] = []  # [weighted sum, weight, number of sizes]
            sizes = sorted(self._step_s)
            for c in sizes:
                w = min(cap, max(1.0, self._seen.get(c, 1)))
                blocks.append([self._step_s[c] * w, w, 1])
                while len(blocks) > 1 and (
                    blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]
                ):
                    total, weight, n = blocks.pop()
                    blocks[-1][0] += total
                    blocks[-1][1] += weight
                    blocks[-1][2] += n
            values = [b[0] / b[1] for b in blocks for _ in range(int(b[2]))]
            self._envelope = list(zip(sizes, values, strict=True))
        return self._envelope

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

    def prefill_s(self, num_tokens: int, num_prompts: int = 1) -> float:
        """Seconds to prefill `num_tokens` computed prompt tokens of `num_prompts` prompts."""
        if num_tokens <= 0:
            return 0.0
        with self._lock:
            return num_tokens / self._rate_at(num_tokens / max(1, num_prompts))

    def prefill_tokens_per_s(self, tokens_per_prompt: float = 0.0) -> float:
        """The prefill rate at `tokens_per_prompt` computed tokens a prompt (0: the probe's
        prompt length)."""
        with self._lock:
            return self._rate_at(tokens_per_prompt or PROBE_PROMPT_TOKENS)

    def _rate_at(self, tokens_per_prompt: float) -> float:
        x = math.log2(max(1.0, tokens_per_prompt))
        points = sorted((math.log2(n), r) for n, r in self._prefill_rate.items())
        if x <= points[0][0]:
            return points[0][1]
        for (x0, r0), (x1, r1) in zip(points, points[1:], strict=False):
            if x <= x1:
                return r0 + (r1 - r0) * (x - x0) / (x1 - x0)
        return points[-1][1]

    @staticmethod
    def _length_bucket(tokens_per_prompt: float) -> int:
        return 1 << max(0, round(math.log2(max(1.0, tokens_per_prompt))))

    def service_s(self, prompt_tokens: int, max_tokens: int, concurrency: int) -> float:
        return self.prefill_s(prompt_tokens) + max_tokens * self.step_s(concurrency)

    def observe_step(
        self, concurrency: int, step_s: float, prefill_tokens: int = 0, prefill_rows: int = 0
    ) -> None:
        """A real step's wall time, at `concurrency` requests in the engine, `prefill_tokens`
        of them prompt tokens computed for `prefill_rows` prompts (those whose first token
        came in it; 0: one prompt's chunk). The step is split: decode time at `concurrency`
        + prefill_tokens x seconds per prompt token at that many tokens a prompt; what
        exceeds the decode estimate is the prefill's (an estimate of the per-token cost at
        that length), the rest the decode's. One observation counts at most `max_jump` x
        the current estimate (see `_bounded`).

        NOTE: filing prefill-heavy steps whole under their batch size made the decode step
        of mid-size batches ~1.5x too slow (2048 prompt tokens cost a SmolLM2-like step 20x
        a decode row), while prefill, timed per request from entering the engine, counted
        the other prompts and decode steps it waited on: both predicted late."""
        if concurrency < 1 or step_s <= 0:
            return
        if prefill_tokens > 0:
            decode_s = self.step_s(concurrency)
            extra_s = step_s - decode_s
            length = self._length_bucket(prefill_tokens / max(1, prefill_rows))
            with self._lock:
                if extra_s > 0:
                    old = 1.0 / self._rate_at(length)  # a new length starts from its neighbours
                    per_token = self._bounded(old, extra_s / prefill_tokens)
                    self._prefill_rate[length] = 1.0 / per_token
                    self._prefill_steps_seen += 1
                rate = self._rate_at(length)
            step_s -= prefill_tokens / rate
            if step_s <= 0:
                return
        # Filed under its exact batch size, interpolated between sizes seen. NOTE: sizes
        # were once rounded down to a power of two (a step of 18 rows filed as 32 had made
        # the 32-row estimate optimistic); rounded down, a 15-row step counted as 8 and the
        # model over-predicted the decode of mid-size batches by ~20%, shedding work that
        # fitted. The measured margin (admission.WaitingQueue.margin) covers what remains.
        bucket = concurrency
        with self._lock:
            old = self._step_s.get(bucket)
            if old is None:
                # NOTE: a new size starts from the sizes around it and moves by the
                # average's weight, as a seen one does: one step taken whole made a slow
                # step (a collection, a client's burst of calls) that size's time for good.
                old = self._interpolated(self._points, bucket)
            self._step_s[bucket] = self._bounded(old, step_s)
            self._seen[bucket] = self._seen.get(bucket, 0) + 1
            self._envelope = None

    @property
    def measured_on_traffic(self) -> bool:
        """The prefill rate has been refreshed by real steps (MIN_TRAFFIC_PREFILL_STEPS), not
        only by the start-up probe. NOTE: admission credits expected prefix-cache hits only
        then (serving/frontend/prefix_shadow.py). The probe times 96-token uncached prompts;
        a cached chat's 9-token tails cost ~3x more per token (each prompt row carries its
        own overhead), and a cold SmolLM2 burst credited at the probe's rate ran 20% past
        deadline."""
        with self._lock:
            return self._prefill_steps_seen >= MIN_TRAFFIC_PREFILL_STEPS

    @property
    def length_fraction(self) -> float:
        with self._lock:
            return self._length_fraction

    def observe_length(self, num_tokens: int, max_tokens: int) -> None:
        """A request ended after `num_tokens` of its `max_tokens` (stop or length)."""
        if max_tokens < 1 or num_tokens < 0:
            return
        with self._lock:
            f = min(1.0, num_tokens / max_tokens)
            self._length_fraction += self.smoothing * (f - self._length_fraction)

    def expected_tokens(self, max_tokens: float, produced: int = 0) -> float:
        """Tokens a request with `max_tokens` (having produced `produced`) is expected to
        still generate: the mean fraction of max_tokens, at least one more, at most what
        is left."""
        left = max(0.0, max_tokens - produced)
        return min(left, max(1.0, self.length_fraction * max_tokens - produced))

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A real request's prompt: from entering the engine to its first token (bounded
        as steps are)."""
        if num_tokens < 1 or seconds <= 0:
            return
        length = self._length_bucket(num_tokens)
        with self._lock:
            old_s_per_token = 1.0 / self._rate_at(length)
            s_per_token = self._bounded(old_s_per_token, seconds / num_tokens)
            self._prefill_rate[length] = 1.0 / s_per_token

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
        prefill_prompts_ahead: int = 0,
    ) -> Estimate:
        """`prefill_tokens_ahead`: prompt tokens of requests that will prefill before this
        one gets its first token (they share the engine's prefill budget), of
        `prefill_prompts_ahead` prompts.
        `engine_remaining_tokens`: tokens each request in the engine may still generate;
        given, the wait is `slot_wait_s` (slots freed as those finish, then the queued ones
        ahead each holding one for a mean service time), else the uniform drain."""
        c = self.max_inflight
        concurrency = min(c, ahead + 1)
        wait_s = 0.0
        mean_service_s = self.service_s(round(mean_prompt_tokens), round(mean_max_tokens), c)
        if engine_remaining_tokens is not None:
            # The slots as the known work leaves them: the engine's requests end after
            # their expected remaining tokens, the queued ones ahead take the earliest free
            # slot each for a mean service. This one starts on the earliest; the others'
            # overlap with its decode is the batch it decodes in (it shrinks as they end).
            step_c = self.step_s(c)
            free_at_s = [r * step_c for r in engine_remaining_tokens]
            stall_s = self.prefill_s(round(mean_prompt_tokens))
            slots = slots_after(free_at_s, ahead - len(free_at_s), mean_service_s, c, stall_s)
            wait_s = slots[0]
            own_s = self.expected_tokens(max_tokens) * self.step_s(concurrency)
            overlap = sum(min(1.0, max(0.0, (u - wait_s) / own_s)) for u in slots[1:])
            concurrency = min(c, 1 + overlap)
        elif ahead >= c:
            if drain_per_s is None or drain_per_s <= 0:
                drain_per_s = c / max(mean_service_s, 1e-9)
            wait_s = (ahead - c + 1) / drain_per_s
        step_s = self.step_s(round(concurrency))
        prefill_s = self.prefill_s(prompt_tokens + prefill_tokens_ahead, 1 + prefill_prompts_ahead)
        service_s = prefill_s + max_tokens * step_s
        return Estimate(wait_s, service_s, step_s, concurrency)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "step_s_by_concurrency": dict(sorted(self._step_s.items())),
                "prefill_tokens_per_s": self._rate_at(PROBE_PROMPT_TOKENS),
                "prefill_rate_by_len": dict(sorted(self._prefill_rate.items())),
                "length_fraction": self._length_fraction,
                "prefill_steps_seen": self._prefill_steps_seen,
                "steps_seen": dict(sorted(self._seen.items())),
            }


def prefill_tokens_of_step(
    outputs, processed_before: int | None, processed_after: int | None, first_token_prompts: int
) -> int:
    """Prompt tokens a step computed: the engine's token counter's advance
    (`num_tokens_processed`, EngineCore and MockEngine) less one decode token per request
    that received a later token; without the counter (an engine in a child process), the
    computed prompts of the requests whose first token came in it (chunks of a longer
    prompt then count in the step that finishes it)."""
    if processed_before is None or processed_after is None:
        return first_token_prompts
    decodes = sum(
        len(out.new_token_ids)
        for out in outputs
        if out.new_token_ids and out.num_output_tokens > len(out.new_token_ids)
    )
    return max(0, processed_after - processed_before - decodes)


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
    return slots_after(engine_free_at_s, queued_ahead, service_s, slots)[0]


def slots_after(
    engine_free_at_s: Sequence[float],
    queued_ahead: int,
    service_s: float,
    slots: int,
    stall_s: float = 0.0,
) -> list[float]:
    """The slots' free times (a heap: earliest first) once the queued ones ahead took theirs
    (see `slot_wait_s`). `stall_s`: what each one's prefill delays the requests running
    when it starts (they share its steps), so every other slot frees that much later."""
    # A slot free now is taken at once; its request's first token comes after the prompts
    # started before it (they prefill together). Busy slots are all still busy at each
    # later start, so one offset carries the stalls to every entry of the heap.
    free_now = max(0, slots - len(engine_free_at_s))
    offset = 0.0  # added to every heap entry: the stalls so far
    busy = sorted(engine_free_at_s)
    for _ in range(max(0, queued_ahead)):
        if free_now:  # starts now, its first token after the prompts started before it
            free_now -= 1
            start = offset
        else:
            start = heapq.heappop(busy) + offset
        offset += stall_s
        heapq.heappush(busy, start + service_s - offset)
    return [0.0] * free_now + [f + offset for f in busy]


def probe(
    engine,
    max_inflight: int,
    *,
    sizes: tuple[int, ...] | None = None,
    prompt_tokens: int = PROBE_PROMPT_TOKENS,
    decode_steps: int = 3,
    token_id: int = 65,
    clock: Callable[[], float] = time.perf_counter,
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
        # (and counts the steps this batch's prompts take: its stagger)
        _, _, stagger = _probe_batch(engine, b, prompt_tokens, 1, token_id, clock, 0)
        decode_s, prefill_rate, _ = _probe_batch(
            engine, b, prompt_tokens, decode_steps, token_id, clock, stagger
        )
        step_s[b] = decode_s
        prefill_rates.append(prefill_rate)
    rate = float(np.median(prefill_rates))
    model = CapacityModel(step_s, rate, max_inflight, prefill_rate_by_len={prompt_tokens: rate})
    log.info("capacity model seeded: %s", model.snapshot())
    return model


def _probe_batch(
    engine, batch: int, prompt_tokens: int, decode_steps: int, token_id: int, clock, stagger: int
):
    ids = [f"capacity-probe-{uuid.uuid4().hex}" for _ in range(batch)]
    # They run to max_tokens on their own: no aborts in the engine's books. NOTE: sampled,
    # not greedy: chat traffic samples (temperature 1 by default), which runs the step's
    # "full" sampler program (engine/runner/shapes.py), ~10-20 ms more per SmolLM2 step at 32 rows
    # than greedy's argmax; a greedy probe seeded 64-token calls ~20% too fast and the
    # calls a cold burst admitted timed out at 56-57 of 64 tokens (benchmarks/RESULTS.md).
    # NOTE: max_tokens was decode_steps + 1; but a batch whose prompts take several
    # prefill steps (64 x 96 tokens in a 2048-token budget) staggers: the first ones ended
    # during the "decode" steps, which then timed a third of the batch (step_s(64)
    # measured 0.057 s where a 64-row step took 0.129 s). Now + `stagger`: the prefill
    # steps the first pass took.
    sampling = SamplingParams(
        max_tokens=decode_steps + 1 + stagger, temperature=1.0, seed=0, ignore_eos=True
    )
    produced = dict.fromkeys(ids, 0)
    for request_id in ids:
        # distinct prompts, so the prefix cache cannot shorten the prefill. NOTE: they were
        # distinct within a pass but equal across the two passes of a size, so the measured
        # pass hit the cache the first one had filled and timed a prefill of the last page
        # only (~6x too fast for 96-token prompts in 16-token pages).
        rng = random.Random(request_id)
        prompt = [token_id + rng.randrange(50) for _ in range(prompt_tokens)]
        engine.add_request(EngineRequest(request_id, prompt, sampling, tenant="capacity-probe"))
    try:
        start, prefill_steps = clock(), 0
        while min(produced.values()) == 0:
            _count(engine.step(), produced)
            prefill_steps += 1
        prefill_s = clock() - start
        start = clock()
        for _ in range(decode_steps):
            _count(engine.step(), produced)
        decode_s = (clock() - start) / decode_steps
    except BaseException:
        for request_id in ids:
            engine.abort_request(request_id)
        raise
    finally:
        while engine.has_unfinished():
            engine.step()
    # the prompts' own cost: their steps less the decode work those steps also did
    prefill_rate = batch * prompt_tokens / max(prefill_s - prefill_steps * decode_s, 1e-9)
    return decode_s, prefill_rate, prefill_steps


def _count(outputs, produced: dict[str, int]) -> None:
    for out in outputs:
        if out.request_id in produced:
            produced[out.request_id] += len(out.new_token_ids)
