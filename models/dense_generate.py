"""The dense, non-paged generate loop: one prompt at a time over a contiguous KV cache.

This is the correctness oracle for the paged engine (its greedy outputs must match token for
token) and the simplest way to run a model. Shapes are bucketed (prompt length padded to a
power of two, cache length fixed per call) so a session compiles a handful of programs.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs.model_config import ModelConfig
from models.families import forward
from models.llama import Params


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass
class DenseKVCache:
    k: jax.Array  # [L, max_len, K, hd]
    v: jax.Array  # [L, max_len, K, hd]

    @classmethod
    def zeros(cls, cfg: ModelConfig, max_len: int, dtype=jnp.float32) -> DenseKVCache:
        shape = (cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def dense_attention(cfg: ModelConfig, positions: jax.Array):
    """Attention over a contiguous cache for one sequence whose new tokens start at
    positions[0] and are contiguous. Keys at cache positions > the query's are masked."""

    def attention(q, k, v, layer, cache: DenseKVCache, sliding_window=cfg.sliding_window):
        start = positions[0]
        ck = jax.lax.dynamic_update_slice(
            cache.k, k[None].astype(cache.k.dtype), (layer, start, 0, 0)
        )
        cv = jax.lax.dynamic_update_slice(
            cache.v, v[None].astype(cache.v.dtype), (layer, start, 0, 0)
        )
        keys, values = ck[layer], cv[layer]  # [S, K, hd]
        T, H, hd = q.shape
        K = keys.shape[1]
        qg = q.reshape(T, K, H // K, hd)  # [T, K, G, hd]
        scores = jnp.einsum("TKGH,SKH->TKGS", qg, keys.astype(q.dtype)) / jnp.sqrt(hd)
        key_pos = jnp.arange(keys.shape[0])
        mask = key_pos[None, :] <= positions[:, None]  # [T, S]
        if sliding_window is not None:
            mask &= key_pos[None, :] > positions[:, None] - sliding_window
        scores = jnp.where(mask[:, None, None, :], scores.astype(jnp.float32), -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        out = jnp.einsum("TKGS,SKH->TKGH", probs, values.astype(q.dtype))
        return out.reshape(T, H, hd), DenseKVCache(ck, cv)

    return attention


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def dense_step(
    params: Params,
    cfg: ModelConfig,
    cache: DenseKVCache,
    token_ids: jax.Array,
    positions: jax.Array,
    last_index: jax.Array,
):
    """Runs tokens [T] at `positions` [T]; returns (logits [V] of row last_index, cache)."""
    logits, cache = forward(
        params,
        cfg,
        token_ids,
        positions,
        cache,
        dense_attention(cfg, positions),
        logits_indices=last_index[None],
    )
    return logits[0], cache


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


def generate_dense(
    params: Params,
    cfg: ModelConfig,
    prompt_ids: list[int],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    eos_token_ids: tuple[int, ...] = (),
    seed: int = 0,
    max_len: int | None = None,
) -> dict:
    """Generates up to `max_tokens` tokens after `prompt_ids`. Returns a dict with
    `token_ids` (the output only), `finish_reason` ("stop" on EOS, else "length") and
    timings `prefill_s`, `decode_s`."""
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("prompt_ids is empty: need at least one token")
    max_len = max_len or _bucket(n + max_tokens, 256)
    if n + max_tokens > max_len:
        raise ValueError(f"prompt ({n}) + max_tokens ({max_tokens}) > max_len ({max_len})")
    dtype = params.embed.dtype
    cache = DenseKVCache.zeros(cfg, max_len, dtype)
    padded = _bucket(n)
    tokens = np.zeros(padded, np.int32)
    tokens[:n] = prompt_ids
    key = jax.random.key(seed)
    t0 = time.perf_counter()
    logits, cache = dense_step(
        params,
        cfg,
        cache,
        jnp.asarray(tokens),
        jnp.arange(padded, dtype=jnp.int32),
        jnp.int32(n - 1),
    )
    out: list[int] = []
    finish_reason = "length"
    prefill_s = None
    for i in range(max_tokens):
        if temperature == 0.0:
            token = int(jnp.argmax(logits))
        else:
            key, sub = jax.random.split(key)
            token = int(jax.random.categorical(sub, logits / temperature))
        if prefill_s is None:
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
        out.append(token)
        if token in eos_token_ids:
            finish_reason = "stop"
            break
        if i + 1 == max_tokens:
            break
        pos = jnp.array([n + i], jnp.int32)
        logits, cache = dense_step(
            params, cfg, cache, jnp.array([token], jnp.int32), pos, jnp.int32(0)
        )
    return {
        "token_ids": out,
        "finish_reason": finish_reason,
        "prefill_s": prefill_s,
        "decode_s": time.perf_counter() - t0,
    }
