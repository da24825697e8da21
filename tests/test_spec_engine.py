"""Speculative decoding through the engine (tiny model): spec on == spec off for greedy
requests, token for token, with ngram drafts and with an oracle proposer whose drafts are
right or deliberately corrupted (so accepted runs, rejections, stops inside a run and
max_tokens all happen); logprobs are the target's; a random workload with a tiny pool
(preemptions) and cancellations returns every page.

One engine config (OPTS) for all tests, so the compiled step programs are shared."""

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from configs.engine_config import EngineConfig
from configs.spec_config import SpeculativeConfig
from engine import LLM, SamplingParams
from engine.api_types import EngineRequest
from engine.core import EngineCore
from models.registry import load_model
from tests.test_engine import TINY_OPTS, mixed_prompts
from tests.test_prefix_cache_engine import check_page_references

pytestmark = pytest.mark.compile  # builds its own engine configurations

K = 3
# prompt_lookup_min=1: the random tiny model never quotes its prompt, so only 1-grams match
SPEC = {"num_speculative_tokens": K, "disable_by_batch_size": None, "prompt_lookup_min": 1}
# 15 usable pages of 8 tokens: preemptions; 6 step shapes: few programs to compile
OPTS = dict(TINY_OPTS, num_pages=16, max_step_shapes=6)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_model():
    return load_model("tiny")


def repetitive_prompts(n, seed=1):
    """Prompts that repeat a phrase: ngram lookup finds drafts in them."""
    rng = np.random.default_rng(seed)
    return [[1] + rng.integers(3, 512, int(rng.integers(4, 10))).tolist() * 3 for _ in range(n)]


