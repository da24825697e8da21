"""Plain-`jnp` references: the KV write, ragged paged attention and decode paged attention.

These are the CPU path (fast under XLA) and the oracle the Pallas kernels are tested against.
The ragged reference cuts the flat batch into query blocks of BQ tokens of ONE sequence each
(pallas_kernels/layout.py) and attends each block against its sequence's gathered pages:

    q [T, H, hd] --(gather block rows)--> qb [NB, BQ, H, hd]    NB <= cdiv(T, BQ) + S
    pages (layer, page_table[block_seq])  (ONE gather: no per-layer copy of the cache)
        -> [K, NB, P*ps, hd]: keys at positions 0 .. P*ps-1 of the block's sequence
    scores [K, NB, BQ, G, N], masked causally / by window, softmax, @ V -> [NB, BQ, H, hd]
    --(gather back: token t -> (its block, its row))--> [T, H, hd]

BQ (static) follows the average query length T / S: many short prompts get small blocks,
so no sequence is padded to `max_query_len` (39 prompts of 13 tokens in a 512-token group:
96 blocks x 16 rows instead of 64 x 256 padded rows); one long chunk gets one block, so
its pages are gathered once.

Masked-out K/V positions may hold anything (the tests fill them with NaN), so V is zeroed
where the mask is false, and fully masked rows (padding, empty sequences) yield zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import layout

INT8_MAX = 127.0


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row absmax int8 quantization over the last axis: x ~= q * scale[..., None]."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / INT8_MAX  # [...]
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / safe[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def write_kv_reference(
    k_pages, v_pages, k, v, slot_mapping, layer, *, k_scales=None, v_scales=None
):
    """Scatter k, v [T, K, hd] into the slots of layer `layer` (in place when donated)."""
    page_size = k_pages.shape[3]
    page = slot_mapping // page_size  # [T]
    offset = slot_mapping % page_size  # [T]
    # Advanced indices (layer, page, offset) are split by a slice, so the indexed shape is
    # [T, K, hd]: exactly k's layout.
    if k_scales is None:
        k_pages = k_pages.at[layer, :, page, offset].set(k.astype(k_pages.dtype))
        v_pages = v_pages.at[layer, :, page, offset].set(v.astype(v_pages.dtype))
        return k_pages, v_pages, None, None
    kq, ks = quantize_int8(k)  # [T, K, hd], [T, K]
    vq, vs = quantize_int8(v)
    k_pages = k_pages.at[layer, :, page, offset].set(kq)
    v_pages = v_pages.at[layer, :, page, offset].set(vq)
    k_scales = k_scales.at[layer, :, page, offset].set(ks)
    v_scales = v_scales.at[layer, :, page, offset].set(vs)
    return k_pages, v_pages, k_scales, v_scales


def _gather_pages(pages, scales, page_table, layer, *, seq_major: bool = False):
    """Keys or values of every sequence, float32: [K, S, N, hd] (head-major) or, with
    `seq_major`, [S, K, N, hd]; N = P * page_size.

    ONE gather of (layer, page) pairs whose output is already in the order the dots batch
    over ((K, S) or (S, K)), so no transposed copy of the gathered pages is made."""
    num_kv_heads, page_size, head_dim = pages.shape[1], pages.shape[3], pages.shape[4]
    layer_ids = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), page_table.shape)
    idx = jnp.stack([layer_ids, page_table], axis=-1)  # [S, P, 2]
    head_dim_at = 1 if seq_major else 0  # where the K slice dimension lands in the output

    def gather(x, slice_tail):  # x [L, K, num_pages, ...] -> [K, S, P, ...] or [S, K, P, ...]
        dims = jax.lax.GatherDimensionNumbers(
            offset_dims=(head_dim_at, *range(3, 3 + len(slice_tail))),
            collapsed_slice_dims=(0, 2),
            start_index_map=(0, 2),
        )
        sizes = (1, num_kv_heads, 1, *slice_tail)
        return jax.lax.gather(x, idx, dims, sizes, mode="promise_in_bounds")

    x = gather(pages, (page_size, head_dim)).astype(jnp.float32)  # [., ., P, ps, hd]
    if scales is not None:
        x = x * gather(scales, (page_size,))[..., None]  # [., ., P, ps, 1]
    a, b, p = x.shape[:3]
    return x.reshape(a, b, p * page_size, head_dim)


def _softmax_rows(scores, mask):
    """Softmax over the last axis where `mask` holds (broadcast against scores); rows with
    no allowed position give zeros."""
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    return probs / jnp.where(denom > 0, denom, 1.0)


def attend_padded(
    qs,
    q_pos,
    q_valid,
    k_pages,
    v_pages,
    kv_lens,
    page_table,
    layer,
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    k_scales=None,
    v_scales=None,
):
    """Attention of per-sequence padded queries qs [S, Qm, H, hd] at positions q_pos [S, Qm]
    (rows with q_valid False give zeros) over each sequence's pages. Returns [S, Qm, H, hd]
    float32.

    Both products are batched dots over (K, S). Decode (one query per sequence) has its own
    sequence-major version below, `decode_paged_attention_reference`."""
    num_seqs, qm, num_heads, head_dim = qs.shape
    num_kv_heads = k_pages.shape[1]
    group = num_heads // num_kv_heads
    keys = _gather_pages(k_pages, k_scales, page_table, layer)  # [K, S, N, hd]
    values = _gather_pages(v_pages, v_scales, page_table, layer)  # [K, S, N, hd]
    n = keys.shape[2]
    kv_pos = jnp.arange(n, dtype=jnp.int32)  # [N]
    in_cache = kv_pos[None, :] < kv_lens[:, None]  # [S, N]
    used = in_cache
    if sliding_window is not None:  # before every query's window: may be released pages
        first = jnp.min(jnp.where(q_valid, q_pos, jnp.iinfo(jnp.int32).max), axis=1)  # [S]
        used = used & (kv_pos[None, :] > first[:, None] - sliding_window)
    values = jnp.where(used[None, :, :, None], values, 0.0)

    qg = qs.astype(jnp.float32).reshape(num_seqs, qm, num_kv_heads, group, head_dim)
    qg = qg.transpose(2, 0, 1, 3, 4)  # [K, S, Qm, G, hd]
    scores = jnp.einsum("ksqgd,ksnd->ksqgn", qg, keys)  # [K, S, Qm, G, N]
    scores = scores * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & in_cache[:, None, :]  # [S, Qm, N]
    if sliding_window is not None:
        mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    mask &= q_valid[:, :, None]
    mask = mask[None, :, :, None]  # [1, S, Qm, 1, N]
    probs = _softmax_rows(scores, mask)  # [K, S, Qm, G, N]
    out = jnp.einsum("ksqgn,ksnd->ksqgd", probs, values)  # [K, S, Qm, G, hd]
    return out.transpose(1, 2, 0, 3, 4).reshape(num_seqs, qm, num_heads, head_dim)


def token_to_seq(query_start, num_seqs, num_tokens):
    """For each flat token row: its sequence, its index inside that sequence, and whether
    it is a real row (not padding beyond query_start[num_seqs])."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    num_s = query_start.shape[0] - 1
    seq = jnp.searchsorted(query_start[1:], rows, side="right").astype(jnp.int32)  # [T]
    seq = jnp.minimum(seq, num_s - 1)
    idx = rows - query_start[seq]
    valid = (rows < query_start[num_seqs[0]]) & (idx >= 0)
    return seq, idx, valid


