"""Admission control, tenant budgets and the circuit breaker, with a fake clock and numbers
checkable by hand."""

import contextlib
from types import SimpleNamespace

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequestError
from engine.sampling.params import SamplingParams
from serving.frontend.admission import (
    AdmissionConfig,
    DrainMeter,
    QueuedRequest,
    Rejected,
    WaitingQueue,
    check_limits,
)
from serving.frontend.breaker import CircuitBreaker
from serving.frontend.tenants import TenantLimiter, TenantPolicy, TenantRegistry, UnknownApiKey
from serving.grpc_api.dispatch import DispatchLedger


class Clock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


def _q(rid, tokens=10, priority=1, deadline_s=None):
    return QueuedRequest(rid, tokens, priority, 0.0, deadline_s)


# ---- limits -------------------------------------------------------------------------------
CFG = AdmissionConfig(
    max_prompt_tokens=100,
    max_tokens=50,
    max_model_len=120,
    max_stop_strings=2,
    max_stop_string_chars=5,
)


@pytest.mark.parametrize(
    "prompt,sp,field",
    [
        (0, SamplingParams(), "prompt"),
        (101, SamplingParams(), "prompt"),
        (10, SamplingParams(max_tokens=51), "max_tokens"),
        (100, SamplingParams(max_tokens=21), "max_tokens"),  # 100 + 21 > 120
        (10, SamplingParams(stop=("a", "b", "c")), "stop"),
        (10, SamplingParams(stop=("abcdef",)), "stop"),
    ],
)
def test_limits_name_the_field(prompt, sp, field):
    with pytest.raises(InvalidRequestError) as info:
        check_limits(CFG, prompt, sp)
    assert info.value.field == field
    assert field in str(info.value)


def test_limits_accept_exact_fit():
    check_limits(CFG, 100, SamplingParams(max_tokens=20))  # 100 + 20 == 120


# ---- waiting queue ------------------------------------------------------------------------
def test_queue_full_by_count_and_tokens():
    clock = Clock()
    q = WaitingQueue(
        AdmissionConfig(max_queue_requests=2, max_queue_tokens=25, default_retry_after_ms=777),
        clock,
    )
    q.offer(_q("a", 10))
    q.offer(_q("b", 10))
    with pytest.raises(Rejected) as info:
        q.offer(_q("c", 1))
    assert (info.value.reason, info.value.retry_after_ms) == ("queue_full", 777)  # no rate yet
    q.pop()
    with pytest.raises(Rejected) as info:
        q.offer(_q("c", 16))  # 10 + 16 > 25
    assert info.value.reason == "queue_tokens"
    q.offer(_q("c", 15))
    assert (len(q), q.num_tokens) == (2, 25)


def test_drain_meter_counts_saturated_time_only():
    m = DrainMeter(window_s=10.0, min_events=4)
    m.set_saturated(0.0, True)
    for t in (1.0, 2.0, 3.0):
        m.record(t, 100)
    assert m.rates(3.0) is None  # 3 < min_events
    m.record(4.0, 100)
    assert m.rates(4.0) == (1.0, 100.0)  # 4 requests, 400 tokens in 4 saturated s
    m.set_saturated(4.0, False)
    assert m.rates(8.0) == (1.0, 100.0)  # idle time does not dilute the rate
    m.set_saturated(8.0, True)
    m.record(9.0, 500)
    assert m.rates(10.0) == (5 / 6, 900 / 6)  # 5 requests in 4 + 2 saturated s
    # window [1.5, 11.5]: t = 1 fell out; 2.5 + 3.5 saturated s
    assert m.rates(11.5) == (4 / 6, 800 / 6)
    assert m.rates(12.5) is None  # t = 2 too: 3 left


def _queue_with_rate(clock, **cfg):
    """The saturated engine let 20 requests of 10 tokens through in 10 s: 2 req/s, 20 tok/s."""
    q = WaitingQueue(AdmissionConfig(drain_window_s=10.0, **cfg), clock)
    q.drain.set_saturated(100.0, True)
    for i in range(20):
        q.drain.record(100.0 + i * 0.5, 10)
    clock.t = 110.0
    return q


