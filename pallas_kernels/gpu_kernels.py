"""Pallas GPU kernels (Triton lowering) for ragged and decode paged attention.

Files: gpu_kernels.py (this: the ragged kernel, and the public entry points), gpu_decode.py
(the split-K decode kernel), gpu_common.py (the online-softmax loop both share).

NOTE: why the Triton lowering and not Mosaic GPU. In JAX 0.10.2 both exist; the Triton
lowering (`jax.experimental.pallas.triton`) takes plain `jnp` bodies with gathers through a
vector of page ids (`k_ref[layer, head, page_ids]`), runs under `interpret=True` on CPU (so
the kernels are tested in CI), lowers on a CPU-only machine (`lower(lowering_platforms=
("cuda",))`, checked in the tests) and is what JAX's own `pallas.ops.gpu.paged_attention`
uses, so the benchmark compares like with like. Mosaic GPU kernels are built from
Hopper-specific primitives (TMA copies, wgmma, barriers) the CPU interpreter does not run,
and a page-gathered K/V block needs one TMA per page. The Triton lowering is deprecated in
JAX 0.11: moving to Mosaic GPU is the follow-up once kernels can be checked on a GPU.

Both kernels take the full stacked cache [L, K, num_pages, page_size, hd] in global memory
(no BlockSpec) and a layer index in a [1] int32 input, so no layer is ever copied out. Each
program walks blocks of `pages_per_block` pages of one sequence with an online softmax:

  ragged  grid (query block g, kv head h): BQ query tokens of one sequence x the Gp query
          heads of KV head h = one [BQ*Gp, hd] tile. Query blocks are numbered over the
          whole batch (sum over sequences of cdiv(query_len, BQ) <= cdiv(T, BQ) + S), the
          block -> (sequence, block-in-sequence) table is built outside in jnp. Only the KV
          blocks between the window start and the tile's last query position are read.
          Results go out through a masked store into a zero-initialised [T+BQ, K, Gp, hd]
          (aliased), so rows of other sequences in the tile are never written.
  decode  grid (sequence, kv head, split): flash-decoding: each split reads a contiguous
          share of the sequence's KV blocks into [Gp, hd] partials (o, m, l); one jnp
          combine merges the splits. Gp = the group padded to >= 16 (Triton dot minimum).

Masking: logits outside the causal/window/length mask become -1e30 and their probabilities
0, and V (and the V scales for int8) are zeroed past kv_len, so NaN garbage in unused slots
never reaches the output; fully masked rows divide by 1 and give zeros.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import layout
from pallas_kernels.gpu_common import (
    KV_BLOCK_TOKENS,
    Q_TILE_ROWS,
    attend_blocks,
    check_gpu_shapes,
    kv_block_range,
    layer_array,
)
from pallas_kernels.gpu_decode import decode_paged_attention_gpu
from pallas_kernels.layout import block_table, num_query_blocks, pad_page_table, pow2
from pallas_kernels.reference import token_to_seq

__all__ = ["decode_paged_attention_gpu", "ragged_paged_attention_gpu"]


def _ragged_kernel(
    block_seq_ref,
    block_idx_ref,
    query_start_ref,
    kv_lens_ref,
    layer_ref,
    page_table_ref,
    q_ref,
    k_ref,
    v_ref,
    ks_ref,
    vs_ref,
    _o_init_ref,
    o_ref,
    *,
    block_q,
    group,
    pages_per_block,
    sm_scale,
    sliding_window,
    soft_cap,
):
    # q_ref/o_ref [T+BQ, K, Gp, hd]; k_ref/v_ref [L, K, num_pages, ps, hd]; page_table [S, Pp]
    g, head = pl.program_id(0), pl.program_id(1)
    group_pad, head_dim = q_ref.shape[2], q_ref.shape[3]
    seq = block_seq_ref[g]  # -1 for a block past the batch's last one
    seq_c = jnp.maximum(seq, 0)
    b = block_idx_ref[g]
    q_start = query_start_ref[seq_c]
    q_len = query_start_ref[seq_c + 1] - q_start
    kv_len = kv_lens_ref[seq_c]
    layer = layer_ref[0]
    row0 = q_start + b * block_q
    rows = block_q * group_pad
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    i = b * block_q + r // group_pad  # query index inside the sequence, per tile row
    row_valid = (i < q_len) & (r % group_pad < group) & (seq >= 0)
    q_pos = kv_len - q_len + i
    q = q_ref[pl.ds(row0, block_q), head, :, :].reshape(rows, head_dim)
    last_pos = kv_len - q_len + jnp.minimum((b + 1) * block_q, q_len) - 1
    j_start, j_end = kv_block_range(
        kv_len - q_len + b * block_q, last_pos, pages_per_block * k_ref.shape[3], sliding_window
    )
    j_end = jnp.where(seq >= 0, j_end, j_start)
    o, _, l = attend_blocks(
        q,
        q_pos,
        row_valid,
        kv_len,
        seq_c,
        j_start,
        j_end,
        layer,
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
    o = o / jnp.where(l > 0, l, 1.0)[:, None]
    tok = b * block_q + lax.broadcasted_iota(jnp.int32, (block_q, group_pad, head_dim), 0)
    store_mask = (tok < q_len) & (seq >= 0)
    plgpu.store(
        o_ref.at[pl.ds(row0, block_q), head, :, :],
        o.reshape(block_q, group_pad, head_dim).astype(o_ref.dtype),
        mask=store_mask,
    )


def ragged_paged_attention_gpu(
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
    check_gpu_shapes(page_size, head_dim)
    opts = {
        "sm_scale": sm_scale,
        "sliding_window": sliding_window,
        "soft_cap": soft_cap,
        "k_scales": k_scales,
        "v_scales": v_scales,
        "interpret": interpret,
    }
    if max_query_len == 1:  # decode-only step: the split-K decode kernel parallelises better
        return _ragged_as_decode(
            q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, layer, **opts
        )
    group = num_heads // num_kv_heads
    group_pad = pow2(group)
    block_q = max(
        max(1, 16 // group_pad), min(max(1, Q_TILE_ROWS // group_pad), pow2(max_query_len))
    )
    pages_per_block = max(1, KV_BLOCK_TOKENS["ragged"] // page_size)
    num_s = kv_lens.shape[0]
    num_blocks = num_query_blocks(num_tokens, num_s, max_query_len, block_q)
    block_seq, block_idx, _ = block_table(query_start, num_seqs, block_q, num_blocks)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, block_q), (0, 0), (0, group_pad - group), (0, 0)))
    out_shape = jax.ShapeDtypeStruct(qg.shape, q.dtype)
    o_init_index = 9 if k_scales is None else 11  # None scales are no kernel inputs
    kernel = functools.partial(
        _ragged_kernel,
        block_q=block_q,
        group=group,
        pages_per_block=pages_per_block,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    out = pl.pallas_call(
        kernel,
        grid=(num_blocks, num_kv_heads),
        out_shape=out_shape,
        input_output_aliases={o_init_index: 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="ragged_paged_attention",
    )(
        block_seq,
        block_idx,
        query_start,
        kv_lens,
        layer_array(layer),
        pad_page_table(page_table, pages_per_block),
        qg,
        k_pages,
        v_pages,
        k_scales,
        v_scales,
        jnp.zeros(qg.shape, q.dtype),
    )
    out = out[:num_tokens, :, :group].reshape(num_tokens, num_heads, head_dim)
    _, _, valid = token_to_seq(query_start, num_seqs, num_tokens)
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


def _ragged_as_decode(
    q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, layer, **opts
):
    """A ragged batch whose sequences have 0 or 1 query each, through the decode kernel."""
    q_lens = layout.query_lens(query_start, num_seqs)  # [S]
    rows = jnp.clip(query_start[:-1], 0, q.shape[0] - 1)
    out = decode_paged_attention_gpu(
        q[rows], k_pages, v_pages, jnp.where(q_lens > 0, kv_lens, 0), page_table, layer, **opts
    )  # [S, H, hd]
    seq, _, valid = token_to_seq(query_start, num_seqs, q.shape[0])
    return jnp.where(valid[:, None, None], out[seq], 0).astype(q.dtype)
