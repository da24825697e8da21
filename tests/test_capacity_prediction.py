"""The admission model is right, not just safe (issue 34): its predicted finish against the
finish requests had, on an engine with known step times in virtual time
(tests/capacity_sim.py: the real WaitingQueue, CapacityModel and MockEngine; no sleeps)."""

import dataclasses
import json

import numpy as np
import pytest

from serving.engine_host.mock_engine import MockEngine
from serving.frontend import capacity_calibration as calib
from serving.frontend.admission import AdmissionConfig
from serving.frontend.capacity_calibration import PredictionTracker
from serving.frontend.capacity_model import CapacityModel
from serving.testing import running_server
from tests import capacity_sim as sim

NO_LIMITS = AdmissionConfig(max_queue_requests=100_000, queue_timeout_s=1e9)


def _p90_error(pairs) -> float:
    predicted, actual = np.asarray(pairs).T  # [2, n]
    return float(np.quantile(np.abs(actual - predicted) / actual, 0.9))


def _pairs(results):
    return [(r.predicted_s, r.actual_s) for r in results if r.predicted_s is not None]


def test_prediction_error_on_a_mixed_workload():
    """400 requests in bursts and Poisson spells, prompts 16-400 tokens, max_tokens 16-128,
    each running to max_tokens: every admitted request's predicted finish (as updated by
    the requests admitted after it) is within 20% of its actual finish at p90. A constant
    predictor (the median finish) is off by far more on the same requests, so the bound
    is not one any prediction would meet."""
    workload = [dataclasses.replace(a, stop_after=None) for a in sim.mixed_workload(0, 400)]
    results = sim.run(workload, 16, sim.calibrated_model(16), NO_LIMITS)
    pairs = _pairs(results)
    assert len(pairs) == 400
    assert _p90_error(pairs) <= 0.20
    actual = np.array([a for _, a in pairs])
    constant = [(float(np.median(actual)), a) for a in actual]
    assert _p90_error(constant) > 0.5


def test_prediction_error_when_replies_end_at_eos():
    """The same kind of workload with 70% of the replies ending early at a length the model
    cannot know (it learns the mean fraction of max_tokens): the other requests' lengths
    move this one's wait, so the p90 error is larger. NOTE: 15-30% over 8 seeded
    workloads at 16 and 32 slots; the 20% target holds only when lengths are known."""
    results = sim.run(sim.mixed_workload(0, 400), 16, sim.calibrated_model(16), NO_LIMITS)
    pairs = _pairs(results)
    assert len(pairs) == 400 and _p90_error(pairs) <= 0.30
    flat = CapacityModel({16: 0.05}, prefill_tokens_per_s=5000.0, max_inflight=16)
    flat.max_jump = 1.0  # a model that does not learn: one step time for every batch
    flat.smoothing = 0.0
    results = sim.run(sim.mixed_workload(0, 400), 16, flat, NO_LIMITS)
    assert _p90_error(_pairs(results)) > 0.30


def _capacity(max_inflight, arrival, n_max=300) -> int:
    """The known capacity: the largest k such that a burst of the first k requests, all
    admitted, all finish by the deadline (bisection over runs without a model)."""
    lo, hi = 0, n_max
    while lo < hi:
        k = (lo + hi + 1) // 2
        if all(r.in_time for r in sim.run([arrival] * k, max_inflight, None, NO_LIMITS)):
            lo = k
        else:
            hi = k - 1
    return lo


