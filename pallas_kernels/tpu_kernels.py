"""Pallas Mosaic TPU kernel for ragged paged attention (decode is the query_len == 1 case).

Grid (query block g, kv head h, kv step j), j innermost and "arbitrary" (a reduction):

    scalar prefetch (SMEM): block_seq[NB], block_idx[NB], query_start[S+1], kv_lens[S],
                            kv_start[NB], kv_end[NB], page_table[S*P] (flat), layer[1]
    q tile   [BQ*G, hd]     block (g, h) of q gathered outside into [NB, K, BQ*G, hd]
    K, V     N x [ps, hd]   N = 128 // ps pages per step, each its own input (the same cache
                            array passed N times, no copy) whose index map looks up
                            (layer, h, page_table[seq*P + kv_start[g] + j*N + slot]) in the
                            stacked [L, K, num_pages, ps, hd] cache, so Pallas' pipeline DMAs
                            exactly the sequence's pages and the layer is never sliced out
    scales   N x [1, ps]    int8 only, from [L, K, num_pages, 1, ps] (a free reshape)
    out      [BQ*G, hd]     written at the last kv step from the f32 accumulator

The kernel runs one online-softmax update per page slot (`pl.when` skips slots past the
block's last needed page). Slots past it clamp their index map to the last needed page, so
Pallas skips their copy (unchanged block index). No ref is reshaped inside the kernel (the
TPU interpreter of JAX 0.10.2 cannot handle reshaped refs): the query tile is laid out as
[BQ*G, hd] outside. A query block only visits the pages between its window start and its
last query, and with a sliding window the kv grid axis shrinks to the window's pages.

NOTE: the per-page dots are [BQ*G, ps] (small for the MXU) and each grid step still costs
~0.35 us; a faster version would DMA many pages per step into one VMEM buffer by hand
(`memory_space=pl.ANY` + `pltpu.make_async_copy`), as JAX's own TPU kernels do. Not yet
measured on a TPU (none was available): correctness comes from TPU interpret mode and the
Mosaic lowering check in tests/test_kernels.py.
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
KV_TOKENS_PER_STEP = 128  # pages fetched (and pipelined) per grid step: 128 // page_size


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
    *refs,
    pages_per_step,
    block_q,
    group,
    sm_scale,
    sliding_window,
    soft_cap,
    quantized,
):
    # q_ref [M, hd]; then pages_per_step K refs [ps, hd], as many V refs, (as many K and V
    # scale refs [1, ps]); o_ref [M, hd]; scratch acc [M, hd], m and l [M, LANES].
    n = pages_per_step
    k_refs, v_refs = refs[:n], refs[n : 2 * n]
    ks_refs, vs_refs = (refs[2 * n : 3 * n], refs[3 * n : 4 * n]) if quantized else ((), ())
    o_ref, acc_ref, m_ref, l_ref = refs[(4 if quantized else 2) * n :]
    del page_table_ref, layer_ref  # used by the index maps only
    g, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        m_ref[...] = jnp.full_like(m_ref, MASK_VALUE)
        l_ref[...] = jnp.zeros_like(l_ref)

    seq = jnp.maximum(block_seq_ref[g], 0)
    ctx = {
        "q_len": query_start_ref[seq + 1] - query_start_ref[seq],
        "kv_len": kv_lens_ref[seq],
        "first_query": block_idx_ref[g] * block_q,
    }
    for t in range(n):  # static: one online-softmax update per page of this step
        page = kv_start_ref[g] + j * n + t

        @pl.when(page < kv_end_ref[g])
        def _compute(t=t, page=page):
            _update(
                page,
                q_ref,
                k_refs[t],
                v_refs[t],
                ks_refs[t] if quantized else None,
                vs_refs[t] if quantized else None,
                acc_ref,
                m_ref,
                l_ref,
                **ctx,
                group=group,
                sm_scale=sm_scale,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
            )

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        l = l_ref[...][:, :1]
        o_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def _update(
    page,
    q_ref,
    k_ref,
    v_ref,
    ks_ref,
    vs_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    q_len,
    kv_len,
    first_query,
    group,
    sm_scale,
    sliding_window,
    soft_cap,
):
    """Online-softmax update of the accumulators with one page (its `page`-th of the seq)."""
    rows, page_size = q_ref.shape[0], k_ref.shape[0]
    # lax.div, not //: floor division lowers through `sign`, which Mosaic lowers per TPU
    # generation (and so cannot be lowered on a CPU-only machine in the tests).
    row = lax.broadcasted_iota(jnp.int32, (rows, page_size), 0)
    i = first_query + lax.div(row, jnp.int32(group))  # query index in the sequence
    q_pos = kv_len - q_len + i  # [M, ps]
    kv_pos = page * page_size + lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
    mask = (i < q_len) & (kv_pos <= q_pos) & (kv_pos < kv_len)
    if sliding_window is not None:
        mask &= kv_pos > q_pos - sliding_window
    q = q_ref[...]
    dtype = q.dtype
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    in_cache = (
        page * page_size + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
    ) < kv_len  # [ps, 1]
    k = jnp.where(in_cache, k_ref[...].astype(jnp.float32), 0.0).astype(dtype)
    v = jnp.where(in_cache, v_ref[...].astype(jnp.float32), 0.0)
    logits = jnp.einsum(
        "md,nd->mn", q, k, precision=precision, preferred_element_type=jnp.float32
    )  # [M, ps]
    if ks_ref is not None:
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
    if vs_ref is not None:
        in_cache_row = (
            page * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
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
    slot,
    pages_per_step,
    pages_per_seq,
):
    """Page `slot` of kv step j; past the last needed page, the last needed page again (an
    unchanged block index: Pallas skips the copy)."""
    last = jnp.maximum(kv_end[g] - 1, kv_start[g])
    block = kv_start[g] + j * pages_per_step + slot
    block = jnp.minimum(jnp.minimum(block, last), pages_per_seq - 1)
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
    max_pages = pages_per_seq
    if sliding_window is not None:  # a block spans at most window + BQ - 1 positions
        max_pages = min(max_pages, pl.cdiv(sliding_window + block_q - 1, page_size) + 1)
    pages_per_step = max(1, min(KV_TOKENS_PER_STEP // page_size, max_pages))
    kv_steps = pl.cdiv(max_pages, pages_per_step)
    tiles = layout.gather_query_tiles(
        q, query_start, block_seq, block_idx, num_kv_heads, block_q
    )  # [NB, K, M, hd]
    maps = [
        functools.partial(
            _kv_index_map, slot=t, pages_per_step=pages_per_step, pages_per_seq=pages_per_seq
        )
        for t in range(pages_per_step)
    ]
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda g, h, j, *_: (g, h, 0, 0))
    kv_specs = [pl.BlockSpec((None, None, None, page_size, head_dim), m) for m in maps]
    n = pages_per_step
    # The same cache array is passed once per page slot: each slot is its own pipelined
    # input (no copy: XLA passes the same buffer).
    in_specs = [q_spec, *kv_specs, *kv_specs]
    operands = [tiles, *[k_pages] * n, *[v_pages] * n]
    quantized = k_scales is not None
    if quantized:
        scale_specs = [pl.BlockSpec((None, None, None, 1, page_size), m) for m in maps]
        in_specs += [*scale_specs, *scale_specs]
        scale_shape = (*k_scales.shape[:3], 1, page_size)  # a free reshape
        operands += [*[k_scales.reshape(scale_shape)] * n, *[v_scales.reshape(scale_shape)] * n]
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
        pages_per_step=pages_per_step,
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
