"""Admission that knows its capacity from the first request (serving/frontend/capacity_model.py)."""

import threading

import pytest

from serving.engine_host.mock_engine import MockEngine
from serving.frontend.admission import AdmissionConfig, QueuedRequest, Rejected, WaitingQueue
from serving.frontend.capacity_model import CapacityModel, probe, slot_wait_s
from serving.testing import outcome_counts, running_server


def test_step_time_interpolates_and_refreshes():
    model = CapacityModel({1: 0.01, 8: 0.03}, prefill_tokens_per_s=1000.0, max_inflight=8)
    assert model.step_s(1) == 0.01 and model.step_s(8) == 0.03
    assert model.step_s(4) == pytest.approx(0.01 + 0.02 * 3 / 7)
    assert model.step_s(0) == 0.01 and model.step_s(64) == 0.03  # flat outside
    for _ in range(200):
        model.observe_step(8, 0.05)  # the engine got slower: the model follows
    assert model.step_s(8) == pytest.approx(0.05, rel=1e-3)
    assert model.prefill_s(500) == pytest.approx(0.5)
    for _ in range(200):
        model.observe_prefill(512, 0.128)  # long prompts prefill faster than the seed said
    assert model.prefill_s(512) == pytest.approx(512 / 4000, rel=1e-3)
    assert model.prefill_s(96) == pytest.approx(96 / 1000)  # the seed's length keeps its rate
    # in between: interpolated in log2 of the tokens per prompt
    assert model.prefill_tokens_per_s(221.7) == pytest.approx(2500, rel=1e-2)
    assert model.prefill_s(2 * 512, 2) == pytest.approx(2 * 512 / 4000, rel=1e-3)


def test_one_compiling_step_does_not_poison_the_model():
    """A step that compiled a new shape (x100 the usual time) moves the estimate by at most
    smoothing x (max_jump - 1) = 10%; a lasting slowdown is still followed."""
    model = CapacityModel({1: 0.2}, prefill_tokens_per_s=100.0, max_inflight=8)
    model.observe_step(1, 20.0)
    assert model.step_s(1) == pytest.approx(0.22)
    model.observe_prefill(32, 15.0)  # a first token after a 15 s compile
    assert model.prefill_s(32) == pytest.approx(0.32 * 1.1)
    # a first observation of a size starts from the sizes around it and is clamped too
    model.observe_step(4, 30.0)
    assert model.step_s(4) == pytest.approx(0.22 + 0.1 * (2 * 0.22 - 0.22))
    for _ in range(100):
        model.observe_step(1, 0.5)
    assert model.snapshot()["step_s_by_concurrency"][1] == pytest.approx(0.5, rel=1e-3)
    # pooled with size 4's one step (a larger batch is not cheaper), weighted 10 : 1
    assert model.step_s(1) == pytest.approx((10 * 0.5 + 0.242) / 11, rel=1e-3)


def test_a_step_of_more_rows_is_not_cheaper():
    """A few slow steps at a rarely seen size do not make that size slower than a larger,
    often seen batch (weighted isotonic: step_s non-decreasing in the batch); a lasting
    slowdown seen often at a small size still lifts it past a stale larger one."""
    model = CapacityModel({1: 0.05, 16: 0.05, 64: 0.052}, prefill_tokens_per_s=1e6, max_inflight=64)
    for _ in range(10):
        model.observe_step(16, 0.05)
        model.observe_step(64, 0.052)
    for _ in range(3):
        model.observe_step(4, 0.1)  # slow steps (a collection, a client's stall) at size 4
    assert model.snapshot()["step_s_by_concurrency"][4] > 0.06
    # pooled with sizes 16 and 64 (10 steps each): 3 steps lift them by ~1 ms, not to 0.06
    assert model.step_s(4) == model.step_s(64) == pytest.approx(0.0526, rel=0.01)
    assert all(model.step_s(c) <= model.step_s(c + 1) for c in range(1, 64))