@pytest.mark.parametrize("max_inflight,prompt,max_tokens", [(32, 40, 64), (64, 40, 64)])
def test_a_burst_is_served_at_capacity(max_inflight, prompt, max_tokens, tmp_path):
    """300 requests at once, 15 s deadline (issue 34: "admitted requests all finish in
    time, and the count admitted is within 10% of the known capacity"), three times: cold
    (start-up probe, the configured prior margin), warm (the margin is the measured p90 of
    actual / predicted finish from the cold burst) and restarted (calibration saved and
    loaded, nothing probed). The old prior of 1.2 admits 0.78-0.80 of capacity cold and
    fails here. NOTE: when a wave's prompts overflow the step's token budget (16 x 200
    tokens in 2048) the model does not see the stagger: the warm burst admitted 37 of a
    capacity of 42 (12% under), all in time."""
    arrival = sim.Arrival(0.0, prompt, max_tokens, None, 15.0)
    capacity = _capacity(max_inflight, arrival)
    burst = [arrival] * 300
    model, tracker = sim.calibrated_model(max_inflight), PredictionTracker(min_samples=8)
    cold = sim.run(burst, max_inflight, model, NO_LIMITS, tracker)
    cold_admitted = [r for r in cold if r.admitted]
    assert all(r.in_time for r in cold_admitted)
    assert abs(len(cold_admitted) - capacity) <= 0.1 * capacity, (len(cold_admitted), capacity)
    assert {r.reason for r in cold if not r.admitted} == {"deadline"}
    warm = sim.run(burst, max_inflight, model, NO_LIMITS, tracker)
    warm_admitted = [r for r in warm if r.admitted]
    assert all(r.in_time for r in warm_admitted)
    assert abs(len(warm_admitted) - capacity) <= 0.1 * capacity, (len(warm_admitted), capacity)
    assert len(warm_admitted) >= len(cold_admitted)
    # a restart: the calibration saved and loaded into a fresh model and queue
    path = str(tmp_path / "capacity.json")
    calib.save(path, "k", model, tracker)
    loaded, ratios = calib.load(path, "k", max_inflight)
    restarted_tracker = PredictionTracker(min_samples=8)
    restarted_tracker.restore(ratios)
    restarted = sim.run(burst, max_inflight, loaded, NO_LIMITS, restarted_tracker)
    restarted_admitted = [r for r in restarted if r.admitted]
    assert all(r.in_time for r in restarted_admitted)
    assert abs(len(restarted_admitted) - capacity) <= 0.1 * capacity, (
        len(restarted_admitted),
        capacity,
    )


def test_a_burst_of_one_chat_after_its_traffic_is_served_at_capacity():
    """300 calls of one chat at once after a trickle of it (its pages in the prefix cache,
    the prefill rate measured on traffic), 360 of each call's 400 tokens cached: admission
    charges each only its uncached share (serving/frontend/prefix_shadow.py), all finish in
    time and the count is within 10% of the known capacity. The control, charged whole
    prompts (no shadow), admits 0.63 of it: SmolLM2's warm burst of one chat (32 of 41
    tokens cached) was served at 0.66."""
    chat = dict(prompt_tokens=400, max_tokens=64, shared_prefix=360)
    trickle = [sim.Arrival(float(t), **chat) for t in range(20)]  # one a second, no deadline

    def arrivals(k):
        return trickle + [sim.Arrival(30.0, deadline_s=15.0, **chat)] * k

    lo, hi = 0, 300  # the known capacity: the most burst calls that all finish in time
    while lo < hi:
        k = (lo + hi + 1) // 2
        if all(r.in_time for r in sim.run(arrivals(k), 64, None, NO_LIMITS)[len(trickle) :]):
            lo = k
        else:
            hi = k - 1
    capacity = lo
    for shadow in (True, False):
        model, tracker = sim.calibrated_model(64), PredictionTracker(min_samples=8)
        results = sim.run(arrivals(300), 64, model, NO_LIMITS, tracker, shadow=shadow)
        assert model.measured_on_traffic
        admitted = [r for r in results[len(trickle) :] if r.admitted]
        assert all(r.in_time for r in admitted)
        if shadow:
            assert abs(len(admitted) - capacity) <= 0.1 * capacity, (len(admitted), capacity)
        else:
            assert len(admitted) < 0.9 * capacity, (len(admitted), capacity)


def test_calibration_survives_a_restart(tmp_path):
    model = CapacityModel({1: 0.02, 8: 0.05}, prefill_tokens_per_s=4000.0, max_inflight=8)
    model.observe_length(30, 100)
    for _ in range(5):  # the steps seen per size (the isotonic weights) are kept too
        model.observe_step(8, 0.06)
    assert model.snapshot()["steps_seen"] == {1: 1, 8: 6}
    tracker = PredictionTracker(min_samples=2)
    for predicted, actual in [(1.0, 1.1), (2.0, 1.9), (1.0, 1.0)]:
        tracker.observe(predicted, actual)
    path = str(tmp_path / "capacity" / "k.json")
    calib.save(path, "k", model, tracker)
    loaded, ratios = calib.load(path, "k", 8)
    assert loaded.snapshot() == model.snapshot()
    assert ratios == tracker.ratios()
    assert calib.load(path, "another-engine", 8) is None  # a different model or shape
    assert calib.load(str(tmp_path / "missing.json"), "k", 8) is None
    with open(path, "w") as f:
        f.write("{not json")
    assert calib.load(path, "k", 8) is None  # unreadable: probe instead, never fatal
    with open(path, "w") as f:
        json.dump({"format": 1, "key": "k", "step_s_by_concurrency": {}}, f)
    assert calib.load(path, "k", 8) is None  # malformed


