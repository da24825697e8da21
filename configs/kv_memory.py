"""KV-cache memory arithmetic (the seeds' formula).

    KV bytes per token    = 2 (K and V) x layers x KV heads x head_dim x bytes per element
                            (+ 2 x layers x KV heads x 4 for int8: one float32 scale per
                            token per KV head for K and for V, as PagedKVCache stores them)
    KV bytes per sequence = KV bytes per token x cached tokens

Worked example from the seeds: 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per
token, so an 8,192-token sequence holds 1 GiB of raw K/V (before page rounding).
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
    per_head = cfg.head_dim * dtype_bytes(dtype)
    if dtype == "int8":  # the scales are part of the cache (a bare byte count has none)
        per_head += INT8_SCALE_BYTES
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head * kv_head_replication


def kv_bytes_per_sequence(
    cfg: ModelConfig, num_tokens: int, dtype: str | int = "bfloat16", page_size: int | None = None
) -> int:
    """K+V bytes for one sequence of `num_tokens`, rounded up to whole pages if `page_size`."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens}: must be >= 0")
    if page_size:
        num_tokens = math.ceil(num_tokens / page_size) * page_size
    return kv_bytes_per_token(cfg, dtype) * num_tokens
