"""The exact speculative acceptance rule (Leviathan et al. 2023; Chen et al. 2023), as pure
JAX functions over fixed shapes, and the target distribution it needs.

For one speculating sequence with k drafted tokens x_0..x_{k-1} (Sv sequences, V vocab):

    p [Sv, k+1, V]  target probabilities at the k+1 verified positions (position j predicts
                    the token after x_{j-1}; position k is the bonus position)
    q [Sv, k, V]    draft probabilities the drafts were drawn from (None: point masses at
                    the drafts, a deterministic proposer such as ngram)

    for j in 0..k-1:   accept x_j with probability min(1, p_j(x_j) / q_j(x_j))
                       on the first rejection: emit y ~ normalize(max(0, p_j - q_j)), stop
    all k accepted:    emit a bonus y ~ p_k

so a step emits n accepted drafts plus one more token (1..k+1 tokens), and every emitted
token has exactly the target's distribution given the tokens before it. Greedy rows
(temperature 0): accept x_j iff x_j == argmax p_j; the correction / bonus is argmax p_j,
so speculative greedy equals plain greedy token for token.

p (and q, for a model proposer) must be the distributions AFTER the request's own sampling
transforms, so that speculative sampling equals ordinary sampling with the same parameters:
`target_probs` applies the engine sampler's transforms (engine/sampling/sampler.py: min_tokens ban,
temperature, top-k, top-p, min-p, with the same candidate set and thresholds), row by row.
Repetition/presence/frequency penalties change with every accepted token, so rows that use
them do not speculate (engine/spec/decode.py); they are plain decodes.

Two forms:
  - `accept_drafts(p, q, ...)`: the rule for any q, what the engine runs for the model
    proposers "draft" and "layers" (engine/spec/step.py), tested on toy vocabularies
    (tests/test_spec_rule.py).
  - `accept_point_mass_drafts(sampled, drafts, ...)`: what the engine runs for ngram's
    point-mass drafts. The request's own sampler draws y_j at every verified position
    (same seed, output index, transforms and candidate set as a plain step); x_j is
    accepted iff y_j == x_j, and the first mismatching y_j is the correction. This is the
    rule above for q = point mass (P(accept) = p(x); y given y != x is the residual), and
    it emits exactly the tokens plain decoding would: seeded sampling stays reproducible
    whether a token came from a speculative step or a plain one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from engine.sampling.sampler import (
    DEFAULT_MAX_CANDIDATES,
    SamplingTensors,
    argmax_and_max,
    ban_stop_ids_before_min_tokens,
    top_candidates,
    top_k_top_p_threshold,
)

Array = jax.Array
_NEG_INF = float("-inf")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AcceptResult:
    num_accepted: Array  # [Sv] int32, accepted drafts n in [0, num_drafts]
    tokens: Array  # [Sv, k+1] int32: [:, :n] drafts, [:, n] correction/bonus, then -1


def processed_logits(logits: Array, tensors: SamplingTensors) -> Array:
    """[R, V] the sampler's processed logits (min_tokens ban; penalties never speculate):
    what logprobs are reported under and greedy picks from."""
    return ban_stop_ids_before_min_tokens(logits.astype(jnp.float32), tensors)


def target_probs(
    logits: Array, tensors: SamplingTensors, max_candidates: int = DEFAULT_MAX_CANDIDATES
) -> Array:
    """[R, V] the distribution engine.sampling.sampler.sample draws row r from: processed logits ->
    / temperature -> top-k -> top-p -> min-p -> softmax. Greedy rows get a point mass at
    the greedy token. top-k / top-p use the sampler's candidate set (its top C processed
    logits) and thresholds, so the two agree exactly (see engine/sampling/sampler.py's notes)."""
    R, V = logits.shape
    lg = processed_logits(logits, tensors)  # [R, V]
    greedy_ids, row_max = argmax_and_max(lg)  # [R], [R]
    temperature = jnp.where(tensors.temperature > 0, tensors.temperature, 1.0)  # [R]
    scaled = lg / temperature[:, None]  # [R, V]
    lse_scaled = jax.nn.logsumexp(scaled, axis=-1)  # [R]
    cand, _ = top_candidates(lg, min(max_candidates, V))  # [R, C] descending
    thr = top_k_top_p_threshold(cand, temperature, lse_scaled, tensors, V)  # [R]
    min_p_thr = jnp.where(
        tensors.min_p > 0, row_max + temperature * jnp.log(tensors.min_p), _NEG_INF
    )  # [R]
    thr = jnp.maximum(thr, min_p_thr)
    probs = jax.nn.softmax(jnp.where(lg >= thr[:, None], scaled, _NEG_INF), axis=-1)  # [R, V]
    point = jax.nn.one_hot(greedy_ids, V, dtype=probs.dtype)  # [R, V]
    return jnp.where((tensors.temperature > 0)[:, None], probs, point)


def _categorical(keys: Array, weights: Array) -> Array:
    """[R] one draw per row from unnormalized weights [R, V] >= 0 (Gumbel-max)."""
    g = jax.vmap(lambda k: jax.random.gumbel(k, (weights.shape[-1],)))(keys)  # [R, V]
    return jnp.argmax(jnp.log(weights) + g, axis=-1).astype(jnp.int32)


def accept_drafts(
    p: Array,
    q: Array | None,
    drafts: Array,
    num_drafts: Array,
    greedy: Array,
    accept_keys: Array,
    residual_keys: Array,
) -> AcceptResult:
    """The rule of the module docstring for Sv sequences at once.

    p [Sv, k+1, V] target probabilities; q [Sv, k, V] draft probabilities or None (point
    masses at the drafts); drafts [Sv, k] int32; num_drafts [Sv] int32 (positions j >=
    num_drafts are not drafts: the bonus is drawn at position num_drafts); greedy [Sv] bool;
    accept_keys / residual_keys [Sv, k+1] random keys (one per row and position)."""
    Sv, k1, V = p.shape
    k = k1 - 1
    j = jnp.arange(k)[None, :]  # [1, k]
    x = jnp.clip(drafts, 0, V - 1)  # [Sv, k]
    p_x = jnp.take_along_axis(p[:, :k], x[..., None], axis=-1)[..., 0]  # [Sv, k]
    if q is None:
        q = jax.nn.one_hot(x, V, dtype=p.dtype)  # [Sv, k, V]
    q_x = jnp.take_along_axis(q, x[..., None], axis=-1)[..., 0]  # [Sv, k]
    u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(key)))(accept_keys[:, :k])  # [Sv, k]
    # u < p/q without dividing; a draft with q_x = 0 (one q could not have drawn) is
    # accepted iff p_x > 0, the limit of min(1, p/q).
    accepted = u * q_x < p_x
    argmax_p = jnp.argmax(p, axis=-1).astype(jnp.int32)  # [Sv, k+1]
    accepted = jnp.where(greedy[:, None], x == argmax_p[:, :k], accepted)
    accepted &= j < num_drafts[:, None]
    n = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)  # [Sv] leading run
    # The extra token's distribution at position n: residual after a rejection, p_n at the
    # bonus position (n == num_drafts). A residual with no mass (p <= q everywhere, reached
    # only through rounding) falls back to p.
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [Sv, V]
    q_pad = jnp.concatenate([q, jnp.zeros((Sv, 1, V), q.dtype)], axis=1)  # [Sv, k+1, V]
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]  # [Sv, V]
    bonus = n >= num_drafts  # [Sv]
    residual = jnp.where(bonus[:, None], p_n, jnp.maximum(p_n - q_n, 0.0))  # [Sv, V]
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_n)
    key_n = jnp.take_along_axis(residual_keys, n[:, None], axis=1)[:, 0]  # [Sv]
    # Randomness (Gumbel over [Sv, V]) only when some row samples.
    drawn = jax.lax.cond(
        jnp.all(greedy),
        lambda: jnp.zeros((Sv,), jnp.int32),
        lambda: _categorical(key_n, residual),
    )  # [Sv]
    extra = jnp.where(greedy, jnp.take_along_axis(argmax_p, n[:, None], axis=1)[:, 0], drawn)
    tokens = jnp.concatenate([x, jnp.zeros((Sv, 1), jnp.int32)], axis=1)  # [Sv, k+1]
    pos = jnp.arange(k1)[None, :]  # [1, k+1]
    tokens = jnp.where(pos == n[:, None], extra[:, None], tokens)
    tokens = jnp.where(pos > n[:, None], -1, tokens)  # not emitted
    return AcceptResult(num_accepted=n.astype(jnp.int32), tokens=tokens.astype(jnp.int32))