def ragged_block_q(num_tokens: int, num_seqs_padded: int, max_query_len: int) -> int:
    """Static query-block size of the reference: the power of two nearest above the mean
    query length T / S, at least 16 (fewer re-gathers of a sequence's pages than rows) and
    at most pow2(max_query_len)."""
    mean = max(1, num_tokens // max(1, num_seqs_padded))
    return min(layout.pow2(max_query_len), max(16, layout.pow2(mean)))


def ragged_paged_attention_reference(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_table,
    query_start,
    num_seqs,
    layer,
    *,
    sm_scale,
    max_query_len,
    sliding_window=None,
    soft_cap=None,
    k_scales=None,
    v_scales=None,
):
    num_tokens, num_s = q.shape[0], kv_lens.shape[0]
    block_q = ragged_block_q(num_tokens, num_s, max_query_len)
    num_blocks = layout.num_query_blocks(num_tokens, num_s, max_query_len, block_q)
    block_seq, block_idx, first_block = layout.block_table(
        query_start, num_seqs, block_q, num_blocks
    )  # [NB], [NB], [S]
    seq = jnp.maximum(block_seq, 0)  # [NB]
    q_len = layout.query_lens(query_start, num_seqs)[seq]  # [NB]
    i = block_idx[:, None] * block_q + jnp.arange(block_q, dtype=jnp.int32)[None, :]  # [NB, BQ]
    rows = jnp.clip(query_start[seq][:, None] + i, 0, num_tokens - 1)  # [NB, BQ]
    q_valid = (block_seq >= 0)[:, None] & (i < q_len[:, None])  # [NB, BQ]
    q_pos = kv_lens[seq][:, None] - q_len[:, None] + i  # [NB, BQ]
    out = attend_padded(
        q[rows],
        q_pos,
        q_valid,
        k_pages,
        v_pages,
        kv_lens[seq],
        page_table[seq],
        layer,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scales=k_scales,
        v_scales=v_scales,
    )  # [NB, BQ, H, hd]
    tok_seq, tok_idx, valid = token_to_seq(query_start, num_seqs, num_tokens)  # [T] each
    block = jnp.clip(first_block[tok_seq] + tok_idx // block_q, 0, num_blocks - 1)
    flat = out[block, jnp.clip(tok_idx, 0) % block_q]  # [T, H, hd]
    return jnp.where(valid[:, None, None], flat, 0.0).astype(q.dtype)


def decode_paged_attention_reference(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_table,
    layer,
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    k_scales=None,
    v_scales=None,
):
    """One query per sequence, q [S, H, hd] at position kv_lens - 1 (kv_lens 0: zeros).

    Sequence-major throughout: q [S, H, hd] already is [S, K, G, hd], so with the pages
    gathered as [S, K, N, hd] both dots batch over (S, K) and the output reshapes to
    [S, H, hd] with no transposed copy (attend_padded's head-major order needs one for q
    and one for the output). Same products, same results. In the 64-way SmolLM2 decode step
    the attention's profiled op time drops from ~43 to ~35 ms, but the step's process CPU
    time moved < 1% (XLA's workers spin in the gaps; benchmarks/RESULTS.md, "64-way decode,
    part 2"): kept because it is the simpler layout, not for speed."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[1]
    group = num_heads // num_kv_heads
    keys = _gather_pages(k_pages, k_scales, page_table, layer, seq_major=True)  # [S, K, N, hd]
    values = _gather_pages(v_pages, v_scales, page_table, layer, seq_major=True)
    kv_pos = jnp.arange(keys.shape[2], dtype=jnp.int32)  # [N]
    # causal for the one query at kv_lens - 1 is exactly "in the cache"
    mask = kv_pos[None, :] < kv_lens[:, None]  # [S, N]
    if sliding_window is not None:  # pages before the window may be released: never used
        mask &= kv_pos[None, :] > (kv_lens - 1)[:, None] - sliding_window
    values = jnp.where(mask[:, None, :, None], values, 0.0)  # unwritten slots may hold NaN
    qg = q.astype(jnp.float32).reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = jnp.einsum("skgd,sknd->skgn", qg, keys) * sm_scale  # [S, K, G, N]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    probs = _softmax_rows(scores, mask[:, None, None, :])  # [S, K, G, N]
    out = jnp.einsum("skgn,sknd->skgd", probs, values)  # [S, K, G, hd]
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)
