"""The paged KV cache as a pytree (layout: WORKSPACE.md, pallas_kernels/__init__.py).

k_pages, v_pages   [L, K, num_pages, page_size, hd]
k_scales, v_scales [L, K, num_pages, page_size] float32, only for int8 KV

With local-layer page release (`EngineConfig.release_local_pages`) a model with
full-attention and sliding-window layers (Gemma 3) keeps one paged cache per layer group
(`WindowedKVCache`): the full-attention layers in pool pages addressed by the scheduler's
page tables, the sliding-window layers in a ring of R pages per sequence slot

    local page of logical page i of the sequence in slot s = 1 + s * R + i % R

so writing logical page i reuses the ring page of logical page i - R, which no query of the
step (nor any later one) can see: R = `configs.kv_memory.ring_pages(window, page_size,
prefill_chunk_size)` covers every position a step writes or reads. The ring is derived from
the slot alone, on the device (`ring_slot_mapping`, `ring_page_table`): the host allocates,
counts and frees nothing for the local layers, and a request that starts over (admission,
preemption by recompute) rewrites its ring before reading it. Local page 0 is the group's
null page (padding rows write there).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_pages", "v_pages", "k_scales", "v_scales"],
    meta_fields=[],
)
@dataclasses.dataclass
class PagedKVCache:
    k_pages: jax.Array
    v_pages: jax.Array
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None

    @classmethod
    def zeros(
        cls,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        kv_dtype: str = "float32",
        sharding=None,
        num_layers: int | None = None,
    ) -> PagedKVCache:
        """`num_layers`: the layers this cache holds (default all of the model's)."""
        layers = cfg.num_layers if num_layers is None else num_layers
        shape = (layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        dtype = jnp.dtype(kv_dtype)
        zeros = functools.partial(jnp.zeros, device=sharding) if sharding else jnp.zeros
        if dtype == jnp.int8:
            return cls(
                zeros(shape, jnp.int8),
                zeros(shape, jnp.int8),
                zeros(shape[:-1], jnp.float32),
                zeros(shape[:-1], jnp.float32),
            )
        return cls(zeros(shape, dtype), zeros(shape, dtype))

    @property
    def num_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["full", "local"],
    meta_fields=["group_index", "layer_windows", "ring_pages"],
)
@dataclasses.dataclass
class WindowedKVCache:
    """One paged cache per layer group (module doc):

    full   [Lg, K, num_pages, ps, hd]           full-attention layers; pool pages
    local  [Ll, K, 1 + max_num_seqs * R, ps, hd] sliding-window layers; a ring per slot
    """

    full: PagedKVCache
    local: PagedKVCache
    group_index: tuple[int, ...]  # per model layer: its index inside its group's cache
    layer_windows: tuple[int | None, ...]  # per model layer: its window (None: full)
    ring_pages: int  # R

    @classmethod
    def zeros(
        cls,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        ring_pages: int,
        kv_dtype: str = "float32",
        sharding=None,
    ) -> WindowedKVCache:
        windows = cfg.layer_windows()
        is_local = [w is not None for w in windows]
        num_local = sum(is_local)
        group_index, seen = [], {True: 0, False: 0}
        for local in is_local:
            group_index.append(seen[local])
            seen[local] += 1
        full = PagedKVCache.zeros(
            cfg, num_pages, page_size, kv_dtype, sharding, num_layers=cfg.num_layers - num_local
        )
        local = PagedKVCache.zeros(
            cfg, 1 + max_num_seqs * ring_pages, page_size, kv_dtype, sharding, num_local
        )
        return cls(full, local, tuple(group_index), tuple(windows), ring_pages)

    @property
    def num_bytes(self) -> int:
        return self.full.num_bytes + self.local.num_bytes

    @property
    def num_local_pages(self) -> int:
        """Pages of the local group, its null page included (1 + max_num_seqs * R)."""
        return self.local.k_pages.shape[2]


def ring_page_table(slots: jax.Array, num_cols: int, ring_pages: int) -> jax.Array:
    """slots [S] int32 -> [S, num_cols] local page of each logical page of the sequences."""
    cols = jnp.arange(num_cols, dtype=jnp.int32) % ring_pages  # [P]
    return 1 + slots[:, None] * ring_pages + cols[None, :]


def ring_slot_mapping(
    slot_mapping: jax.Array,
    positions: jax.Array,
    row_slots: jax.Array,
    ring_pages: int,
    page_size: int,
) -> jax.Array:
    """[T] flat local-cache slot of each token row: position p of the sequence in slot s goes
    to ring page 1 + s * R + (p // ps) % R; a padding row (its pool slot in the null page,
    slot_mapping < page_size) goes to the local null page."""
    page = 1 + row_slots * ring_pages + (positions // page_size) % ring_pages
    return jnp.where(slot_mapping >= page_size, page * page_size + positions % page_size, 0)
