"""Plain-`jnp` references: the KV write, ragged paged attention and decode paged attention.

These are the CPU path (fast under XLA) and the oracle the Pallas kernels are tested against.
The ragged reference pads each sequence's queries to the static `max_query_len` and attends
them against that sequence's gathered pages:

    q [T, H, hd] --(gather rows query_start[s] + i)--> qs [S, Qm, H, hd]
    k_pages[layer, :, page_table]  (ONE gather: no per-layer copy of the stacked cache)
        -> [S, P, K, ps, hd] -> keys at positions 0 .. P*ps-1 of each sequence
    scores [S, K, G, Qm, N], masked causally / by window, softmax, @ V -> [S, Qm, H, hd]
    --(gather back: token t -> (its sequence, its index))--> [T, H, hd]

Masked-out K/V positions may hold anything (the tests fill them with NaN), so V is zeroed
where the mask is false, and fully masked rows (padding, empty sequences) yield zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


def _gather_pages(pages, scales, page_table, layer):
    """Keys or values of every sequence, [S, K, N, hd] float32 with N = P * page_size."""
    x = pages[layer, :, page_table]  # [S, P, K, ps, hd]  one gather, layer and pages together
    x = x.astype(jnp.float32)
    if scales is not None:
        x = x * scales[layer, :, page_table][..., None]  # [S, P, K, ps, 1]
    s, p, k, ps, hd = x.shape
    return x.transpose(0, 2, 1, 3, 4).reshape(s, k, p * ps, hd)


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
    float32."""
    num_seqs, qm, num_heads, head_dim = qs.shape
    num_kv_heads = k_pages.shape[1]
    group = num_heads // num_kv_heads
    keys = _gather_pages(k_pages, k_scales, page_table, layer)  # [S, K, N, hd]
    values = _gather_pages(v_pages, v_scales, page_table, layer)  # [S, K, N, hd]
    n = keys.shape[2]
    kv_pos = jnp.arange(n, dtype=jnp.int32)  # [N]
    in_cache = kv_pos[None, :] < kv_lens[:, None]  # [S, N]
    values = jnp.where(in_cache[:, None, :, None], values, 0.0)

    qg = qs.astype(jnp.float32).reshape(num_seqs, qm, num_kv_heads, group, head_dim)
    scores = jnp.einsum("sqkgd,sknd->skgqn", qg, keys) * sm_scale  # [S, K, G, Qm, N]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & in_cache[:, None, :]  # [S, Qm, N]
    if sliding_window is not None:
        mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    mask &= q_valid[:, :, None]
    mask = mask[:, None, None]  # [S, 1, 1, Qm, N]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.where(mask, jnp.exp(scores - row_max), 0.0)  # [S, K, G, Qm, N]
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("skgqn,sknd->sqkgd", probs / jnp.where(denom > 0, denom, 1.0), values)
    return out.reshape(num_seqs, qm, num_heads, head_dim)


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


def pad_queries(q, query_start, kv_lens, num_seqs, max_query_len):
    """Gather q [T, H, hd] into per-sequence padded rows [S, Qm, H, hd] with each row's
    position and validity."""
    num_s = kv_lens.shape[0]
    seq_ids = jnp.arange(num_s, dtype=jnp.int32)
    q_lens = jnp.where(seq_ids < num_seqs[0], query_start[1:] - query_start[:-1], 0)  # [S]
    i = jnp.arange(max_query_len, dtype=jnp.int32)  # [Qm]
    rows = jnp.clip(query_start[:-1, None] + i[None, :], 0, q.shape[0] - 1)  # [S, Qm]
    q_valid = i[None, :] < q_lens[:, None]  # [S, Qm]
    q_pos = kv_lens[:, None] - q_lens[:, None] + i[None, :]  # [S, Qm]
    return q[rows], q_pos, q_valid


def unpad_outputs(out, query_start, num_seqs, num_tokens, dtype):
    """Per-sequence padded outputs [S, Qm, H, hd] back to flat rows [T, H, hd] (zeros for
    padding rows). A sequence longer than Qm (a caller error) has its extra rows clamped."""
    seq, idx, valid = token_to_seq(query_start, num_seqs, num_tokens)
    idx = jnp.clip(idx, 0, out.shape[1] - 1)
    flat = out[seq, idx]  # [T, H, hd]
    return jnp.where(valid[:, None, None], flat, 0.0).astype(dtype)


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
    qs, q_pos, q_valid = pad_queries(q, query_start, kv_lens, num_seqs, max_query_len)
    out = attend_padded(
        qs,
        q_pos,
        q_valid,
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
    )  # [S, Qm, H, hd]
    return unpad_outputs(out, query_start, num_seqs, q.shape[0], q.dtype)


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
    q_pos = (kv_lens - 1)[:, None]  # [S, 1]
    q_valid = (kv_lens > 0)[:, None]  # [S, 1]
    out = attend_padded(
        q[:, None],
        q_pos,
        q_valid,
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
    return out[:, 0].astype(q.dtype)
