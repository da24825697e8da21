"""Sampling end to end with speculation (tiny model): over many seeds, the first 3 tokens
generated with top-k sampling have the same distribution with and without speculation
(chi-square test of homogeneity per position, p-value > 0.001), and, since the engine
couples the point-mass rule with the request's own sampler, they are even the same tokens
seed for seed. The drafts are the greedy continuation (often right, often wrong), so
accepts and rejections both happen inside the engine."""

import numpy as np
import pytest
from scipy import stats

from engine import LLM, SamplingParams
from tests.test_spec_engine import OPTS, SPEC

pytestmark = pytest.mark.compile  # builds its own engine configurations

N_REQUESTS = 300
PROMPT = [1, 40, 41, 42, 43, 40, 41, 42, 43]
ALPHA = 1e-3


def _params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=seed)


def _run(llm, seeds):
    return [o.token_ids for o in llm.generate([PROMPT] * len(seeds), [_params(s) for s in seeds])]


@pytest.fixture(scope="module")
def outputs(tiny_model):
    off = LLM(tiny_model, **OPTS)
    greedy = off.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3))[0].token_ids
    on = LLM(tiny_model, speculative=SPEC, **OPTS)
    # The greedy continuation of the prompt as drafts, whatever was sampled so far.
    on.engine.spec.proposer = lambda req, k: greedy[req.num_output_tokens :][:k]
    seeds = list(range(N_REQUESTS))
    return _run(off, seeds), _run(on, seeds), on


@pytest.fixture(scope="module")
def tiny_model():
    from models.registry import load_model

    return load_model("tiny")


def homogeneity_pvalue(a: list[int], b: list[int]) -> float:
    """Chi-square test that two samples of token ids come from one distribution; values
    seen fewer than 10 times in all are pooled into one cell."""
    values, counts = np.unique(a + b, return_counts=True)
    common = set(values[counts >= 10].tolist())
    cell = lambda xs: (
        [sum(x == v for x in xs) for v in sorted(common)] + [sum(x not in common for x in xs)]
    )
    table = np.array([cell(a), cell(b)])
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return stats.chi2_contingency(table).pvalue


def test_first_three_tokens_have_the_same_distribution(outputs):
    off, on, llm = outputs
    s = llm.stats()
    assert s["spec_accepted_tokens"] > 0 and s["spec_accepted_tokens"] < s["spec_drafted_tokens"]
    for pos in range(3):
        a = [t[pos] for t in off if len(t) > pos]
        b = [t[pos] for t in on if len(t) > pos]
        assert len(a) == len(b) == N_REQUESTS
        assert homogeneity_pvalue(a, b) > ALPHA, pos


def test_speculation_differs_from_a_wrong_sample(outputs):
    """The test above can fail: a sample from another distribution (the off run shifted to
    a different top-k) is told apart."""
    off, _, _ = outputs
    other = LLM(outputs[2].model, **OPTS)
    shifted = [
        o.token_ids
        for o in other.generate(
            [PROMPT] * N_REQUESTS,
            [
                SamplingParams(temperature=1.0, top_k=6, max_tokens=1, seed=s)
                for s in range(N_REQUESTS)
            ],
        )
    ]
    assert homogeneity_pvalue([t[0] for t in off], [t[0] for t in shifted]) < ALPHA


def test_seeded_sampling_equals_spec_off_token_for_token(outputs):
    """Drafts are accepted iff the request's own sampler draws them (engine/spec/rule.py's
    coupled form), so a seeded request emits what it would without speculation."""
    off, on, _ = outputs
    assert on == off


def test_seeded_requests_are_reproducible_with_speculation(outputs, tiny_model):
    _, on, llm = outputs
    again = _run(llm, list(range(24)))
    assert again == on[:24]
