"""The engine's device state as one pytree: what every step program reads and donates.

    kv           PagedKVCache  [L, K, num_pages, page_size, hd] (+ int8 scales)
    counts       [max_num_seqs, V] int32  each slot's output token counts (penalties)
    prompt_mask  [max_num_seqs, V] bool   each slot's prompt tokens (repetition penalty)
    last_tokens  [max_num_seqs] int32     the last token sampled into each slot

`counts` and `prompt_mask` are [1, 1] placeholders until the penalty state is allocated
(at once on one device; with a mesh on first use, engine/runner/model_runner.py says why).
ModelRunner holds the one live DeviceState; the jitted steps take it donated and return the
next one, so XLA updates every field in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from engine.runner.kv_cache import PagedKVCache


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["kv", "counts", "prompt_mask", "last_tokens"],
    meta_fields=[],
)
@dataclasses.dataclass
class DeviceState:
    kv: PagedKVCache
    counts: jax.Array  # [max_num_seqs, V] int32, or a [1, 1] placeholder
    prompt_mask: jax.Array  # [max_num_seqs, V] bool, or a [1, 1] placeholder
    last_tokens: jax.Array  # [max_num_seqs] int32

    @classmethod
    def without_penalties(cls, kv: PagedKVCache, num_slots: int, place=None) -> DeviceState:
        """A state whose penalty counts are [1, 1] placeholders (a step program that never
        applies penalties reads nothing else); `place` puts each new array on its devices."""
        place = place or (lambda x: x)
        return cls(
            kv,
            place(jnp.zeros((1, 1), jnp.int32)),
            place(jnp.zeros((1, 1), jnp.int32)),
            place(jnp.zeros((num_slots,), jnp.int32)),
        )
