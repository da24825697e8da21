"""Overlapped steps (EngineConfig.async_scheduling, the default) against the synchronous loop,
the fixed shape set, and "nothing compiles after warm-up" (issues 20 and 21.3).

The overlapped engine dispatches step N+1 before it reads step N's tokens; its outputs must
be the synchronous engine's, token for token and character for character, on a workload that
mixes greedy and seeded sampling, penalties, logprobs, stop ids and stop strings, min_tokens,
cancellations, preemption (a tiny page pool) and prefix-cache hits."""

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from configs.engine_config import EngineConfig, SchedulerConfig
from engine.api_types import EngineRequest
from engine.batch.builder import BatchShape
from engine.core import EngineCore
from engine.runner.shapes import ShapeSet, reachable_shapes, step_cost, step_shapes
from engine.sampling.params import SamplingParams

OPTS = dict(
    page_size=8, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=32, max_model_len=256
)


def _params(i: int, stop_id: int) -> SamplingParams:
    kinds = [
        SamplingParams(temperature=0, max_tokens=14),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=100 + i),
        SamplingParams(temperature=0, max_tokens=12, frequency_penalty=1.5, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=10, seed=7 + i, logprobs=2),
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=(stop_id,), min_tokens=2),
        SamplingParams(temperature=0.7, top_k=20, max_tokens=12, seed=i, stop=("a", "e")),
    ]
    return kinds[i % len(kinds)]


def _workload(n: int = 18, seed: int = 0):
    rng = np.random.default_rng(seed)
    shared = [1] + rng.integers(3, 512, 23).tolist()  # 3 full pages of 8: prefix-cache hits
    prompts = []
    for i in range(n):
        tail = rng.integers(3, 512, int(rng.integers(1, 40))).tolist()
        prompts.append(shared + tail if i % 3 == 0 else [1] + tail)
    return prompts


def _drive(core: EngineCore, prompts, stop_id: int, cancel=(4, 11)) -> dict:
    """Adds requests over the first steps, cancels `cancel` at step 5, runs to the end.
    Returns request id -> (token ids, text, finish reason, number of logprobs)."""
    out = {f"r{i}": ([], "", None, 0) for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    for step in itertools.count():
        for i, p in pending[:3]:
            core.add_request(EngineRequest(f"r{i}", p, _params(i, stop_id)))
        pending = pending[3:]
        if step == 5:
            for i in cancel:
                core.abort_request(f"r{i}")
        for o in core.step():
            toks, text, reason, nlp = out[o.request_id]
            assert reason is None, f"{o.request_id}: output after it finished"
            out[o.request_id] = (
                toks + o.new_token_ids,
                text + o.new_text,
                o.finish_reason if o.finished else None,
                nlp + len(o.logprobs or []),
            )
        if not pending and not core.has_unfinished():
            break
        assert step < 500
    core.pool.check_invariants()
    assert core.pool.num_used_pages == 0
    return out


@pytest.fixture(scope="module")
def stop_id(tiny_model):
    core = EngineCore(tiny_model, EngineConfig(model="tiny", num_pages=200, **OPTS))
    core.add_request(
        EngineRequest("probe", [1, 10, 11, 12], SamplingParams(temperature=0, max_tokens=6))
    )
    toks = []
    while core.has_unfinished():
        toks += [t for o in core.step() for t in o.new_token_ids]
    return toks[3]  # a token greedy decoding reaches: some requests stop on it


@pytest.mark.compile
@pytest.mark.parametrize("num_pages", [200, 20])  # 20: a tiny pool, preemptions
def test_overlapped_outputs_equal_synchronous(tiny_model, stop_id, num_pages):
    prompts = _workload()
    runs = {}
    for overlap in (False, True):
        cfg = EngineConfig(model="tiny", num_pages=num_pages, async_scheduling=overlap, **OPTS)
        core = EngineCore(tiny_model, cfg)
        runs[overlap] = (_drive(core, prompts, stop_id), core.stats())
    (sync, sync_stats), (over, over_stats) = runs[False], runs[True]
    for rid in sync:
        if sync[rid][2] == "cancelled" or over[rid][2] == "cancelled":
            assert rid in ("r4", "r11"), rid
            continue
        assert over[rid] == sync[rid], rid
    reasons = {v[2] for v in sync.values()}
    assert {"stop", "length", "cancelled"} <= reasons
    assert over_stats["prefix_cache_hit_tokens"] > 0
    if num_pages == 20:
        assert sync_stats["num_preemptions"] > 0 and over_stats["num_preemptions"] > 0
    # At most one wasted step per request: overlap never runs far ahead.
    assert over_stats["num_steps"] <= sync_stats["num_steps"] + len(prompts)


@pytest.mark.compile
def test_synchronous_engine_matches_overlapped_on_greedy_batches(tiny_model):
    prompts = _workload(12, seed=3)
    params = SamplingParams(temperature=0, max_tokens=10)
    got = []
    for overlap in (False, True):
        core = EngineCore(
            tiny_model, EngineConfig(model="tiny", num_pages=200, async_scheduling=overlap, **OPTS)
        )
        for i, p in enumerate(prompts):
            core.add_request(EngineRequest(f"g{i}", p, params))
        toks = {f"g{i}": [] for i in range(len(prompts))}
        while core.has_unfinished():
            for o in core.step():
                toks[o.request_id] += o.new_token_ids
        got.append(toks)
    assert got[0] == got[1]


# Nothing compiles after warm-up on a random workload: tests/test_warmup_shapes.py (a
# coarser shape set, padding in every dimension, more request kinds than this file had).


# ---------------------------------------------------------------- the shape set (no device)

_CONFIGS = [
    SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=8192),
    SchedulerConfig(page_size=8, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=32),
    SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=512, max_model_len=2048),
    SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=24, prefill_chunk_size=12),
]


