"""The device step: one pure function, jitted once per `BatchShape` (and sampler variant).

    (params, state: DeviceState, batch) -> (state, packed results, aux)

The device state (engine/runner/state.py: KV cache, penalty counts, prompt mask,
`last_tokens`) is donated, so XLA updates it in place.
The results come back as ONE [Sd + Sp, 2 + 2 * MAX_LOGPROBS] float32 array (tokens
bit-cast), the only device->host transfer of a step. A row whose logits hold a NaN or inf
has its token set to NONFINITE_TOKEN on device (the flag travels in the same array); the
engine fails that request instead of emitting a token sampled from garbage.

`last_tokens [max_num_seqs] int32` is the last token sampled for each slot. A row whose
input token the host has not read yet (`batch.token_slots[row] >= 0`: overlapped steps,
engine/core.py) takes it from there, so step N+1 can be dispatched before step N's tokens
reach the host; each step then writes the (finite) tokens it samples back into their slots.

`aux`: the model family's auxiliary output (models/families.py `AUX_OUTPUT`; the MoE
families' expert token counts [L, E] int32, padding rows excluded by `real_token_rows`), or
None: a family without one runs the same program as before it existed (no extra output).
The host fetches it in the same `device_get` as the packed results (engine/core.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig
from engine.batch.builder import BatchShape, PackedBatch, StepBatch
from engine.runner.kv_cache import (
    PagedKVCache,
    WindowedKVCache,
    ring_page_table,
    ring_slot_mapping,
)
from engine.runner.state import DeviceState
from engine.sampling.sampler import SamplingFlags, sample, update_counts
from models.families import aux_output, forward_with_aux
from models.llama import Params
from models.lora import LoraInputs
from pallas_kernels import decode_paged_attention, ragged_paged_attention, write_kv

NONFINITE_TOKEN = -1  # sampled-token value of a row whose logits were not all finite
NONFINITE_ERROR = "model produced non-finite logits"  # the error of a request failed for it


def paged_attention_fn(cfg: ModelConfig, batch: StepBatch, shape: BatchShape, impl: str, mesh=None):
    """The model's attention over the paged cache for this batch layout (engine/batch/builder.py).
    With a mesh, the KV write and the kernels run per shard under `jax.shard_map`: each
    model shard holds H/m query heads and the KV heads they read (engine/parallel/sharding.py)."""
    sm_scale = 1.0 / math.sqrt(cfg.head_dim)
    Sd = shape.num_decode
    opts = dict(sm_scale=sm_scale, impl=impl)
    meta = (
        batch.slot_mapping,
        batch.kv_lens_d,
        batch.page_table_d,
        batch.kv_lens_p,
        batch.page_table_p,
        batch.query_start_p,
        batch.num_seqs_p,
    )

    def local(q, k, v, layer, cache: PagedKVCache, meta, sliding_window=cfg.sliding_window):
        slots, kv_lens_d, page_table_d, kv_lens_p, page_table_p, query_start_p, num_p = meta
        kp, vp, ks, vs = write_kv(
            cache.k_pages,
            cache.v_pages,
            k,
            v,
            slots,
            layer,
            k_scales=cache.k_scales,
            v_scales=cache.v_scales,
        )
        scales = dict(k_scales=ks, v_scales=vs)
        outs = []
        if Sd:
            outs.append(
                decode_paged_attention(
                    q[:Sd],
                    kp,
                    vp,
                    kv_lens_d,
                    page_table_d,
                    layer,
                    **opts,
                    **scales,
                    sliding_window=sliding_window,
                )
            )
        if shape.num_prefill_tokens:
            outs.append(
                ragged_paged_attention(
                    q[Sd:],
                    kp,
                    vp,
                    kv_lens_p,
                    page_table_p,
                    query_start_p,
                    num_p,
                    layer,
                    max_query_len=shape.max_query_len,
                    sliding_window=sliding_window,
                    **opts,
                    **scales,
                )
            )
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
        return out.astype(q.dtype), PagedKVCache(kp, vp, ks, vs)

    def windowed_attention(q, k, v, layer, cache: WindowedKVCache, sliding_window):
        """A layer of one group of a WindowedKVCache (engine/runner/kv_cache.py): its index
        inside the group's cache, and for the sliding-window group the ring's addressing."""
        index = jnp.asarray(cache.group_index, jnp.int32)[layer]
        if sliding_window is None:
            out, full = local(q, k, v, index, cache.full, meta, sliding_window=None)
            return out, dataclasses.replace(cache, full=full)
        ring_meta = windowed_meta(batch, shape, cache.ring_pages, cache.full.k_pages.shape[3])
        out, ring = local(q, k, v, index, cache.local, ring_meta, sliding_window=sliding_window)
        return out, dataclasses.replace(cache, local=ring)

    if mesh is None:

        def attention_one_device(q, k, v, layer, cache, sliding_window=cfg.sliding_window):
            if isinstance(cache, WindowedKVCache):
                return windowed_attention(q, k, v, layer, cache, sliding_window)
            return local(q, k, v, layer, cache, meta, sliding_window=sliding_window)

        return attention_one_device

    from jax.sharding import PartitionSpec as P

    # NOTE: EngineCore refuses a mesh with release_local_pages, so a mesh sees PagedKVCache
    heads = P(None, "model", None)  # q [T, H, hd], k/v [T, K, hd], out [T, H, hd]

    def attention(q, k, v, layer, cache: PagedKVCache, sliding_window=cfg.sliding_window):
        kv_spec = P(None, "model")
        cache_spec = PagedKVCache(
            kv_spec,
            kv_spec,
            None if cache.k_scales is None else kv_spec,
            None if cache.v_scales is None else kv_spec,
        )
        sharded = jax.shard_map(
            functools.partial(local, sliding_window=sliding_window),
            mesh=mesh,
            in_specs=(heads, heads, heads, P(), cache_spec, P()),
            out_specs=(heads, cache_spec),
            check_vma=False,
        )
        return sharded(q, k, v, layer, cache, meta)

    return attention


def windowed_meta(batch: StepBatch, shape: BatchShape, ring_pages: int, page_size: int) -> tuple:
    """The attention metadata of `paged_attention_fn` for the sliding-window group of a
    WindowedKVCache: the same lengths and query starts, the local slot mapping and page
    tables of each row's slot ring."""
    Sd = shape.num_decode
    num_tokens = batch.positions.shape[0]
    rows_p = jnp.arange(num_tokens - Sd, dtype=jnp.int32)  # prefill token rows
    seq_p = jnp.searchsorted(batch.query_start_p[1:], rows_p, side="right")
    seq_p = jnp.minimum(seq_p, shape.num_prefill_seqs - 1)
    row_slots = batch.slot_ids[:Sd]  # [T] the slot of each token row's sequence
    if shape.num_prefill_tokens:
        row_slots = jnp.concatenate([row_slots, batch.slot_ids[Sd + seq_p]])
    slots = ring_slot_mapping(batch.slot_mapping, batch.positions, row_slots, ring_pages, page_size)
    P = shape.pages_per_seq
    return (
        slots,
        batch.kv_lens_d,
        ring_page_table(batch.slot_ids[:Sd], P, ring_pages),
        batch.kv_lens_p,
        ring_page_table(batch.slot_ids[Sd:], P, ring_pages),
        batch.query_start_p,
        batch.num_seqs_p,
    )


