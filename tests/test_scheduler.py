"""Scheduler: chunked prefill, token budget, slots, preemption, priorities, deadlines, aborts,
prefix-cache admission, and hypothesis invariants over random workloads."""

import dataclasses

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from configs.engine_config import SchedulerConfig
from engine.errors import DuplicateRequestError, InvalidRequestError
from engine.sampling.params import SamplingParams
from engine.sched.page_pool import PagePool
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler

BASE = SchedulerConfig(
    page_size=4,
    num_pages=64,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    prefill_chunk_size=16,
    max_model_len=256,
    priority_aging_per_s=0.0,
    enable_prefix_caching=True,
    prefix_cache_ttl_s=None,
)


def _sched(**kw) -> Scheduler:
    cfg = dataclasses.replace(BASE, **kw)
    return Scheduler(cfg, PagePool.from_config(cfg))


def _req(
    rid: str, num_prompt: int, max_tokens: int = 4, first_token: int | None = None, **kw
) -> Request:
    first = first_token if first_token is not None else 1000 * (hash(rid) % 1000)
    return Request(
        rid,
        list(range(first, first + num_prompt)),
        SamplingParams(max_tokens=max_tokens),
        cache_salt="tenant:t",
        **kw,
    )


def _step(s: Scheduler, now_s: float, token: int = 7):
    """One engine step with a fake device; finishes requests at max_tokens."""
    out = s.schedule(now_s)
    received = s.update_after_step(out, {rid: token for rid in out.sampling_request_ids}, now_s)
    for r in received:
        if r.num_output_tokens >= r.sampling.max_tokens:
            s.finish_request(r.request_id, "length", now_s)
    return out


def _drain(s: Scheduler, now_s: float = 0.0, max_steps: int = 1000) -> float:
    for _ in range(max_steps):
        if not s.has_unfinished():
            return now_s
        now_s += 1.0
        _step(s, now_s)
    raise AssertionError("requests did not finish")


# ---- chunked prefill and the token budget ---------------------------------------------
def test_chunked_prefill_accounting():
    s = _sched(prefill_chunk_size=8)
    r = _req("a", 20, max_tokens=2)
    s.add_request(r)
    plan = []
    for t in range(5):
        out = _step(s, float(t))
        plan += [(x.start, x.num_new_tokens, x.samples) for x in out.scheduled]
    assert plan == [(0, 8, False), (8, 8, False), (16, 4, True), (20, 1, True)]
    assert r.finish_reason == "length" and r.output_token_ids == [7, 7]
    assert r.token_times_s == [2.0, 3.0] and r.first_scheduled_s == 0.0 and r.finish_s == 3.0
    assert s.pool.num_free_pages == 63


def test_decodes_go_first_and_prefill_chunks_share_the_budget():
    s = _sched(max_num_batched_tokens=10, prefill_chunk_size=8)
    a, b = _req("a", 2, max_tokens=10), _req("b", 40, arrival_s=1.0)
    s.add_request(a)
    s.add_request(b)
    out = _step(s, 0.0)
    assert out.num_scheduled_tokens == {"a": 2, "b": 8}
    out = _step(s, 1.0)
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"]
    assert out.num_scheduled_tokens == {"a": 1, "b": 8}
    assert out.total_num_scheduled_tokens == 9  # b's chunk is capped at 8, not the budget


def test_budget_smaller_than_the_decodes_leaves_some_for_next_step():
    s = _sched(max_num_batched_tokens=2, prefill_chunk_size=2)
    for i in range(3):
        s.add_request(_req(f"r{i}", 1, max_tokens=3, arrival_s=float(i)))
    for t in range(20):
        out = _step(s, float(t))
        assert out.total_num_scheduled_tokens <= 2
    assert not s.has_unfinished() and s.num_finished == {"length": 3}


