"""What `LLM(...)` accepts besides the model, checked before anything loads: engine option
names and types (the EngineConfig fields), `tensor_parallel_size` as a mesh, and the
`gpu_memory_utilization` fraction that sizes the KV pool from the device's memory."""

from __future__ import annotations

import dataclasses
import logging
import typing

from configs.engine_config import EngineConfig
from engine.errors import InvalidRequestError

log = logging.getLogger("engine.llm")

ENGINE_OPTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "model")


def describe(value) -> str:
    return f"{type(value).__name__} {value!r:.60}"


def mesh_from(mesh: str | None, tensor_parallel_size: int | None) -> str | None:
    if tensor_parallel_size is None:
        return mesh
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise InvalidRequestError("tensor_parallel_size", tensor_parallel_size, "an int >= 1")
    if mesh is not None:
        raise InvalidRequestError(
            "tensor_parallel_size", tensor_parallel_size, f"give it or mesh={mesh!r}, not both"
        )
    return None if tensor_parallel_size == 1 else f"model:{tensor_parallel_size}"


def check_engine_options(options: dict) -> None:
    """Unknown names and wrong types, before anything loads."""
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        raise TypeError(
            f"LLM() got unknown option(s) {unknown}; engine options are {list(ENGINE_OPTIONS)}, "
            "plus mesh, tensor_parallel_size, gpu_memory_utilization, warmup, impl"
        )
    hints = typing.get_type_hints(EngineConfig)
    for name, value in options.items():
        allowed = typing.get_args(hints[name]) or (hints[name],)
        if value is None and type(None) in allowed:
            continue
        kinds = [t for t in allowed if t in _CHECKED_TYPES]
        if kinds and not any(_CHECKED_TYPES[t](value) for t in kinds):
            expected = " or ".join(t.__name__ for t in allowed)
            raise TypeError(f"LLM(): {name} expected {expected}, got {describe(value)}")


_CHECKED_TYPES = {  # annotation -> accepts (bools are not ints here)
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def check_fraction(fraction) -> None:
    if fraction is None:
        return
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool):
        raise TypeError(f"gpu_memory_utilization: expected a float, got {describe(fraction)}")
    if not 0.0 < fraction <= 1.0:
        raise InvalidRequestError("gpu_memory_utilization", fraction, "0 < x <= 1")


def with_memory_fraction(config: EngineConfig, fraction: float) -> EngineConfig:
    """kv_cache_bytes = fraction x device memory - bytes in use (weights loaded)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        log.warning(
            "gpu_memory_utilization=%s ignored: %s reports no memory limit; using "
            "kv_cache_bytes=%d",
            fraction,
            jax.local_devices()[0].platform,
            config.kv_cache_bytes,
        )
        return config
    if config.num_pages is not None:
        raise InvalidRequestError(
            "gpu_memory_utilization", fraction, "give it or num_pages, not both"
        )
    budget = int(limit * fraction) - int(stats.get("bytes_in_use", 0))
    if budget <= 0:
        raise InvalidRequestError(
            "gpu_memory_utilization",
            fraction,
            f"leaves no KV memory: {limit * fraction / 2**30:.2f} GiB allowed, "
            f"{stats.get('bytes_in_use', 0) / 2**30:.2f} GiB already in use",
        )
    return dataclasses.replace(config, kv_cache_bytes=budget)
