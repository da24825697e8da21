"""The speculative acceptance rule (engine/spec/rule.py) keeps the target distribution.

Toy vocabularies, context-free targets (p_j does not depend on earlier tokens), so every
emitted token at position j must be distributed as p_j: the first token always, the second
one among the draws that accepted the first draft. Each case draws N_DRAWS times in one
jitted call and runs a chi-square goodness-of-fit test (p-value > 0.001); the same test
must reject a deliberately wrong rule (accept every draft)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from engine.sampling.sampler import SamplingTensors, sample
from engine.spec.rule import (
    accept_all_drafts_wrong,
    accept_drafts,
    accept_point_mass_drafts,
    target_probs,
)

N_DRAWS = 120_000
V = 8
K = 2
ALPHA = 1e-3


def _normalize(x):
    x = np.asarray(x, np.float64)
    return (x / x.sum()).astype(np.float32)


def _cases():
    rng = np.random.default_rng(0)
    random_p = [_normalize(rng.random(V)) for _ in range(K + 1)]
    random_q = [_normalize(rng.random(V)) for _ in range(K)]
    half = np.r_[np.ones(V // 2), np.zeros(V // 2)]
    q_zero_where_p = [_normalize(half), _normalize(half[::-1] + 0.1 * half)]
    p_zero_where_q = [_normalize(half[::-1]), _normalize(rng.random(V) * half), _normalize(half)]
    peaked = _normalize(np.r_[50.0, np.ones(V - 1)])
    flat = _normalize(np.ones(V))
    return {
        "random": (random_p, random_q),
        "q=0 where p>0": ([_normalize(rng.random(V))] * (K + 1), q_zero_where_p),
        "p=0 where q>0": (p_zero_where_q, [_normalize(rng.random(V))] * K),
        "peaked p, flat q": ([peaked] * (K + 1), [flat] * K),
        "flat p, peaked q": ([flat] * (K + 1), [peaked] * K),
    }


@jax.jit
def _draw(key, p, q):
    """N_DRAWS independent speculative steps: drafts ~ q_j, then the rule."""
    kd, ka, kr = jax.random.split(key, 3)
    drafts = jax.random.categorical(kd, jnp.log(q), shape=(N_DRAWS, K)).astype(jnp.int32)
    return _apply(accept_drafts, ka, kr, p, q, drafts)


def _apply(rule, ka, kr, p, q, drafts):
    P = jnp.broadcast_to(p, (N_DRAWS, K + 1, V))
    Q = None if q is None else jnp.broadcast_to(q, (N_DRAWS, K, V))
    keys = lambda k: jax.random.split(k, N_DRAWS * (K + 1)).reshape(N_DRAWS, K + 1)
    out = rule(
        P,
        Q,
        drafts,
        jnp.full((N_DRAWS,), K, jnp.int32),
        jnp.zeros((N_DRAWS,), bool),
        keys(ka),
        keys(kr),
    )
    return out.num_accepted, out.tokens


@jax.jit
def _draw_wrong(key, p, q):
    kd, ka, kr = jax.random.split(key, 3)
    drafts = jax.random.categorical(kd, jnp.log(q), shape=(N_DRAWS, K)).astype(jnp.int32)
    return _apply(accept_all_drafts_wrong, ka, kr, p, q, drafts)


def chi2_pvalue(tokens: np.ndarray, p: np.ndarray) -> float:
    """Goodness of fit of the observed tokens to p. Tokens where p == 0 must never occur."""
    counts = np.bincount(tokens, minlength=len(p))
    assert counts[p == 0].sum() == 0, f"tokens with p = 0 emitted: {counts}"
    return _chisquare(counts, p)


def _chisquare(counts: np.ndarray, p: np.ndarray) -> float:
    """p-value of counts against p; cells expecting fewer than 5 draws are pooled into one."""
    p = np.asarray(p, np.float64)
    expected = p / p.sum() * counts.sum()
    small = expected < 5
    obs = np.r_[counts[~small], counts[small].sum()]
    exp = np.r_[expected[~small], expected[small].sum()]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp).pvalue


def _positions_pvalues(n_acc, tokens, p):
    n_acc, tokens = np.asarray(n_acc), np.asarray(tokens)
    first = chi2_pvalue(tokens[:, 0], p[0])
    second = chi2_pvalue(tokens[n_acc >= 1, 1], p[1])
    return first, second


@pytest.mark.parametrize("case", list(_cases()))
def test_emitted_tokens_follow_the_target(case):
    p_list, q_list = _cases()[case]
    p, q = np.stack(p_list), np.stack(q_list)
    n_acc, tokens = _draw(jax.random.key(1), p, q)
    first, second = _positions_pvalues(n_acc, tokens, p)
    assert first > ALPHA and second > ALPHA, (case, first, second)
    # Acceptance as theory says: P(accept x_0) = sum_x min(p_0(x), q_0(x)).
    accepted = float(np.mean(np.asarray(n_acc) >= 1))
    expected = float(np.minimum(p[0], q[0]).sum())
    assert abs(accepted - expected) < 5 * np.sqrt(expected * (1 - expected) / N_DRAWS) + 1e-3


@pytest.mark.parametrize("case", ["random", "peaked p, flat q", "flat p, peaked q"])
def test_the_same_test_detects_accept_all(case):
    p_list, q_list = _cases()[case]
    p, q = np.stack(p_list), np.stack(q_list)
    n_acc, tokens = _draw_wrong(jax.random.key(1), p, q)
    first, _ = _positions_pvalues(n_acc, tokens, p)
    assert first < 1e-9, (case, first)


def test_point_mass_draft_keeps_the_target():
    """A deterministic proposer (ngram): q is a point mass at the draft."""
    rng = np.random.default_rng(3)
    p = np.stack([_normalize(rng.random(V)) for _ in range(K + 1)])

    @jax.jit
    def draw(key):
        ka, kr = jax.random.split(key)
        drafts = jnp.tile(jnp.array([[3, 5]], jnp.int32), (N_DRAWS, 1))
        return _apply(accept_drafts, ka, kr, p, None, drafts)

    n_acc, tokens = draw(jax.random.key(2))
    first, second = _positions_pvalues(n_acc, tokens, p)
    assert first > ALPHA and second > ALPHA
    assert abs(float(np.mean(np.asarray(n_acc) >= 1)) - p[0][3]) < 0.01


def test_point_mass_rule_coupled_with_the_sampler_keeps_the_target():
    """The engine's form for ngram drafts: accept x_j iff the ordinary sampler drew x_j."""
    rng = np.random.default_rng(4)
    p = np.stack([_normalize(rng.random(V)) for _ in range(K + 1)])

    @jax.jit
    def draw(key):
        y = jax.random.categorical(key, jnp.log(p), shape=(N_DRAWS, K + 1)).astype(jnp.int32)
        drafts = jnp.tile(jnp.array([[3, 5]], jnp.int32), (N_DRAWS, 1))
        out = accept_point_mass_drafts(y, drafts, jnp.full((N_DRAWS,), K, jnp.int32))
        return out.num_accepted, out.tokens

    n_acc, tokens = draw(jax.random.key(7))
    first, second = _positions_pvalues(n_acc, tokens, p)
    assert first > ALPHA and second > ALPHA
    assert abs(float(np.mean(np.asarray(n_acc) >= 1)) - p[0][3]) < 0.01