def real_token_rows(batch: StepBatch, shape: BatchShape) -> jax.Array:
    """[Sd + Tp] bool: the rows that hold a scheduled token, not bucket padding. A decode
    row is real when its sequence has a KV length (padding: 0); the prefill rows are packed
    from Sd on, and query_start_p's last entry is their count (engine/batch/builder.py)."""
    decode = batch.kv_lens_d > 0  # [Sd]
    num_prefill_rows = batch.positions.shape[0] - shape.num_decode
    prefill = jnp.arange(num_prefill_rows) < batch.query_start_p[-1]  # [Tp]
    return jnp.concatenate([decode, prefill])


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "shape", "flags", "use_penalties", "impl", "mesh"),
    donate_argnames=("state",),
)
def engine_step(
    params: Params,
    state: DeviceState,
    batch: StepBatch | PackedBatch,
    *,
    cfg: ModelConfig,
    shape: BatchShape,
    flags: SamplingFlags,
    use_penalties: bool,
    impl: str = "auto",
    mesh=None,
    lora: LoraInputs | None = None,
    token_bitmask: jax.Array | None = None,
):
    """Returns (state, packed [Sd + Sp, 2 + 2K] float32, aux: the family's auxiliary output
    or None, module doc). `mesh`: None (one device) or the
    engine's ("data", "expert", "model") mesh (params/cache placed by engine/parallel/sharding).
    `batch` may come packed (two flat buffers: one host->device copy each,
    engine/batch/builder.py); it is unpacked here by static slices. `lora`: the adapter
    slot stack and each token row's slot (engine/lora/adapters.py); None (no LoRA) is the
    plain model. `token_bitmask` [Sd + Sp, ceil(V/32)] int32: structured output's allowed
    tokens (None: a separate trace, so steps without constrained rows are unchanged)."""
    kv_cache, counts, last_tokens = state.kv, state.counts, state.last_tokens
    prompt_mask = state.prompt_mask  # read only; returned as it came
    if isinstance(batch, PackedBatch):
        batch = batch.unpack(shape)
    attention = paged_attention_fn(cfg, batch, shape, impl, mesh)
    from_device = last_tokens[jnp.maximum(batch.token_slots, 0)]  # [T]
    token_ids = jnp.where(batch.token_slots >= 0, from_device, batch.token_ids)  # [T]
    real = real_token_rows(batch, shape) if aux_output(cfg) else None  # traced only if read
    logits, kv_cache, aux = forward_with_aux(
        params,
        cfg,
        token_ids,
        batch.positions,
        kv_cache,
        attention,
        batch.logits_indices,
        lora,
        real_tokens=real,
    )  # [Sd + Sp, V]
    if mesh is not None:  # sampling sees the full (all-gathered) logits on every device
        logits = jax.lax.with_sharding_constraint(logits, replicated(mesh))
    if use_penalties:
        rows_counts = counts[batch.slot_ids]  # [R, V]
        rows_mask = prompt_mask[batch.slot_ids]
        result = sample(logits, batch.sampling, rows_counts, rows_mask, flags, token_bitmask)
        counts = update_counts(counts, batch.slot_ids, result.tokens, batch.sample_mask)
    else:
        result = sample(logits, batch.sampling, flags=flags, token_bitmask=token_bitmask)
    finite = jnp.all(jnp.isfinite(logits), axis=-1)  # [Sd + Sp]
    # Padding, non-sampling and non-finite rows scatter out of range (dropped); a request
    # whose row is non-finite is failed by the host one step later.
    num_slots = last_tokens.shape[0]
    write_to = jnp.where(batch.sample_mask & finite, batch.slot_ids, num_slots)  # [Sd + Sp]
    last_tokens = last_tokens.at[write_to].set(result.tokens, mode="drop")
    result.tokens = jnp.where(finite, result.tokens, NONFINITE_TOKEN)
    packed = result.pack()
    if mesh is not None:  # replicated: every process can read it; one jit key for the state
        packed, counts, prompt_mask, last_tokens, aux = jax.lax.with_sharding_constraint(
            (packed, counts, prompt_mask, last_tokens, aux), replicated(mesh)
        )
    return DeviceState(kv_cache, counts, prompt_mask, last_tokens), packed, aux


def replicated(mesh):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec())