PROMPTS = repetitive_prompts(5) + mixed_prompts(4, seed=3)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Spec off: the plain greedy tokens, then a params list with stops inside the run
    (a stop id met mid-output, shorter max_tokens, logprobs) and its spec-off outputs."""
    off = LLM(tiny_model, **OPTS)
    plain = [o.token_ids for o in off.generate(PROMPTS, GREEDY)]
    params = []
    for i, toks in enumerate(plain):
        kw = dict(temperature=0, max_tokens=MAX_TOKENS)
        if i % 3 == 0:
            kw["stop_token_ids"] = [toks[7]]  # stops inside a speculative run
        if i % 3 == 1:
            kw["max_tokens"] = 5 + i
        if i % 4 == 2:
            kw["logprobs"] = 2
        params.append(SamplingParams(**kw))
    outs = off.generate(PROMPTS, params)
    return plain, params, outs


def oracle(plain, corrupt: float, seed=0):
    """Drafts = the true greedy continuation (spec off), each token corrupted with
    probability `corrupt`: exercises accepted runs and rejections at every position."""
    future = {tuple(p): p + t for p, t in zip(PROMPTS, plain)}
    rng = np.random.default_rng(seed)

    def propose(req, k):
        full = future[tuple(req.prompt_token_ids)]
        n = req.num_known_tokens
        drafts = list(full[n : n + k])
        return [(t + 1) % 512 if rng.random() < corrupt else t for t in drafts]

    return propose


def spec_llm(tiny_model, proposer=None):
    llm = LLM(tiny_model, speculative=SPEC, **OPTS)
    if proposer is not None:
        llm.engine.spec.proposer = proposer
    return llm


def check_same(outs, want):
    for o, w in zip(outs, want):
        assert (o.token_ids, o.finish_reason) == (w.token_ids, w.finish_reason)
        if w.logprobs is not None:
            for a, b in zip(o.logprobs, w.logprobs):
                assert a.token_id == b.token_id
                np.testing.assert_allclose(a.logprob, b.logprob, atol=1e-4)
                assert [i for i, _ in a.top] == [i for i, _ in b.top]


def assert_idle(llm):
    pool = llm.engine.pool
    pool.check_invariants()
    assert pool.num_used_pages == 0 and not llm.engine.has_unfinished()


def test_ngram_greedy_equals_spec_off(tiny_model, reference):
    _, params, want = reference
    llm = spec_llm(tiny_model)
    check_same(llm.generate(PROMPTS, params), want)
    s = llm.stats()
    assert s["spec_drafted_tokens"] > 0 and s["spec_verify_steps"] > 0
    assert sum(s["spec_accepted_hist"]) == s["spec_verified_seqs"]
    assert_idle(llm)


@pytest.mark.parametrize("corrupt", [0.0, 0.3])
def test_oracle_drafts_accept_reject_and_stop_inside_runs(tiny_model, reference, corrupt):
    plain, params, want = reference
    llm = spec_llm(tiny_model, oracle(plain, corrupt))
    outs = llm.generate(PROMPTS, params)
    check_same(outs, want)
    s = llm.stats()
    assert s["spec_accepted_tokens"] > 0
    if corrupt == 0.0:  # every draft right: all accepted, k + 1 tokens per verify
        assert s["spec_accepted_tokens"] == s["spec_drafted_tokens"]
        assert s["spec_accepted_hist"][K] > 0
    else:
        assert 0 < s["spec_accepted_tokens"] < s["spec_drafted_tokens"]
        assert s["spec_accepted_hist"][0] > 0
    drafted = sum(o.metrics.spec_drafted_tokens for o in outs)
    assert drafted == s["spec_drafted_tokens"]
    assert sum(o.metrics.spec_accepted_tokens for o in outs) == s["spec_accepted_tokens"]
    for o, p in zip(outs, params):
        assert len(o.token_ids) <= p.max_tokens
    assert_idle(llm)


def test_policy_turns_speculation_off_above_the_batch_size(tiny_model, reference):
    plain, params, want = reference
    llm = LLM(tiny_model, speculative=dict(SPEC, disable_by_batch_size=2), **OPTS)
    llm.engine.spec.proposer = oracle(plain, 0.0)
    check_same(llm.generate(PROMPTS, params), want)
    s = llm.stats()
    assert s["num_steps"] > s["spec_verify_steps"] + s["spec_plain_steps"]  # overlapped ones
    assert s["spec_verify_steps"] > 0  # the tail of the batch (<= 2 running) speculated


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.of({"method": "medusa"})
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig.of("draft:k=2")  # a draft model is required
    with pytest.raises(ValueError, match="known keys"):
        SpeculativeConfig.of({"k": 3})
    assert SpeculativeConfig.of("ngram:k=2,disable_by_batch_size=none") == SpeculativeConfig(
        num_speculative_tokens=2, disable_by_batch_size=None
    )
    assert SpeculativeConfig.of("off") is None
    assert EngineConfig(speculative="ngram:k=5").speculative.num_speculative_tokens == 5


def drive_random_workload(core, requests, plain) -> dict[str, str]:
    """Runs (prompt index, arrival step, abort delay) requests through `core`, checking page
    references every step; every request ends exactly once with a prefix of its spec-off
    greedy tokens (all of them unless cancelled). Returns {request id: finish reason}."""
    tokens, reasons, step = {}, {}, 0
    last_arrival = max(at for _, at, _ in requests)
    while step <= last_arrival or core.has_unfinished():
        for i, (which, at, abort_after) in enumerate(requests):
            if at == step:
                core.add_request(EngineRequest(f"r{i}", PROMPTS[which], GREEDY))
                tokens[f"r{i}"] = []
            if abort_after is not None and at + abort_after == step:
                core.abort_request(f"r{i}")
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in reasons, "two outcomes for one request"
                reasons[out.request_id] = out.finish_reason
        check_page_references(core)
        step += 1
        assert step < 500, "the workload did not finish"
    assert len(reasons) == len(requests)
    for i, (which, _, _) in enumerate(requests):
        got, want = tokens[f"r{i}"], plain[which]
        assert got == want[: len(got)]
        if reasons[f"r{i}"] != "cancelled":
            assert got == want
    return reasons


# ---- randomized: preemptions (tiny pool), cancellations, every page back ---------------------
WORKLOAD_REQUEST = st.tuples(
    st.integers(0, len(PROMPTS) - 1),  # which prompt
    st.integers(0, 6),  # arrival step
    st.one_of(st.none(), st.integers(0, 8)),  # abort this many steps after arrival
)


@settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    requests=st.lists(WORKLOAD_REQUEST, min_size=3, max_size=8), corrupt=st.sampled_from([0.0, 0.4])
)
def test_random_workload_tiny_pool_returns_every_page(tiny_model, reference, requests, corrupt):
    plain = reference[0]
    # 15 usable pages of 8 tokens for up to 8 requests of up to ~47 tokens: preemptions.
    core = EngineCore(tiny_model, EngineConfig(model="tiny", speculative=SPEC, **OPTS))
    core.spec.proposer = oracle(plain, corrupt, seed=len(requests))
    reasons = drive_random_workload(core, requests, plain)
    s = core.stats()
    event(f"preemptions>0: {s['num_preemptions'] > 0}")
    event(f"cancelled>0: {'cancelled' in reasons.values()}")
    event(f"accepted>0: {s['spec_accepted_tokens'] > 0}")
    assert core.pool.num_free_pages == core.pool.num_pages - 1  # every page is back
    assert core.pool.num_used_pages == 0