def accept_all_drafts_wrong(p, q, drafts, num_drafts, greedy, accept_keys, residual_keys):
    """A deliberately WRONG rule (accepts every draft; the bonus from p): tests check that
    the distribution test detects it. Never used by the engine."""
    Sv, k1, V = p.shape
    n = num_drafts.astype(jnp.int32)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    key_n = jnp.take_along_axis(residual_keys, n[:, None], axis=1)[:, 0]
    extra = _categorical(key_n, p_n)
    tokens = jnp.concatenate([drafts, jnp.zeros((Sv, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(k1)[None, :] == n[:, None], extra[:, None], tokens)
    return AcceptResult(num_accepted=n, tokens=tokens)


def accept_point_mass_drafts(sampled: Array, drafts: Array, num_drafts: Array) -> AcceptResult:
    """The rule for point-mass drafts (a deterministic proposer: ngram), coupled with the
    ordinary sampler. sampled [Sv, k+1]: the token the request's own sampler
    (engine.sampling.sampler.sample, same seed and output index) draws at each verified position;
    drafts [Sv, k]; num_drafts [Sv].

    Accept x_j iff the sampler drew x_j there; emit the sampler's token at the first
    mismatch (or at the bonus position). This IS the exact rule with q = point mass at x:
    P(accept) = p(x) = min(1, p(x) / 1), and a draw y ~ p conditioned on y != x is
    distributed as normalize(max(0, p - q)). The coupling makes a speculative request emit
    exactly the tokens the non-speculative sampler would: greedy and seeded sampling
    reproduce token for token with speculation on or off."""
    Sv, k1 = sampled.shape
    k = k1 - 1
    j = jnp.arange(k)[None, :]  # [1, k]
    accepted = (sampled[:, :k] == drafts) & (j < num_drafts[:, None])  # [Sv, k]
    n = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)  # [Sv]
    pos = jnp.arange(k1)[None, :]  # [1, k+1]
    tokens = jnp.where(pos <= n[:, None], sampled, -1)  # accepted drafts == sampled there
    return AcceptResult(num_accepted=n.astype(jnp.int32), tokens=tokens.astype(jnp.int32))