def test_retry_after_from_drain_rate():
    clock = Clock()
    q = _queue_with_rate(clock, max_queue_requests=3, max_queue_tokens=10_000)
    for rid in "abc":
        q.offer(_q(rid))
    with pytest.raises(Rejected) as info:
        q.offer(_q("d"))
    # one request must drain at 2 req/s: 500 ms
    assert (info.value.reason, info.value.retry_after_ms) == ("queue_full", 500)
    assert q.estimated_wait_s() == 1.5  # 3 queued / 2 per s


def test_estimated_wait_past_deadline_rejects_at_once():
    clock = Clock()
    q = _queue_with_rate(clock, max_queue_requests=100)
    for rid in "abcd":
        q.offer(_q(rid))  # 4 queued: 2 s of wait at 2 req/s
    with pytest.raises(Rejected) as info:
        q.offer(_q("late", deadline_s=clock.t + 1.5))
    assert (info.value.reason, info.value.retry_after_ms) == ("deadline", 500)
    q.offer(_q("fits", deadline_s=clock.t + 2.5))


def test_priority_then_fifo_and_aging():
    clock = Clock(0.0)
    q = WaitingQueue(AdmissionConfig(aging_s=10.0), clock)
    q.offer(_q("low-old", priority=0))
    clock.t = 5.0
    q.offer(_q("normal", priority=1))
    q.offer(_q("high", priority=2))
    q.offer(_q("normal2", priority=1))
    assert q.pop().request_id == "high"
    assert q.pop().request_id == "normal"  # FIFO among equals
    clock.t = 16.0  # low-old: 0 + 16/10 = 1.6 < normal2: 1 + 11/10 = 2.1
    assert q.pop().request_id == "normal2"
    assert q.pop().request_id == "low-old"


def test_aging_lets_low_overtake():
    clock = Clock(0.0)
    q = WaitingQueue(AdmissionConfig(aging_s=10.0), clock)
    q.offer(_q("low", priority=0))
    clock.t = 25.0
    q.offer(_q("high", priority=2))  # low: 0 + 2.5 = 2.5 > high: 2 + 0
    assert q.pop().request_id == "low"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=30))
def test_no_starvation(priorities):
    """A LOW request (class 0) under a stream of arrivals of any class, one arrival and one
    pop per second, aging_s = 1. At second t it ranks 0 + t; an item that arrived at second s
    ranks p + t - s, above it only if p > s (ties go to the older victim). With p <= 2 only
    the arrival of second 1 can outrank it, so it is taken by the second pop at the latest."""
    clock = Clock(0.0)
    q = WaitingQueue(AdmissionConfig(aging_s=1.0, queue_timeout_s=1e9), clock)
    q.offer(_q("victim", priority=0))
    for i, p in enumerate(priorities):
        clock.t += 1.0
        q.offer(_q(f"r{i}", priority=p))
        if q.pop().request_id == "victim":
            assert i <= 1
            return
    assert len(priorities) <= 1


def test_expire_deadline_and_queue_timeout():
    clock = Clock(0.0)
    q = WaitingQueue(AdmissionConfig(queue_timeout_s=5.0), clock)
    q.offer(_q("d", deadline_s=2.0))
    q.offer(_q("t"))
    clock.t = 2.0
    assert [(i.request_id, why) for i, why in q.expire()] == [("d", "timed_out")]
    clock.t = 5.0
    assert [(i.request_id, why) for i, why in q.expire()] == [("t", "queue_timeout")]
    assert len(q) == 0 and q.num_tokens == 0


def test_remove():
    q = WaitingQueue(AdmissionConfig())
    q.offer(_q("a", 7))
    assert q.remove("a").num_tokens == 7
    assert q.remove("a") is None and q.num_tokens == 0


