"""The Pallas TPU kernel in TPU interpret mode on CPU against naive dense attention (NaN in
every unused slot; the interpreter also raises on out-of-bounds reads). TPU interpret mode
runs each grid step on the host, so the cases are the smallest that still cover page sizes,
GQA ratios, head dims, dtypes, int8, windows and the layer index. Also: the kernel lowers to
Mosaic for TPU on this CPU-only machine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.testing import make_case, make_decode_case, naive_attention

IMPL = "tpu"


def _check(out, expected, dtype):
    tol = 2e-4 if dtype == jnp.float32 else 3e-2
    out = np.asarray(jnp.asarray(out, jnp.float32))
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "page_size,group,head_dim,dtype,int8",
    [
        (8, 3, 64, jnp.float32, False),
        (16, 4, 128, jnp.bfloat16, False),
        (32, 1, 64, jnp.float32, True),
        (64, 8, 64, jnp.bfloat16, True),
    ],
)
def test_ragged_kernel_matches_naive(page_size, group, head_dim, dtype, int8):
    ps = page_size
    # 1-token decode, empty sequence, mid-page chunk crossing a boundary, whole prompt.
    case = make_case(
        np.random.default_rng(ps),
        kv_lens=[1, 0, ps + 5, 11],
        q_lens=[1, 0, 7, 11],
        page_size=ps,
        num_kv_heads=1,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        int8=int8,
        pad_seqs=1,
        pad_tokens=2,
    )
    out = pk.ragged_paged_attention(
        *case.attention_args(),
        sm_scale=0.15,
        max_query_len=case.max_query_len,
        k_scales=case.k_scales,
        v_scales=case.v_scales,
        impl=IMPL,
        interpret=True,
    )
    _check(out, naive_attention(case, sm_scale=0.15), dtype)


@pytest.mark.parametrize("page_size,group,int8", [(16, 3, True)])  # BQ = 1 tiles
def test_decode_kernel_matches_naive(page_size, group, int8):
    case, q, expected = make_decode_case(
        np.random.default_rng(1),
        [1, 0, page_size, 2 * page_size + 1],
        sm_scale=0.2,
        page_size=page_size,
        num_kv_heads=2,
        group=group,
        head_dim=64,
        int8=int8,
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
    _check(out, expected, jnp.float32)


def test_window_soft_cap_and_traced_layer():
    case = make_case(
        np.random.default_rng(4),
        kv_lens=[30, 4],
        q_lens=[6, 1],
        page_size=8,
        num_kv_heads=1,
        group=2,
        head_dim=64,
        num_layers=2,
        layer=1,
    )
    args = case.attention_args()[:-1]
    f = jax.jit(
        lambda lyr: pk.ragged_paged_attention(
            *args,
            lyr,
            sm_scale=0.2,
            max_query_len=6,
            sliding_window=9,
            soft_cap=2.0,
            impl=IMPL,
            interpret=True,
        )
    )
    expected = naive_attention(case, sm_scale=0.2, sliding_window=9, soft_cap=2.0)
    _check(f(jnp.int32(1)), expected, jnp.float32)


@pytest.mark.parametrize("int8", [False, True])
def test_kernel_lowers_for_tpu(int8):
    case = make_case(
        np.random.default_rng(0),
        kv_lens=[40, 9],
        q_lens=[7, 1],
        page_size=16,
        num_kv_heads=2,
        group=4,
        head_dim=128,
        dtype=jnp.bfloat16,
        int8=int8,
    )

    def step(q, kp, vp, kl, pt, qs, ns, ks, vs):
        return pk.ragged_paged_attention(
            q,
            kp,
            vp,
            kl,
            pt,
            qs,
            ns,
            jnp.int32(0),
            sm_scale=0.1,
            max_query_len=8,
            sliding_window=7,
            soft_cap=3.0,
            k_scales=ks,
            v_scales=vs,
            impl="tpu",
        )

    lowered = (
        jax.jit(step)
        .trace(*case.attention_args()[:-1], case.k_scales, case.v_scales)
        .lower(lowering_platforms=("tpu",))
    )
    assert "tpu_custom_call" in lowered.as_text()
