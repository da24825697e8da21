"""The `layers` proposer through the engine (tiny model, 2 layers): greedy spec on ==
spec off token for token on the mixed batch (stops inside runs, logprobs); the whole model
as its own draft (num_draft_layers = num_layers) accepts every draft, greedy and sampled,
which checks that the draft reuses the target's K/V and that q is the real distribution;
sampling: the first 3 tokens over many seeds have the spec-off distribution (chi-square);
a random workload with preemptions and cancellations returns every page."""

import pytest

from configs.spec_config import SpeculativeConfig
from engine import LLM, SamplingParams
from tests.test_spec_engine import OPTS, PROMPTS, assert_idle, check_same, reference  # noqa: F401
from tests.test_spec_sampling import PROMPT, homogeneity_pvalue

pytestmark = pytest.mark.compile  # builds its own engine configurations

K = 3
LAYERS = {"method": "layers", "num_speculative_tokens": K, "disable_by_batch_size": None}
N_SEEDS = 300
ALPHA = 1e-3


@pytest.fixture(scope="module")
def tiny_model():
    from models.registry import load_model

    return load_model("tiny")


def layers_llm(tiny_model, num_layers):
    return LLM(tiny_model, speculative=dict(LAYERS, num_draft_layers=num_layers), **OPTS)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_greedy_equals_spec_off(tiny_model, reference, num_layers):  # noqa: F811
    _, params, want = reference
    llm = layers_llm(tiny_model, num_layers)
    outs = llm.generate(PROMPTS, params)
    check_same(outs, want)
    s = llm.stats()
    assert s["spec_verify_steps"] > 0 and s["spec_drafted_tokens"] > 0
    assert sum(o.metrics.spec_drafted_tokens for o in outs) == s["spec_drafted_tokens"]
    if num_layers == 2:  # the model drafting for itself: every draft is its own argmax
        assert s["spec_accepted_tokens"] == s["spec_drafted_tokens"]
    assert_idle(llm)


def _sampled(llm, seeds, top_k=3):
    params = [SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, seed=s) for s in seeds]
    return [o.token_ids for o in llm.generate([PROMPT] * len(seeds), params)]


@pytest.fixture(scope="module")
def sampled(tiny_model):
    seeds = list(range(N_SEEDS))
    off = _sampled(LLM(tiny_model, **OPTS), seeds)
    on = layers_llm(tiny_model, 1)
    return off, _sampled(on, seeds), on


def test_sampling_first_three_tokens_have_the_spec_off_distribution(sampled):
    off, on, llm = sampled
    s = llm.stats()
    # q (1 layer) differs from p (2 layers): accepts and rejections both happen
    assert 0 < s["spec_accepted_tokens"] < s["spec_drafted_tokens"]
    for pos in range(3):
        a = [t[pos] for t in off]
        b = [t[pos] for t in on]
        assert len(a) == len(b) == N_SEEDS
        assert homogeneity_pvalue(a, b) > ALPHA, pos


def test_sampling_is_reproducible_per_seed(sampled, tiny_model):
    _, on, llm = sampled
    assert _sampled(llm, list(range(16))) == on[:16]


def test_whole_model_as_draft_accepts_every_sampled_draft(tiny_model):
    """q == p (same layers, same K/V, same transforms): min(1, p/q) = 1 everywhere."""
    llm = layers_llm(tiny_model, 2)
    _sampled(llm, list(range(12)), top_k=50)
    s = llm.stats()
    assert s["spec_drafted_tokens"] > 0
    assert s["spec_accepted_tokens"] >= 0.99 * s["spec_drafted_tokens"]


def test_config_errors_name_the_field(tiny_model):
    with pytest.raises(ValueError, match="num_draft_layers"):
        SpeculativeConfig(method="layers")
    with pytest.raises(ValueError, match="num_draft_layers"):
        SpeculativeConfig(method="ngram", num_draft_layers=2)
    with pytest.raises(ValueError, match=r"num_draft_layers=3 .* num_layers \(2\)"):
        layers_llm(tiny_model, 3)
    cfg = SpeculativeConfig.of("layers:k=2,layers=1")
    assert (cfg.num_draft_layers, cfg.describe()) == (1, "layers:k=2,layers=1")
