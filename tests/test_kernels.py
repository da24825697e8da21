"""Paged attention, one module for every implementation: the jnp reference (the oracle), the jnp
loops of cpu_kernels.py (the CPU path), the Pallas GPU kernels (Triton lowering) and the Pallas
TPU kernel, both kernels in interpret mode on CPU, each against naive dense float64 attention.
Every slot that must never be read is NaN (the TPU interpreter also raises on out-of-bounds
reads).

Each test takes `impl`; each implementation has its own case list because interpret mode
costs differ: the GPU kernels sweep a sample of the product of page sizes, GQA ratios, head
dims, dtypes and int8 KV, two ragged batches per configuration at the same array sizes (one
compile); TPU interpret mode runs each grid step on the host, so its cases are the smallest
that still cover every value. Kernel cases carry the `interpret` marker (left out of `make
test-fast`). Also here: both kernels lower for CUDA / TPU on this CPU-only machine, the KV
write, and the validation errors of the public functions (shared by every impl).
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.testing import make_case, make_decode_case, naive_attention

F32, BF16 = jnp.float32, jnp.bfloat16
KERNELS = ("gpu", "tpu")
# Per impl: KV heads and padding of the ragged sweep (TPU: one KV head, fewer grid steps).
RAGGED_SETUP = {
    "reference": {"num_kv_heads": 2, "pad_seqs": 1, "pad_tokens": 3},
    "cpu": {"num_kv_heads": 2, "pad_seqs": 2, "pad_tokens": 5},
    "gpu": {"num_kv_heads": 2, "pad_seqs": 1, "pad_tokens": 9},
    "tpu": {"num_kv_heads": 1, "pad_seqs": 1, "pad_tokens": 2},
}


def _params(cases):
    """pytest params from (impl, *values) tuples; kernel cases get the `interpret` mark.
    The id names the scalar values (dtype by name); batch lists stay out of it."""
    marks = lambda impl: [pytest.mark.interpret] if impl in KERNELS else []
    name = lambda v: getattr(v, "__name__", str(v))
    ids = ["-".join(name(v) for v in c if not isinstance(v, tuple)) for c in cases]
    return [pytest.param(*c, marks=marks(c[0]), id=i) for c, i in zip(cases, ids)]


def _check(out, expected, dtype, impl):
    tol = (1e-4 if impl in ("reference", "cpu") else 2e-4) if dtype == F32 else 3e-2
    out = np.asarray(jnp.asarray(out, jnp.float32))
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, expected, atol=tol, rtol=tol)


def _ragged(impl, case, **kw):
    kw.setdefault("max_query_len", case.max_query_len)
    return pk.ragged_paged_attention(
        *case.attention_args(),
        k_scales=case.k_scales,
        v_scales=case.v_scales,
        impl=impl,
        interpret=True,
        **kw,
    )


def _decode(impl, case, q, **kw):
    return pk.decode_paged_attention(
        q,
        case.k_pages,
        case.v_pages,
        case.kv_lens,
        case.page_table,
        case.layer,
        k_scales=case.k_scales,
        v_scales=case.v_scales,
        impl=impl,
        interpret=True,
        **kw,
    )


def _fixed_sizes(batches, page_size):
    """Array sizes that fit every batch, so one compiled function serves them all."""
    pages = [[-(-n // page_size) for n in kv_lens] for kv_lens, *_ in batches]
    return {
        "num_pages": 1 + max(map(sum, pages)) + 2,
        "pages_per_seq": max(max(p, default=0) for p in pages) + 1,
    }


def _gpu_batches(ps):
    """(kv_lens, q_lens): decode of a 1-token sequence, an empty sequence, a chunk ending on
    a page boundary, a chunk starting mid-page and crossing a boundary, a whole prompt; then
    a one-page prefill, a decode just past a boundary, a long chunk over 3 pages, ..."""
    return (
        ([1, 0, 2 * ps, 2 * ps + 5, 13], [1, 0, 16, 9, 13]),
        ([ps, ps + 1, 3 * ps - 1, 2, 7], [8, 1, 20, 2, 1]),
    )


def _tpu_batch(ps):
    # 1-token decode, empty sequence, mid-page chunk crossing a boundary, whole prompt.
    return (([1, 0, ps + 5, 11], [1, 0, 7, 11]),)


_ONE_PAGE_PREFILL = (([16, 17, 5], [16, 3, 5]),)  # one whole page, decode-ish, short
_MID_PAGE_CHUNK = (([40, 0, 9, 32], [7, 0, 1, 32]),)  # chunk after cache, empty, 2 pages
# (impl, page_size, group, head_dim, dtype, int8, batches)
RAGGED_CASES = [
    ("reference", 8, 1, 64, F32, False, (([1], [1]),)),
    ("reference", 16, 3, 128, F32, False, _ONE_PAGE_PREFILL),
    ("reference", 32, 4, 64, F32, False, _MID_PAGE_CHUNK),
    ("reference", 64, 8, 64, F32, False, _MID_PAGE_CHUNK),
    ("reference", 8, 4, 128, BF16, False, _MID_PAGE_CHUNK),
    ("reference", 16, 8, 64, BF16, False, _ONE_PAGE_PREFILL),
    ("reference", 8, 3, 64, F32, True, (([20, 8], [4, 8]),)),
    ("cpu", 8, 1, 64, F32, False, (([1], [1]),)),
    ("cpu", 16, 3, 128, F32, False, _ONE_PAGE_PREFILL),
    ("cpu", 32, 4, 64, F32, False, _MID_PAGE_CHUNK),
    ("cpu", 8, 4, 128, BF16, False, _MID_PAGE_CHUNK),
    ("cpu", 8, 3, 64, F32, True, (([20, 8], [4, 8]),)),
    ("cpu", 16, 2, 64, F32, True, _gpu_batches(16)),
    ("gpu", 8, 1, 64, F32, False, _gpu_batches(8)),
    ("gpu", 16, 3, 128, F32, False, _gpu_batches(16)),
    ("gpu", 32, 4, 64, BF16, False, _gpu_batches(32)),
    ("gpu", 64, 8, 64, F32, False, _gpu_batches(64)),
    ("gpu", 8, 4, 64, F32, True, _gpu_batches(8)),
    ("gpu", 16, 8, 128, BF16, True, _gpu_batches(16)),
    ("tpu", 8, 3, 64, F32, False, _tpu_batch(8)),
    ("tpu", 16, 4, 128, BF16, False, _tpu_batch(16)),
    ("tpu", 32, 1, 64, F32, True, _tpu_batch(32)),
    ("tpu", 64, 8, 64, BF16, True, _tpu_batch(64)),
]


@pytest.mark.parametrize("impl,page_size,group,head_dim,dtype,int8,batches", _params(RAGGED_CASES))
def test_ragged_matches_naive(impl, page_size, group, head_dim, dtype, int8, batches):
    setup = RAGGED_SETUP[impl]
    rng = np.random.default_rng(page_size * 10 + group)
    sizes = _fixed_sizes(batches, page_size)
    num_tokens = max(sum(q_lens) for _, q_lens in batches) + setup["pad_tokens"]
    max_query_len = max(max(q_lens) for _, q_lens in batches)
    for kv_lens, q_lens in batches:
        case = make_case(
            rng,
            kv_lens=kv_lens,
            q_lens=q_lens,
            page_size=page_size,
            num_kv_heads=setup["num_kv_heads"],
            group=group,
            head_dim=head_dim,
            dtype=dtype,
            int8=int8,
            pad_seqs=setup["pad_seqs"],
            num_tokens=num_tokens,
            **sizes,
        )
        out = _ragged(impl, case, sm_scale=head_dim**-0.5, max_query_len=max_query_len)
        chex.assert_shape(out, case.q.shape)
        chex.assert_type(out, dtype)
        _check(out, naive_attention(case, sm_scale=head_dim**-0.5), dtype, impl)
        assert np.all(np.asarray(out)[sum(q_lens) :] == 0)  # padding rows are zeros


def _decode_lists(ps):
    return (
        [1, 0, ps, ps + 1, 3 * ps - 1],
        [2 * ps, 5, 0, 1, 4 * ps],
    )


# (impl, page_size, group, head_dim, dtype, int8, kv_lens lists)
DECODE_CASES = [
    ("reference", 16, 4, 64, F32, False, ([1, 0, 16, 33],)),
    ("cpu", 16, 4, 64, F32, False, ([1, 0, 16, 33],)),
    ("cpu", 8, 4, 64, F32, True, _decode_lists(8)),
    ("gpu", 8, 1, 64, F32, False, _decode_lists(8)),
    ("gpu", 32, 4, 64, BF16, False, _decode_lists(32)),
    ("gpu", 8, 4, 64, F32, True, _decode_lists(8)),
    ("gpu", 16, 8, 128, BF16, True, _decode_lists(16)),
    ("tpu", 16, 3, 64, F32, True, ([1, 0, 16, 33],)),  # BQ = 1 tiles
]


@pytest.mark.parametrize(
    "impl,page_size,group,head_dim,dtype,int8,kv_lens_lists", _params(DECODE_CASES)
)
def test_decode_matches_naive_and_empty_slots_are_zero(
    impl, page_size, group, head_dim, dtype, int8, kv_lens_lists
):
    rng = np.random.default_rng(page_size + group)
    sizes = _fixed_sizes([(k,) for k in kv_lens_lists], page_size)
    for kv_lens in kv_lens_lists:
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
            **sizes,
        )
        out = _decode(impl, case, q, sm_scale=0.2)
        _check(out, expected, dtype, impl)
        assert np.all(np.asarray(out)[np.asarray(kv_lens) == 0] == 0)


WINDOW_CASES = [
    ("reference", 5, None),
    ("reference", None, 2.0),
    ("reference", 9, 1.5),
    ("cpu", 5, None),
    ("cpu", 9, 1.5),
    ("gpu", 6, None),
    ("gpu", 20, 2.5),
]


@pytest.mark.parametrize("impl,window,cap", _params(WINDOW_CASES))
def test_window_and_soft_cap(impl, window, cap):
    rng = np.random.default_rng(window or 0)
    opts = {"sm_scale": 0.2, "sliding_window": window, "soft_cap": cap}
    case = make_case(
        rng,
        kv_lens=[40, 3, 17],
        q_lens=[12, 3, 1],
        page_size=8,
        num_kv_heads=1,
        group=4,
        head_dim=64,
    )
    _check(_ragged(impl, case, **opts), naive_attention(case, **opts), F32, impl)
    dcase, q, expected = make_decode_case(
        rng, [40, 0, 9], **opts, page_size=8, num_kv_heads=1, group=4, head_dim=64
    )
    _check(_decode(impl, dcase, q, **opts), expected, F32, impl)


# (impl, num_layers, layer, sliding_window, soft_cap)
LAYER_CASES = [
    ("reference", 2, 1, None, None),
    ("reference", 3, 2, None, None),
    ("reference", 3, 0, None, None),
    ("cpu", 3, 2, 9, 2.0),
    ("gpu", 3, 2, None, None),
    ("tpu", 2, 1, 9, 2.0),
]


@pytest.mark.parametrize("impl,num_layers,layer,window,cap", _params(LAYER_CASES))
def test_layer_of_stacked_cache_static_and_traced(impl, num_layers, layer, window, cap):
    """Only that layer is read (the others are NaN), with `layer` a Python int or a traced
    int32 inside jit (as under the model's lax.scan)."""
    case = make_case(
        np.random.default_rng(layer),
        kv_lens=[9, 20],
        q_lens=[3, 1],
        page_size=8,
        num_kv_heads=2,
        group=2,
        head_dim=64,
        num_layers=num_layers,
        layer=layer,
    )
    opts = {"sm_scale": 0.1, "sliding_window": window, "soft_cap": cap}
    expected = naive_attention(case, **opts)
    if impl in ("reference", "cpu"):  # the kernels' static-layer path is every other test's
        _check(_ragged(impl, case, **opts), expected, F32, impl)
    args = case.attention_args()[:-1]
    traced = jax.jit(
        lambda lyr: pk.ragged_paged_attention(
            *args, lyr, max_query_len=case.max_query_len, impl=impl, interpret=True, **opts
        )
    )
    _check(traced(jnp.int32(layer)), expected, F32, impl)


@pytest.mark.parametrize("impl", _params([("reference",), ("cpu",), ("gpu",), ("tpu",)]))
def test_decode_only_ragged_batch(impl):
    """max_query_len=1 (what the engine passes for decode-only steps) with empty and padded
    sequences and padding rows."""
    case = make_case(
        np.random.default_rng(9),
        kv_lens=[17, 0, 32, 5],
        q_lens=[1, 0, 1, 1],
        page_size=16,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        pad_seqs=2,
        pad_tokens=3,
    )
    _check(_ragged(impl, case, sm_scale=0.2), naive_attention(case, sm_scale=0.2), F32, impl)


# Each seed builds ~18 loop programs (tens of seconds of CPU): `make test` sweeps all four, a
# run without `compile` tests seed 0 (the others are marked `compile`).
@pytest.mark.parametrize(
    "seed", [0, *(pytest.param(s, marks=pytest.mark.compile) for s in range(1, 4))]
)
def test_cpu_loops_any_chunk_and_group_size(seed):
    """The CPU loops with chunks of one page up to many and groups of one query block up to
    several: every loop bound (first chunk of a sliding window, the last real block, a
    group mixing sequences, padded sequences and rows) against the float64 oracle."""
    from pallas_kernels import cpu_kernels

    rng = np.random.default_rng(seed)
    ps = int(rng.choice([8, 16]))
    for _ in range(3):
        kv_lens = [int(n) for n in rng.integers(0, 70, size=int(rng.integers(1, 5)))]
        q_lens = [max(1, int(rng.integers(0, n + 1))) if n else 0 for n in kv_lens]
        window, cap = [None, 5, 13][int(rng.integers(0, 3))], [None, 2.0][int(rng.integers(0, 2))]
        opts = {"sm_scale": 0.3, "sliding_window": window, "soft_cap": cap}
        shape = {"page_size": ps, "num_kv_heads": 2, "group": 3, "head_dim": 16}
        int8 = bool(rng.integers(0, 2))
        case = make_case(rng, kv_lens=kv_lens, q_lens=q_lens, int8=int8, pad_seqs=2, **shape)
        expected = naive_attention(case, **opts)
        dcase, q, dexpected = make_decode_case(rng, kv_lens, int8=int8, **opts, **shape)
        for chunk, rows in ((ps, ps), (2 * ps, 32), (256, 256)):
            out = cpu_kernels.ragged_paged_attention_cpu(
                *case.attention_args(),
                k_scales=case.k_scales,
                v_scales=case.v_scales,
                max_query_len=case.max_query_len,
                kv_chunk=chunk,
                group_rows=rows,
                **opts,
            )
            _check(out, expected, F32, "cpu")
            out = cpu_kernels.decode_paged_attention_cpu(
                q,
                dcase.k_pages,
                dcase.v_pages,
                dcase.kv_lens,
                dcase.page_table,
                dcase.layer,
                k_scales=dcase.k_scales,
                v_scales=dcase.v_scales,
                kv_chunk=chunk,
                **opts,
            )
            _check(out, dexpected, F32, "cpu")


@pytest.mark.interpret
def test_gpu_decode_many_splits_including_empty_ones(monkeypatch):
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
    _check(fn(q, case.k_pages, case.v_pages, case.kv_lens, case.page_table), expected, F32, "gpu")


# impl -> (lowering platform, custom call in the lowered text, GQA group)
LOWERING = {"gpu": ("cuda", "triton", 3), "tpu": ("tpu", "tpu_custom_call", 4)}


@pytest.mark.parametrize("impl,int8", _params([(i, q) for i in KERNELS for q in (False, True)]))
def test_kernels_lower_for_the_device_on_cpu(impl, int8):
    """Ragged and decode (bf16, window, soft cap) lower for CUDA / TPU without the device."""
    platform, custom_call, group = LOWERING[impl]
    case = make_case(
        np.random.default_rng(0),
        kv_lens=[40, 9],
        q_lens=[7, 1],
        page_size=16,
        num_kv_heads=2,
        group=group,
        head_dim=128,
        dtype=BF16,
        int8=int8,
    )
    opts = {"sm_scale": 0.1, "sliding_window": 7, "soft_cap": 3.0, "impl": impl}

    def step(q, kp, vp, kl, pt, qs, ns, ks, vs):
        scales = {"k_scales": ks, "v_scales": vs}
        out = pk.ragged_paged_attention(
            q, kp, vp, kl, pt, qs, ns, jnp.int32(0), max_query_len=8, **scales, **opts
        )
        dec = pk.decode_paged_attention(q[:2], kp, vp, kl, pt, jnp.int32(0), **scales, **opts)
        return out, dec

    lowered = (
        jax.jit(step)
        .trace(*case.attention_args()[:-1], case.k_scales, case.v_scales)
        .lower(lowering_platforms=(platform,))
    )
    assert lowered.as_text().count(custom_call) >= 2


# ---- the KV write (one implementation for every impl) -----------------------------------
@pytest.mark.parametrize("int8", [False, True])
def test_write_kv_then_attention_equals_dense(int8):
    """Write a whole prompt token by token chunk through write_kv, then attend."""
    rng = np.random.default_rng(5)
    num_layers, kv_heads, page_size, head_dim, n = 2, 2, 8, 64, 13
    shape = (num_layers, kv_heads, 6, page_size, head_dim)
    dtype = jnp.int8 if int8 else F32
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
    q = jnp.asarray(rng.standard_normal((n, 2 * kv_heads, head_dim)), F32)
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


# ---- validation (the public functions check before dispatching to any impl) -------------
_good_case = functools.partial(
    make_case, kv_lens=[5], q_lens=[2], page_size=8, num_kv_heads=2, group=2, head_dim=64
)
_ARG_NAMES = ("q", "k_pages", "v_pages", "kv_lens", "page_table", "query_start", "num_seqs")


@pytest.mark.parametrize(
    "field,bad,match",
    [
        (
            "kv_lens",
            lambda c: c.kv_lens.astype(jnp.int64 if jax.config.x64_enabled else F32),
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
    case = _good_case(np.random.default_rng(0))
    kwargs = dict(zip((*_ARG_NAMES, "layer"), case.attention_args()))
    kwargs[field] = bad(case)
    with pytest.raises(ValueError, match=match):
        pk.ragged_paged_attention(**kwargs, sm_scale=0.1, max_query_len=2)


def test_other_validation_errors():
    case = _good_case(np.random.default_rng(0))
    args = case.attention_args()
    scales = jnp.zeros(case.k_pages.shape[:4])
    with pytest.raises(ValueError, match="max_query_len"):
        pk.ragged_paged_attention(*args, sm_scale=0.1, max_query_len=0)
    with pytest.raises(ValueError, match="impl"):
        pk.ragged_paged_attention(*args, sm_scale=0.1, max_query_len=2, impl="cuda")
    with pytest.raises(ValueError, match="k_scales"):
        pk.ragged_paged_attention(*args, sm_scale=0.1, max_query_len=2, k_scales=scales)
    with pytest.raises(ValueError, match="k_pages"):  # float cache with scales
        pk.ragged_paged_attention(
            *args, sm_scale=0.1, max_query_len=2, k_scales=scales, v_scales=scales
        )
    with pytest.raises(ValueError, match="q has shape"):
        pk.decode_paged_attention(case.q, *args[1:5], 0, sm_scale=0.1)
    with pytest.raises(ValueError, match="slot_mapping"):
        pk.write_kv(
            case.k_pages, case.v_pages, case.q[:, :2], case.q[:, :2], jnp.zeros((3,), jnp.int32), 0
        )
    with pytest.raises(ValueError, match="k has shape"):
        pk.write_kv(case.k_pages, case.v_pages, case.q, case.q, jnp.zeros((2,), jnp.int32), 0)


def _release_before_window(case, window, page_size):
    """NaN in every page that lies wholly before the window of its sequence's first query
    (what local-layer page release may have handed to someone else)."""
    k, v = np.array(case.k_pages), np.array(case.v_pages)
    table = np.asarray(case.page_table)
    for s, q_len in enumerate(case.q_lens):
        first_visible = int(case.kv_lens[s]) - q_len - window + 1
        for i in range(max(0, first_visible) // page_size):
            k[case.layer, :, table[s, i]] = np.nan
            v[case.layer, :, table[s, i]] = np.nan
    return dataclasses.replace(case, k_pages=jnp.asarray(k), v_pages=jnp.asarray(v))


@pytest.mark.parametrize("impl", _params([("reference",), ("cpu",), ("gpu",)]))
def test_pages_before_the_window_are_never_used(impl):
    """A page table entry of a page before every query's window is never used (its content
    may be anything, NaN here); the chunk or block that holds it is still read."""
    rng = np.random.default_rng(7)
    opts = {"sm_scale": 0.2, "sliding_window": 20}
    sizes = dict(page_size=8, num_kv_heads=1, group=4, head_dim=64)
    case = make_case(rng, kv_lens=[300, 40, 17], q_lens=[12, 3, 1], **sizes)
    expected = naive_attention(case, **opts)
    _check(_ragged(impl, _release_before_window(case, 20, 8), **opts), expected, F32, impl)
    dcase, q, expected = make_decode_case(rng, [300, 0, 45], **opts, **sizes)
    dcase = _release_before_window(dcase, 20, 8)
    _check(_decode(impl, dcase, q, **opts), expected, F32, impl)
