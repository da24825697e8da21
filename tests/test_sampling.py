"""engine.sampling.sampler: greedy, temperature statistics, filters, penalties, seeds,
logprobs, jit."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.sampling.params import MAX_LOGPROBS, SamplingParams
from engine.sampling.sampler import (
    MAX_MIN_TOKENS_STOP_IDS,
    SampleResult,
    SamplingFlags,
    SamplingTensors,
    apply_penalties,
    init_counts,
    reset_slot_counts,
    resolve_seed,
    sample_jit,
    seed_to_key_data,
    update_counts,
    uses_penalties,
)

# One batch shape for every test, so `sample_jit` compiles once per flag variant (compiles
# dominate this file's time on a 2-core machine).
S, V = 512, 600  # V = 600: three blocks of 256, the last one padded
rng = np.random.default_rng(0)


def tensors(params, output_lens=None, eos=()):
    output_lens = output_lens if output_lens is not None else [0] * len(params)
    t = SamplingTensors.from_params(params, output_lens, None, S, eos)
    return jax.tree.map(jnp.asarray, t)


def pad_vocab(rows):
    """[n, v] -> [S, V] float32, extra tokens at -inf, extra rows zeros."""
    rows = np.atleast_2d(np.asarray(rows, np.float32))
    out = np.zeros((S, V), np.float32)
    out[:, rows.shape[1] :] = -np.inf
    out[: rows.shape[0], : rows.shape[1]] = rows
    return jnp.asarray(out)


def draw_many(logits_row, params_fn, n, flags=None):
    """n samples of one row of logits, each from its own seed (batches of S)."""
    logits = pad_vocab(np.tile(np.asarray(logits_row, np.float32), (S, 1)))
    out = []
    for first in range(0, n, S):
        t = tensors([params_fn(seed) for seed in range(first, first + S)])
        out.append(np.asarray(sample_jit(logits, t, flags=flags or SamplingFlags()).tokens))
    return np.concatenate(out)[:n]


def seeded(seed, **kwargs):
    return SamplingParams(seed=seed, **kwargs)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def chi_square(tokens, probs):
    counts = np.bincount(tokens, minlength=len(probs))
    expected = len(tokens) * np.asarray(probs)
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    return float((((counts - expected) ** 2)[support] / expected[support]).sum())


def test_greedy_rows_take_argmax_with_every_flag_set():
    logits = jnp.asarray(rng.standard_normal((S, V)).astype(np.float32) * 3)
    t = tensors([SamplingParams(temperature=0.0)] * 6)  # and S - 6 padding rows
    for flags in [
        SamplingFlags(),
        SamplingFlags(all_greedy=True, filters=False, top_logprobs=False),
    ]:
        res = sample_jit(logits, t, flags=flags)
        np.testing.assert_array_equal(res.tokens, np.argmax(logits, axis=-1))


def test_ties_and_runtime_branches_give_the_same_greedy_rows():
    """Integer logits (many ties): the greedy pick is the first maximum (np.argmax) in the
    greedy variant (two-reduction argmax) and in the full one, whether or not a row of the
    batch filters (the full variant's two runtime branches: C candidates vs top K)."""
    logits = jnp.asarray(rng.integers(0, 4, (S, V)).astype(np.float32))
    greedy_rows = [SamplingParams(temperature=0.0)] * 6
    plain = tensors(greedy_rows)
    with_filter = tensors(greedy_rows + [SamplingParams(top_p=0.5, seed=1)])
    res = {
        "greedy": sample_jit(logits, plain, flags=SamplingFlags(all_greedy=True, filters=False)),
        "full": sample_jit(logits, plain),
        "full_filtering_row": sample_jit(logits, with_filter),
    }
    want = np.argmax(np.asarray(logits), axis=-1)
    for name, r in res.items():
        np.testing.assert_array_equal(np.asarray(r.tokens)[:6], want[:6], err_msg=name)
    for field in ("top_ids", "top_logprobs", "logprobs"):
        a, b = (np.asarray(getattr(res[k], field))[:6] for k in ("full", "full_filtering_row"))
        np.testing.assert_array_equal(a, b, err_msg=field)


def test_padding_rows_are_greedy_and_seedless_greedy_rows_are_allowed():
    t = SamplingTensors.from_params([SamplingParams(temperature=0.0)], [0], None, 4)
    assert t.temperature.tolist() == [0.0] * 4 and t.top_p.tolist() == [1.0] * 4


def test_temperature_sampling_matches_softmax_chi_square():
    # 10 tokens; 4096 draws with fixed seeds: chi-square (9 dof) < 27.9 (p = 0.001).
    logits = np.log(np.array([30, 20, 15, 10, 8, 6, 5, 3, 2, 1], np.float32))
    for temperature in (1.0, 0.5, 2.0):
        probs = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
        params_fn = functools.partial(seeded, temperature=temperature)
        toks = draw_many(logits, params_fn, 8 * S)
        assert chi_square(toks, probs) < 27.9, temperature


def test_hierarchical_draw_across_blocks_matches_softmax():
    # mass spread over all three blocks of 256; the filter-free compiled variant.
    logits = np.full(V, -30.0, np.float32)
    hot = {3: 0.3, 255: 0.1, 256: 0.2, 400: 0.15, 599: 0.25}
    for i, p in hot.items():
        logits[i] = np.log(p)
    probs = np.exp(logits) / np.exp(logits).sum()
    toks = draw_many(logits, lambda s: SamplingParams(seed=s), 8 * S, SamplingFlags(filters=False))
    assert set(np.unique(toks)) <= set(hot)
    assert chi_square(toks, probs) < 18.5  # 4 dof, p = 0.001


def allowed_reference(logits, temperature, top_k, top_p, min_p):
    """numpy: the set of tokens top-k -> top-p -> min-p keep (vLLM definitions)."""
    scaled = logits / temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.ones(len(logits), bool)
    if top_k:
        keep[order[top_k:]] = False
    p = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    p = p / p.sum()
    before = np.cumsum(p[order]) - p[order]
    keep[order[before >= top_p]] = False
    keep &= scaled >= scaled.max() + np.log(min_p) if min_p > 0 else True
    return set(np.flatnonzero(keep))


@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(5, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (8, 0.7, 0.1), (40, 0.95, 0.0)],
)
def test_filters_never_pick_excluded_tokens(top_k, top_p, min_p):
    logits = rng.standard_normal(V).astype(np.float32) * 2
    allowed = allowed_reference(logits, 0.8, top_k, top_p, min_p)
    toks = draw_many(
        logits,
        lambda s: SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p, seed=s),
        4 * S,
    )
    assert set(np.unique(toks)) <= allowed
    assert len(set(np.unique(toks))) >= min(3, len(allowed))  # the filter is not degenerate


