"""Pallas GPU (Triton lowering) decode kernel: flash-decoding over the paged cache.

Grid (sequence, kv head, split): each program takes the [Gp, hd] query tile of one
sequence's KV head (Gp = the GQA group padded to >= 16, Triton's dot minimum), reads a
contiguous share of that sequence's KV blocks (each `pages_per_block` pages gathered through
the page table from the full stacked cache) and writes unnormalised partials (o, m, l); one
jnp `combine_splits` merges them. The split count grows when S * K programs would not fill
the GPU (small batches, long contexts).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_common import (
    DECODE_LAUNCH,
    DECODE_TARGET_PROGRAMS,
    KV_BLOCK_TOKENS,
    MAX_DECODE_SPLITS,
    attend_blocks,
    check_gpu_shapes,
    kv_block_range,
    layer_array,
)
from pallas_kernels.layout import pad_page_table, pow2


def _decode_kernel(
    kv_lens_ref,
    layer_ref,
    page_table_ref,
    q_ref,
    k_ref,
    v_ref,
    ks_ref,
    vs_ref,
    o_ref,
    m_ref,
    l_ref,
    *,
    group,
    pages_per_block,
    blocks_per_split,
    sm_scale,
    sliding_window,
    soft_cap,
):
    # q_ref [Gp, hd] (one sequence, one KV head); o_ref [Gp, hd]; m_ref, l_ref [Gp]
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group_pad = q_ref.shape[0]
    kv_len = kv_lens_ref[seq]
    block = pages_per_block * k_ref.shape[3]
    r = lax.broadcasted_iota(jnp.int32, (group_pad,), 0)
    row_valid = (r < group) & (kv_len > 0)
    q_pos = jnp.zeros((group_pad,), jnp.int32) + (kv_len - 1)
    lo, hi = kv_block_range(kv_len - 1, kv_len - 1, block, sliding_window)
    j_start = jnp.maximum(lo, split * blocks_per_split)
    j_end = jnp.minimum(jnp.where(kv_len > 0, hi, 0), (split + 1) * blocks_per_split)
    o, m, l = attend_blocks(
        q_ref[...],
        q_pos,
        row_valid,
        kv_len,
        seq,
        j_start,
        jnp.maximum(j_end, j_start),
        layer_ref[0],
        head,
        page_table_ref,
        k_ref,
        v_ref,
        ks_ref,
        vs_ref,
        pages_per_block=pages_per_block,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def decode_paged_attention_gpu(
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
    interpret=False,
    num_splits=None,
):
    num_s, num_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_pages.shape
    check_gpu_shapes(page_size, head_dim)
    group = num_heads // num_kv_heads
    group_pad = max(16, pow2(group))
    pages_per_block = max(1, min(KV_BLOCK_TOKENS["decode"] // page_size, pow2(page_table.shape[1])))
    page_table = pad_page_table(page_table, pages_per_block)
    num_kv_blocks = page_table.shape[1] // pages_per_block
    if num_splits is None:
        wanted = pl.cdiv(DECODE_TARGET_PROGRAMS, num_s * num_kv_heads)
        num_splits = max(1, min(wanted, MAX_DECODE_SPLITS))
    splits = min(num_splits, num_kv_blocks)
    blocks_per_split = pl.cdiv(num_kv_blocks, splits)
    qg = q.reshape(num_s, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    kernel = functools.partial(
        _decode_kernel,
        group=group,
        pages_per_block=pages_per_block,
        blocks_per_split=blocks_per_split,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    part = (splits, num_s, num_kv_heads, group_pad)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(num_s, num_kv_heads, splits),
        in_specs=[pl.no_block_spec] * 3
        + [pl.BlockSpec((None, None, group_pad, head_dim), lambda s, h, i: (s, h, 0, 0))]
        + [pl.no_block_spec] * 2
        + [None if k_scales is None else pl.no_block_spec] * 2,
        out_specs=[
            pl.BlockSpec((None, None, None, group_pad, head_dim), lambda s, h, i: (i, s, h, 0, 0)),
            pl.BlockSpec((None, None, None, group_pad), lambda s, h, i: (i, s, h, 0)),
            pl.BlockSpec((None, None, None, group_pad), lambda s, h, i: (i, s, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(**DECODE_LAUNCH),
        name="decode_paged_attention",
    )(kv_lens, layer_array(layer), page_table, qg, k_pages, v_pages, k_scales, v_scales)
    out = combine_splits(o, m, l)  # [S, K, Gp, hd]
    return out[:, :, :group].reshape(num_s, num_heads, head_dim).astype(q.dtype)


def combine_splits(o, m, l):
    """Merge flash-decoding partials o [N, ..., hd], m, l [N, ...] over the split axis."""
    m_max = jnp.max(m, axis=0)
    w = jnp.exp(m - m_max[None])  # [N, ...]
    l_tot = jnp.sum(w * l, axis=0)
    o_tot = jnp.sum(w[..., None] * o, axis=0)
    return o_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]
