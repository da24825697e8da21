"""The prefix cache's host tier (engine/sched/host_tier.py, engine/runner/kv_offload.py).

Bookkeeping without JAX (HostKVTier alone: states, LRU, bounds, TTL, clear, collisions),
then the real engine on the tiny model with a pool too small to keep a prefix: the prefix
evicted from the device is served from host memory with outputs identical to recomputing it
and to no cache at all, the reloaded pages are bitwise the evicted ones, hits and copies are
counted, a tiny host tier evicts by LRU within its bytes, nothing leaks (cancellation
included), int8 KV, and the KV events name the medium.

Engine shapes as tests/test_prefix_cache_engine.py (page_size 8, 7 pages, 2 sequences, a
16-token step, max_model_len 32), so the step programs are shared with that module.
"""

import dataclasses

import numpy as np
import pytest

from configs.engine_config import EngineConfig
from engine import LLM, SamplingParams
from engine.api_types import EngineRequest
from engine.sched.host_tier import HostKVTier
from engine.sched.kv_events import KvEventRecorder
from engine.sched.page_pool import CachedPage

PS = 8
OPTS = {
    "page_size": PS,
    "num_pages": 7,
    "max_num_seqs": 2,
    "max_num_batched_tokens": 16,
    "prefill_chunk_size": 16,
    "max_model_len": 32,
}
GREEDY = SamplingParams(temperature=0, max_tokens=6)
BASE = [1] + np.random.default_rng(7).integers(3, 512, 23).tolist()  # 24 tokens: 3 pages
HOST_GIB = 1e-3  # ~260 pages of the tiny model: never full here


def question(i: int, n: int) -> list[int]:
    return np.random.default_rng(100 + i).integers(3, 512, n).tolist()


def evict_all(llm, n: int = 3) -> None:
    """Distinct 24-token prompts: with 6 usable pages, every earlier cached page is evicted."""
    llm.generate([question(50 + i, 24) for i in range(n)], GREEDY)


def tokens(out) -> list[int]:
    return list(out.token_ids)


# ---- HostKVTier alone (no JAX) ----------------------------------------------------------
def page(key: int, parent=None, released_s: float = 0.0) -> CachedPage:
    return CachedPage(key, parent, (key, key + 1), ("rev", None, "salt"), released_s)


def small_tier(num_slots: int) -> HostKVTier:
    return HostKVTier(num_slots, 2, {"k_pages": ((1, 1, 2, 3), np.float32)})


def land(tier: HostKVTier) -> list[int]:
    """Complete every queued save with page content = its device page id."""
    saves = tier.take_saves()
    n = len(saves)
    arrays = {"k_pages": np.zeros((1, 1, n, 2, 3), np.float32)}
    for j, (device_page, _) in enumerate(saves):
        arrays["k_pages"][:, :, j] = device_page
    tier.write([e for _, e in saves], arrays)
    return [p for p, _ in saves]


def test_tier_saving_entries_are_not_hit_until_their_bytes_land():
    tier = small_tier(4)
    assert tier.offer(5, page(10))
    assert tier.get(10) is None  # SAVING
    assert land(tier) == [5]
    entry = tier.get(10)
    assert entry is not None and tier.read([entry])["k_pages"].max() == 5
    assert not tier.offer(6, page(10))  # already here: touched, no second copy
    assert tier.take_saves() == [] and tier.stats.saved_pages == 1
    tier.check_invariants()


def test_tier_full_evicts_least_recently_used_ready_entry_never_a_saving_one():
    tier = small_tier(2)
    tier.offer(1, page(10))
    tier.offer(2, page(11))
    land(tier)
    tier.queue_load(3, tier.get(10), now_s=1.0)  # 10 is now the most recently used
    tier.take_loads()
    assert tier.offer(4, page(12))  # evicts 11
    assert tier.get(11) is None and tier.get(10) is not None
    assert tier.offer(5, page(13))  # 10 ready, 12 SAVING: evicts 10 ...
    assert tier.get(10) is None
    assert not tier.offer(6, page(14))  # ... and now only SAVING entries: dropped
    assert tier.stats.evictions == 2 and tier.stats.dropped_offers == 1
    assert land(tier) == [4, 5]
    assert tier.num_used_slots <= tier.num_slots and tier.bytes_used <= tier.bytes_total
    tier.check_invariants()


def test_tier_load_of_an_entry_dropped_after_its_lookup_reads_its_bytes():
    tier = small_tier(1)
    tier.offer(1, page(10))
    land(tier)
    hit = tier.get(10)
    assert tier.offer(2, page(11))  # the admission's own allocation evicts it: slot reused
    tier.queue_load(3, hit, now_s=1.0)
    [(device_page, entry)] = tier.take_loads()
    assert device_page == 3 and tier.read([entry])["k_pages"].max() == 1  # not yet 2
    assert land(tier) == [2] and tier.get(11).slot == entry.slot
    tier.check_invariants()