def test_greedy_accepts_iff_argmax_and_corrects_with_argmax():
    p = np.zeros((3, K + 1, V), np.float32)
    p[:, 0, 2] = p[:, 1, 4] = p[:, 2, 6] = 1.0
    drafts = jnp.array([[2, 4], [2, 1], [7, 4]], jnp.int32)
    keys = jax.random.split(jax.random.key(0), 3 * (K + 1)).reshape(3, K + 1)
    out = accept_drafts(
        jnp.asarray(p), None, drafts, jnp.array([2, 2, 2]), jnp.ones(3, bool), keys, keys
    )
    assert np.asarray(out.num_accepted).tolist() == [2, 1, 0]
    assert np.asarray(out.tokens).tolist() == [[2, 4, 6], [2, 4, -1], [2, -1, -1]]


def test_fewer_drafts_than_k_draw_the_bonus_at_num_drafts():
    p = np.zeros((1, K + 1, V), np.float32)
    p[0, 0, 1] = p[0, 1, 5] = p[0, 2, 6] = 1.0
    keys = jax.random.split(jax.random.key(0), K + 1)[None]
    out = accept_drafts(
        jnp.asarray(p), None, jnp.array([[1, 0]]), jnp.array([1]), jnp.ones(1, bool), keys, keys
    )
    assert int(out.num_accepted[0]) == 1
    assert np.asarray(out.tokens)[0, :2].tolist() == [1, 5]


def _tensors(n, **rows):
    base = dict(
        temperature=np.ones(n, np.float32),
        top_k=np.zeros(n, np.int32),
        top_p=np.ones(n, np.float32),
        min_p=np.zeros(n, np.float32),
        repetition_penalty=np.ones(n, np.float32),
        presence_penalty=np.zeros(n, np.float32),
        frequency_penalty=np.zeros(n, np.float32),
        key_data=np.stack([np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32)], 1),
        step=np.zeros(n, np.int32),
        min_tokens=np.zeros(n, np.int32),
        stop_ids=np.full((n, 16), -1, np.int32),
    )
    base.update({k: np.full(n, v, base[k].dtype) for k, v in rows.items()})
    return SamplingTensors(**base)


@pytest.mark.parametrize(
    "transform",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=3),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=0.9, min_p=0.2),
    ],
)
def test_target_probs_is_what_the_sampler_draws_from(transform):
    """p after the request's transforms == the empirical distribution of engine.sampling.sampler."""
    n, vocab = 60_000, 300  # vocab > BLOCK: the hierarchical draw crosses blocks
    logits = jnp.asarray(np.random.default_rng(5).normal(size=vocab) * 2, jnp.float32)
    tensors = _tensors(n, **transform)
    p = np.asarray(target_probs(logits[None], _tensors(1, **transform)))[0]
    tokens = jax.jit(lambda lg, t: sample(jnp.broadcast_to(lg, (n, vocab)), t).tokens)(
        logits, tensors
    )
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    assert counts[p == 0].sum() == 0  # filtered-out tokens are never drawn
    assert _chisquare(counts, p) > ALPHA