def test_slot_limit():
    s = _sched(max_num_seqs=2)
    for i in range(4):
        s.add_request(_req(f"r{i}", 3, max_tokens=2, arrival_s=float(i)))
    out = _step(s, 0.0)
    assert list(out.num_scheduled_tokens) == ["r0", "r1"] and out.num_waiting == 2
    _step(s, 1.0)  # r0, r1 finish
    out = _step(s, 2.0)
    assert list(out.num_scheduled_tokens) == ["r2", "r3"]


# ---- preemption by recompute ------------------------------------------------------------
@pytest.mark.parametrize("prio_a,prio_b,victim", [(1, 0, "b"), (0, 1, "a"), (0, 0, "b")])
def test_preemption_victim_is_lowest_priority_then_latest_arrival(prio_a, prio_b, victim):
    s = _sched(num_pages=5)  # 4 usable pages of 4 tokens
    a = _req("a", 7, max_tokens=8, priority=prio_a, arrival_s=0.0)
    b = _req("b", 7, max_tokens=8, priority=prio_b, arrival_s=1.0)
    s.add_request(a)
    s.add_request(b)
    _step(s, 0.0)  # both prefill 7 tokens (2 pages each) and sample
    _step(s, 1.0)  # position 7: still in page 2
    out = _step(s, 2.0)  # position 8 needs a third page each: one must go
    loser = s.requests[victim]
    assert out.preempted_request_ids == [victim]
    assert loser.status is RequestStatus.WAITING and loser.num_preemptions == 1
    assert loser.num_computed_tokens == 0 and loser.page_ids == []
    assert loser.output_token_ids == [7, 7]  # kept, to be recomputed
    assert list(out.num_scheduled_tokens) == ["b" if victim == "a" else "a"]
    assert s.num_preemptions == 1 and s.waiting == [loser]
    s.pool.check_invariants()


