"""The jnp reference (the CPU path) against naive dense attention, the KV write, the layer
index of the stacked cache, and the validation errors of the public functions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.testing import make_case, make_decode_case, naive_attention

# (kv_lens, q_lens): 0, 1, exact page multiples, boundary crossings, chunks from mid-page.
RAGGED_SHAPES = [
    ([1], [1]),
    ([16, 17, 5], [16, 3, 5]),  # full prefill of exactly one page, decode-ish, short
    ([40, 0, 9, 32], [7, 0, 1, 32]),  # chunk mid-page after cache, empty seq, 2-page prefill
]


@pytest.mark.parametrize(
    "page_size,group,head_dim,dtype,shapes",
    [
        (8, 1, 64, jnp.float32, 0),
        (16, 3, 128, jnp.float32, 1),
        (32, 4, 64, jnp.float32, 2),
        (64, 8, 64, jnp.float32, 2),
        (8, 4, 128, jnp.bfloat16, 2),
        (16, 8, 64, jnp.bfloat16, 1),
    ],
)
def test_ragged_reference_matches_naive(page_size, group, head_dim, dtype, shapes):
    kv_lens, q_lens = RAGGED_SHAPES[shapes]
    case = make_case(
        np.random.default_rng(page_size + group),
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=page_size,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        pad_seqs=1,
        pad_tokens=3,
    )
    out = pk.ragged_paged_attention(
        *case.attention_args(),
        sm_scale=1 / math.sqrt(head_dim),
        max_query_len=case.max_query_len,
        impl="reference",
    )
    assert out.shape == case.q.shape and out.dtype == dtype
    expected = naive_attention(case, sm_scale=1 / math.sqrt(head_dim))
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("window,cap", [(5, None), (None, 2.0), (9, 1.5)])
def test_ragged_reference_window_and_soft_cap(window, cap):
    case = make_case(
        np.random.default_rng(7),
        kv_lens=[30, 12, 3],
        q_lens=[10, 1, 3],
        page_size=8,
        num_kv_heads=2,
        group=2,
        head_dim=64,
    )
    out = pk.ragged_paged_attention(
        *case.attention_args(),
        sm_scale=0.2,
        max_query_len=10,
        sliding_window=window,
        soft_cap=cap,
        impl="reference",
    )
    expected = naive_attention(case, sm_scale=0.2, sliding_window=window, soft_cap=cap)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-4, rtol=1e-4)


def test_int8_reference_matches_dequantized_naive():
    case = make_case(
        np.random.default_rng(3),
        kv_lens=[20, 8],
        q_lens=[4, 8],
        page_size=8,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        int8=True,
    )
    out = pk.ragged_paged_attention(
        *case.attention_args(),
        sm_scale=0.125,
        max_query_len=8,
        k_scales=case.k_scales,
        v_scales=case.v_scales,
        impl="reference",
    )
    np.testing.assert_allclose(
        np.asarray(out), naive_attention(case, sm_scale=0.125), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("num_layers,layer", [(2, 1), (3, 2), (3, 0)])
def test_layer_index_reads_only_that_layer(num_layers, layer):
    case = make_case(
        np.random.default_rng(layer),
        kv_lens=[9, 16],
        q_lens=[2, 1],
        page_size=8,
        num_kv_heads=1,
        group=4,
        head_dim=64,
        num_layers=num_layers,
        layer=layer,
    )
    expected = naive_attention(case, sm_scale=0.1)
    out = pk.ragged_paged_attention(
        *case.attention_args(), sm_scale=0.1, max_query_len=2, impl="reference"
    )
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-4, rtol=1e-4)
    # Traced layer inside jit / scan: the same answer.
    args = case.attention_args()
    traced = jax.jit(
        lambda lyr: pk.ragged_paged_attention(
            *args[:-1], lyr, sm_scale=0.1, max_query_len=2, impl="reference"
        )
    )(jnp.int32(layer))
    np.testing.assert_allclose(np.asarray(traced), expected, atol=1e-4, rtol=1e-4)


def test_decode_reference_matches_naive_and_empty_slots_are_zero():
    rng = np.random.default_rng(11)
    case, q, expected = make_decode_case(
        rng, [1, 0, 16, 33], sm_scale=0.3, page_size=16, num_kv_heads=2, group=4, head_dim=64
    )
    out = pk.decode_paged_attention(
        q,
        case.k_pages,
        case.v_pages,
        case.kv_lens[:4],
        case.page_table[:4],
        0,
        sm_scale=0.3,
        impl="reference",
    )
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-4, rtol=1e-4)
    assert np.all(np.asarray(out)[1] == 0)


@pytest.mark.parametrize("int8", [False, True])
def test_write_kv_then_attention_equals_dense(int8):
    """Write a whole prompt token by token chunk through write_kv, then attend."""
    rng = np.random.default_rng(5)
    num_layers, kv_heads, page_size, head_dim, n = 2, 2, 8, 64, 13
    shape = (num_layers, kv_heads, 6, page_size, head_dim)
    dtype = jnp.int8 if int8 else jnp.float32
    k_pages = jnp.full(shape, 0 if int8 else jnp.nan, dtype)
    v_pages = jnp.full(shape, 0 if int8 else jnp.nan, dtype)
    scales = jnp.full(shape[:4], jnp.nan) if int8 else None
    k_scales = v_scales = scales
    pages = np.array([4, 2])  # non-contiguous
    k = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
    pos = np.arange(n)
    slots = jnp.asarray(pages[pos // page_size] * page_size + pos % page_size, jnp.int32)
    for lo, hi in [(0, 5), (5, 13)]:  # two chunks, the second crossing a page boundary
        k_pages, v_pages, k_scales, v_scales = pk.write_kv(
            k_pages,
            v_pages,
            jnp.asarray(k[lo:hi]),
            jnp.asarray(v[lo:hi]),
            slots[lo:hi],
            1,
            k_scales=k_scales,
            v_scales=v_scales,
        )
    got_k = np.asarray(k_pages[1][:, pages[pos // page_size], pos % page_size], np.float32)
    if int8:
        got_k = (
            got_k * np.asarray(k_scales[1][:, pages[pos // page_size], pos % page_size])[..., None]
        )
        assert np.all(np.isnan(np.asarray(k_scales[0])))  # other layer untouched
    np.testing.assert_allclose(got_k.transpose(1, 0, 2), k, atol=0.02 if int8 else 0)
    q = jnp.asarray(rng.standard_normal((n, 2 * kv_heads, head_dim)), jnp.float32)
    out = pk.ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        jnp.array([n], jnp.int32),
        jnp.asarray(pages[None], jnp.int32),
        jnp.array([0, n], jnp.int32),
        jnp.array([1], jnp.int32),
        1,
        sm_scale=0.125,
        max_query_len=n,
        k_scales=k_scales,
        v_scales=v_scales,
        impl="reference",
    )
    kk = np.repeat(k, 2, axis=1)
    vv = np.repeat(v, 2, axis=1)
    logits = np.einsum("thd,shd->hts", np.asarray(q), kk) * 0.125
    logits = np.where(pos[None, :, None] >= pos[None, None, :], logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    dense = np.einsum("hts,shd->thd", w / w.sum(-1, keepdims=True), vv)
    np.testing.assert_allclose(np.asarray(out), dense, atol=0.05 if int8 else 1e-4)


def test_write_kv_donated_in_jit_keeps_other_slots():
    shape = (1, 1, 3, 4, 64)
    k_pages = jnp.zeros(shape)
    v_pages = jnp.ones(shape)
    step = jax.jit(lambda kp, vp, k, s: pk.write_kv(kp, vp, k, k, s, 0)[:2], donate_argnums=(0, 1))
    k_new = jnp.full((2, 1, 64), 7.0)
    k_pages, v_pages = step(k_pages, v_pages, k_new, jnp.array([5, 6], jnp.int32))
    kp = np.asarray(k_pages).reshape(-1, 64)
    assert np.all(kp[[5, 6]] == 7) and np.all(np.delete(kp, [5, 6], axis=0) == 0)


def _good_args():
    case = make_case(
        np.random.default_rng(0),
        kv_lens=[5],
        q_lens=[2],
        page_size=8,
        num_kv_heads=2,
        group=2,
        head_dim=64,
    )
    return case


@pytest.mark.parametrize(
    "field,bad,match",
    [
        (
            "kv_lens",
            lambda c: c.kv_lens.astype(jnp.int64 if jax.config.x64_enabled else jnp.float32),
            "kv_lens",
        ),
        ("page_table", lambda c: c.page_table[:, :, None], "page_table"),
        ("query_start", lambda c: c.query_start[:-1], "query_start"),
        ("num_seqs", lambda c: c.num_seqs[0], "num_seqs"),
        ("q", lambda c: c.q[:, :3], "q has shape"),
        ("v_pages", lambda c: c.v_pages[:, :1], "v_pages"),
        ("layer", lambda c: 4, "layer=4"),
    ],
)
def test_ragged_validation_errors_name_the_argument(field, bad, match):
    case = _good_args()
    kwargs = dict(
        zip(
            [
                "q",
                "k_pages",
                "v_pages",
                "kv_lens",
                "page_table",
                "query_start",
                "num_seqs",
                "layer",
            ],
            case.attention_args(),
        )
    )
    kwargs[field] = bad(case)
    with pytest.raises(ValueError, match=match):
        pk.ragged_paged_attention(**kwargs, sm_scale=0.1, max_query_len=2)


def test_other_validation_errors():
    case = _good_args()
    args = case.attention_args()
    with pytest.raises(ValueError, match="max_query_len"):
        pk.ragged_paged_attention(*args, sm_scale=0.1, max_query_len=0)
    with pytest.raises(ValueError, match="impl"):
        pk.ragged_paged_attention(*args, sm_scale=0.1, max_query_len=2, impl="cuda")
    with pytest.raises(ValueError, match="k_scales"):
        pk.ragged_paged_attention(
            *args, sm_scale=0.1, max_query_len=2, k_scales=jnp.zeros(case.k_pages.shape[:4])
        )
    with pytest.raises(ValueError, match="k_pages"):  # float cache with scales
        pk.ragged_paged_attention(
            *args,
            sm_scale=0.1,
            max_query_len=2,
            k_scales=jnp.zeros(case.k_pages.shape[:4]),
            v_scales=jnp.zeros(case.k_pages.shape[:4]),
        )
    with pytest.raises(ValueError, match="q has shape"):
        pk.decode_paged_attention(case.q, *args[1:5], 0, sm_scale=0.1)
    with pytest.raises(ValueError, match="slot_mapping"):
        pk.write_kv(
            case.k_pages, case.v_pages, case.q[:, :2], case.q[:, :2], jnp.zeros((3,), jnp.int32), 0
        )
    with pytest.raises(ValueError, match="k has shape"):
        pk.write_kv(case.k_pages, case.v_pages, case.q, case.q, jnp.zeros((2,), jnp.int32), 0)