def test_tier_expire_clear_and_collisions():
    tier = small_tier(3)
    tier.offer(1, page(10, released_s=0.0))
    tier.offer(2, page(11, released_s=5.0))
    land(tier)
    assert tier.expire(now_s=6.0, ttl_s=3.0) == 1  # 10 released at 0 s
    assert tier.get(10) is None and tier.get(11) is not None
    other = dataclasses.replace(page(11), token_ids=(7, 7))  # same key, other content
    assert tier.offer(3, other)  # replaces the old entry
    assert tier.get(11) is None
    tier.offer(4, page(12))
    tier.clear()
    land(tier)  # saves dispatched before the clear land nowhere
    assert tier.num_used_slots == 0 and tier.get(12) is None
    tier.check_invariants()


def test_tier_events_name_the_cpu_medium():
    tier = small_tier(1)
    tier.events = KvEventRecorder(block_size=2)
    tier.offer(1, page(10))
    land(tier)
    tier.offer(2, page(11))  # evicts 10
    land(tier)
    kinds = [(e[0], e[-1]) for e in tier.events.take()]
    assert kinds == [("BlockStored", "CPU"), ("BlockRemoved", "CPU"), ("BlockStored", "CPU")]


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match="host_kv_gib"):
        EngineConfig(model="tiny", host_kv_gib=-1)
    with pytest.raises(ValueError, match="prefix_caching"):
        EngineConfig(model="tiny", host_kv_gib=1, prefix_caching=False)


# ---- the engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm_host(tiny_model):
    return LLM(tiny_model, host_kv_gib=HOST_GIB, **OPTS)


@pytest.fixture(scope="module")
def llm_device_only(tiny_model):
    return LLM(tiny_model, **OPTS)


@pytest.fixture(scope="module")
def llm_no_cache(tiny_model):
    return LLM(tiny_model, prefix_caching=False, **OPTS)


def assert_idle(llm) -> None:
    core = llm.engine
    core.pool.check_invariants()  # the host tier's too
    assert core.pool.num_used_pages == 0 and not core.has_unfinished()


@pytest.mark.compile  # its own engines and step programs
def test_evicted_prefix_is_served_from_host_identical_to_recompute_and_no_cache(
    llm_host, llm_device_only, llm_no_cache
):
    core = llm_host.engine
    prompts = [BASE + question(i, 2) for i in range(3)]
    got, recomputed, plain = [], [], []
    for p in prompts:
        for llm in (llm_host, llm_device_only):
            llm.generate([BASE + question(99, 1)], GREEDY)  # cache the prefix
            evict_all(llm)  # and push it out of the device pool
        before = core.stats()
        got.append(tokens(llm_host.generate([p], GREEDY)[0]))
        after = core.stats()
        assert after["host_kv_hit_tokens"] - before["host_kv_hit_tokens"] == 24
        assert after["host_kv_loaded_pages"] - before["host_kv_loaded_pages"] == 3
        recomputed.append(tokens(llm_device_only.generate([p], GREEDY)[0]))
        plain.append(tokens(llm_no_cache.generate([p], GREEDY)[0]))
    assert got == recomputed == plain
    stats = core.stats()
    assert stats["host_kv_saved_pages"] > 0 and stats["host_kv_saved_bytes"] > 0
    assert stats["prefix_cache_hit_tokens"] >= stats["host_kv_hit_tokens"] >= 72
    assert stats["host_kv_bytes_used"] <= stats["host_kv_bytes_total"]
    assert llm_device_only.engine.stats()["host_kv_enabled"] is False
    assert_idle(llm_host)


@pytest.mark.compile  # its own engines and step programs
def test_mixed_batch_with_host_hits_matches_no_cache(llm_host, llm_no_cache):
    """Two requests at once, one reloading the prefix from host, one fresh, then one that
    hits the reloaded pages on the device."""
    llm_host.generate([BASE + question(98, 1)], GREEDY)
    evict_all(llm_host)
    hits = llm_host.engine.stats()["host_kv_hit_tokens"]
    prompts = [BASE + question(20, 2), question(21, 10), BASE + question(22, 2)]
    got = [tokens(o) for o in llm_host.generate(prompts, GREEDY)]
    want = [tokens(o) for o in llm_no_cache.generate(prompts, GREEDY)]
    assert got == want
    assert llm_host.engine.stats()["host_kv_hit_tokens"] >= hits + 24
    # the pages evict_all cached were saved in the launches that loaded BASE back
    again = [question(50 + i, 24) for i in range(3)]
    got = [tokens(o) for o in llm_host.generate(again, GREEDY)]
    assert got == [tokens(o) for o in llm_no_cache.generate(again, GREEDY)]
    assert_idle(llm_host)


