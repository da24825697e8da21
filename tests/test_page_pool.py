"""Page allocator and prefix cache: allocation, reference counts, block hashing, LRU, TTL."""

import dataclasses

import pytest

from configs.engine_config import CacheSharingPolicy, EngineConfig, SchedulerConfig
from configs.model_config import from_name
from engine.sched.page_pool import PagePool, cache_salt_for
from engine.sched.request import Request

PS = 4  # page size of these tests


def _pool(num_pages=16, **kw) -> PagePool:
    kw.setdefault("model_keys", ("rev1", "tok", "tmpl"))
    return PagePool(num_pages, PS, **kw)


def _req(tokens, salt="tenant:a", rid="r") -> Request:
    return Request(rid, list(tokens), cache_salt=salt)


def _computed(pool: PagePool, tokens, salt="tenant:a", rid="r") -> Request:
    """A request whose tokens were all computed into fresh pages, full pages registered."""
    req = _req(tokens, salt, rid)
    req.page_ids = pool.allocate(pool.pages_for_tokens(len(tokens)))
    req.num_computed_tokens = len(tokens)
    pool.cache_full_pages(req)
    return req


# ---- allocation ------------------------------------------------------------------------
def test_allocate_hands_out_distinct_pages_never_the_null_page():
    pool = _pool(num_pages=8)
    pages = pool.allocate(7)
    assert sorted(pages) == list(range(1, 8))
    assert pool.num_free_pages == 0 and pool.num_used_pages == 7
    pool.check_invariants()


def test_allocate_returns_none_when_there_is_no_room_and_counts_it():
    pool = _pool(num_pages=5)
    assert pool.allocate(3) is not None
    assert pool.allocate(2) is None
    assert pool.stats.allocation_failures == 1
    assert pool.num_free_pages == 1  # a failed allocation takes nothing
    assert pool.allocate(0) == []


def test_free_returns_pages_and_double_free_raises():
    pool = _pool(num_pages=5)
    pages = pool.allocate(4)
    pool.free(pages, now_s=0.0)
    assert pool.num_free_pages == 4 and all(pool.ref_counts[p] == 0 for p in pages)
    with pytest.raises(ValueError, match="double free"):
        pool.free(pages[:1], now_s=0.0)
    with pytest.raises(ValueError):
        pool.free([0], now_s=0.0)
    pool.check_invariants()


def test_shared_cached_page_is_free_only_after_its_last_reference():
    pool = _pool()
    a = _computed(pool, range(8))  # two full pages, both cached
    b = _req(list(range(8)) + [99], rid="b")
    hit, n = pool.find_cached_prefix(b)
    assert hit == a.page_ids and n == 8
    pool.acquire(hit)
    assert [pool.ref_counts[p] for p in hit] == [2, 2]
    pool.free(a.page_ids, now_s=1.0)
    assert [pool.ref_counts[p] for p in hit] == [1, 1]
    assert pool.num_free_pages == 15 - 2
    pool.free(hit, now_s=2.0)
    assert pool.num_free_pages == 15
    pool.check_invariants()


def test_acquire_refuses_a_free_uncached_page():
    pool = _pool()
    with pytest.raises(ValueError, match="not cached"):
        pool.acquire([3])


# ---- prefix hits -----------------------------------------------------------------------
def test_prefix_ending_mid_page_does_not_hit_the_partial_page():
    pool = _pool()
    a = _computed(pool, range(10))  # pages [0..3], [4..7] full; [8, 9] partial, not cached
    assert pool.num_cached_pages == 2
    b = _req([0, 1, 2, 3, 4, 5, 50, 51, 52, 53])  # shares 6 tokens: one full page
    assert pool.find_cached_prefix(b) == (a.page_ids[:1], 4)


def test_prefix_at_an_exact_page_boundary_hits_whole_pages():
    pool = _pool()
    a = _computed(pool, range(8))
    b = _req(list(range(8)) + [70, 71, 72])
    assert pool.find_cached_prefix(b) == (a.page_ids, 8)


def test_the_last_token_is_never_served_from_the_cache():
    pool = _pool()
    a = _computed(pool, range(12))
    # The whole prompt is cached: at most len - 1 = 7 tokens may be, in whole pages: 4.
    assert pool.find_cached_prefix(_req(range(8))) == (a.page_ids[:1], 4)
    assert pool.find_cached_prefix(_req(range(9))) == (a.page_ids[:2], 8)
    assert pool.find_cached_prefix(_req(range(1))) == ([], 0)


