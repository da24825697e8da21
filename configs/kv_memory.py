"""KV-cache memory arithmetic (the seeds' formula).

    KV bytes per token    = 2 (K and V) x layers x KV heads x head_dim x bytes per element
                            (+ 2 x layers x KV heads x 4 for int8: one float32 scale per
                            token per KV head for K and for V, as PagedKVCache stores them)
    KV bytes per sequence = KV bytes per token x cached tokens

Worked example from the seeds: 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per
token, so an 8,192-token sequence holds 1 GiB of raw K/V (before page rounding).

Local-layer page release (`EngineConfig.release_local_pages`): the sliding-window layers of a
model with both kinds (Gemma 3: 5 local : 1 global) keep one ring of `ring_pages` pages per
sequence slot instead of pages for the whole context, so a long context costs

    global layers x per-layer bytes x context  +  local layers x per-layer bytes x ring tokens
"""

from __future__ import annotations

import math

from configs.model_config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
INT8_SCALE_BYTES = 4  # float32 absmax/127 per token per KV head (pallas_kernels.reference)


def dtype_bytes(dtype: str | int) -> int:
    if isinstance(dtype, int):
        return dtype
    try:
        return DTYPE_BYTES[str(dtype)]
    except KeyError:
        raise ValueError(f"kv dtype {dtype!r}: expected one of {sorted(DTYPE_BYTES)}") from None


def kv_bytes_per_token(
    cfg: ModelConfig, dtype: str | int = "bfloat16", kv_head_replication: int = 1
) -> int:
    """Raw K+V bytes one cached token occupies across all layers.

    `kv_head_replication` > 1 models tensor-parallel degrees above the KV-head count, where
    each KV head is stored on several devices (the seeds list it as a KV multiplier).
    """
    return cfg.num_layers * kv_bytes_per_token_per_layer(cfg, dtype) * kv_head_replication


def kv_bytes_per_token_per_layer(cfg: ModelConfig, dtype: str | int = "bfloat16") -> int:
    """Raw K+V bytes one cached token occupies in one layer."""
    per_head = cfg.head_dim * dtype_bytes(dtype)
    if dtype == "int8":  # the scales are part of the cache (a bare byte count has none)
        per_head += INT8_SCALE_BYTES
    return 2 * cfg.num_kv_heads * per_head


def local_layer_window(cfg: ModelConfig) -> int:
    """The one window of the model's sliding-window layers, when it also has full-attention
    layers (the split `release_local_pages` needs); ValueError naming the model otherwise."""
    windows = cfg.layer_windows()
    local = {w for w in windows if w is not None}
    if len(local) != 1 or None not in windows:
        raise ValueError(
            f"model {cfg.name!r}: layer windows {sorted(set(windows), key=str)}; local page "
            "release needs full-attention layers and sliding-window layers of one window "
            "(Gemma 3)"
        )
    return local.pop()


def ring_pages(window: int, page_size: int, max_query_len: int) -> int:
    """Pages of one sequence's ring in a sliding-window layer group. A step writes its new
    tokens (up to `max_query_len` per sequence: a prefill chunk, or a decode and its drafts)
    before attending, and its first query reads back `window - 1` positions, so the positions
    alive in one step span window + max_query_len - 1 tokens; starting at any offset in a
    page they touch at most ceil((window + max_query_len + page_size - 2) / page_size)
    pages. Decode alone (max_query_len 1) needs at most ceil(window / page_size) + 1."""
    for name, value in (("window", window), ("page_size", page_size)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    if max_query_len < 1:
        raise ValueError(f"max_query_len={max_query_len}: must be >= 1")
    return -(-(window + max_query_len + page_size - 2) // page_size)


def kv_bytes_per_token_in_context(
    cfg: ModelConfig,
    context_tokens: int,
    dtype: str | int = "bfloat16",
    *,
    release_local_pages: bool = False,
    page_size: int = 16,
    max_query_len: int = 256,
) -> float:
    """KV bytes per token of ONE sequence holding `context_tokens` (pages rounded up): every
    layer's pages for the whole context, or with `release_local_pages` the full-attention
    layers' pages plus one ring (`ring_pages`) per sliding-window layer."""
    if context_tokens < 1:
        raise ValueError(f"context_tokens={context_tokens}: must be >= 1")
    per_layer = kv_bytes_per_token_per_layer(cfg, dtype)
    held = math.ceil(context_tokens / page_size) * page_size
    if not release_local_pages:
        return cfg.num_layers * per_layer * held / context_tokens
    window = local_layer_window(cfg)
    num_local = sum(w is not None for w in cfg.layer_windows())
    ring = ring_pages(window, page_size, max_query_len) * page_size
    num_global = cfg.num_layers - num_local
    return (num_global * held + num_local * min(ring, held)) * per_layer / context_tokens


def kv_bytes_per_sequence(
    cfg: ModelConfig, num_tokens: int, dtype: str | int = "bfloat16", page_size: int | None = None
) -> int:
    """K+V bytes for one sequence of `num_tokens`, rounded up to whole pages if `page_size`."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens}: must be >= 0")
    if page_size:
        num_tokens = math.ceil(num_tokens / page_size) * page_size
    return kv_bytes_per_token(cfg, dtype) * num_tokens
