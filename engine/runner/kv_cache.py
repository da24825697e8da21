"""The paged KV cache as a pytree (layout: WORKSPACE.md, pallas_kernels/__init__.py).

k_pages, v_pages   [L, K, num_pages, page_size, hd]
k_scales, v_scales [L, K, num_pages, page_size] float32, only for int8 KV
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
    ) -> PagedKVCache:
        shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
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