def test_calibration_key_names_model_and_engine_shape():
    class Identity:
        name, revision, engine_version = "m", "r1", "e"

    stats = {"max_num_seqs": 8, "max_model_len": 512, "kv_capacity_tokens": 4096}
    key = calib.calibration_key(Identity, stats, 8)
    assert key == calib.calibration_key(Identity, dict(stats), 8)
    assert key != calib.calibration_key(Identity, stats, 4)
    assert key != calib.calibration_key(Identity, {**stats, "max_num_seqs": 16}, 8)
    assert calib.calibration_path("/x/cache/xla", key) == f"/x/cache/capacity/{key}.json"


def test_margin_is_the_measured_quantile():
    from serving.frontend.admission import WaitingQueue

    model = CapacityModel({1: 0.1}, prefill_tokens_per_s=100.0, max_inflight=1)
    q = WaitingQueue(AdmissionConfig(deadline_margin=1.2), capacity=model)
    q.tracker = PredictionTracker(min_samples=10)
    assert q.margin() == 1.2  # nothing measured yet: the configured margin
    for i in range(10):
        q.tracker.observe(1.0, 1.0 + 0.01 * i)  # ratios 1.00 ... 1.09
    assert q.margin() == pytest.approx(np.quantile([1.0 + 0.01 * i for i in range(10)], 0.9))
    for _ in range(100):
        q.tracker.observe(1.0, 0.7)  # a pessimistic model: never scaled below itself
    assert q.margin() == 1.0
    for _ in range(100):
        q.tracker.observe(1.0, 10.0)
    assert q.margin() == 2.0  # bounded


def _samples(server, name: str) -> float:
    for metric in server.metrics.registry.collect():
        for s in metric.samples:
            if s.name == name:
                return s.value
    return 0.0


def test_server_keeps_its_calibration_and_exposes_its_error(tmp_path):
    """Through the gRPC server on the mock engine: each finished call adds to the
    predicted-vs-actual histograms; the calibration is written beside the compilation
    cache at shutdown, and the next server of the same engine shape starts from it
    instead of probing (a probe would add steps to the engine)."""
    cache_dir = str(tmp_path / "xla")
    with running_server(
        MockEngine(max_num_seqs=4), max_inflight=4, capacity_calibration_dir=cache_dir
    ) as (server, client):
        for i in range(5):
            assert client.generate(f"call {i}", max_tokens=8, timeout_s=30).code == "OK"
        assert _samples(server, "pagedjax_admission_finish_ratio_count") == 5
        assert _samples(server, "pagedjax_admission_predicted_finish_seconds_count") == 5
        snapshot = server.waiting.capacity.snapshot()
    files = list((tmp_path / "capacity").glob("*.json"))
    assert len(files) == 1
    restarted = MockEngine(max_num_seqs=4)
    with running_server(restarted, max_inflight=4, capacity_calibration_dir=cache_dir) as (
        server,
        _,
    ):
        assert restarted.num_steps == 0  # no probe ran
        assert server.waiting.capacity.snapshot()["step_s_by_concurrency"] == {
            int(k): v for k, v in snapshot["step_s_by_concurrency"].items()
        }
        assert len(server.waiting.tracker) == 5


def test_interactive_keeps_its_deadline_while_a_batch_tenant_floods():
    """A batch tenant floods (300 low-priority requests at once, 30 s deadline) while an
    interactive tenant sends one high-priority call a second (4 s deadline), 16 slots, the
    engine preempting for priority. Every interactive call is admitted and finishes in
    time; the flood is served to what fits, its excess shed at arrival or displaced by the
    interactive calls (with Retry-After), and no admitted request of either is late. With
    equal priorities the interactive calls queue behind the flood and are all shed."""
    flood = [sim.Arrival(0.0, 100, 64, None, 30.0, priority=0, tenant="batch")] * 300
    calls = [sim.Arrival(0.5 + i, 40, 32, None, 4.0, priority=2, tenant="chat") for i in range(20)]
    arrivals = sorted(flood + calls, key=lambda a: a.t)
    results = sim.run(arrivals, 16, sim.calibrated_model(16), NO_LIMITS, priority_overflow=4)
    chat = [r for r in results if r.arrival.tenant == "chat"]
    batch = [r for r in results if r.arrival.tenant == "batch"]
    assert all(r.admitted and r.in_time for r in chat)
    assert all(r.in_time for r in batch if r.admitted)
    served = sum(r.admitted for r in batch)
    assert 0 < served < 300
    assert {r.reason for r in batch if not r.admitted} <= {"deadline", "displaced"}
    equal = [dataclasses.replace(a, priority=0) for a in arrivals]
    results = sim.run(equal, 16, sim.calibrated_model(16), NO_LIMITS, priority_overflow=4)
    assert not any(r.admitted for r in results if r.arrival.tenant == "chat")