def test_a_hash_collision_is_a_miss_not_a_wrong_hit():
    pool = _pool()
    a = _computed(pool, range(8))
    cached = pool._cached[a.page_ids[0]]
    pool._cached[a.page_ids[0]] = dataclasses.replace(cached, token_ids=(9, 9, 9, 9))
    assert pool.find_cached_prefix(_req(range(9))) == ([], 0)


def test_same_salt_shares_different_salts_never_do():
    pool = _pool()
    _computed(pool, range(8), salt="tenant:a")
    assert pool.find_cached_prefix(_req(range(9), salt="tenant:a"))[1] == 8
    assert pool.find_cached_prefix(_req(range(9), salt="tenant:b"))[1] == 0
    assert pool.find_cached_prefix(_req(range(9), salt=None))[1] == 0


def test_other_adapter_does_not_hit():
    pool = _pool()
    _computed(pool, range(8))
    other = _req(range(9))
    other.adapter_id = "lora-1"
    assert pool.find_cached_prefix(other)[1] == 0


def test_revision_change_clears_the_cache():
    pool = _pool()
    a = _computed(pool, range(8))
    pool.free(a.page_ids, now_s=0.0)
    pool.clear_cache(("rev2", "tok", "tmpl"))
    assert pool.num_cached_pages == 0 and pool.num_free_pages == 15
    assert pool.find_cached_prefix(_req(range(9))) == ([], 0)
    b = _computed(pool, range(8), rid="b")  # cached again under the new revision
    assert pool.find_cached_prefix(_req(range(9), rid="c")) == (b.page_ids, 8)
    pool.check_invariants()


def test_pages_in_use_at_a_revision_change_are_not_cached_again():
    pool = _pool()
    a = _req(range(12))
    a.page_ids = pool.allocate(3)
    a.num_computed_tokens = 8
    pool.cache_full_pages(a)
    assert pool.num_cached_pages == 2
    pool.clear_cache(("rev2", "tok", "tmpl"))
    a.num_computed_tokens = 12  # its third page, computed on top of the old model's K/V
    pool.cache_full_pages(a)
    assert pool.num_cached_pages == 0
    pool.free(a.page_ids, now_s=0.0)
    pool.check_invariants()


def test_prefix_caching_off_never_hits_nor_caches():
    pool = _pool(enable_prefix_caching=False)
    _computed(pool, range(8))
    assert pool.num_cached_pages == 0
    assert pool.find_cached_prefix(_req(range(9))) == ([], 0)


def test_a_key_cached_twice_keeps_the_first_page():
    pool = _pool()
    a = _computed(pool, range(8), rid="a")
    b = _computed(pool, range(8), rid="b")  # computed concurrently, same content
    assert pool.num_cached_pages == 2
    assert pool.find_cached_prefix(_req(range(9)))[0] == a.page_ids
    pool.free(b.page_ids, now_s=0.0)  # b's pages go back as plain free pages
    assert pool.num_free_pages == 15 - 2
    pool.check_invariants()


# ---- LRU eviction and TTL --------------------------------------------------------------
def test_lru_evicts_the_least_recently_released_cached_page_first():
    pool = _pool(num_pages=4)  # 3 usable pages
    a = _computed(pool, range(4), rid="a")
    b = _computed(pool, range(10, 14), rid="b")
    c = _computed(pool, range(20, 24), rid="c")
    for t, req in enumerate([b, a, c]):
        pool.free(req.page_ids, now_s=float(t))
    assert pool.num_free_pages == 3 and pool.num_cached_pages == 3
    assert pool.allocate(1) == b.page_ids
    assert pool.stats.evictions == 1
    assert pool.find_cached_prefix(_req(range(10, 15)))[1] == 0  # b evicted
    assert pool.find_cached_prefix(_req(range(5)))[1] == 4  # a still cached
    pool.check_invariants()


def test_plain_free_pages_are_used_before_evicting_cached_ones():
    pool = _pool(num_pages=4)
    a = _computed(pool, range(4))
    pool.free(a.page_ids, now_s=0.0)
    assert pool.allocate(2) is not None
    assert pool.stats.evictions == 0 and pool.num_cached_pages == 1


def test_a_requests_tail_pages_are_evicted_before_its_head():
    pool = _pool(num_pages=4)
    a = _computed(pool, range(12))
    pool.free(a.page_ids, now_s=0.0)
    assert pool.allocate(1) == [a.page_ids[2]]
    assert pool.find_cached_prefix(_req(range(9))) == (a.page_ids[:2], 8)


