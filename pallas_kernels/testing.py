"""Test and benchmark inputs: a paged cache built from per-sequence contiguous K/V, with every
slot that should never be read (other layers, unused pages, the null page, slots past
kv_lens, q padding rows) filled with NaN, plus a naive dense numpy attention to check
against. Used by tests/test_kernels.py and benchmarks/kernels_bench.py."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import INT8_MAX


@dataclasses.dataclass
class PagedCase:
    q: jnp.ndarray  # [T, H, hd]
    k_pages: jnp.ndarray  # [L, K, num_pages, page_size, hd]
    v_pages: jnp.ndarray
    k_scales: jnp.ndarray | None  # [L, K, num_pages, page_size]
    v_scales: jnp.ndarray | None
    kv_lens: jnp.ndarray  # [S] int32
    page_table: jnp.ndarray  # [S, P] int32
    query_start: jnp.ndarray  # [S + 1] int32
    num_seqs: jnp.ndarray  # [1] int32
    layer: int
    max_query_len: int
    keys: list  # per real sequence: [kv_len, K, hd] float64 (dequantized)
    values: list
    q_lens: list

    def attention_args(self):
        return (
            self.q,
            self.k_pages,
            self.v_pages,
            self.kv_lens,
            self.page_table,
            self.query_start,
            self.num_seqs,
            self.layer,
        )


def _quantize_np(x):
    scale = np.abs(x).max(axis=-1) / INT8_MAX
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.round(x / safe[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale.astype(np.float32)


def make_case(
    rng: np.random.Generator,
    *,
    kv_lens,
    q_lens,
    page_size,
    num_kv_heads,
    group,
    head_dim,
    dtype=jnp.float32,
    int8=False,
    num_layers=1,
    layer=0,
    pad_seqs=0,
    pad_tokens=0,
    extra_pages=2,
    shuffle=True,
    nan_fill=True,
    num_pages=None,
    pages_per_seq=None,
    num_tokens=None,
) -> PagedCase:
    """A ragged batch: sequence s has kv_lens[s] tokens cached (its last q_lens[s] are the
    queries). pad_seqs empty sequences and pad_tokens q rows are appended as padding.
    num_pages / pages_per_seq / num_tokens fix the array sizes (so cases of different
    lengths share one compiled function); by default they fit the lengths."""
    assert all(0 <= ql <= kl for ql, kl in zip(q_lens, kv_lens))
    fill = np.nan if nan_fill else 0.0
    num_real = len(kv_lens)
    pages_needed = [-(-n // page_size) for n in kv_lens]
    max_pages = pages_per_seq or max([1, *pages_needed]) + 1  # spare null entries
    num_pages = num_pages or 1 + sum(pages_needed) + extra_pages
    assert max(pages_needed, default=0) <= max_pages and sum(pages_needed) < num_pages
    ids = np.arange(1, num_pages)
    if shuffle:
        ids = rng.permutation(ids)
    kv_shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    k_pages = np.full(kv_shape, fill, np.float32)
    v_pages = np.full(kv_shape, fill, np.float32)
    page_table = np.zeros((num_real + pad_seqs, max_pages), np.int32)
    keys, values, cursor = [], [], 0
    for s, n in enumerate(kv_lens):
        kc = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
        vc = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
        kc = np.asarray(jnp.asarray(kc, dtype).astype(jnp.float32))  # round like the cache
        vc = np.asarray(jnp.asarray(vc, dtype).astype(jnp.float32))
        pages = ids[cursor : cursor + pages_needed[s]]
        cursor += pages_needed[s]
        page_table[s, : len(pages)] = pages
        pos = np.arange(n)
        k_pages[layer, :, pages[pos // page_size], pos % page_size] = kc
        v_pages[layer, :, pages[pos // page_size], pos % page_size] = vc
        keys.append(kc.astype(np.float64))
        values.append(vc.astype(np.float64))
    k_scales = v_scales = None
    if int8:
        k_pages, k_scales = _quantize_np(np.nan_to_num(k_pages))
        v_pages, v_scales = _quantize_np(np.nan_to_num(v_pages))
        unused = np.ones(kv_shape[:4], bool)
        for s, n in enumerate(kv_lens):
            pos = np.arange(n)
            unused[layer, :, page_table[s, pos // page_size], pos % page_size] = False
            pg, off = page_table[s, pos // page_size], pos % page_size
            keys[s] = (
                k_pages[layer, :, pg, off].astype(np.float64)
                * k_scales[layer, :, pg, off][..., None]
            )
            values[s] = (
                v_pages[layer, :, pg, off].astype(np.float64)
                * v_scales[layer, :, pg, off][..., None]
            )
        k_scales[unused] = fill
        v_scales[unused] = fill
    num_heads = num_kv_heads * group
    total = sum(q_lens)
    if num_tokens is not None:
        assert num_tokens >= total
        pad_tokens = num_tokens - total
    q = rng.standard_normal((total + pad_tokens, num_heads, head_dim)).astype(np.float32)
    q[total:] = fill
    query_start = np.concatenate([[0], np.cumsum(q_lens), np.full(pad_seqs, total)])
    cache_dtype = jnp.int8 if int8 else dtype
    return PagedCase(
        q=jnp.asarray(q, dtype),
        k_pages=jnp.asarray(k_pages, cache_dtype),
        v_pages=jnp.asarray(v_pages, cache_dtype),
        k_scales=None if k_scales is None else jnp.asarray(k_scales),
        v_scales=None if v_scales is None else jnp.asarray(v_scales),
        kv_lens=jnp.asarray(list(kv_lens) + [0] * pad_seqs, jnp.int32),
        page_table=jnp.asarray(page_table),
        query_start=jnp.asarray(query_start, jnp.int32),
        num_seqs=jnp.asarray([num_real], jnp.int32),
        layer=layer,
        max_query_len=max([1, *q_lens]),
        keys=keys,
        values=values,
        q_lens=list(q_lens),
    )


def naive_attention(case: PagedCase, *, sm_scale, sliding_window=None, soft_cap=None):
    """Dense float64 attention, one query at a time, from the contiguous K/V: [T, H, hd]."""
    q = np.asarray(case.q.astype(jnp.float32), np.float64)
    out = np.zeros_like(q)
    num_kv_heads = case.k_pages.shape[1]
    group = q.shape[1] // num_kv_heads
    start = 0
    for s, q_len in enumerate(case.q_lens):
        kv_len = case.keys[s].shape[0]
        for i in range(q_len):
            pos = kv_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                kh = case.keys[s][lo : pos + 1, h // group]  # [n, hd]
                vh = case.values[s][lo : pos + 1, h // group]
                logits = kh @ q[start + i, h] * sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                w = np.exp(logits - logits.max())
                out[start + i, h] = (w / w.sum()) @ vh
        start += q_len
    return out


def make_decode_case(
    rng: np.random.Generator, kv_lens, *, sm_scale, sliding_window=None, soft_cap=None, **kw
):
    """Decode inputs: (case, q [S, H, hd], expected [S, H, hd]). Empty slots (kv_len 0) get
    NaN queries and expect zeros."""
    case = make_case(rng, kv_lens=kv_lens, q_lens=[1 if n else 0 for n in kv_lens], **kw)
    expected = naive_attention(
        case, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
    )
    live = (np.asarray(kv_lens) > 0)[:, None, None]
    rows = np.minimum(np.asarray(case.query_start[: len(kv_lens)]), case.q.shape[0] - 1)
    q = np.where(live, np.asarray(case.q.astype(jnp.float32))[rows], np.nan)
    return case, jnp.asarray(q, case.q.dtype), np.where(live, expected[rows], 0.0)
