"""Admission against an engine with known step times, in virtual time (no sleeps, no timed
assertions): the real WaitingQueue and CapacityModel in front of the real MockEngine
(scheduler, page pool, stop checks), driven the way serving/frontend/engine_loop.py drives them,
with a virtual clock that each engine step advances by a known cost:

    step_s = BASE_S + PER_ROW_S x rows + PER_TOKEN_S x tokens computed (prompt + decode)

so the decode step grows with the batch and a prefill costs per prompt token, as on a
device. The capacity model is seeded by `capacity_model.probe` on the same clock (the
warm-up calibration) and refreshed online, as the server does.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from configs.engine_config import SchedulerConfig
from engine.api_types import EngineRequest
from engine.sampling.params import SamplingParams
from serving.engine_host.mock_engine import MockEngine, expected_continuation
from serving.frontend.admission import AdmissionConfig, QueuedRequest, Rejected, WaitingQueue
from serving.frontend.capacity_calibration import PredictionTracker
from serving.frontend.capacity_model import CapacityModel, prefill_tokens_of_step, probe
from serving.frontend.prefix_shadow import PrefixShadow

BASE_S, PER_ROW_S, PER_TOKEN_S = 0.020, 0.0015, 0.0002


class VirtualClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def step_cost_s(plan) -> float:
    rows = len(plan.scheduled)
    tokens = sum(s.num_new_tokens for s in plan.scheduled)
    return BASE_S + PER_ROW_S * rows + PER_TOKEN_S * tokens


@dataclasses.dataclass
class Arrival:
    t: float
    prompt_tokens: int
    max_tokens: int
    stop_after: int | None = None  # ends ("stop") after this many tokens; None: max_tokens
    deadline_s: float | None = None  # relative to t
    priority: int = 1
    tenant: str = "default"
    shared_prefix: int = 0  # the prompt's first tokens, the same in every request (one chat)


@dataclasses.dataclass
class Result:
    arrival: Arrival
    admitted: bool
    reason: str = ""  # why shed
    finished_s: float | None = None  # absolute virtual time of its last token
    num_tokens: int = 0
    predicted_s: float | None = None  # settle_prediction's (predicted, actual)
    actual_s: float | None = None

    @property
    def in_time(self) -> bool:
        a = self.arrival
        return self.finished_s is not None and (
            a.deadline_s is None or self.finished_s <= a.t + a.deadline_s
        )


def new_engine(
    max_num_seqs: int, clock: VirtualClock, priority_preemption: bool = False
) -> MockEngine:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        num_pages=8192,
        page_size=16,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        prefill_chunk_size=256,
        priority_preemption=priority_preemption,
    )
    engine = MockEngine(config=config)
    engine.on_plan = lambda plan: setattr(clock, "t", clock.t + step_cost_s(plan))
    return engine


def calibrated_model(max_inflight: int) -> CapacityModel:
    """The start-up probe on the virtual clock (what the server's warm-up measures)."""
    clock = VirtualClock()
    return probe(new_engine(max_inflight, clock), max_inflight, clock=clock)


def _request(rid: str, a: Arrival) -> EngineRequest:
    # distinct prompts after the shared prefix (the prefix cache would otherwise shorten most
    # prefills)
    shared = np.random.default_rng(12345).integers(97, 123, size=a.shared_prefix)
    rng = np.random.default_rng(int(rid[1:]))
    tail = rng.integers(97, 123, size=a.prompt_tokens - a.shared_prefix)
    prompt = [int(t) for t in np.concatenate([shared, tail])]
    stop_ids: tuple[int, ...] = ()
    if a.stop_after is not None:
        assert a.stop_after <= 90, "the mock's outputs repeat every 95 tokens"
        stop_ids = (expected_continuation(prompt[-1], a.stop_after)[-1],)
    sp = SamplingParams(max_tokens=a.max_tokens, stop_token_ids=stop_ids, ignore_eos=True)
    return EngineRequest(rid, prompt, sp, priority=a.priority, tenant=a.tenant)


def run(
    arrivals: list[Arrival],
    max_inflight: int,
    model: CapacityModel | None,
    cfg: AdmissionConfig | None = None,
    tracker: PredictionTracker | None = None,
    priority_overflow: int = 0,
    shadow: bool = True,
) -> list[Result]:
    """Replay `arrivals` (sorted by t) through admission and the engine; every request's
    result. `model` None: no capacity model (everything admitted unless the queue is full).
    `tracker`: the prediction tracker to use (carried from an earlier run: a warm server).
    `priority_overflow`: as EngineLoop's (the engine then preempts for priority).
    `shadow`: admission expects prefix-cache hits (serving/frontend/prefix_shadow.py), as
    the server does with its prefix cache on."""
    clock = VirtualClock()
    engine = new_engine(max_inflight, clock, priority_preemption=priority_overflow > 0)
    cfg = cfg or AdmissionConfig(max_queue_requests=100_000, queue_timeout_s=1e9)
    q = WaitingQueue(cfg, clock=clock, capacity=model)
    q.preemptible_slots = priority_overflow
    if shadow:
        q.prefix_shadow = PrefixShadow(engine.sched_config.page_size, engine.sched_config.num_pages)
    expected_cached: dict[str, int] = {}
    prefix_keys: dict[str, list[int]] = {}
    if tracker is not None:
        q.tracker = tracker
    results = {f"r{i}": Result(a, False) for i, a in enumerate(arrivals)}
    pending = list(results.items())
    in_engine: dict[str, float] = {}  # request id -> added at
    tokens: dict[str, int] = {}
    while pending or len(q) or engine.has_unfinished():
        while pending and pending[0][1].arrival.t <= clock.t:
            rid, res = pending.pop(0)
            a = res.arrival
            # as serving/frontend/generation.py
            keys, cached = q.expected_cached(_request(rid, a).prompt_token_ids, (a.tenant,))
            expected_cached[rid], prefix_keys[rid] = cached, keys
            item = QueuedRequest(
                rid,
                a.prompt_tokens + a.max_tokens,
                a.priority,
                a.t,
                None if a.deadline_s is None else a.t + a.deadline_s,
                prompt_tokens=a.prompt_tokens,
                max_tokens=a.max_tokens,
                cached_tokens=cached,
            )
            try:
                q.offer(item)
                res.admitted = True
            except Rejected as e:
                res.reason = e.reason
        for item, why in q.expire():
            results[item.request_id].admitted = why != "displaced"
            results[item.request_id].reason = why
        while True:  # as EngineLoop._feed
            if len(in_engine) < max_inflight:
                item = q.pop()
            elif len(in_engine) < max_inflight + priority_overflow:
                lowest = min(results[r].arrival.priority for r in in_engine)
                item = q.pop_above(lowest)
            else:
                break
            if item is None:
                break
            engine.add_request(_request(item.request_id, results[item.request_id].arrival))
            in_engine[item.request_id], tokens[item.request_id] = clock.t, 0
        q.num_in_engine = len(in_engine)
        unprefilled = [r for r in in_engine if tokens[r] == 0]  # as EngineLoop._unprefilled
        q.unprefilled_engine_tokens = sum(
            max(1, results[r].arrival.prompt_tokens - expected_cached[r]) for r in unprefilled
        )
        q.unprefilled_engine_prompts = len(unprefilled)
        q.engine_progress = [
            (results[r].arrival.max_tokens, tokens[r], results[r].arrival.priority)
            for r in in_engine
        ]
        if not engine.has_unfinished():
            if pending:
                clock.t = max(clock.t, pending[0][1].arrival.t)
            continue
        start = clock.t
        firsts = []
        concurrency, processed = len(in_engine), engine.num_tokens_processed
        outputs = engine.step()
        for out in outputs:
            rid = out.request_id
            if rid not in in_engine:
                continue
            if tokens[rid] == 0 and out.new_token_ids:
                computed = results[rid].arrival.prompt_tokens - out.num_cached_tokens
                firsts.append((in_engine[rid], clock.t, computed))
                if prefix_keys[rid]:  # as EngineLoop._observe_prefill
                    q.prefix_shadow.prefilled(prefix_keys[rid])
            tokens[rid] += len(out.new_token_ids)
            if out.finished:
                res = results[rid]
                res.finished_s, res.num_tokens = clock.t, tokens[rid]
                if model is not None:
                    model.observe_length(tokens[rid], res.arrival.max_tokens)
                settled = q.settle_prediction(rid, tokens[rid], clock.t)
                if settled is not None:
                    res.predicted_s, res.actual_s = settled
                del in_engine[rid]
        if model is not None:  # as serving/frontend/engine_loop.py times a step
            prefill = prefill_tokens_of_step(
                outputs, processed, engine.num_tokens_processed, sum(n for _, _, n in firsts)
            )
            model.observe_step(concurrency, clock.t - start, prefill, len(firsts))
    return list(results.values())


def mixed_workload(seed: int = 0, n: int = 400) -> list[Arrival]:
    """Bursts and Poisson spells, prompts 16-400 tokens, max_tokens 16-128, most stopping
    before max_tokens (as chat replies end at EOS), no deadlines (every request is served,
    so every prediction is checked)."""
    rng = np.random.default_rng(seed)
    arrivals, t = [], 0.0
    while len(arrivals) < n:
        if rng.random() < 0.3:  # a burst
            k = int(rng.integers(10, 60))
            times = [t] * k
        else:  # a Poisson spell
            k = int(rng.integers(10, 40))
            times = list(t + np.cumsum(rng.exponential(1 / rng.uniform(2, 20), size=k)))
        for at in times:
            max_tokens = int(rng.integers(16, 129))
            stop = None if rng.random() < 0.3 else int(rng.integers(4, min(max_tokens, 90) + 1))
            arrivals.append(Arrival(float(at), int(rng.integers(16, 401)), max_tokens, stop))
        t = float(times[-1]) + float(rng.exponential(4.0))
    return sorted(arrivals[:n], key=lambda a: a.t)