# ---- tenants ------------------------------------------------------------------------------
def test_registry_keys():
    reg = TenantRegistry.from_dict(
        {"tenants": [{"name": "acme", "api_keys": ["k1"], "max_concurrency": 2}]}
    )
    assert reg.authenticate("k1").name == "acme"
    with pytest.raises(UnknownApiKey):
        reg.authenticate("nope")
    with pytest.raises(UnknownApiKey):
        reg.authenticate(None)  # tenants configured, anonymous not allowed
    assert TenantRegistry().authenticate(None).name == "default"


def test_token_budget_reserve_refund_refill():
    clock = Clock(0.0)
    lim = TenantLimiter(clock)
    acme = TenantPolicy("acme", tokens_per_minute=600)  # refills 10 tokens/s
    r1 = lim.acquire(acme, prompt_tokens=100, max_tokens=300)  # reserves 400 -> 200 left
    assert lim.level(acme) == 200
    with pytest.raises(Rejected) as info:
        lim.acquire(acme, prompt_tokens=100, max_tokens=200)  # needs 300, has 200
    # 100 tokens short at 10 tokens/s: 10 s
    assert (info.value.reason, info.value.retry_after_ms) == ("tenant_tokens", 10_000)
    assert lim.release(acme, r1, completion_tokens=50) == 250  # 300 - 50 unused
    assert lim.level(acme) == 450
    clock.t = 30.0
    assert lim.level(acme) == 600  # capped at one minute's worth
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        lim.acquire(acme, prompt_tokens=1, max_tokens=600)  # can never fit


def test_concurrency_limit():
    lim = TenantLimiter(Clock())
    acme = TenantPolicy("acme", max_concurrency=2)
    r = [lim.acquire(acme, 1, 1) for _ in range(2)]
    with pytest.raises(Rejected, match="in flight") as info:
        lim.acquire(acme, 1, 1)
    assert info.value.reason == "tenant_concurrency"
    lim.release(acme, r[0], 1)
    lim.acquire(acme, 1, 1)
    assert lim.active("acme") == 2


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 50), st.integers(1, 50), st.integers(0, 50)),
        min_size=1,
        max_size=20,
    )
)
def test_budget_never_exceeds_capacity_nor_goes_negative(requests):
    clock = Clock(0.0)
    lim = TenantLimiter(clock)
    pol = TenantPolicy("t", tokens_per_minute=200)
    held = []
    for prompt, max_tokens, used in requests:
        with contextlib.suppress(Rejected):
            held.append((lim.acquire(pol, prompt, max_tokens), min(used, max_tokens)))
        assert 0 <= lim.level(pol) <= 200
    spent = sum(r.reserved_tokens for r, _ in held)
    assert lim.level(pol) == 200 - spent  # no time passed: exact bookkeeping
    for r, used in held:
        lim.release(pol, r, used)
    refunded_level = 200 - sum(r.reserved_tokens - (r.max_tokens - u) for r, u in held)
    assert lim.level(pol) == refunded_level and lim.active("t") == 0


# ---- circuit breaker ----------------------------------------------------------------------
def test_breaker_opens_probes_and_closes():
    clock = Clock(0.0)
    b = CircuitBreaker(failure_threshold=2, cooldown_s=5.0, clock=clock)
    b.record_failure()
    assert b.state == "closed" and b.allow() is None
    b.record_success()
    b.record_failure()
    b.record_failure()
    assert b.state == "open"
    clock.t = 1.0
    assert b.allow() == 4000  # 4 s of cooldown left
    clock.t = 5.0
    assert b.state == "half_open"
    assert b.allow() is None  # the probe
    assert b.allow() == 5000  # only one probe at a time
    b.record_failure()  # probe step failed: open again
    assert b.state == "open"
    clock.t = 10.0
    assert b.allow() is None
    b.record_success()
    assert b.state == "closed" and b.allow() is None


# ---- calls dropped before a handler ran -----------------------------------------------------
class _Aborted(Exception):
    pass


class _FakeContext:
    def abort(self, code, details):
        raise _Aborted(code, details)