@pytest.mark.parametrize("padded_attention", [True, False])
@pytest.mark.parametrize("sc", _CONFIGS)
def test_shape_set_is_small_and_holds_every_reachable_shape(sc, padded_attention):
    every = reachable_shapes(sc)
    decode_only = {s for s in every if s.num_prefill_tokens == 0}
    for max_shapes in (1, 2, 8, 32, 64, 10_000):
        shapes = ShapeSet.for_config(sc, max_shapes, padded_attention=padded_attention)
        assert len(shapes) <= max_shapes  # --warmup_max_shapes is honoured
        assert max(every) in shapes.shapes
        if len(every) <= max_shapes:
            assert sorted(shapes.shapes) == every
        for need in every:  # every bucketed batch fits a shape of the set
            assert shapes.fit(need).fits(need)
        if max_shapes >= 2:  # a decode-only step is never padded with a prefill group
            assert all(shapes.fit(s).num_prefill_tokens == 0 for s in decode_only)


@settings(max_examples=60, deadline=None)
@given(
    sd=st.integers(0, 32),
    tp=st.integers(0, 512),
    sp=st.integers(1, 32),
    pages=st.integers(1, 512),
    max_shapes=st.sampled_from([8, 64, 200]),
    padded=st.booleans(),
)
def test_fit_is_the_cheapest_shape_that_holds_the_batch(sd, tp, sp, pages, max_shapes, padded):
    sc = _CONFIGS[0]
    if tp == 0:
        sp = 0
    sp = min(sp, max(tp // 2, 0))
    if sd == 0 and tp == 0:
        sd = 1
    need = BatchShape(sd, tp, sp, pages, min(tp, sc.prefill_chunk_size))
    shapes = ShapeSet(step_shapes(sc, max_shapes, padded_attention=padded), sc.page_size, padded)
    got = shapes.fit(need)
    assert got.fits(need) and got in shapes.shapes
    cost = lambda s: step_cost(s, 16, padded)  # noqa: E731
    cheaper = [s for s in shapes.shapes if s.fits(need) and cost(s) < cost(got)]
    if tp == 0:  # a decode-only step may keep a decode-only shape over a cheaper prefill one
        cheaper = [s for s in cheaper if s.num_prefill_tokens == 0]
    assert cheaper == []


def test_a_batch_larger_than_the_largest_shape_is_refused():
    shapes = ShapeSet([BatchShape(4, 0, 0, 4, 1)], page_size=16)
    with pytest.raises(ValueError, match="no compiled step shape"):
        shapes.fit(dataclasses.replace(BatchShape(4, 0, 0, 4, 1), num_decode=5))


def test_compile_counts_reach_the_server_metrics():
    from serving.frontend.metrics import ServerMetrics

    m = ServerMetrics("tiny", "rev")
    m.observe_stats({"compiles_total": 5, "compiles_after_warmup": None}, 0)
    m.observe_stats({"compiles_total": 7, "compiles_after_warmup": 1}, 0)
    text = m.exposition().decode()
    assert 'pagedjax_compiles_total{model="tiny",revision="rev"} 7.0' in text
    assert 'pagedjax_compiles_after_warmup_total{model="tiny",revision="rev"} 1.0' in text
