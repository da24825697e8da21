"""Index bookkeeping shared by the kernels, done in jnp outside them (all O(S) or O(T)).

The ragged batch is cut into query blocks of BQ tokens of ONE sequence each, numbered over
the whole batch:

    sequence   0: 5 queries   1: 1 query   2: 0   3: 9 queries       (BQ = 4)
    blocks     g=0 g=1        g=2                 g=3 g=4 g=5        g>=6: past the end
    block_seq  0   0          1                   3   3   3          -1
    block_idx  0   1          0                   0   1   2

so the number of blocks is at most cdiv(T, BQ) + S, whatever the mix of prefill chunks and
decodes (a per-sequence [S, max_query_len] padding would be S * max_query_len rows).
"""

from __future__ import annotations

import jax.numpy as jnp


def pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def num_query_blocks(
    num_tokens: int, num_seqs_padded: int, max_query_len: int, block_q: int
) -> int:
    """Static upper bound on the number of query blocks of a batch."""
    return min(
        -(-num_tokens // block_q) + num_seqs_padded, num_seqs_padded * -(-max_query_len // block_q)
    )


def query_lens(query_start, num_seqs):
    seq_ids = jnp.arange(query_start.shape[0] - 1, dtype=jnp.int32)
    return jnp.where(seq_ids < num_seqs[0], query_start[1:] - query_start[:-1], 0)  # [S]


def block_table(query_start, num_seqs, block_q: int, num_blocks: int):
    """For each query block g: its sequence (-1 past the end) and its index in that
    sequence; and for each sequence the number of its first block."""
    num_s = query_start.shape[0] - 1
    n_blocks = (query_lens(query_start, num_seqs) + block_q - 1) // block_q  # [S]
    ends = jnp.cumsum(n_blocks)
    g = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, g, side="right").astype(jnp.int32), num_s - 1)
    idx = (g - (ends[seq] - n_blocks[seq])).astype(jnp.int32)
    return jnp.where(g < ends[-1], seq, -1), idx, (ends - n_blocks).astype(jnp.int32)


def kv_block_bounds(
    block_seq,
    block_idx,
    query_start,
    kv_lens,
    num_seqs,
    *,
    block_q: int,
    kv_block: int,
    sliding_window: int | None,
):
    """First and one-past-last KV block (of kv_block tokens) each query block must read:
    from the window start of its first query to its last query's position."""
    seq = jnp.maximum(block_seq, 0)
    q_len = query_lens(query_start, num_seqs)[seq]
    kv_len = kv_lens[seq]
    first_pos = kv_len - q_len + block_idx * block_q
    last_pos = kv_len - q_len + jnp.minimum((block_idx + 1) * block_q, q_len) - 1
    lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    start = lo // kv_block
    end = jnp.maximum(jnp.floor_divide(last_pos, kv_block) + 1, start)
    valid = block_seq >= 0
    return jnp.where(valid, start, 0).astype(jnp.int32), jnp.where(valid, end, 0).astype(jnp.int32)


def pad_page_table(page_table, multiple: int):
    pad = -page_table.shape[1] % multiple
    return jnp.pad(page_table, ((0, 0), (0, pad)))  # padded entries: the null page


def gather_query_tiles(q, query_start, block_seq, block_idx, num_kv_heads: int, block_q: int):
    """q [T, H, hd] -> tiles [NB, K, BQ*G, hd]: row r of tile (g, h) is query token
    block_idx*BQ + r // G of sequence block_seq[g], query head h*G + r % G. Rows past the
    sequence hold other tokens (masked in the kernel)."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    start = query_start[jnp.maximum(block_seq, 0)] + block_idx * block_q  # [NB]
    rows = jnp.clip(start[:, None] + jnp.arange(block_q)[None, :], 0, num_tokens - 1)
    tiles = q[rows].reshape(-1, block_q, num_kv_heads, group, head_dim)  # [NB, BQ, K, G, hd]
    return tiles.transpose(0, 2, 1, 3, 4).reshape(-1, num_kv_heads, block_q * group, head_dim)


def scatter_query_tiles(
    tiles, query_start, num_seqs, first_block, num_tokens: int, block_q: int, dtype
):
    """Inverse of gather_query_tiles: tiles [NB, K, BQ*G, hd] -> [T, H, hd], zeros for rows
    past query_start[num_seqs]."""
    num_blocks, num_kv_heads, rows, head_dim = tiles.shape
    group = rows // block_q
    per_token = tiles.reshape(num_blocks, num_kv_heads, block_q, group, head_dim)
    per_token = per_token.transpose(0, 2, 1, 3, 4)  # [NB, BQ, K, G, hd]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(
        jnp.searchsorted(query_start[1:], t, side="right"), query_start.shape[0] - 2
    ).astype(jnp.int32)
    i = t - query_start[seq]
    valid = (t < query_start[num_seqs[0]]) & (i >= 0)
    g = jnp.clip(first_block[seq] + i // block_q, 0, num_blocks - 1)
    out = per_token[g, i % block_q].reshape(num_tokens, num_kv_heads * group, head_dim)
    return jnp.where(valid[:, None, None], out, 0).astype(dtype)
