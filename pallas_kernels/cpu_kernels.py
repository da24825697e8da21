"""Paged attention for XLA:CPU: plain `jnp` inside `lax` loops whose trip counts are data, so
a step pays for the tokens and cache positions it really has, not for its padded shape.

Why a third implementation beside the reference and the Pallas kernels: the reference
(reference.py) computes over the whole padded shape, every query block against all P pages
of its page table. That is what an oracle should do, and on CPU (where it used to serve every
step) it made a step's cost follow the compiled shape: a prefill step of two 256-token chunks
padded to (Sp 8, P 64) spent about 7x the attention of the two chunks themselves
(benchmarks/RESULTS.md, "Served path"). The Pallas kernels avoid that with grids bounded by
scalar-prefetched lengths; XLA:CPU has no such grids, but it runs `lax.while_loop`s whose
bounds are computed on the device. So here:

  ragged   query blocks of BQ tokens of one sequence each (layout.py), taken GB blocks at a
           time by a while loop that stops after the last REAL block; for each group, a
           second while loop walks the cache in chunks of C positions from the first chunk
           any of its queries may see (sliding window) to the last one it needs, with an
           online (flash-style) softmax. Padded sequences and blocks cost nothing; page-table
           padding costs nothing.
  decode   every row at once (one query each), the same chunk loop up to the longest row's
           length in the batch.

Same inputs, outputs and options as the reference (sliding window, soft cap, int8 pages with
per-token scales); results equal it to float32 rounding (tests/test_kernels.py checks all
three implementations against a float64 dense oracle, with NaN in every slot that must not
be read). `impl="auto"` picks this on CPU; `impl="reference"` still forces the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import layout, reference

# Positions per cache chunk and query rows per ragged group. Measured on SmolLM2-135M shapes
# on the 2-core CPU (benchmarks/RESULTS.md, "CPU attention loops"): an iteration costs a
# fixed ~0.1 ms of loop and gather overhead, so chunks much smaller than this lose to
# overhead and much larger ones to masked work past the real lengths.
KV_CHUNK = 256
GROUP_ROWS = 256
# Decode has one query per row, so a chunk's matmuls are small and the masked work past each
# row's length dominates sooner: 64 positions measured best or within 10% of best for 1-64
# rows at contexts 77-300 (benchmarks/RESULTS.md, "CPU attention loops").
DECODE_KV_CHUNK = 64


def _chunk_pages(page_table, chunk: int, pages_per_chunk: int):
    """page_table[..., chunk * n : (chunk + 1) * n] for a traced chunk index."""
    start = chunk * pages_per_chunk
    return jax.lax.dynamic_slice_in_dim(page_table, start, pages_per_chunk, axis=-1)


def _gather_chunk(pages, scales, layer, page_ids):
    """pages [L, K, num_pages, ps, hd], page_ids [R, n] -> [R, K, n * ps, hd] float32
    (dequantized with `scales` when given)."""
    num_kv_heads, page_size, head_dim = pages.shape[1], pages.shape[3], pages.shape[4]
    rows, n = page_ids.shape
    idx = jnp.stack(
        [jnp.broadcast_to(jnp.asarray(layer, jnp.int32), page_ids.shape), page_ids], axis=-1
    )  # [R, n, 2]

    def gather(x, tail):
        dims = jax.lax.GatherDimensionNumbers(
            offset_dims=(1, *range(3, 3 + len(tail))),
            collapsed_slice_dims=(0, 2),
            start_index_map=(0, 2),
        )
        return jax.lax.gather(x, idx, dims, (1, num_kv_heads, 1, *tail), mode="promise_in_bounds")

    x = gather(pages, (page_size, head_dim)).astype(jnp.float32)  # [R, K, n, ps, hd]
    if scales is not None:
        x = x * gather(scales, (page_size,))[..., None]
    return x.reshape(rows, num_kv_heads, n * page_size, head_dim)


def _online_update(carry, scores, mask, values):
    """One chunk of a flash-style softmax. scores [R, K, Q, C], mask broadcastable to it,
    values [R, K, C, hd]; carry (m [R, K, Q], l [R, K, Q], acc [R, K, Q, hd])."""
    m, l, acc = carry
    scores = jnp.where(mask, scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))  # [R, K, Q]
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.where(mask, jnp.exp(scores - m_safe[..., None]), 0.0)  # [R, K, Q, C]
    alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)  # [R, K, Q]
    l = alpha * l + jnp.sum(p, axis=-1)
    acc = alpha[..., None] * acc + jnp.einsum("rkqc,rkcd->rkqd", p, values)
    return m_new, l, acc


def _attend_chunks(
    q,
    q_pos,
    q_valid,
    kv_lens,
    page_table,
    lo,
    hi,
    k_pages,
    v_pages,
    k_scales,
    v_scales,
    layer,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    kv_chunk,
):
    """q [R, K, Q, hd] at positions q_pos [R, Q] (q_valid [R, Q]) of R sequences (kv_lens [R],
    page_table [R, P] padded to a multiple of the chunk's pages) over cache chunks lo..hi-1
    (traced ints). Returns [R, K, Q, hd] float32, zeros for rows that see nothing."""
    rows, num_kv_heads, nq, head_dim = q.shape
    page_size = k_pages.shape[3]
    per_chunk = kv_chunk // page_size
    offsets = jnp.arange(kv_chunk, dtype=jnp.int32)  # [C]

    if sliding_window is not None:  # each row's first visible position - 1
        big = jnp.iinfo(jnp.int32).max
        before = jnp.min(jnp.where(q_valid, q_pos, big), axis=1) - sliding_window  # [R]

    def body(state):
        c, carry = state
        ids = _chunk_pages(page_table, c, per_chunk)  # [R, n]
        keys = _gather_chunk(k_pages, k_scales, layer, ids)  # [R, K, C, hd]
        values = _gather_chunk(v_pages, v_scales, layer, ids)
        kv_pos = c * kv_chunk + offsets  # [C]
        in_cache = kv_pos[None, :] < kv_lens[:, None]  # [R, C]
        used = in_cache
        if sliding_window is not None:  # a chunk may start before the window: released pages
            used = used & (kv_pos[None, :] > before[:, None])
        values = jnp.where(used[:, None, :, None], values, 0.0)  # unwritten slots: NaN
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & in_cache[:, None, :]  # [R, Q, C]
        if sliding_window is not None:
            mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        mask &= q_valid[:, :, None]
        scores = jnp.einsum("rkqd,rkcd->rkqc", q, keys) * sm_scale  # [R, K, Q, C]
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        return c + 1, _online_update(carry, scores, mask[:, None], values)

    init = (
        jnp.full((rows, num_kv_heads, nq), -jnp.inf, jnp.float32),
        jnp.zeros((rows, num_kv_heads, nq), jnp.float32),
        jnp.zeros((rows, num_kv_heads, nq, head_dim), jnp.float32),
    )
    _, (_, l, acc) = jax.lax.while_loop(lambda s: s[0] < hi, body, (lo, init))
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def _chunk_size(page_size: int, want: int) -> int:
    return max(page_size, (want // page_size) * page_size)


def ragged_paged_attention_cpu(
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
    kv_chunk: int = KV_CHUNK,
    group_rows: int = GROUP_ROWS,
):
    num_tokens, num_heads, head_dim = q.shape
    num_s = kv_lens.shape[0]
    num_kv_heads, page_size = k_pages.shape[1], k_pages.shape[3]
    group = num_heads // num_kv_heads
    kv_chunk = _chunk_size(page_size, kv_chunk)
    page_table = layout.pad_page_table(page_table, kv_chunk // page_size)
    block_q = min(layout.pow2(max_query_len), layout.pow2(min(num_tokens, group_rows)))
    num_blocks = layout.num_query_blocks(num_tokens, num_s, max_query_len, block_q)
    per_group = max(1, group_rows // block_q)  # query blocks per loop iteration
    num_groups = -(-num_blocks // per_group)
    block_seq, block_idx, _ = layout.block_table(query_start, num_seqs, block_q, num_blocks)
    pad = num_groups * per_group - num_blocks
    block_seq = jnp.pad(block_seq, (0, pad), constant_values=-1)  # [NG * GB]
    block_idx = jnp.pad(block_idx, (0, pad))
    start, end = layout.kv_block_bounds(
        block_seq,
        block_idx,
        query_start,
        kv_lens,
        num_seqs,
        block_q=block_q,
        kv_block=kv_chunk,
        sliding_window=sliding_window,
    )  # [NG * GB] each, in chunks
    real_blocks = jnp.sum(block_seq >= 0)
    q_lens = layout.query_lens(query_start, num_seqs)  # [S]
    i = jnp.arange(block_q, dtype=jnp.int32)

    def body(state):
        g, out = state
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, g * per_group, per_group)  # noqa: E731
        bseq, bidx, bstart, bend = sl(block_seq), sl(block_idx), sl(start), sl(end)  # [GB]
        real = bseq >= 0
        seq = jnp.maximum(bseq, 0)
        q_len = q_lens[seq]  # [GB]
        pos_in_seq = bidx[:, None] * block_q + i[None, :]  # [GB, BQ]
        q_valid = real[:, None] & (pos_in_seq < q_len[:, None])
        rows = query_start[seq][:, None] + pos_in_seq  # [GB, BQ]
        q_pos = kv_lens[seq][:, None] - q_len[:, None] + pos_in_seq  # [GB, BQ]
        tile = q[jnp.clip(rows, 0, num_tokens - 1)].astype(jnp.float32)  # [GB, BQ, H, hd]
        tile = tile.reshape(per_group, block_q, num_kv_heads, group, head_dim)
        tile = tile.transpose(0, 2, 1, 3, 4).reshape(
            per_group, num_kv_heads, block_q * group, head_dim
        )  # [GB, K, BQ*G, hd]: row r is query r // G, head k * G + r % G
        big = jnp.iinfo(jnp.int32).max
        lo = jnp.min(jnp.where(real, bstart, big))
        hi = jnp.max(jnp.where(real, bend, 0))
        res = _attend_chunks(
            tile,
            jnp.repeat(q_pos, group, axis=1),
            jnp.repeat(q_valid, group, axis=1),
            kv_lens[seq],
            page_table[seq],
            lo,
            hi,
            k_pages,
            v_pages,
            k_scales,
            v_scales,
            layer,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            kv_chunk=kv_chunk,
        )  # [GB, K, BQ*G, hd]
        res = res.reshape(per_group, num_kv_heads, block_q, group, head_dim)
        res = res.transpose(0, 2, 1, 3, 4).reshape(per_group * block_q, num_heads, head_dim)
        dest = jnp.where(q_valid, rows, num_tokens).reshape(-1)  # invalid rows: dropped
        return g + 1, out.at[dest].set(res, mode="drop")

    out = jnp.zeros((num_tokens, num_heads, head_dim), jnp.float32)
    last_group = (real_blocks + per_group - 1) // per_group
    _, out = jax.lax.while_loop(lambda s: s[0] < last_group, body, (jnp.int32(0), out))
    return out.astype(q.dtype)


def decode_paged_attention_cpu(
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
    kv_chunk: int = DECODE_KV_CHUNK,
):
    """One query per sequence, q [S, H, hd] at position kv_lens - 1 (kv_lens 0: zeros).
    A page table of at most two chunks goes to the reference: the loop could save at most
    one chunk of masked work and costs more than that in loop overhead (decode64 at P 8 in
    benchmarks/step_profile.py)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pages.shape[1], k_pages.shape[3]
    group = num_heads // num_kv_heads
    kv_chunk = _chunk_size(page_size, kv_chunk)
    if page_table.shape[1] * page_size <= 2 * kv_chunk:
        return reference.decode_paged_attention_reference(
            q,
            k_pages,
            v_pages,
            kv_lens,
            page_table,
            layer,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            k_scales=k_scales,
            v_scales=v_scales,
        )
    page_table = layout.pad_page_table(page_table, kv_chunk // page_size)
    q_pos = (kv_lens - 1)[:, None]  # [S, 1]
    q_valid = (kv_lens > 0)[:, None]
    hi = (jnp.max(kv_lens) + kv_chunk - 1) // kv_chunk
    if sliding_window is None:
        lo = jnp.int32(0)
    else:
        first = jnp.maximum(kv_lens - sliding_window, 0) // kv_chunk
        lo = jnp.min(jnp.where(kv_lens > 0, first, hi)).astype(jnp.int32)
    qg = q.astype(jnp.float32).reshape(num_seqs, num_kv_heads, group, head_dim)
    out = _attend_chunks(
        qg,
        jnp.repeat(q_pos, group, axis=1),
        jnp.repeat(q_valid, group, axis=1),
        kv_lens,
        page_table,
        lo,
        hi,
        k_pages,
        v_pages,
        k_scales,
        v_scales,
        layer,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        kv_chunk=kv_chunk,
    )  # [S, K, G, hd]
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)