@pytest.mark.compile  # its own engines and step programs
def test_reloaded_pages_equal_the_evicted_pages_bitwise(llm_host):
    core = llm_host.engine
    llm_host.generate([BASE + question(97, 1)], GREEDY)
    keys = [base_key(core, i) for i in range(3)]
    before = {k: device_page(core, core.pool.page_of_key(k)) for k in keys}
    evict_all(llm_host)
    assert all(core.pool.page_of_key(k) is None for k in keys)
    llm_host.generate([BASE + question(96, 1)], GREEDY)  # reloads them
    for k in keys:
        after = device_page(core, core.pool.page_of_key(k))
        for name in before[k]:
            np.testing.assert_array_equal(after[name], before[k][name])
    assert_idle(llm_host)


def base_key(core, i: int) -> int:
    """The prefix-cache key of BASE's page i (cached on the device now)."""
    tokens_i = tuple(BASE[i * PS : (i + 1) * PS])
    [key] = [c.key for c in core.pool.cached_pages if c.token_ids == tokens_i]
    return key


def device_page(core, page_id: int) -> dict[str, np.ndarray]:
    fields = ("k_pages", "v_pages", "k_scales", "v_scales")
    return {
        n: np.asarray(getattr(core.runner.state.kv, n)[:, :, page_id])
        for n in fields
        if getattr(core.runner.state.kv, n) is not None
    }


@pytest.mark.compile  # its own engines and step programs
def test_tiny_host_tier_keeps_its_bound_and_evicts_by_lru(tiny_model):
    llm = LLM(tiny_model, host_kv_gib=2.5 * 4096 / 2**30, **OPTS)  # 2 pages of 4 KiB
    tier = llm.engine.offload.tier
    assert tier.num_slots == 2
    for i in range(4):
        llm.generate([question(200 + i, 24)], GREEDY)
        assert tier.num_used_slots <= 2 and tier.bytes_used <= tier.bytes_total
    stats = llm.engine.stats()
    assert stats["host_kv_evictions"] > 0 and stats["host_kv_pages_used"] == 2
    assert_idle(llm)


@pytest.mark.compile  # its own engines and step programs
def test_cancelled_request_after_its_reload_frees_both_tiers_pages(llm_host):
    core = llm_host.engine
    llm_host.generate([BASE + question(95, 1)], GREEDY)
    evict_all(llm_host)
    loaded = core.stats()["host_kv_loaded_pages"]
    core.add_request(EngineRequest("cancel-me", BASE + question(94, 2), GREEDY))
    core.step()  # admitted: the prefix copied back, the rest prefilled
    assert core.stats()["host_kv_loaded_pages"] == loaded + 3
    core.abort_request("cancel-me")
    while core.has_unfinished():
        core.step()
    assert_idle(llm_host)


@pytest.mark.compile  # its own engines and step programs
def test_int8_kv_host_tier_matches_recompute(tiny_model):
    opts = {**OPTS, "kv_dtype": "int8"}
    host = LLM(tiny_model, host_kv_gib=HOST_GIB, **opts)
    plain = LLM(tiny_model, prefix_caching=False, **opts)
    assert set(host.engine.offload.tier.store) == {"k_pages", "v_pages", "k_scales", "v_scales"}
    host.generate([BASE + question(93, 1)], GREEDY)
    evict_all(host)
    p = BASE + question(92, 2)
    assert tokens(host.generate([p], GREEDY)[0]) == tokens(plain.generate([p], GREEDY)[0])
    assert host.engine.stats()["host_kv_hit_tokens"] == 24
    assert_idle(host)


@pytest.mark.compile  # its own engines and step programs
def test_kv_events_report_the_move_to_cpu_and_back(tiny_model):
    from engine.sched import kv_events

    llm = LLM(tiny_model, host_kv_gib=HOST_GIB, **OPTS)
    [recorder] = kv_events.attach(llm.engine)
    llm.generate([BASE + question(91, 1)], GREEDY)
    base_hash = kv_events.block_hash(base_key(llm.engine, 0))
    evict_all(llm)
    llm.generate([BASE + question(90, 1)], GREEDY)
    events = recorder.take()
    media = {(e[0], e[-1]) for e in events if e[0] != "AllBlocksCleared"}
    assert ("BlockStored", "CPU") in media and ("BlockRemoved", "GPU") in media
    stored_cpu = {h for e in events if e[0] == "BlockStored" and e[-1] == "CPU" for h in e[1]}
    assert base_hash in stored_cpu


