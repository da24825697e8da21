"""Subtle wrong speculative rules must fail the same chi-square test the real rule passes,
and the bonus token (position k, emitted when all k drafts are accepted) must follow p_k.

tests/test_spec_rule.py's only wrong-rule control accepts every draft, which any test
rejects. Here a rule family written in the test (`_rule`) has the exact rule as one
variant (it must pass: the harness is fair) and plausible mistakes as the others, each of
which must be rejected on the toy context-free targets (every emitted token at position j
must be distributed as p_j, given the draws that reached j):

    resample_from_p      on rejection draw from p_j instead of normalize(max(p_j - q_j, 0))
    bonus_from_previous  the bonus drawn from p_{k-1} (the wrong position) instead of p_k
    accept_with_p        accept x_j with probability p_j(x_j), ignoring q
    inverted_ratio       accept with probability min(1, q_j(x_j) / p_j(x_j))

NOTE: "accept with p/q without the min" is not a wrong rule in this form: with u uniform in
[0, 1), u < p/q and u < min(1, p/q) are the same event, so it is not among the variants."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from engine.spec.rule import accept_drafts

N_DRAWS = 120_000
V = 8
K = 2
ALPHA = 1e-3


def _normalize(x):
    x = np.asarray(x, np.float64)
    return (x / x.sum()).astype(np.float32)


def _targets():
    """p [K+1, V] different at every position (so a wrong position shows), q [K, V] a mix
    of p and noise (acceptance near 2/3, so ~50k of the draws reach the bonus)."""
    rng = np.random.default_rng(11)
    p = np.stack([_normalize(rng.random(V) ** 2) for _ in range(K + 1)])
    q = np.stack([_normalize(p[j] + 0.5 * _normalize(rng.random(V))) for j in range(K)])
    return p, q


def _pvalue(tokens: np.ndarray, p: np.ndarray) -> float:
    """Chi-square goodness of fit of tokens to p; a token with p = 0 gives 0. Cells expecting
    fewer than 5 draws are pooled."""
    p = np.asarray(p, np.float64)
    counts = np.bincount(tokens, minlength=len(p))
    if counts[p == 0].sum():
        return 0.0
    expected = p / p.sum() * counts.sum()
    small = expected < 5
    obs = np.r_[counts[~small], counts[small].sum()]
    exp = np.r_[expected[~small], expected[small].sum()]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp).pvalue)


def position_pvalues(n_acc, tokens, p) -> dict[str, float]:
    """p-values of position 0 (every draw), 1 (draws that accepted x_0) and the bonus
    (position K, draws that accepted all K drafts)."""
    n_acc, tokens = np.asarray(n_acc), np.asarray(tokens)
    assert (n_acc == K).sum() > 2000, "too few all-accepted draws to test the bonus"
    return {
        "first": _pvalue(tokens[:, 0], p[0]),
        "second": _pvalue(tokens[n_acc >= 1, 1], p[1]),
        "bonus": _pvalue(tokens[n_acc == K, K], p[K]),
    }


def _drafts_and_keys(key, q):
    kd, ka, kr = jax.random.split(key, 3)
    drafts = jax.random.categorical(kd, jnp.log(q), shape=(N_DRAWS, K)).astype(jnp.int32)
    return drafts, ka, kr


@functools.partial(jax.jit, static_argnames=("variant",))
def _rule(key, p, q, variant: str):
    """N_DRAWS speculative steps with the rule `variant` ("exact" or a mistake above)."""
    drafts, ka, kr = _drafts_and_keys(key, q)
    P = jnp.broadcast_to(p, (N_DRAWS, K + 1, V))
    Q = jnp.broadcast_to(q, (N_DRAWS, K, V))
    p_x = jnp.take_along_axis(P[:, :K], drafts[..., None], axis=-1)[..., 0]  # [N, K]
    q_x = jnp.take_along_axis(Q, drafts[..., None], axis=-1)[..., 0]  # [N, K]
    u = jax.random.uniform(ka, (N_DRAWS, K))  # [N, K]
    accepted = {
        "accept_with_p": u < p_x,
        "inverted_ratio": u * p_x < q_x,
    }.get(variant, u * q_x < p_x)
    n = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)  # [N]
    p_n = jnp.take_along_axis(P, n[:, None, None], axis=1)[:, 0]  # [N, V]
    q_pad = jnp.concatenate([Q, jnp.zeros((N_DRAWS, 1, V))], axis=1)  # [N, K+1, V]
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]  # [N, V]
    residual = p_n if variant == "resample_from_p" else jnp.maximum(p_n - q_n, 0.0)
    bonus_p = P[:, K - 1] if variant == "bonus_from_previous" else P[:, K]  # [N, V]
    weights = jnp.where((n == K)[:, None], bonus_p, residual)  # [N, V]
    weights = jnp.where(jnp.sum(weights, -1, keepdims=True) > 0, weights, p_n)
    extra = jax.random.categorical(kr, jnp.log(weights)).astype(jnp.int32)  # [N]
    tokens = jnp.concatenate([drafts, jnp.zeros((N_DRAWS, 1), jnp.int32)], axis=1)
    pos = jnp.arange(K + 1)[None, :]
    tokens = jnp.where(pos == n[:, None], extra[:, None], tokens)
    return n, jnp.where(pos > n[:, None], -1, tokens)


WRONG = ["resample_from_p", "bonus_from_previous", "accept_with_p", "inverted_ratio"]


def test_the_exact_variant_of_the_test_rule_passes():
    p, q = _targets()
    pv = position_pvalues(*_rule(jax.random.key(3), p, q, "exact"), p)
    assert min(pv.values()) > ALPHA, pv


@pytest.mark.parametrize("variant", WRONG)
def test_each_subtle_wrong_rule_is_rejected(variant):
    p, q = _targets()
    pv = position_pvalues(*_rule(jax.random.key(3), p, q, variant), p)
    assert min(pv.values()) < 1e-9, (variant, pv)


@jax.jit
def _engine_rule(key, p, q):
    drafts, ka, kr = _drafts_and_keys(key, q)
    keys = lambda k: jax.random.split(k, N_DRAWS * (K + 1)).reshape(N_DRAWS, K + 1)  # noqa: E731
    out = accept_drafts(
        jnp.broadcast_to(p, (N_DRAWS, K + 1, V)),
        jnp.broadcast_to(q, (N_DRAWS, K, V)),
        drafts,
        jnp.full((N_DRAWS,), K, jnp.int32),
        jnp.zeros((N_DRAWS,), bool),
        keys(ka),
        keys(kr),
    )
    return out.num_accepted, out.tokens


def test_engine_rule_keeps_every_position_including_the_bonus():
    """engine.spec.rule.accept_drafts on the same targets: positions 0, 1 and the bonus
    position K each follow p_j. Shown (2026-12-04) to catch, planted one at a time in
    accept_drafts: the bonus drawn from p_{k-1} (`residual = where(bonus, p[:, k - 1], ...)`,
    which only the bonus check sees) and resampling from p_n instead of the residual."""
    p, q = _targets()
    pv = position_pvalues(*_engine_rule(jax.random.key(5), p, q), p)
    assert min(pv.values()) > ALPHA, pv