def test_slot_wait_follows_the_waves_of_a_burst():
    # 2 slots, the engine's requests end at 1 s and 2 s; 2 queued ahead hold 3 s each
    assert slot_wait_s([1.0, 2.0], 2, 3.0, 2) == pytest.approx(4.0)
    assert slot_wait_s([1.0], 0, 3.0, 2) == 0.0  # a slot is free now
    assert slot_wait_s([], 8, 1.1, 4) == pytest.approx(2.2)  # the third wave of a burst
    model = CapacityModel({4: 0.1}, prefill_tokens_per_s=100.0, max_inflight=4)
    est = model.estimate(
        ahead=5,
        prompt_tokens=10,
        max_tokens=20,
        mean_prompt_tokens=10,
        mean_max_tokens=20,
        engine_remaining_tokens=[5, 10, 15, 20],  # free at 0.5, 1.0, 1.5, 2.0 s
    )
    # 1 queued ahead takes the slot freed at 0.5 s; this one gets the one freed at 1.0 s,
    # 0.1 s later: the queued one's prefill (10 tokens at 100/s) stalls the running ones
    assert est.wait_s == pytest.approx(1.1)


def test_estimate_is_wait_plus_own_prefill_and_decode():
    model = CapacityModel({4: 0.1}, prefill_tokens_per_s=100.0, max_inflight=4)
    free = model.estimate(
        ahead=2, prompt_tokens=10, max_tokens=20, mean_prompt_tokens=10, mean_max_tokens=20
    )
    assert free.wait_s == 0 and free.service_s == pytest.approx(0.1 + 2.0)
    # 6 ahead with 4 slots: 3 must leave first; modelled drain = 4 / 2.1 s per request
    busy = model.estimate(
        ahead=6, prompt_tokens=10, max_tokens=20, mean_prompt_tokens=10, mean_max_tokens=20
    )
    assert busy.wait_s == pytest.approx(3 / (4 / 2.1))
    crowded = model.estimate(
        ahead=2,
        prompt_tokens=10,
        max_tokens=20,
        mean_prompt_tokens=10,
        mean_max_tokens=20,
        prefill_tokens_ahead=90,  # others prefill first: 100 tokens before the first token
    )
    assert crowded.service_s == pytest.approx(1.0 + 2.0)
    measured = model.estimate(
        ahead=6,
        prompt_tokens=10,
        max_tokens=20,
        mean_prompt_tokens=10,
        mean_max_tokens=20,
        drain_per_s=6.0,
    )
    assert measured.wait_s == pytest.approx(0.5)


def _item(i, deadline_s=None, max_tokens=10):
    return QueuedRequest(f"r{i}", 10 + max_tokens, 1, 0.0, deadline_s, None, 0, 10, max_tokens)


def test_a_cold_burst_is_shed_from_the_first_request():
    """No drain measured yet: the model alone decides. 4 slots, 10-token prompts (0.1 s of
    prefill each at 100 tokens/s), 10 tokens x 0.1 s, deadline 2.5 s. The first wave's four
    prompts prefill together (0.4 s), so all four end at 1.4 s; the fifth starts then and
    ends at 1.4 + 0.1 + 1.0 = 2.5 s; a sixth would start 0.1 s later (the fifth's prefill
    holds the slots) and end at 2.6 s -> exactly 5 admitted. (A uniform drain rate admitted
    9; waves without the prompts' prefill, 8, and the second wave timed out.)"""
    model = CapacityModel({4: 0.1}, prefill_tokens_per_s=100.0, max_inflight=4)
    q = WaitingQueue(AdmissionConfig(deadline_margin=1.0), clock=lambda: 0.0, capacity=model)
    admitted, shed = 0, []
    for i in range(30):
        try:
            q.offer(_item(i, deadline_s=2.5))
            admitted += 1
        except Rejected as e:
            shed.append(e)
    assert admitted == 5 and len(shed) == 25
    assert all(e.reason == "deadline" and e.retry_after_ms > 0 for e in shed)
    assert "exceeds the deadline" in str(shed[0])


