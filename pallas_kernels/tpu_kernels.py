"""Pallas Mosaic TPU kernel for ragged paged attention (decode is the query_len == 1 case).

Grid (query block g, kv head h, kv step j), j innermost and "arbitrary" (a reduction):

    scalar prefetch (SMEM): block_seq[NB], block_idx[NB], query_start[S+1], kv_lens[S],
                            kv_start[NB], kv_end[NB], page_table[S*P] (flat), layer[1]
    q tile   [BQ*G, hd]     block (g, h) of q gathered outside into [NB, K, BQ*G, hd]
    K, V     [ps, hd]       block (layer, h, page_table[seq*P + kv_start[g] + j]) of the
                            stacked [L, K, num_pages, ps, hd] cache: the index map does the
                            page-table lookup, so Pallas' pipeline DMAs exactly one page per
                            step and the layer is never sliced out
    scales   [1, ps]        int8 only, from [L, K, num_pages, 1, ps] (a free reshape)
    out      [BQ*G, hd]     written at the last kv step from the f32 accumulator

Steps past a block's last needed page (j >= kv_end - kv_start) clamp their index map to the
last needed page, so Pallas skips the DMA (same block index as the previous step), and
`pl.when` skips the compute. No ref is reshaped inside the kernel (the TPU interpreter of JAX
0.10.2 cannot handle reshaped refs): the query tile is laid out as [BQ*G, hd] outside.

NOTE: one page per grid step keeps this simple and exactly testable in TPU interpret mode,
but costs a grid step (~0.35 us) per page and per skipped step; a faster version would DMA
several pages per step by hand (`memory_space=pl.ANY` + `pltpu.make_async_copy`), as JAX's
own TPU kernels do. Not yet measured on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import layout

MASK_VALUE = -1e30
LANES = 128  # m and l scratch are lane-replicated, as in JAX's TPU flash attention
MAX_BLOCK_Q = 8


def _kernel(
    block_seq_ref,
    block_idx_ref,
    query_start_ref,
    kv_lens_ref,
    kv_start_ref,
    kv_end_ref,
    page_table_ref,
    layer_ref,
    q_ref,
    k_ref,
    v_ref,
    *rest,
    block_q,
    group,
    sm_scale,
    sliding_window,
    soft_cap,
    quantized,
):
    # q_ref [M, hd]; k_ref, v_ref [ps, hd]; (ks_ref, vs_ref [1, ps]); o_ref [M, hd]
    if quantized:
        ks_ref, vs_ref, o_ref, acc_ref, m_ref, l_ref = rest
    else:
        o_ref, acc_ref, m_ref, l_ref = rest
    del page_table_ref, layer_ref  # used by the index maps only
    g, j = pl.program_id(0), pl.program_id(2)
    rows = q_ref.shape[0]
    page_size = k_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
        l_ref[...] = jnp.zeros_like(l_ref)

    kv_block = kv_start_ref[g] + j

    @pl.when(kv_block < kv_end_ref[g])
    def _compute():
        seq = jnp.maximum(block_seq_ref[g], 0)
        q_len = query_start_ref[seq + 1] - query_start_ref[seq]
        kv_len = kv_lens_ref[seq]
        # lax.div, not //: floor division lowers through `sign`, which Mosaic lowers per
        # TPU generation (and so cannot be lowered on a CPU-only machine in the tests).
        row = lax.broadcasted_iota(jnp.int32, (rows, page_size), 0)
        i = block_idx_ref[g] * block_q + lax.div(row, jnp.int32(group))
        q_pos = kv_len - q_len + i  # [M, ps]
        kv_pos = kv_block * page_size + lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
        mask = (i < q_len) & (kv_pos <= q_pos) & (kv_pos < kv_len)
        if sliding_window is not None:
            mask &= kv_pos > q_pos - sliding_window
        q = q_ref[...]
        dtype = q.dtype
        precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
        in_cache = (
            kv_block * page_size + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
        ) < kv_len  # [ps, 1]
        k = jnp.where(in_cache, k_ref[...].astype(jnp.float32), 0.0).astype(dtype)
        v = jnp.where(in_cache, v_ref[...].astype(jnp.float32), 0.0)
        logits = jnp.einsum(
            "md,nd->mn", q, k, precision=precision, preferred_element_type=jnp.float32
        )  # [M, ps]
        if quantized:
            logits = logits * ks_ref[...]  # [1, ps]
        logits = logits * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logits = jnp.where(mask, logits, MASK_VALUE)
        m_prev = m_ref[...][:, :1]  # [M, 1]
        m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(logits - m_next), 0.0)  # [M, ps]
        l_next = alpha * l_ref[...][:, :1] + jnp.sum(p, axis=1, keepdims=True)
        if quantized:
            in_cache_row = (
                kv_block * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
            ) < kv_len  # [1, ps]
            p = p * jnp.where(in_cache_row, vs_ref[...], 0.0)
        pv = jnp.einsum(
            "mn,nd->md",
            p.astype(dtype),
            v.astype(dtype),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        acc_ref[...] = alpha * acc_ref[...] + pv
        m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l_next, l_ref.shape)

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        l = l_ref[...][:, :1]
        o_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def _kv_index_map(
    g,
    h,
    j,
    block_seq,
    block_idx,
    query_start,
    kv_lens,
    kv_start,
    kv_end,
    page_table,
    layer,
    *,
    pages_per_seq,
):
    last = jnp.maximum(kv_end[g] - 1, kv_start[g])
    block = jnp.minimum(jnp.minimum(kv_start[g] + j, last), pages_per_seq - 1)
    page = page_table[jnp.maximum(block_seq[g], 0) * pages_per_seq + block]
    return layer[0], h, page, 0, 0


def ragged_paged_attention_tpu(
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
    interpret=False,
):
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_pages.shape
    num_s, pages_per_seq = page_table.shape
    group = num_heads // num_kv_heads
    block_q = min(MAX_BLOCK_Q, layout.pow2(max_query_len))
    rows = block_q * group
    num_blocks = layout.num_query_blocks(num_tokens, num_s, max_query_len, block_q)
    block_seq, block_idx, first_block = layout.block_table(
        query_start, num_seqs, block_q, num_blocks
    )
    kv_start, kv_end = layout.kv_block_bounds(
        block_seq,
        block_idx,
        query_start,
        kv_lens,
        num_seqs,
        block_q=block_q,
        kv_block=page_size,
        sliding_window=sliding_window,
    )
    kv_steps = pages_per_seq
    if sliding_window is not None:  # a block spans at most window + BQ - 1 positions
        kv_steps = min(kv_steps, pl.cdiv(sliding_window + block_q - 1, page_size) + 1)
    tiles = layout.gather_query_tiles(
        q, query_start, block_seq, block_idx, num_kv_heads, block_q
    )  # [NB, K, M, hd]
    kv_map = functools.partial(_kv_index_map, pages_per_seq=pages_per_seq)
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda g, h, j, *_: (g, h, 0, 0))
    kv_spec = pl.BlockSpec((None, None, None, page_size, head_dim), kv_map)
    in_specs = [q_spec, kv_spec, kv_spec]
    operands = [tiles, k_pages, v_pages]
    quantized = k_scales is not None
    if quantized:
        scale_spec = pl.BlockSpec((None, None, None, 1, page_size), kv_map)
        in_specs += [scale_spec, scale_spec]
        scale_shape = (*k_scales.shape[:3], 1, page_size)
        operands += [k_scales.reshape(scale_shape), v_scales.reshape(scale_shape)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=8,
        grid=(num_blocks, num_kv_heads, kv_steps),
        in_specs=in_specs,
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((rows, head_dim), jnp.float32),
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, LANES), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _kernel,
        block_q=block_q,
        group=group,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        quantized=quantized,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(tiles.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )(
        block_seq,
        block_idx,
        query_start,
        kv_lens,
        kv_start,
        kv_end,
        page_table.reshape(-1),
        jnp.asarray(layer, jnp.int32).reshape(1),
        *operands,
    )
    return layout.scatter_query_tiles(
        out, query_start, num_seqs, first_block, num_tokens, block_q, q.dtype
    )


def decode_paged_attention_tpu(
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
):
    """Decode = the ragged kernel with one query per sequence (BQ = 1, tile [G, hd])."""
    num_s = q.shape[0]
    query_start = jnp.arange(num_s + 1, dtype=jnp.int32)
    num_seqs = jnp.array([num_s], jnp.int32)
    return ragged_paged_attention_tpu(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_table,
        query_start,
        num_seqs,
        layer,
        sm_scale=sm_scale,
        max_query_len=1,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scales=k_scales,
        v_scales=v_scales,
        interpret=interpret,
    )
