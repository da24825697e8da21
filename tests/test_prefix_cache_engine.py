"""Prefix caching through the real engine (tiny model): it reuses computation, never answers.

Greedy outputs must be identical with the cache on and off; hits must never cross tenants
(unless a sharing group says so) or model revisions; with a small pool, hits, evictions,
preemptions and cancellations together must leave every page accounted for.

One engine shape set for the whole file (page_size 8, 7 pages, 2 sequences, a 16-token step,
max_model_len 32: the page-table bucket is always 4), so the cache-on and cache-off engines
and every hypothesis example reuse the same few compiled step programs.
"""

import dataclasses
import time

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from configs.engine_config import CacheSharingPolicy, EngineConfig
from engine import LLM, SamplingParams
from engine.api_types import EngineRequest
from engine.core import EngineCore

PS = 8
OPTS = {
    "page_size": PS,
    "num_pages": 7,
    "max_num_seqs": 2,
    "max_num_batched_tokens": 16,
    "prefill_chunk_size": 16,
    "max_model_len": 32,
}
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
BASE = [1] + np.random.default_rng(7).integers(3, 512, 23).tolist()  # 24 tokens


def question(i: int, n: int) -> list[int]:
    return np.random.default_rng(100 + i).integers(3, 512, n).tolist()


@pytest.fixture(scope="module")
def llm_on(tiny_model):
    return LLM(tiny_model, **OPTS)


@pytest.fixture(scope="module")
def llm_off(tiny_model):
    return LLM(tiny_model, prefix_caching=False, **OPTS)


def greedy_one(llm, prompt, tenant="default"):
    return llm.generate([prompt], GREEDY, tenant=tenant)[0]


def assert_pool_idle(llm_or_core):
    core = getattr(llm_or_core, "engine", llm_or_core)
    core.pool.check_invariants()
    assert core.pool.num_used_pages == 0 and not core.has_unfinished()


# ---- cache on == cache off ----------------------------------------------------------------
# (prefix length, question lengths): prefixes ending mid-page (5, 12, 20) and exactly at a
# page boundary (8, 16); 16 + 0 is a fully cached prompt (only 8 tokens may hit: the last
# token is always computed), 16 + 1 hits both pages and computes one token.
PREFIX_CASES = [(5, [3, 2]), (8, [4, 2]), (12, [3, 4]), (16, [0, 1, 4]), (20, [2, 3])]


def prefix_workload():
    prompts, groups, i = [], [], 0
    for length, q_lens in PREFIX_CASES:
        for q in q_lens:
            prompts.append(BASE[:length] + question(i, q))
            groups.append(length)
            i += 1
    return prompts, groups