def test_top_k_alone_samples_its_k_tokens_with_renormalized_probs():
    logits = np.log(np.array([1, 2, 3, 4, 10, 20, 30, 0.5], np.float32))
    probs = np.array([0, 0, 0, 0, 10, 20, 30, 0], np.float32) / 60
    toks = draw_many(logits, lambda s: SamplingParams(top_k=3, seed=s), 8 * S)
    assert chi_square(toks, probs) < 13.8  # 2 dof, p = 0.001


class TestPenaltiesJittedAndEager(chex.TestCase):
    """The device-side penalty functions are pure: the same answer traced under jit and run
    eagerly (chex variants run each test both ways)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_penalties_follow_vllm_definitions_by_hand(self):
        logits = jnp.array([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, -1.0, 0.0, 4.0]])
        counts = jnp.array([[0, 2, 0, 1, 0], [0, 0, 3, 0, 0]], jnp.int32)
        prompt = jnp.array([[True, False, False, False, False], [False, True, False, False, False]])
        t = SamplingTensors.from_params(
            [
                SamplingParams(
                    repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, seed=0
                ),
                SamplingParams(repetition_penalty=0.5, presence_penalty=-1.0, seed=0),
            ],
            [0, 0],
            None,
            2,
        )
        got = self.variant(apply_penalties)(logits, counts, prompt, t)
        chex.assert_shape(got, (2, 5))
        chex.assert_type(got, jnp.float32)
        # row 0: rep 2 on tokens {0 (prompt), 1, 3 (output)}; then -0.5*count -0.25*(count>0)
        want0 = [2.0 / 2, -1.0 * 2 - 0.5 * 2 - 0.25, 0.5, 3.0 / 2 - 0.5 - 0.25, -2.0]
        # row 1: rep 0.5 on {1 (prompt), 2 (output)}; presence -1 on token 2
        want1 = [1.0, 1.0 / 0.5, -1.0 * 0.5 + 1.0, 0.0, 4.0]
        np.testing.assert_allclose(got, [want0, want1], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_counts_reset_and_update(self):
        counts, prompt = init_counts(3, 10)
        counts = counts.at[1].set(7)  # stale state from an earlier request in slot 1
        counts, prompt = self.variant(reset_slot_counts)(
            counts, prompt, 1, jnp.array([4, 4, 9, 0, 0]), 3, jnp.array([5, 5, 2, 0]), 3
        )
        assert np.flatnonzero(prompt[1]).tolist() == [4, 9]
        assert np.asarray(counts[1]).tolist() == [0, 0, 1, 0, 0, 2, 0, 0, 0, 0]
        counts = self.variant(update_counts)(
            counts, jnp.array([1, 0, 2]), jnp.array([2, 3, 3]), jnp.array([True, True, False])
        )
        chex.assert_type(counts, jnp.int32)
        assert int(counts[1, 2]) == 2 and int(counts[0, 3]) == 1 and int(counts[2].sum()) == 0


def test_penalties_change_the_greedy_pick_and_logprobs_use_penalized_logits():
    logits = pad_vocab([[5.0, 4.0, 0.0]])
    counts = np.zeros((S, V), np.int32)
    counts[0, 0] = 3
    counts, prompt = jnp.asarray(counts), jnp.zeros((S, V), bool)
    t = tensors([SamplingParams(temperature=0.0, frequency_penalty=1.0)])
    res = sample_jit(logits, t, counts, prompt)
    assert int(res.tokens[0]) == 1  # 5 - 3 = 2 < 4
    want = log_softmax(np.array([2.0, 4.0, 0.0]))
    np.testing.assert_allclose(res.logprobs[0], want[1], atol=1e-6)
    np.testing.assert_array_equal(res.top_ids[0, :3], [1, 0, 2])


def test_same_seed_same_tokens_whatever_the_slot_and_companions():
    row = rng.standard_normal(V).astype(np.float32)
    target = SamplingParams(temperature=1.3, top_p=0.95, seed=1234)

    def run(slot, companions, step):
        params = list(companions)
        params.insert(slot, target)
        logits = rng.standard_normal((S, V)).astype(np.float32)
        logits[slot] = row
        t = tensors(params, output_lens=[step] * len(params))
        return int(sample_jit(jnp.asarray(logits), t).tokens[slot])

    a = [SamplingParams(seed=7), SamplingParams(temperature=0.0)]
    b = [SamplingParams(top_k=3, seed=1)] * 5 + [SamplingParams(min_p=0.3, seed=9)] * 2
    for step in range(3):
        assert run(0, a, step) == run(5, b, step) == run(2, b, step)
    # the output position is folded into the key: the tokens are not all equal across steps
    assert len({run(0, a, step) for step in range(8)}) > 1
    # another batch bucket (S = 8): same token
    small = jax.tree.map(jnp.asarray, SamplingTensors.from_params([target], [2], None, 8))
    logits8 = jnp.zeros((8, V)).at[0].set(row)
    assert int(sample_jit(logits8, small).tokens[0]) == run(3, b, 2)


def test_flags_chosen_for_the_batch_do_not_change_a_rows_token():
    logits = jnp.asarray(rng.standard_normal((S, V)).astype(np.float32) * 2)
    plain = tensors(
        [SamplingParams(temperature=0.9, min_p=0.01 * (i % 3), seed=i) for i in range(S)]
    )
    want = np.asarray(sample_jit(logits, plain).tokens)
    np.testing.assert_array_equal(
        sample_jit(logits, plain, flags=SamplingFlags(filters=False)).tokens, want
    )
    filtered = tensors([SamplingParams(top_k=30, top_p=0.9, seed=i) for i in range(S)])
    np.testing.assert_array_equal(
        sample_jit(logits, filtered).tokens,
        sample_jit(logits, filtered, flags=SamplingFlags(max_candidates=V)).tokens,
    )


def test_top_k_at_least_vocab_is_off():
    logits = np.log(np.arange(1, 11, dtype=np.float32))
    toks = draw_many(logits, functools.partial(seeded, top_k=V), 4 * S)
    assert chi_square(toks, np.arange(1, 11) / 55) < 27.9


def test_logprobs_are_log_softmax_of_processed_logits():
    logits = jnp.asarray(rng.standard_normal((S, V)).astype(np.float32) * 2)
    t = tensors(
        [
            SamplingParams(temperature=0.0),
            SamplingParams(seed=1),
            SamplingParams(top_k=4, seed=2),
            SamplingParams(top_p=0.5, temperature=0.3, seed=3),
            SamplingParams(min_p=0.5, seed=4),
        ]
    )
    res = sample_jit(logits, t)
    logp = log_softmax(np.asarray(logits))
    rows = np.arange(S)
    np.testing.assert_allclose(res.logprobs, logp[rows, np.asarray(res.tokens)], atol=1e-5)
    order = np.argsort(-logp, axis=-1, kind="stable")[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(res.top_ids, order)
    np.testing.assert_allclose(res.top_logprobs, np.take_along_axis(logp, order, -1), atol=1e-5)


def test_stop_ids_are_banned_before_min_tokens():
    logits = pad_vocab([[0.0, 1.0, 9.0, 8.0, 0.5]] * 2)  # token 2 (EOS) is the argmax
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    res = sample_jit(logits, tensors([p, p], output_lens=[1, 2], eos=(2,)))
    assert res.tokens[:2].tolist() == [1, 2]  # step 1 < 2: EOS and stop id 3 banned
    assert float(res.logprobs[0]) == pytest.approx(
        log_softmax(np.array([0.0, 1.0, 0.5]))[1], abs=1e-6
    )


def test_sample_compiles_once_for_fixed_shapes():
    logits = jnp.asarray(rng.standard_normal((S, V)).astype(np.float32))
    sizes = []
    for i in range(4):
        params = [
            SamplingParams(
                temperature=0.1 * i,
                top_k=i,
                top_p=1.0 - 0.1 * i,
                repetition_penalty=1.0 + i,
                seed=i,
            )
        ] * (3 + i)
        t = tensors(params, output_lens=[i] * len(params), eos=(2,))
        jax.block_until_ready(sample_jit(logits + i, t))
        sizes.append(sample_jit._cache_size())
    assert sizes[1:] == sizes[:1] * 3  # new values, batch contents, steps: no new compile


def test_pack_round_trips_exactly():
    logits = jnp.asarray(rng.standard_normal((S, V)).astype(np.float32) * 3)
    res = sample_jit(logits, tensors([SamplingParams(seed=s) for s in range(S)]))
    packed = jax.device_get(jax.jit(SampleResult.pack)(res))
    assert packed.shape == (S, 2 + 2 * MAX_LOGPROBS) and packed.dtype == np.float32
    back = SampleResult.unpack(packed)
    for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(back, name), np.asarray(getattr(res, name)))


def test_host_helpers():
    assert seed_to_key_data(2**40 + 5).tolist() == [256, 5]
    np.testing.assert_array_equal(
        seed_to_key_data(12345), jax.random.key_data(jax.random.key(12345))
    )
    assert resolve_seed(SamplingParams(seed=9)) == 9
    assert 0 <= resolve_seed(SamplingParams()) < 2**63
    with pytest.raises(ValueError, match="no seed"):
        SamplingTensors.from_params([SamplingParams()], [0], None, 2)
    with pytest.raises(ValueError, match="num_slots"):
        SamplingTensors.from_params([None] * 3, [0] * 3, None, 2)
    t = SamplingTensors.from_params([SamplingParams(stop_token_ids=(5, 2))], [0], [1], 2, (2,))
    assert (
        t.stop_ids[0, :3].tolist() == [2, 5, -1] and t.stop_ids.shape[1] == MAX_MIN_TOKENS_STOP_IDS
    )
    assert t.key_data[0].tolist() == [0, 1]
    flags = SamplingFlags.for_batch([SamplingParams(temperature=0.0), None])
    assert flags == dataclasses.replace(
        SamplingFlags(), filters=False, all_greedy=True, top_logprobs=False
    )
    assert uses_penalties([None, SamplingParams(presence_penalty=0.1)])
    assert not uses_penalties([None, SamplingParams()])


def test_nucleus_wider_than_the_candidate_cap_is_truncated_to_the_cap():
    logits = rng.standard_normal(V).astype(np.float32) * 0.1  # flat: the 0.99 nucleus > 256
    top = set(np.argsort(-logits, kind="stable")[:256])
    capped = draw_many(logits, functools.partial(seeded, top_p=0.99), 2 * S)
    assert set(np.unique(capped)) <= top
    exact = draw_many(
        logits, functools.partial(seeded, top_p=0.99), 2 * S, SamplingFlags(max_candidates=V)
    )
    assert not set(np.unique(exact)) <= top
