"""Shared pieces of the Pallas GPU kernels (Triton lowering): the online-softmax loop over
page blocks, the KV block range of a query tile, shape checks and the tuning constants."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.layout import pow2

MASK_VALUE = -1e30
# Tuning table: tokens per KV block, query-tile rows. Decode measured on one H200 (JAX 0.11.2,
# 64 seqs x 4k context, bf16, GQA 32:8; benchmarks/device_sweep.py, RESULTS.md 2026-12-04):
# 64-token blocks 0.61 ms against 0.81 (128) and 0.70 (256) in the same run. The ragged
# kernel's 64 is still a guess.
KV_BLOCK_TOKENS = {"ragged": 64, "decode": 64}
Q_TILE_ROWS = 64
# Decode: split each sequence's KV blocks until S * K * splits reaches this many programs
# (an H200 has 132 SMs; several programs per SM hide memory latency).
DECODE_TARGET_PROGRAMS = 1024
MAX_DECODE_SPLITS = 32
# Triton launch parameters of the decode kernel (a table of its own so a sweep,
# benchmarks/device_sweep.py, can try others without editing the kernel).
DECODE_LAUNCH = {"num_warps": 4, "num_stages": 2}


def check_gpu_shapes(page_size, head_dim):
    for name, n in (("page_size", page_size), ("head_dim", head_dim)):
        if n != pow2(n) or n < 8:
            raise ValueError(f"{name}={n}: the Pallas GPU kernels need a power of two >= 8")


def attend_blocks(
    q,
    q_pos,
    row_valid,
    kv_len,
    seq,
    j_start,
    j_end,
    layer,
    head,
    page_table_ref,
    k_ref,
    v_ref,
    ks_ref,
    vs_ref,
    *,
    pages_per_block,
    sm_scale,
    sliding_window,
    soft_cap,
):
    """Online softmax of q [M, hd] over KV blocks j_start..j_end-1 of sequence `seq`.
    Returns o [M, hd] (unnormalised), m [M], l [M], all float32."""
    m_rows, head_dim = q.shape
    page_size = k_ref.shape[3]
    block = pages_per_block * page_size
    compute_dtype = q.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    if sliding_window is not None:  # the block's first visible position - 1
        big = jnp.iinfo(jnp.int32).max
        first_visible = jnp.min(jnp.where(row_valid, q_pos, big)) - sliding_window

    def body(j, carry):
        o, m, l = carry
        page_ids = page_table_ref[seq, pl.ds(j * pages_per_block, pages_per_block)]  # [PPB]
        k = k_ref[layer, head, page_ids].reshape(block, head_dim)  # [BK, hd]
        v = v_ref[layer, head, page_ids].reshape(block, head_dim)
        kv_pos = j * block + lax.broadcasted_iota(jnp.int32, (block,), 0)  # [BK]
        in_cache = kv_pos < kv_len
        logits = lax.dot_general(
            q,
            k.astype(compute_dtype),
            (((1,), (1,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        if ks_ref is not None:
            k_scale = ks_ref[layer, head, page_ids].reshape(block)  # [BK]
            logits = logits * k_scale[None, :]
        logits = logits * sm_scale  # [M, BK]
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        mask = row_valid[:, None] & in_cache[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        logits = jnp.where(mask, logits, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(logits - m_new[:, None]), 0.0)  # [M, BK]
        l_new = alpha * l + jnp.sum(p, axis=1)
        if vs_ref is not None:
            v_scale = vs_ref[layer, head, page_ids].reshape(block)
            p = p * jnp.where(in_cache, v_scale, 0.0)[None, :]
        used = in_cache
        if sliding_window is not None:  # a block may start before the window: released pages
            used &= kv_pos > first_visible
        v = jnp.where(used[:, None], v.astype(compute_dtype), 0.0).astype(compute_dtype)
        pv = lax.dot_general(
            p.astype(compute_dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return alpha[:, None] * o + pv, m_new, l_new

    init = (
        jnp.zeros((m_rows, head_dim), jnp.float32),
        jnp.full((m_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
    )
    return lax.fori_loop(j_start, j_end, body, init)


def kv_block_range(first_pos, last_pos, block, sliding_window):
    """KV blocks covering positions max(0, first_pos - window + 1) .. last_pos."""
    lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    return lo // block, last_pos // block + 1


def layer_array(layer):
    return jnp.asarray(layer, jnp.int32).reshape(1)