def test_a_shed_message_names_the_margin_it_applied():
    """A 1.1 s estimate (0.1 s prefill + 10 tokens x 0.1 s) against 1.1 s left is shed only
    because of the 1.2 margin: the message must say so, or it reads as if 1.1 s exceeded 1.1 s."""
    model = CapacityModel({1: 0.1}, prefill_tokens_per_s=100.0, max_inflight=1)
    q = WaitingQueue(AdmissionConfig(deadline_margin=1.2), clock=lambda: 0.0, capacity=model)
    with pytest.raises(Rejected, match=r"x margin 1.2 = 1.320s exceeds the deadline \(1.100s left"):
        q.offer(_item(0, deadline_s=1.1))


def test_without_a_deadline_the_queue_timeout_bounds_the_wait():
    model = CapacityModel({1: 1.0}, prefill_tokens_per_s=1e6, max_inflight=1)
    q = WaitingQueue(AdmissionConfig(queue_timeout_s=5.0), clock=lambda: 0.0, capacity=model)
    for i in range(6):  # 10 s per request: waits 0, 10 s ... past 5 s from the second on
        try:
            q.offer(_item(i))
        except Rejected as e:
            assert e.reason == "queue_timeout" and i >= 1
            break
    assert len(q) == 1


def test_probe_measures_the_mock_and_leaves_it_empty():
    engine = MockEngine(step_time_s=0.01, max_num_seqs=4)
    model = probe(engine, max_inflight=4)
    snap = model.snapshot()
    assert set(snap["step_s_by_concurrency"]) == {1, 4}
    assert all(0.009 < s < 0.2 for s in snap["step_s_by_concurrency"].values())
    assert not engine.has_unfinished() and engine.stats()["kv_pages_used"] == 0


def test_burst_through_the_server_mostly_finishes_or_is_shed():
    """60 calls at once, 4 slots of a 20 ms/step mock, 30 tokens each (0.6 s), 2 s deadline:
    about 12 fit; the rest must be shed at arrival, not time out."""
    engine = MockEngine(step_time_s=0.02, max_num_seqs=4, num_pages=1024)
    with running_server(engine, max_inflight=4) as (server, client):
        results = []

        def call(i):
            results.append(client.generate("abc", max_tokens=30, timeout_s=2.0))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(60)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        codes = [r.code for r in results]
        assert codes.count("DEADLINE_EXCEEDED") <= 6, outcome_counts(server)  # <= 10%
        assert codes.count("OK") >= 6 and set(codes) <= {
            "OK",
            "RESOURCE_EXHAUSTED",
            "DEADLINE_EXCEEDED",
        }
        shed = [r for r in results if r.code == "RESOURCE_EXHAUSTED"]
        assert shed and all(r.retry_after_ms for r in shed)


def test_short_tails_do_not_slow_whole_prompts():
    """Prefill is timed per computed token at each length of computed tokens a prompt: a
    cached chat's 9-token tails (~3x the per-token cost of 96-token prompts on SmolLM2: each
    prompt row costs too) leave the probe's 96-token rate as it was; a 41-token prompt falls
    in between (log2 interpolation). With one rate for all lengths the tails' rate charged a
    restarted server's whole prompts ~3x too slow (benchmarks/RESULTS.md)."""
    model = CapacityModel({64: 0.1}, prefill_tokens_per_s=900.0, max_inflight=64)
    for _ in range(100):  # 64 tails of 9 tokens in a step: 0.1 s decode + 1.8 s of prefill
        model.observe_step(64, 0.1 + 64 * 9 / 300.0, prefill_tokens=64 * 9, prefill_rows=64)
    tails = model.prefill_tokens_per_s(8)
    assert tails < 450.0  # learned (shared with the decode estimate: not exactly 300)
    assert model.prefill_s(96) == pytest.approx(96 / 900.0)  # untouched
    whole = model.prefill_s(64 * 41, 64)
    assert 64 * 41 / 900.0 < whole < 64 * 41 / 300.0
    assert model.snapshot()["prefill_rate_by_len"][8] == tails
