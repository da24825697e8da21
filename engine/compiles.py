"""How many programs JAX compiled for a jitted function in this process, counted through
JAX's public monitoring events (jax.monitoring) instead of jit's private `_cache_size()`.

JAX records BACKEND_COMPILE_EVENT, with `fun_name="jit(<name>)"`, once for every program
it compiles (or loads from the persistent compilation cache): a new shape, new static
arguments, or new input shardings/committedness of an already traced function all count.
That is what "a step compiled after warm-up" means.

NOTE: the counts are process-wide, like jit's own cache; the listener is registered once,
when this module is first imported, so compiles before that are not counted (engine/step.py
imports it before defining the step).
"""

from __future__ import annotations

import collections
import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_counts: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


def _on_duration_event(event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _counts[str(kwargs.get("fun_name", ""))] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration_event)


def num_compiles(fn) -> int:
    """Programs compiled for the jitted function `fn` (by its name) since import."""
    with _lock:
        return _counts[f"jit({fn.__name__})"]