def test_cache_hit_on_a_free_page_takes_it_out_of_the_free_queue():
    pool = _pool(num_pages=3)
    a = _computed(pool, range(8))
    pool.free(a.page_ids, now_s=0.0)
    hit, _ = pool.find_cached_prefix(_req(range(9)))
    assert not pool.can_allocate(1, reserving=hit)
    pool.acquire(hit)
    assert pool.num_free_pages == 0 and pool.allocate(1) is None
    pool.check_invariants()


def test_ttl_expires_released_pages_only():
    pool = _pool(ttl_s=10.0)
    a = _computed(pool, range(4), rid="a")
    b = _computed(pool, range(10, 14), rid="b")
    pool.free(a.page_ids, now_s=100.0)
    assert pool.expire(now_s=109.9) == 0
    assert pool.expire(now_s=110.0) == 1
    assert pool.stats.expirations == 1
    assert pool.find_cached_prefix(_req(range(5)))[1] == 0
    assert pool.expire(now_s=1e9) == 0  # b is in use: it never expires
    assert all(pool.ref_counts[p] == 1 for p in b.page_ids)
    assert pool.find_cached_prefix(_req(range(10, 15)))[1] == 4
    pool.check_invariants()


def test_no_ttl_never_expires():
    pool = _pool(ttl_s=None)
    a = _computed(pool, range(4))
    pool.free(a.page_ids, now_s=0.0)
    assert pool.expire(now_s=1e12) == 0 and pool.num_cached_pages == 1


def test_stats_report_the_counters():
    pool = _pool()
    pool.record_lookup(10, 4)
    assert (pool.stats.queried_tokens, pool.stats.hit_tokens) == (10, 4)
    assert pool.stats.hit_rate == pytest.approx(0.4)
    assert pool.num_free_pages == 15 and pool.num_used_pages == 0


# ---- tenant salts and configs ----------------------------------------------------------
def test_cache_salt_policy():
    policy = CacheSharingPolicy(
        isolated_tenants=frozenset({"secret"}),
        shared_groups=(("public", frozenset({"acme", "globex"})),),
    )
    assert cache_salt_for("a", policy) == cache_salt_for("a", policy) == "tenant:a"
    assert cache_salt_for("a", policy) != cache_salt_for("b", policy)
    assert cache_salt_for("acme", policy) == cache_salt_for("globex", policy)
    assert cache_salt_for("secret", policy) != cache_salt_for("secret", policy)
    # a tenant named like a group does not get the group's salt
    assert cache_salt_for("group:public", policy) != cache_salt_for("acme", policy)
    assert cache_salt_for("x") == "tenant:x"


def test_cache_policy_rejects_ambiguous_tenants():
    with pytest.raises(ValueError, match="one group only"):
        CacheSharingPolicy(shared_groups=(("g1", frozenset({"a"})), ("g2", frozenset({"a"}))))
    with pytest.raises(ValueError, match="isolated"):
        CacheSharingPolicy(
            isolated_tenants=frozenset({"a"}), shared_groups=(("g", frozenset({"a"})),)
        )


@pytest.mark.parametrize(
    "field,value",
    [
        ("page_size", 0),
        ("num_pages", 1),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("prefill_chunk_size", 10_000),
        ("priority_aging_per_s", -1.0),
        ("prefix_cache_ttl_s", 0.0),
    ],
)
def test_scheduler_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        SchedulerConfig(**{field: value})


def test_engine_config_resolves_a_kv_budget_into_pages():
    model = from_name("smollm2-135m")  # 2 x 30 x 3 x 64 x 4 B = 46,080 B per token (f32)
    cfg = EngineConfig(page_size=16, kv_cache_bytes=46_080 * 16 * 100)
    sched = cfg.scheduler_config(model)
    assert sched.num_pages == 100 and sched.max_model_len == model.max_seq_len
    assert EngineConfig(num_pages=7).scheduler_config(model).num_pages == 7
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        EngineConfig(kv_cache_bytes=1000).scheduler_config(model)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    assert EngineConfig(max_num_batched_tokens=64).scheduler_config(model).prefill_chunk_size == 64
    assert EngineConfig().scheduler_config(model).prefill_chunk_size == 256
    with pytest.raises(ValueError, match="prefill_chunk_size=100"):
        EngineConfig(max_num_batched_tokens=64, prefill_chunk_size=100)
    assert PagePool.from_config(sched).num_pages == 100