def test_dispatch_ledger_gives_undispatched_calls_one_outcome():
    clock = Clock(0.0)
    recorded = []

    class Ledger:
        def reject(self, *args, **kwargs):
            recorded.append((args, kwargs))

    d = DispatchLedger(Ledger(), "/pagedjax.v1.PagedJax/Generate", timeout_s=5.0, clock=clock)
    base = grpc.unary_stream_rpc_method_handler(lambda request, context: iter(["tok"]))
    details = SimpleNamespace(method="/pagedjax.v1.PagedJax/Generate", invocation_metadata=())
    first = d.intercept_service(lambda _: base, details)
    late = d.intercept_service(lambda _: base, details)
    other = SimpleNamespace(method="/pagedjax.v1.PagedJax/Tokenize", invocation_metadata=())
    assert d.intercept_service(lambda _: base, other) is base  # only Generate is noted
    assert d.num_pending() == 2
    assert list(first.unary_stream("req", _FakeContext())) == ["tok"]  # claimed in time
    clock.t = 4.9
    assert d.reap() == 0
    clock.t = 5.0
    assert d.reap() == 1 and d.num_pending() == 0
    assert recorded[0][1]["outcome"] == "cancelled" and recorded[0][0][2] == "before_dispatch"
    with pytest.raises(_Aborted):  # picked up after being recorded: no second outcome
        list(late.unary_stream("req", _FakeContext()))
    assert len(recorded) == 1


def test_a_popped_request_counts_as_in_the_engine_before_the_feed_ends():
    """The engine thread pops queued requests one by one and sets the engine's counts only
    after its feed: an arrival judged in between must still see the popped ones ahead of
    it (they were once in neither count, and a fifth wave of a mock burst was admitted as
    if it were the fourth, then timed out). 2 slots, 1 s per request: the fifth request in
    line starts at 2 s whether its four predecessors are queued or half fed."""
    from serving.frontend.capacity_model import CapacityModel

    def queue():
        model = CapacityModel({1: 0.1, 2: 0.1}, prefill_tokens_per_s=1e9, max_inflight=2)
        q = WaitingQueue(AdmissionConfig(deadline_margin=1.0), clock=Clock(), capacity=model)
        for i in range(4):
            q.offer(QueuedRequest(f"r{i}", 10, 1, 0.0, prompt_tokens=1, max_tokens=10))
        return q

    def wait_of_next(q):
        item = QueuedRequest("next", 10, 1, 0.0, prompt_tokens=1, max_tokens=10)
        q.offer(item)
        return item.estimate.wait_s

    all_queued = wait_of_next(queue())
    assert all_queued == pytest.approx(2.0)
    mid_feed = queue()
    assert mid_feed.pop().request_id == "r0" and mid_feed.pop().request_id == "r1"
    assert wait_of_next(mid_feed) == pytest.approx(all_queued)


def test_prefix_shadow_expects_the_pages_earlier_prompts_brought():
    """Admission's view of the prefix cache (serving/frontend/prefix_shadow.py): a prompt
    expects the leading full pages a prefilled prompt of the same tenant brought, never its
    last token's page, and forgets the least recently prefilled pages past its bound."""
    from serving.frontend.prefix_shadow import PrefixShadow

    shadow = PrefixShadow(page_size=4, max_pages=6)
    chat = list(range(100, 112))  # 3 full pages
    first = shadow.keys(chat + [1, 2], ("a", None))
    assert shadow.expected_cached(first, 14) == 0  # nothing prefilled yet
    shadow.prefilled(first)
    again = shadow.keys(chat + [3, 4, 5], ("a", None))
    assert shadow.expected_cached(again, 15) == 12  # the chat's 3 pages
    assert shadow.expected_cached(shadow.keys(chat, ("a", None)), 12) == 8  # last page computed
    assert shadow.expected_cached(shadow.keys(chat + [3], ("b", None)), 13) == 0  # tenant apart
    assert shadow.expected_cached(shadow.keys([7] + chat, ("a", None)), 13) == 0  # not a prefix
    shadow.prefilled(shadow.keys(list(range(200, 216)), ("a", None)))  # 4 newer pages
    assert len(shadow) == 6
    assert shadow.expected_cached(again, 15) == 8  # the chat's tail page went first