def test_the_engine_preempts_a_lower_priority_for_a_higher_one():
    """Both slots held by low-priority requests: a high-priority one is scheduled in the
    next step (a low one preempted by recompute), and every request still produces exactly
    its expected output."""
    from configs.engine_config import SchedulerConfig
    from engine.api_types import EngineRequest
    from engine.sampling.params import SamplingParams
    from serving.engine_host.mock_engine import expected_continuation

    config = SchedulerConfig(
        max_num_seqs=2,
        num_pages=64,
        page_size=4,
        max_model_len=64,
        max_num_batched_tokens=64,
        prefill_chunk_size=64,
        priority_preemption=True,
    )
    engine = MockEngine(config=config)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    for rid in ("low-a", "low-b"):
        engine.add_request(EngineRequest(rid, [97, 98, 99], sp, priority=0))
    outputs: dict[str, list[int]] = {}
    for _ in range(3):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.add_request(EngineRequest("high", [100, 101], sp, priority=2))
    step = engine.step()
    assert "high" in {out.request_id for out in step if out.new_token_ids}
    assert engine.stats()["num_preemptions"] == 1
    for out in step:
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert outputs["high"] == expected_continuation(101, 12)
    assert outputs["low-a"] == outputs["low-b"] == expected_continuation(99, 12)


def test_a_tenant_default_priority_applies_to_calls_that_name_none():
    """`priority` per tenant (tenants config): a gRPC call with PRIORITY_UNSPECIFIED or an
    HTTP body without `priority` gets its tenant's class; a named one wins (gRPC HIGH,
    vLLM's -1 over HTTP); an unknown class in the config is an error naming the field."""
    import httpx

    from engine.errors import InvalidRequestError
    from serving.frontend.tenants import TenantRegistry

    tenants = TenantRegistry.from_dict(
        {"tenants": [{"name": "batch", "api_keys": ["k-batch"], "priority": "low"}]}
    )
    assert tenants.authenticate("k-batch").priority == 0
    with pytest.raises(InvalidRequestError, match="priority"):
        TenantRegistry.from_dict({"tenants": [{"name": "x", "priority": "urgent"}]})
    engine = MockEngine()
    seen = {}
    add = engine.add_request

    def record(request, cache_salt=None):
        seen[request.request_id] = request.priority
        add(request, cache_salt)

    engine.add_request = record
    with running_server(engine, tenants=tenants, http_port=0, api_key="k-batch") as (
        server,
        client,
    ):
        assert client.generate("a", max_tokens=2, request_id="grpc-default").code == "OK"
        high = client.generate("a", max_tokens=2, request_id="grpc-high", priority="high")
        assert high.code == "OK"
        url = f"http://127.0.0.1:{server.http_port}/v1/completions"
        headers = {"x-api-key": "k-batch"}
        for body in (
            {"prompt": "a", "max_tokens": 2},
            {"prompt": "a", "max_tokens": 2, "priority": -1},
        ):
            assert httpx.post(url, json=body, headers=headers, timeout=30).status_code == 200
    assert seen["grpc-default"] == 0 and seen["grpc-high"] == 2
    http = [p for rid, p in seen.items() if not rid.startswith(("grpc-", "capacity-probe"))]
    assert http == [0, 2]


@pytest.mark.parametrize("max_inflight", [16, 64])
def test_the_probe_measures_the_known_step_times(max_inflight):
    """The start-up probe on the virtual clock recovers the step law: decode time per batch
    size and the marginal cost of a prompt token (64 x 96-token prompts take 3 steps of a
    2048-token budget; the probe's requests all decode while timed), without aborts."""
    clock = sim.VirtualClock()
    engine = sim.new_engine(max_inflight, clock)
    model = sim.probe(engine, max_inflight, clock=clock)
    for b, step_s in model.snapshot()["step_s_by_concurrency"].items():
        known = sim.BASE_S + (sim.PER_ROW_S + sim.PER_TOKEN_S) * b  # b rows, 1 token each
        assert step_s == pytest.approx(known, rel=0.01)
    assert model.prefill_s(5000) == pytest.approx(5000 * sim.PER_TOKEN_S, rel=0.05)
    assert engine.abort_log == [] and not engine.has_unfinished()