def test_sequential_shared_prefixes_match_cache_off_and_hit(llm_on, llm_off):
    prompts, groups = prefix_workload()
    hits_before = llm_on.stats()["prefix_cache_hit_tokens"]
    for k, (prompt, length) in enumerate(zip(prompts, groups)):
        off, on = greedy_one(llm_off, prompt), greedy_one(llm_on, prompt)
        assert on.token_ids == off.token_ids, (length, prompt)
        assert on.finish_reason == off.finish_reason
        cached = on.metrics.cached_tokens
        assert off.metrics.cached_tokens == 0
        assert cached % PS == 0 and cached <= len(prompt) - 1
        if k and groups[k - 1] == length:  # the previous request just computed this prefix
            assert cached >= min(length // PS, (len(prompt) - 1) // PS) * PS, (length, cached)
    s = llm_on.stats()
    assert s["prefix_cache_hit_tokens"] > hits_before
    assert s["prefix_cache_prefill_tokens_saved"] == s["prefix_cache_hit_tokens"]
    assert 0 < s["prefix_cache_hit_rate"] < 1 and s["prefix_cache_cached_pages"] > 0
    assert llm_off.stats()["prefix_cache_hit_tokens"] == 0
    assert_pool_idle(llm_on)


def test_fully_cached_prompt_hits_whole_pages_but_computes_its_last_token(llm_on, llm_off):
    prompt = BASE[:16]
    first, second = greedy_one(llm_on, prompt), greedy_one(llm_on, prompt)
    assert second.metrics.cached_tokens == 8  # (16 - 1) // 8 pages, never all 16 tokens
    assert first.token_ids == second.token_ids == greedy_one(llm_off, prompt).token_ids
    longer = greedy_one(llm_on, BASE[:17])
    assert longer.metrics.cached_tokens == 16
    assert longer.token_ids == greedy_one(llm_off, BASE[:17]).token_ids


def test_batched_shared_prefixes_match_cache_off(llm_on, llm_off):
    prompts, _ = prefix_workload()
    prompts = prompts + [BASE[:12] + question(50 + i, 3) for i in range(4)]
    on = llm_on.generate(prompts, GREEDY)
    off = llm_off.generate(prompts, GREEDY)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert sum(o.metrics.cached_tokens for o in on) > 0
    assert all(o.metrics.cached_tokens == 0 for o in off)
    assert_pool_idle(llm_on)
    assert_pool_idle(llm_off)


# ---- isolation ------------------------------------------------------------------------------
def test_tenants_never_share_pages_but_a_tenant_shares_with_itself(llm_on):
    llm_on.engine.clear_prefix_cache()
    prompt = BASE[:20] + [7, 8]
    a1 = greedy_one(llm_on, prompt, tenant="alice")
    b1 = greedy_one(llm_on, prompt, tenant="bob")
    a2 = greedy_one(llm_on, prompt, tenant="alice")
    b2 = greedy_one(llm_on, prompt, tenant="bob")
    assert a1.metrics.cached_tokens == 0 and b1.metrics.cached_tokens == 0
    assert a2.metrics.cached_tokens == 16 and b2.metrics.cached_tokens == 16
    assert a1.token_ids == b1.token_ids == a2.token_ids == b2.token_ids
    # Each tenant's copy of the prefix lives in its own pages.
    by_salt = {}
    for page, cached in llm_on.engine.pool._cached.items():
        by_salt.setdefault(cached.extra_keys[-1], set()).add(page)
    assert by_salt["tenant:alice"].isdisjoint(by_salt["tenant:bob"])
    assert_pool_idle(llm_on)


def test_sharing_policy_groups_and_isolated_tenants(tiny_model):
    policy = CacheSharingPolicy(
        isolated_tenants={"secret"}, shared_groups=(("public", {"x", "y"}),)
    )
    llm = LLM(tiny_model, cache_sharing=policy, **OPTS)
    prompt = BASE[:18]
    assert greedy_one(llm, prompt, tenant="x").metrics.cached_tokens == 0
    assert greedy_one(llm, prompt, tenant="y").metrics.cached_tokens == 16  # same group
    assert greedy_one(llm, prompt, tenant="z").metrics.cached_tokens == 0  # outside it
    assert greedy_one(llm, prompt, tenant="secret").metrics.cached_tokens == 0
    assert greedy_one(llm, prompt, tenant="secret").metrics.cached_tokens == 0  # not even itself
    assert_pool_idle(llm)


def test_revision_change_gives_no_hits_and_new_weights_answer(tiny_model, llm_off):
    llm = LLM(tiny_model, **OPTS)
    prompts = [BASE[:20] + question(60 + i, 3) for i in range(3)]
    old = [greedy_one(llm, p) for p in prompts]
    assert old[1].metrics.cached_tokens == 16  # warm under the old revision
    params = jax.tree.map(lambda x: x[..., ::-1] if x.ndim >= 2 else x, tiny_model.params)
    identity = dataclasses.replace(tiny_model.identity, revision="sha256:other-revision")
    new_model = dataclasses.replace(tiny_model, params=params, identity=identity)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    llm.reload_model(new_model)
    assert llm.stats()["prefix_cache_cached_pages"] == 0
    new = [greedy_one(llm, p) for p in prompts]
    assert new[0].metrics.cached_tokens == 0
    assert llm.stats()["prefix_cache_hit_tokens"] - hits == sum(
        o.metrics.cached_tokens for o in new[1:]
    )  # later hits only on new-revision pages
    fresh = LLM(new_model, prefix_caching=False, **OPTS)
    assert [o.token_ids for o in new] == [greedy_one(fresh, p).token_ids for p in prompts]
    assert [o.token_ids for o in new] != [o.token_ids for o in old]  # the weights matter
    assert_pool_idle(llm)


def test_ttl_expires_unused_pages(tiny_model):
    llm = LLM(tiny_model, prefix_cache_ttl_s=0.05, **OPTS)
    prompt = BASE[:20]
    greedy_one(llm, prompt)
    time.sleep(0.1)
    assert greedy_one(llm, prompt).metrics.cached_tokens == 0
    assert llm.stats()["prefix_cache_expirations"] > 0


# ---- randomized: hits, evictions, preemptions, cancellations --------------------------------
def drive(
    core: EngineCore, arrivals: list[tuple[int, list[int], str, int | None]]
) -> tuple[dict[str, list[int]], dict[str, str], dict[str, int]]:
    """Adds request i at step arrivals[i][0] (prompt, tenant), aborts it at step
    arrivals[i][3] if given; checks the page accounting after every step."""
    tokens, reasons, cached = {}, {}, {}
    step = 0
    while step <= max(a[0] for a in arrivals) or core.has_unfinished():
        for i, (at, prompt, tenant, abort_at) in enumerate(arrivals):
            if at == step:
                core.add_request(EngineRequest(f"r{i}", prompt, GREEDY, tenant=tenant))
                tokens[f"r{i}"] = []
            if abort_at == step:
                core.abort_request(f"r{i}")
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in reasons, "two outcomes for one request"
                reasons[out.request_id] = out.finish_reason
                cached[out.request_id] = out.metrics.cached_tokens
        check_page_references(core)
        step += 1
        assert step < 2000, "the workload did not finish"
    return tokens, reasons, cached


def check_page_references(core: EngineCore) -> None:
    """No page is free while a live request holds it: every reference count equals the
    number of live page tables holding the page."""
    pool = core.pool
    pool.check_invariants()
    holders = [0] * pool.num_pages
    for req in core.scheduler.requests.values():
        for page in req.page_ids:
            holders[page] += 1
    assert holders == pool.ref_counts


# (which base, prefix length): long prefixes are drawn often, so that two running requests
# outgrow the 6 pages (preemption) and share full pages (hits).
_STEM = st.tuples(st.sampled_from([0, 1]), st.one_of(st.integers(0, 20), st.integers(16, 20)))
_REQUEST = st.tuples(
    st.integers(0, 8),  # arrival step
    _STEM,
    st.integers(1, 4),  # question length
    st.sampled_from(["t1", "t2"]),
    st.one_of(st.none(), st.integers(0, 10)),  # abort this many steps after arrival
)
_BASES = [BASE, [1] + np.random.default_rng(8).integers(3, 512, 23).tolist()]


@pytest.fixture(scope="module")
def reference_outputs(llm_off):
    memo: dict[tuple, list[int]] = {}

    def get(prompts: list[list[int]]) -> list[list[int]]:
        todo = [p for p in dict.fromkeys(map(tuple, prompts)) if p not in memo]
        if todo:
            for p, out in zip(todo, llm_off.generate([list(p) for p in todo], GREEDY)):
                memo[p] = out.token_ids
        return [memo[tuple(p)] for p in prompts]

    return get


@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(requests=st.lists(_REQUEST, min_size=3, max_size=7), repeat=st.integers(0, 2))
def test_random_workload_matches_cache_off_and_returns_every_page(
    tiny_model, reference_outputs, requests, repeat
):
    arrivals = []
    for i, (at, (base, length), q_len, tenant, abort_after) in enumerate(requests):
        prompt = _BASES[base][:length] + question(i % 3, q_len)  # i % 3: repeated questions
        arrivals.append((at, prompt, tenant, None if abort_after is None else at + abort_after))
    for j in range(repeat):  # exact repeats of earlier prompts, later: fully cached prompts
        at, prompt, tenant, _ = arrivals[j]
        arrivals.append((at + 8, prompt, tenant, None))
    core = EngineCore(tiny_model, EngineConfig(model="tiny", **OPTS))
    tokens, reasons, cached = drive(core, arrivals)
    expected = reference_outputs([a[1] for a in arrivals])
    assert len(reasons) == len(arrivals)
    for i, want in enumerate(expected):
        rid, prompt = f"r{i}", arrivals[i][1]
        if reasons[rid] == "cancelled":
            assert tokens[rid] == want[: len(tokens[rid])]
        else:
            assert (tokens[rid], reasons[rid]) == (
                want,
                "length" if len(want) == MAX_TOKENS and want[-1] != 2 else "stop",
            )
        assert cached[rid] % PS == 0 and cached[rid] <= len(prompt) - 1
    s = core.stats()
    event(f"hits>0: {s['prefix_cache_hit_tokens'] > 0}")
    event(f"evictions>0: {s['prefix_cache_evictions'] > 0}")
    event(f"preemptions>0: {s['num_preemptions'] > 0}")
    event(f"cancelled>0: {'cancelled' in reasons.values()}")
    assert core.pool.num_free_pages == core.pool.num_pages - 1  # every page is back
    assert_pool_idle(core)


def test_pressure_workload_hits_evicts_preempts_and_still_matches(tiny_model, reference_outputs):
    """The mix the random test draws from, pinned so that each effect surely happens."""
    arrivals = [
        (0, BASE[:20] + question(0, 4), "t1", None),
        (0, _BASES[1][:20] + question(1, 4), "t1", None),  # 2 x 4 pages > 6: preempt
        (1, BASE[:20] + question(2, 3), "t1", 3),  # cancelled while waiting/running
        (6, _BASES[1][:16] + question(3, 2), "t2", None),
        (9, BASE[:20] + question(4, 2), "t1", None),
        (14, BASE[:20] + question(0, 4), "t1", None),  # an exact repeat
        (20, _BASES[1][:20] + question(5, 4), "t2", None),
    ]
    core = EngineCore(tiny_model, EngineConfig(model="tiny", **OPTS))
    tokens, reasons, cached = drive(core, arrivals)
    expected = reference_outputs([a[1] for a in arrivals])
    assert reasons["r2"] == "cancelled"
    for i, want in enumerate(expected):
        if i != 2:
            assert tokens[f"r{i}"] == want, i
    s = core.stats()
    assert s["num_preemptions"] > 0
    assert s["prefix_cache_hit_tokens"] > 0 and sum(cached.values()) > 0
    assert s["prefix_cache_evictions"] > 0
    assert_pool_idle(core)


# ---- the benchmark, smoke sizes ----------------------------------------------------------
def test_prefix_cache_bench_smoke(tiny_model):
    from benchmarks.prefix_cache_bench import SIZES, render, run

    result = run(SIZES["smoke"], model=tiny_model)
    shared, ttft = result["shared"], result["ttft"]
    assert shared["outputs_identical"]
    assert shared["on"]["prefill_tokens_saved"] > 0 == shared["off"]["prefill_tokens_saved"]
    assert (
        shared["on"]["tokens_computed"] + shared["on"]["prefill_tokens_saved"]
        == shared["off"]["tokens_computed"]
    )
    assert ttft["warm_cached_tokens_median"] == PS  # 16-token prompts: one full page
    assert result["unshared"]["hit_tokens"] == 0
    text = render(result)
    assert "cold (cache cleared)" in text and "Nothing shared" in text
