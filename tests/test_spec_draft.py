"""The `draft` proposer through the engine (tiny model): a draft model with its own paged
KV cache. The target as its own draft accepts every draft (greedy and sampled); a
different draft (perturbed weights, same tokenizer) keeps greedy output token for
token with accepts and rejections; a random workload with preemptions (tiny pool) and
cancellations returns every page; a draft with another tokenizer is refused by name."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from configs.engine_config import EngineConfig
from engine import LLM, SamplingParams
from engine.core import EngineCore
from engine.spec.draft import DraftModel, DraftTokenizerError, check_draft
from models.registry import load_model
from tests.test_spec_engine import (  # noqa: F401
    GREEDY,
    OPTS,
    PROMPTS,
    WORKLOAD_REQUEST,
    assert_idle,
    check_same,
    drive_random_workload,
    reference,
)

pytestmark = pytest.mark.compile  # builds its own engine configurations

K = 3
DRAFT = {
    "method": "draft",
    "draft_model": "tiny",
    "num_speculative_tokens": K,
    "disable_by_batch_size": None,
}


@pytest.fixture(scope="module")
def tiny_model():
    return load_model("tiny")


@pytest.fixture(scope="module")
def other_draft(tiny_model):
    """Same tokenizer, weights 0.95 * target + 0.05 * another random model: its greedy
    argmax agrees with the target's on ~60% of positions (a fully different random model
    agrees on none), so drafts are both accepted and rejected."""
    other = load_model("tiny", seed=1)
    mix = lambda a, b: 0.95 * a + 0.05 * b if jnp.issubdtype(a.dtype, jnp.floating) else a
    return dataclasses.replace(
        tiny_model, params=jax.tree.map(mix, tiny_model.params, other.params)
    )


def with_draft(core, draft):
    """Swap in another draft model (before any request: its cache starts empty)."""
    core.spec.draft = DraftModel(core.model, draft, core.runner)


def test_target_as_its_own_draft_accepts_everything(tiny_model, reference):  # noqa: F811
    _, params, want = reference
    llm = LLM(tiny_model, speculative=DRAFT, **OPTS)
    check_same(llm.generate(PROMPTS, params), want)
    s = llm.stats()
    assert s["spec_drafted_tokens"] > 0
    assert s["spec_accepted_tokens"] == s["spec_drafted_tokens"]
    sampled = [SamplingParams(temperature=1.0, top_k=50, max_tokens=12, seed=i) for i in range(4)]
    llm.generate(PROMPTS[:4], sampled)
    s2 = llm.stats()
    drafted = s2["spec_drafted_tokens"] - s["spec_drafted_tokens"]
    accepted = s2["spec_accepted_tokens"] - s["spec_accepted_tokens"]
    assert drafted > 0 and accepted >= 0.99 * drafted  # q == p: min(1, p/q) = 1
    assert_idle(llm)


def test_other_draft_keeps_greedy_output(tiny_model, other_draft, reference):  # noqa: F811
    _, params, want = reference
    llm = LLM(tiny_model, speculative=DRAFT, **OPTS)
    with_draft(llm.engine, other_draft)
    check_same(llm.generate(PROMPTS, params), want)
    s = llm.stats()
    assert 0 < s["spec_accepted_tokens"] < s["spec_drafted_tokens"]
    assert_idle(llm)


@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(requests=st.lists(WORKLOAD_REQUEST, min_size=3, max_size=8))
def test_random_workload_tiny_pool_returns_every_page(
    tiny_model,
    other_draft,
    reference,  # noqa: F811
    requests,
):
    plain = reference[0]
    core = EngineCore(tiny_model, EngineConfig(model="tiny", speculative=DRAFT, **OPTS))
    with_draft(core, other_draft)
    drive_random_workload(core, requests, plain)  # the draft cache stays right throughout
    assert core.pool.num_free_pages == core.pool.num_pages - 1  # every page is back
    assert core.pool.num_used_pages == 0


def test_a_draft_with_another_tokenizer_is_refused():
    def model(name, tok_hash, vocab=512):
        ident = types.SimpleNamespace(name=name, tokenizer_hash=tok_hash)
        return types.SimpleNamespace(identity=ident, config=types.SimpleNamespace(vocab_size=vocab))

    with pytest.raises(DraftTokenizerError) as e:
        check_draft(model("target", "sha256:aaa"), model("draft", "sha256:bbb"))
    msg = str(e.value)
    assert "speculative.draft_model='draft'" in msg
    assert "sha256:aaa" in msg and "sha256:bbb" in msg and "tokenizer_hash" in msg
    with pytest.raises(ValueError, match="vocab_size 256"):
        check_draft(model("target", "h"), model("draft", "h", vocab=256))
    check_draft(model("target", "h"), model("draft", "h"))  # same tokenizer: accepted