def test_server_metrics_export_the_host_tier():
    from prometheus_client import generate_latest

    from serving.frontend.metrics import ServerMetrics

    metrics = ServerMetrics("tiny", "r1", compat="none")
    stats = {"host_kv_hit_tokens": 48, "host_kv_saved_bytes": 4096, "host_kv_bytes_used": 8192}
    metrics.observe_stats(stats, num_queued=0)
    metrics.observe_stats({**stats, "host_kv_hit_tokens": 64}, num_queued=0)
    text = generate_latest(metrics.registry).decode()
    assert 'pagedjax_host_kv_hits_tokens_total{model="tiny",revision="r1"} 64.0' in text
    assert 'pagedjax_host_kv_saved_bytes_total{model="tiny",revision="r1"} 4096.0' in text
    assert 'pagedjax_host_kv_bytes_used{model="tiny",revision="r1"} 8192.0' in text


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "args,message",
    [
        (["--model=mock", "--host_kv_gib=1"], "needs a real --model"),
        (["--model=tiny", "--host_kv_gib=1", "--noprefix_caching"], "needs --prefix_caching"),
        (["--model=tiny", "--host_kv_gib=-1"], "--host_kv_gib=-1"),
    ],
)
def test_server_flag_mistakes_are_usage_errors(args, message):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "serving.server", "--metrics_port=-1", *args],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]


@pytest.mark.compile  # its own engines and step programs
def test_prefix_cache_bench_host_tier_smoke(tiny_model):
    from benchmarks.prefix_cache_bench import HOST_SIZES, measure_host_tier, render_host_tier

    result = measure_host_tier(HOST_SIZES["smoke"], model=tiny_model)
    assert result["outputs_identical"]
    assert result["host_stats"]["host_kv_hit_tokens"] > 0
    # the host tier serves what the device-only engine recomputes
    assert min(result["cached_tokens"]["host"]) > max(result["cached_tokens"]["device"])
    assert "with host tier" in render_host_tier(result)


@pytest.mark.compile  # builds the copy programs of 4 page-count buckets
def test_warm_builds_every_copy_program_and_int8_pages_round_trip():
    import jax

    from configs.model_config import ModelConfig
    from engine.runner import compiles
    from engine.runner.kv_cache import PagedKVCache
    from engine.runner.kv_offload import KVOffload
    from engine.sched.page_pool import PagePool

    compiles.install()
    cfg = ModelConfig(name="t", num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2,
                      ffn_size=64, vocab_size=64, head_dim=16)  # fmt: skip
    kv = PagedKVCache.zeros(cfg, 9, 4, "int8", sharding=jax.devices()[0])
    rng = np.random.default_rng(0)
    kv = PagedKVCache(
        *(
            jax.device_put(rng.integers(-9, 9, x.shape).astype(x.dtype))
            for x in kv.__dict__.values()
        )
    )
    pool = PagePool(9, 4)
    offload = KVOffload.attach(pool, kv, 2**20, 8)
    assert offload.warm(kv) == 8  # gather + scatter of 1, 2, 4, 8 pages
    before, tier = compiles.count(), pool.host_tier
    original = {n: np.asarray(getattr(kv, n)) for n in tier.store}
    for i, p in enumerate([3, 5, 6]):
        tier.offer(p, CachedPage(100 + i, None, (i,), ()))
    offload.dispatch_saves(kv)
    offload.before_schedule(wait=True)
    for i, p in enumerate([1, 2, 4]):  # back into other pages
        tier.queue_load(p, tier.get(100 + i), now_s=0.0)
    kv = offload.flush(kv)
    for name, was in original.items():
        now = np.asarray(getattr(kv, name))
        np.testing.assert_array_equal(now[:, :, [1, 2, 4]], was[:, :, [3, 5, 6]])
    assert compiles.count() == before


@pytest.mark.compile  # its own engines (the step shapes of this module)
def test_chat_trace_bench_smoke_host_tier_serves_what_the_device_evicted(tiny_model):
    """The multi-turn chat trace on 6 device pages (working set 13): device only, a returning
    conversation finds at most the system prompt's page; with the host tier every page an
    earlier turn computed comes back, and every reply is the same."""
    from benchmarks.chat_trace_bench import SIZES, measure, render

    result = measure(SIZES["smoke"], model=tiny_model, warm=False)
    assert result["replies_identical"]
    [device], [host] = result["runs"]["device"], result["runs"]["host"]
    assert device["requests"] == host["requests"] == 12
    assert host["hit_rate_of_reusable"] == 1.0 > device["hit_rate_of_reusable"]
    assert host["host_hit_tokens"] > 0 and device["host_hit_tokens"] == 0
    assert host["tokens_computed"] < device["tokens_computed"]
    hs = result["host_stats"]
    assert 0 <= hs["host_kv_loads_hidden"] <= hs["host_kv_load_launches"] > 0
    assert "host tier / device only" in render(result)