def test_a_request_preempts_itself_when_it_is_the_least_important():
    s = _sched(num_pages=5)
    a = _req("a", 5, max_tokens=8, priority=1)
    b = _req("b", 7, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    _step(s, 0.0)
    _step(s, 1.0)
    out = _step(s, 2.0)  # a fits in its 2 pages; b needs a third and is the least important
    assert out.preempted_request_ids == ["b"] and list(out.num_scheduled_tokens) == ["a"]


def test_preempted_request_recomputes_prompt_and_outputs_and_goes_first():
    s = _sched(num_pages=5)
    a = _req("a", 7, max_tokens=3, priority=1, arrival_s=0.0)
    b = _req("b", 7, max_tokens=8, arrival_s=1.0)
    s.add_request(a)
    s.add_request(b)
    _step(s, 0.0)
    _step(s, 1.0)
    out = _step(s, 2.0)  # b preempted with 2 outputs; a samples its third and finishes
    assert out.preempted_request_ids == ["b"] and a.finish_reason == "length"
    c = _req("c", 3, arrival_s=0.5)  # same priority as b, arrived earlier, never preempted
    s.add_request(c)
    out = _step(s, 3.0)
    assert [x.request.request_id for x in out.scheduled] == ["b", "c"]
    first = out.scheduled[0]
    # 9 tokens to recompute; its first page is still in the prefix cache (its second was
    # evicted for a's third page: a request's tail pages are evicted first).
    assert (first.start, first.num_new_tokens) == (4, 5) and first.samples
    assert b.output_token_ids == [7, 7, 7]
    _drain(s, 5.0)
    assert s.pool.num_free_pages == 4


def test_no_admission_in_a_step_that_preempted():
    s = _sched(num_pages=5)
    s.add_request(_req("a", 7, max_tokens=8, priority=1))
    s.add_request(_req("b", 7, max_tokens=8))
    _step(s, 0.0)
    _step(s, 1.0)
    s.add_request(_req("c", 1))
    out = _step(s, 2.0)
    assert out.preempted_request_ids == ["b"] and "c" not in out.num_scheduled_tokens


# ---- priorities and aging ----------------------------------------------------------------
@pytest.mark.parametrize("rate,first", [(0.0, "high"), (1.0, "low")])
def test_aging_lets_an_old_low_priority_request_overtake(rate, first):
    s = _sched(max_num_seqs=1, priority_aging_per_s=rate)
    s.add_request(_req("low", 3, priority=0, arrival_s=0.0))
    s.add_request(_req("high", 3, priority=5, arrival_s=10.0))
    out = _step(s, 20.0)  # low has waited 20 s (+20 at rate 1), high 10 s (+10)
    assert list(out.num_scheduled_tokens) == [first]


@pytest.mark.parametrize("rate,starves", [(0.0, True), (0.5, False)])
def test_aging_stops_a_stream_of_high_priority_requests_starving_a_low_one(rate, starves):
    s = _sched(max_num_seqs=1, priority_aging_per_s=rate)
    low = _req("low", 2, max_tokens=1, priority=0, arrival_s=0.0)
    s.add_request(low)
    for t in range(1, 30):
        s.add_request(_req(f"high{t}", 2, max_tokens=1, priority=1, arrival_s=float(t)))
        _step(s, float(t))
    assert (low.finish_reason is None) == starves


def test_higher_priority_is_admitted_first():
    s = _sched(max_num_seqs=1)
    s.add_request(_req("a", 3, priority=0, arrival_s=0.0))
    s.add_request(_req("b", 3, priority=2, arrival_s=1.0))
    assert list(_step(s, 1.0).num_scheduled_tokens) == ["b"]


# ---- deadlines, aborts, finishes --------------------------------------------------------
def test_requests_past_their_deadline_time_out_and_free_pages():
    s = _sched(max_num_seqs=1)
    run = _req("run", 5, max_tokens=50, deadline_s=5.0)
    wait = _req("wait", 5, deadline_s=3.0)
    ok = _req("ok", 5, max_tokens=2)
    for r in (run, wait, ok):
        s.add_request(r)
    _step(s, 0.0)
    assert s.pool.num_used_pages == 2
    out = _step(s, 3.0)
    assert out.timed_out_request_ids == ["wait"] and wait.finish_reason == "timed_out"
    out = _step(s, 5.0)
    assert out.timed_out_request_ids == ["run"] and run.page_ids == []
    assert list(out.num_scheduled_tokens) == ["ok"]
    _drain(s, 5.0)
    assert s.num_finished == {"timed_out": 2, "length": 1} and s.pool.num_free_pages == 63


def test_abort_takes_effect_at_the_next_schedule():
    s = _sched()
    a, b = _req("a", 9, max_tokens=10), _req("b", 9, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    _step(s, 0.0)
    s.abort_request("a")
    s.abort_request("a")  # twice: still one outcome
    s.abort_request("nope")  # unknown: ignored
    assert a.status is RequestStatus.RUNNING
    out = s.schedule(1.0)
    assert out.aborted_request_ids == ["a"] and a.finish_reason == "cancelled"
    assert a.page_ids == [] and list(out.num_scheduled_tokens) == ["b"]
    assert s.pool.num_used_pages == 3  # b's pages only
    s.update_after_step(out, {"b": 1}, 1.0)
    assert s.num_finished == {"cancelled": 1}


def test_abort_does_not_hit_a_new_request_that_reuses_the_id():
    s = _sched()
    s.add_request(_req("x", 3))
    s.abort_request("x")
    s.finish_request("x", "stop", 0.0)  # ended before the abort took effect
    fresh = _req("x", 3)
    s.add_request(fresh)
    out = s.schedule(1.0)
    assert out.aborted_request_ids == [] and fresh.status is RequestStatus.RUNNING


def test_abort_a_waiting_request():
    s = _sched(max_num_seqs=1)
    s.add_request(_req("a", 3))
    s.add_request(_req("b", 3))
    s.abort_request("b")
    out = s.schedule(0.0)
    assert out.aborted_request_ids == ["b"] and s.waiting == []


def test_finish_request_is_once_only_and_a_failed_step_is_skipped():
    s = _sched()
    a = _req("a", 5)
    s.add_request(a)
    out = s.schedule(0.0)
    assert s.finish_request("a", "failed", 0.5)
    assert not s.finish_request("a", "stop", 0.6)
    assert a.finish_reason == "failed" and a.finish_s == 0.5
    assert s.update_after_step(out, {}, 1.0) == []
    assert a.num_computed_tokens == 0 and s.pool.num_free_pages == 63


def test_add_request_rejects_duplicates_and_oversized_requests():
    s = _sched(num_pages=5, max_model_len=64)
    s.add_request(_req("a", 3))
    with pytest.raises(DuplicateRequestError):
        s.add_request(_req("a", 3))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        s.add_request(_req("long", 62, max_tokens=4))
    with pytest.raises(InvalidRequestError, match="page pool"):
        s.add_request(_req("big", 14, max_tokens=4))  # 18 tokens > 4 pages x 4


def test_config_and_pool_must_agree():
    with pytest.raises(ValueError, match="does not match"):
        Scheduler(BASE, PagePool(8, 4))


# ---- prefix cache through the scheduler -------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_second_request_with_the_same_prefix_computes_only_the_rest(caching):
    s = _sched(enable_prefix_caching=caching)
    s.add_request(_req("a", 18, max_tokens=1, first_token=100))
    _drain(s)
    b = Request(
        "b", list(range(100, 118)) + [5, 6], SamplingParams(max_tokens=1), cache_salt="tenant:t"
    )
    s.add_request(b)
    out = s.schedule(10.0)
    expected = 16 if caching else 0
    assert b.num_cached_tokens == expected
    assert out.scheduled[0].start == expected
    assert out.num_scheduled_tokens == {"b": 20 - expected if caching else 16}
    assert s.stats()["prefix_cache_hit_tokens"] == expected


def test_fully_cached_prompt_still_computes_its_last_token():
    s = _sched()
    s.add_request(_req("a", 8, max_tokens=1, first_token=100))
    _drain(s)
    s.add_request(_req("b", 8, max_tokens=1, first_token=100))
    out = s.schedule(10.0)
    assert (out.scheduled[0].start, out.scheduled[0].num_new_tokens) == (4, 4)
    assert out.scheduled[0].samples


def test_other_tenant_gets_no_hit():
    s = _sched()
    s.add_request(_req("a", 18, max_tokens=1, first_token=100))
    _drain(s)
    other = Request(
        "b", list(range(100, 118)), SamplingParams(max_tokens=1), cache_salt="tenant:other"
    )
    s.add_request(other)
    s.schedule(10.0)
    assert other.num_cached_tokens == 0


def test_stats():
    s = _sched()
    s.add_request(_req("a", 5))
    st_ = s.stats()
    assert st_["num_waiting"] == 1 and st_["num_running"] == 0 and st_["kv_pages_used"] == 0


# ---- hypothesis: invariants over random workloads -----------------------------------------
_PREFIXES = ([1, 2, 3, 1, 2, 3, 1, 2], [2, 2, 1, 1, 3, 3, 2, 1])
_PROMPT = st.builds(
    lambda i, n, tail: _PREFIXES[i][:n] + tail,
    st.integers(0, 1),
    st.integers(0, 8),
    st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
_REQUEST = st.tuples(
    _PROMPT,  # 1 to 12 tokens, often sharing a prefix
    st.integers(1, 8),  # max_tokens
    st.integers(0, 2),  # priority
    st.sampled_from(["s1", "s2"]),  # cache salt
    st.sampled_from([False, False, False, True]),  # has a deadline
)
_OP = st.one_of(
    st.just(("add",)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("finish"), st.integers(0, 30)),
)


def _check_pages(s: Scheduler, kv: dict) -> None:
    """Reference counts equal page-table occurrences; a page is in two tables only through
    the prefix cache; every computed position's (fake) KV is this request's own."""
    pool, ps = s.pool, s.config.page_size
    pool.check_invariants()
    owners: dict[int, int] = {}
    for r in s.running:
        assert len(r.page_ids) == len(set(r.page_ids))
        assert len(r.page_ids) >= pool.pages_for_tokens(r.num_computed_tokens)
        assert r.num_computed_tokens < r.num_tokens  # one token behind: it can always step
        for p in r.page_ids:
            owners[p] = owners.get(p, 0) + 1
        for pos in range(r.num_computed_tokens):
            page = r.page_ids[pos // ps]
            assert kv[(page, pos % ps)] == (r.cache_salt, tuple(r.all_token_ids[: pos + 1]))
    for r in s.waiting:
        assert r.page_ids == [] and r.num_computed_tokens == 0
    for p in range(1, pool.num_pages):
        assert pool.ref_counts[p] == owners.get(p, 0), f"page {p}"
        if owners.get(p, 0) > 1:
            assert p in pool._cached


def _fake_device_step(s: Scheduler, out, kv: dict) -> None:
    """Write each scheduled token's 'KV' (its salt and its whole prefix) into its slot."""
    ps = s.config.page_size
    for x in out.scheduled:
        r = x.request
        for pos in range(x.start, x.start + x.num_new_tokens):
            kv[(r.page_ids[pos // ps], pos % ps)] = (
                r.cache_salt,
                tuple(r.all_token_ids[: pos + 1]),
            )


@settings(max_examples=150, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    extra_pages=st.integers(0, 4),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(1, 12),
    chunk=st.integers(1, 12),
    caching=st.sampled_from([True, True, False]),
    aging=st.sampled_from([0.0, 0.5]),
    ttl=st.sampled_from([None, 8.0]),
    requests=st.lists(_REQUEST, min_size=1, max_size=10),
    ops=st.lists(_OP, min_size=1, max_size=40),
    sampled=st.lists(st.integers(1, 6), min_size=1, max_size=7),
)
def test_random_workloads_keep_the_invariants(
    page_size, extra_pages, max_num_seqs, budget, chunk, caching, aging, ttl, requests, ops, sampled
):
    # The smallest pool that holds one request of 12 + 8 tokens; extra pages on top.
    num_pages = -(-20 // page_size) + 1 + extra_pages
    cfg = SchedulerConfig(
        page_size=page_size,
        num_pages=num_pages,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        prefill_chunk_size=min(chunk, budget),
        max_model_len=64,
        priority_aging_per_s=aging,
        enable_prefix_caching=caching,
        prefix_cache_ttl_s=ttl,
    )
    s = Scheduler(cfg, PagePool.from_config(cfg, model_keys=("rev",)))
    kv: dict = {}
    added: list[Request] = []
    now = [0.0]
    outcomes: dict[str, list[str]] = {}

    def finish(r, reason):
        if s.finish_request(r.request_id, reason, now[0]):
            outcomes.setdefault(r.request_id, []).append(reason)

    def step():
        now[0] += 1.0
        out = s.schedule(now[0])
        assert out.total_num_scheduled_tokens <= budget
        assert out.total_num_scheduled_tokens == sum(x.num_new_tokens for x in out.scheduled)
        assert len(out.scheduled) <= max_num_seqs and len(s.running) <= max_num_seqs
        assert len({x.request.request_id for x in out.scheduled}) == len(out.scheduled)
        for x in out.scheduled:
            assert x.num_new_tokens >= 1 and (
                x.num_new_tokens <= cfg.prefill_chunk_size
                or x.start + x.num_new_tokens == x.request.num_tokens
            )
        for r in out.finished_requests:
            outcomes.setdefault(r.request_id, []).append(r.finish_reason)
        _fake_device_step(s, out, kv)
        tokens = {rid: sampled[i % len(sampled)] for i, rid in enumerate(out.sampling_request_ids)}
        for r in s.update_after_step(out, tokens, now[0]):
            if r.num_output_tokens >= r.sampling.max_tokens:
                finish(r, "length")
            elif r.output_token_ids[-1] == 6:  # the "EOS" of this test
                finish(r, "stop")
        _check_pages(s, kv)

    def add():
        prompt, max_tokens, priority, salt, has_deadline = requests[len(added)]
        r = Request(
            f"r{len(added)}",
            prompt,
            SamplingParams(max_tokens=max_tokens),
            priority=priority,
            cache_salt=salt,
            arrival_s=now[0],
            deadline_s=now[0] + 6.0 if has_deadline else None,
        )
        s.add_request(r)
        added.append(r)

    for op in ops:
        if op[0] == "add" and len(added) < len(requests):
            add()
        elif op[0] in ("abort", "finish") and added:
            r = added[op[1] % len(added)]
            if op[0] == "abort":
                s.abort_request(r.request_id)
            else:
                finish(r, "stop")
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
    while len(added) < len(requests):
        add()
    for _ in range(500):  # drain: the most important request always progresses
        if not s.has_unfinished():
            break
        step()
    assert not s.has_unfinished()
    assert all(len(outcomes.get(r.request_id, [])) == 1 for r in added), outcomes
    assert all(r.status is RequestStatus.FINISHED and r.finish_reason for r in added)
    assert sum(s.num_finished.values()) == len(added)
    assert s.pool.num_free_pages == num_pages - 1 and not any(s.pool.ref_counts)
    s.pool.check_invariants()
    stats = s.stats()  # what this workload exercised (pytest --hypothesis-show-statistics)
    for name in (
        "num_preemptions",
        "prefix_cache_hit_tokens",
        "prefix_cache_evictions",
        "prefix_cache_expirations",
        "allocation_failures",
    ):
        event(f"{name} > 0: {stats[name] > 0}")
    for reason in s.num_finished:
        event(f"finished {reason}")


def _run_with_fake_model(
    cfg: SchedulerConfig, prompts: list[tuple[list[int], str, int]], overlap: bool = False
):
    """Run requests to the end with a fake model that READS its context back from the fake
    KV pages: next token = f(tokens found at positions 0..n-1 through the page table). A
    wrong page (a bad cache hit, a page reused while still referenced) changes the output.
    `overlap`: schedule step N+1 before committing step N's tokens (engine/core.py); a token
    the host does not know yet comes from the fake device's last sampled token."""
    s = Scheduler(cfg, PagePool.from_config(cfg, model_keys=("rev",)))
    ps, kv = cfg.page_size, {}
    reqs = [
        Request(f"r{i}", p, SamplingParams(max_tokens=m), cache_salt=salt, arrival_s=float(i))
        for i, (p, salt, m) in enumerate(prompts)
    ]
    for r in reqs:
        s.add_request(r)
    device_last: dict[str, int] = {}  # the device's copy of each request's last sampled token

    def commit(out, sampled, now):
        for r in s.update_after_step(out, sampled, now):
            if r.num_output_tokens >= r.sampling.max_tokens or r.output_token_ids[-1] == 20:
                s.finish_request(r.request_id, "length", now)

    now, in_flight = 0.0, None
    while (s.has_unfinished() or in_flight) and now < 2000:
        now += 1.0
        out = s.schedule(now)
        sampled = {}
        for x in out.scheduled:
            r = x.request
            for pos in range(x.start, x.start + x.num_new_tokens):
                known = pos < r.num_known_tokens
                token = r.all_token_ids[pos] if known else device_last[r.request_id]
                kv[(r.page_ids[pos // ps], pos % ps)] = (r.cache_salt, token)
            if x.samples:
                end = x.start + x.num_new_tokens  # the whole computed context
                context = [kv[(r.page_ids[pos // ps], pos % ps)] for pos in range(end)]
                assert all(salt == r.cache_salt for salt, _ in context)
                sampled[r.request_id] = hash(tuple(t for _, t in context)) % 20 + 1
                device_last[r.request_id] = sampled[r.request_id]
        if overlap:
            if in_flight is not None:
                commit(*in_flight, now)
            in_flight = (out, sampled) if out.scheduled else None
        else:
            commit(out, sampled, now)
    assert not s.has_unfinished()
    assert s.pool.num_free_pages == cfg.num_pages - 1
    return [r.output_token_ids for r in reqs], s.stats()


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(_PROMPT, st.sampled_from(["s1", "s2"]), st.integers(1, 8)),
        min_size=1,
        max_size=10,
    ),
    page_size=st.sampled_from([1, 2, 4]),
    extra_pages=st.integers(0, 2),
    max_num_seqs=st.integers(2, 4),
    budget=st.integers(1, 12),
)
def test_outputs_are_the_same_with_cache_on_or_off_and_a_tiny_or_large_pool(
    prompts, page_size, extra_pages, max_num_seqs, budget
):
    small = SchedulerConfig(
        page_size=page_size,
        num_pages=-(-20 // page_size) + 1 + extra_pages,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        prefill_chunk_size=budget,
        max_model_len=64,
        enable_prefix_caching=True,
        prefix_cache_ttl_s=None,
    )
    reference, _ = _run_with_fake_model(
        dataclasses.replace(small, num_pages=1000, enable_prefix_caching=False), prompts
    )
    cached, stats = _run_with_fake_model(small, prompts)
    uncached, _ = _run_with_fake_model(
        dataclasses.replace(small, enable_prefix_caching=False), prompts
    )
    overlapped, _ = _run_with_fake_model(small, prompts, overlap=True)
    assert cached == reference and uncached == reference and overlapped == reference
    event(f"hits > 0: {stats['prefix_cache_hit_tokens'] > 0}")
    event(f"preemptions > 0: {stats['num_preemptions'] > 0}")


@settings(max_examples=80, deadline=None)
@given(
    rate=st.sampled_from([0.0, 0.5]),
    rows=st.lists(
        st.tuples(
            st.integers(-1, 1),  # priority
            st.integers(0, 2),  # arrival_s (ties on purpose)
            st.integers(1, 3),  # tokens left to compute (1: a decode)
            st.integers(0, 2),  # outputs known + pending below (0: none left) max_tokens
        ),
        max_size=12,
    ),
)
def test_running_order_is_the_one_stable_sort(rate, rows):
    """_running_in_order (the rank order kept between steps, split into decodes and the
    rest) is the order of the one sort it replaces (host time, #20): decodes first, then
    effective priority, then arrival, ties in running order; requests with no output left
    to schedule left out; and it stays right after `running` changes."""
    s = _sched(priority_aging_per_s=rate, max_num_seqs=16)
    for i, (prio, arrival, left, room) in enumerate(rows):
        outputs = [5] * (3 - room)
        r = _req(f"r{i}", 4, 3, priority=prio, arrival_s=float(arrival), output_token_ids=outputs)
        r.num_computed_tokens = r.num_tokens - left
        r.status = RequestStatus.RUNNING
        s.requests[r.request_id] = r
        s.running.append(r)
    s._ranked = None  # the test filled `running` itself

    def reference():
        live = [r for r in s.running if not r.max_outputs_reached]
        key = lambda r: (  # noqa: E731
            r.num_tokens - r.num_computed_tokens > 1,
            rate * r.arrival_s - r.priority,
            r.arrival_s,
        )
        return sorted(live, key=key)

    assert s._running_in_order() == reference()
    if s.running:  # a request leaves and one arrives: the kept order is rebuilt
        s._finish(s.running[len(s.running) // 2], "stop", 0.0)
        s.add_request(_req("new", 4, priority=0, arrival_s=1.0))
        s.schedule(0.0)  # admits "new" (a prefill) among the running
        assert s._running_in_order() == reference()
