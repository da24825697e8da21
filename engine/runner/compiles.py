"""Counts the XLA programs this process builds, through `jax.monitoring` (public API).

Every program JAX builds, compiled or loaded from the persistent compilation cache, records
one backend-compile event with the jitted function's name; either way the caller waits for
it. The engine reads `count()` before and after its warm-up and every step, so "nothing
compiles while serving" is a number in `EngineCore.stats()` (`compiles_after_warmup`) and in
the server's metrics (`pagedjax_compiles_total`). The count is per process: two engines in
one process see each other's compiles.
"""

from __future__ import annotations

import collections
import threading

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_by_function: collections.Counter[str] = collections.Counter()
_seconds = [0.0]
_cache_hits = [0]
_installed = [False]


def _on_duration(event: str, duration_s: float, **kwargs) -> None:
    if event != _BACKEND_COMPILE_EVENT:
        return
    with _lock:
        _by_function[str(kwargs.get("fun_name", "?"))] += 1
        _seconds[0] += duration_s


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT_EVENT:
        with _lock:
            _cache_hits[0] += 1


def install() -> None:
    """Start counting (idempotent; listeners cannot be removed, so install once)."""
    with _lock:
        if _installed[0]:
            return
        _installed[0] = True
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


def count(function: str | None = None) -> int:
    """Programs built so far in this process (of `function` only, when given)."""
    with _lock:
        return _by_function[function] if function else sum(_by_function.values())


def stats() -> dict:
    with _lock:
        return {
            "compiles_total": sum(_by_function.values()),
            "compile_seconds_total": _seconds[0],
            "compilation_cache_hits_total": _cache_hits[0],
        }
