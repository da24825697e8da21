"""The Pallas GPU kernels (Triton lowering) in interpret mode on CPU against naive dense
attention, over a sampled product of page sizes, GQA ratios, head dims, dtypes and int8 KV;
every unused slot is NaN. Each configuration runs two ragged patterns at the same array
sizes, so it compiles once. Also: the kernels lower for CUDA on this CPU-only machine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.testing import make_case, make_decode_case, naive_attention

IMPL = "gpu"
# (page_size, group, head_dim, dtype, int8): a sample of the product, each value covered.
CONFIGS = [
    (8, 1, 64, jnp.float32, False),
    (16, 3, 128, jnp.float32, False),
    (32, 4, 64, jnp.bfloat16, False),
    (64, 8, 64, jnp.float32, False),
    (8, 4, 64, jnp.float32, True),
    (16, 8, 128, jnp.bfloat16, True),
]


def ragged_patterns(ps):
    """(kv_lens, q_lens): decode of a 1-token sequence, an empty sequence, a chunk ending on
    a page boundary, a chunk starting mid-page and crossing a boundary, a whole prompt; then
    a one-page prefill, a decode just past a boundary, a long chunk over 3 pages, ..."""
    return [
        ([1, 0, 2 * ps, 2 * ps + 5, 13], [1, 0, 16, 9, 13]),
        ([ps, ps + 1, 3 * ps - 1, 2, 7], [8, 1, 20, 2, 1]),
    ]


SIZES = {"num_pages": 12, "pages_per_seq": 4, "num_tokens": 48, "pad_seqs": 1}


def _tol(dtype):
    return 2e-4 if dtype == jnp.float32 else 3e-2


def _check(out, expected, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, expected, atol=_tol(dtype), rtol=_tol(dtype))


@pytest.mark.parametrize("page_size,group,head_dim,dtype,int8", CONFIGS)
def test_ragged_kernel_matches_naive(page_size, group, head_dim, dtype, int8):
    rng = np.random.default_rng(page_size * 10 + group)
    for kv_lens, q_lens in ragged_patterns(page_size):
        case = make_case(
            rng,
            kv_lens=kv_lens,
            q_lens=q_lens,
            page_size=page_size,
            num_kv_heads=2,
            group=group,
            head_dim=head_dim,
            dtype=dtype,
            int8=int8,
            **SIZES,
        )
        out = pk.ragged_paged_attention(
            *case.attention_args(),
            sm_scale=head_dim**-0.5,
            max_query_len=20,
            k_scales=case.k_scales,
            v_scales=case.v_scales,
            impl=IMPL,
            interpret=True,
        )
        _check(out, naive_attention(case, sm_scale=head_dim**-0.5), dtype)
        assert np.all(np.asarray(out)[sum(q_lens) :] == 0)  # padding rows are zeros


@pytest.mark.parametrize("page_size,group,head_dim,dtype,int8", CONFIGS[::2] + [CONFIGS[5]])
def test_decode_kernel_matches_naive(page_size, group, head_dim, dtype, int8):
    rng = np.random.default_rng(page_size + group)
    for kv_lens in (
        [1, 0, page_size, page_size + 1, 3 * page_size - 1],
        [2 * page_size, 5, 0, 1, 4 * page_size],
    ):
        case, q, expected = make_decode_case(
            rng,
            kv_lens,
            sm_scale=0.2,
            page_size=page_size,
            num_kv_heads=2,
            group=group,
            head_dim=head_dim,
            dtype=dtype,
            int8=int8,
            num_pages=12,
            pages_per_seq=5,
        )
        out = pk.decode_paged_attention(
            q,
            case.k_pages,
            case.v_pages,
            case.kv_lens,
            case.page_table,
            0,
            sm_scale=0.2,
            k_scales=case.k_scales,
            v_scales=case.v_scales,
            impl=IMPL,
            interpret=True,
        )
        _check(out, expected, dtype)


@pytest.mark.parametrize("window,cap", [(6, None), (20, 2.5)])
def test_window_and_soft_cap(window, cap):
    rng = np.random.default_rng(window)
    case = make_case(
        rng,
        kv_lens=[40, 3, 17],
        q_lens=[12, 3, 1],
        page_size=8,
        num_kv_heads=1,
        group=4,
        head_dim=64,
    )
    expected = naive_attention(case, sm_scale=0.2, sliding_window=window, soft_cap=cap)
    out = pk.ragged_paged_attention(
        *case.attention_args(),
        sm_scale=0.2,
        max_query_len=12,
        sliding_window=window,
        soft_cap=cap,
        impl=IMPL,
        interpret=True,
    )
    _check(out, expected, jnp.float32)
    dcase, q, dexp = make_decode_case(
        rng,
        [40, 0, 9],
        sm_scale=0.2,
        sliding_window=window,
        soft_cap=cap,
        page_size=8,
        num_kv_heads=1,
        group=4,
        head_dim=64,
    )
    out = pk.decode_paged_attention(
        q,
        dcase.k_pages,
        dcase.v_pages,
        dcase.kv_lens,
        dcase.page_table,
        0,
        sm_scale=0.2,
        sliding_window=window,
        soft_cap=cap,
        impl=IMPL,
        interpret=True,
    )
    _check(out, dexp, jnp.float32)


def test_traced_layer_of_stacked_cache():
    rng = np.random.default_rng(2)
    case = make_case(
        rng,
        kv_lens=[9, 20],
        q_lens=[3, 1],
        page_size=8,
        num_kv_heads=2,
        group=2,
        head_dim=64,
        num_layers=3,
        layer=2,
    )
    args = case.attention_args()[:-1]
    f = jax.jit(
        lambda lyr: pk.ragged_paged_attention(
            *args, lyr, sm_scale=0.1, max_query_len=3, impl=IMPL, interpret=True
        )
    )
    _check(f(jnp.int32(2)), naive_attention(case, sm_scale=0.1), jnp.float32)


@pytest.mark.parametrize("int8", [False, True])
def test_kernels_lower_for_cuda(int8):
    """The Triton lowering of both kernels (bf16, window, soft cap) runs without a GPU."""
    case = make_case(
        np.random.default_rng(0),
        kv_lens=[40, 9],
        q_lens=[7, 1],
        page_size=16,
        num_kv_heads=2,
        group=3,
        head_dim=128,
        dtype=jnp.bfloat16,
        int8=int8,
    )
    opts = {"sm_scale": 0.1, "sliding_window": 7, "soft_cap": 3.0, "impl": "gpu"}

    def step(q, kp, vp, kl, pt, qs, ns, ks, vs):
        out = pk.ragged_paged_attention(
            q,
            kp,
            vp,
            kl,
            pt,
            qs,
            ns,
            jnp.int32(0),
            max_query_len=8,
            k_scales=ks,
            v_scales=vs,
            **opts,
        )
        dec = pk.decode_paged_attention(
            q[:2], kp, vp, kl, pt, jnp.int32(0), k_scales=ks, v_scales=vs, **opts
        )
        return out, dec

    lowered = (
        jax.jit(step)
        .trace(*case.attention_args()[:-1], case.k_scales, case.v_scales)
        .lower(lowering_platforms=("cuda",))
    )
    assert lowered.as_text().count("triton") >= 2


def test_decode_only_ragged_batch_uses_decode_path():
    """max_query_len=1 (what the engine passes for decode-only steps) with empty and padded
    sequences and padding rows."""
    rng = np.random.default_rng(9)
    case = make_case(
        rng,
        kv_lens=[17, 0, 32, 5],
        q_lens=[1, 0, 1, 1],
        page_size=16,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        pad_seqs=2,
        pad_tokens=3,
    )
    out = pk.ragged_paged_attention(
        *case.attention_args(), sm_scale=0.2, max_query_len=1, impl=IMPL, interpret=True
    )
    _check(out, naive_attention(case, sm_scale=0.2), jnp.float32)


def test_decode_many_splits_including_empty_ones(monkeypatch):
    """16-token KV blocks over 40-token contexts: 3 splits; the short sequences' later splits
    are empty and must not disturb the combine."""
    from pallas_kernels import gpu_common, gpu_decode

    monkeypatch.setitem(gpu_common.KV_BLOCK_TOKENS, "decode", 16)
    case, q, expected = make_decode_case(
        np.random.default_rng(6),
        [40, 3, 0, 17],
        sm_scale=0.2,
        page_size=8,
        num_kv_heads=1,
        group=2,
        head_dim=64,
    )
    fn = jax.jit(
        lambda *a: gpu_decode.decode_paged_attention_gpu(*a, 0, sm_scale=0.2, interpret=True)
    )
    out = fn(q, case.k_pages, case.v_pages, case.kv_lens, case.page_table)
    _check(out, expected, jnp.float32)
