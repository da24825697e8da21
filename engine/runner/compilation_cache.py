"""JAX's persistent compilation cache, on by default (issue 21.4).

Compiled XLA programs are written to a directory and read back by later processes, so a
second server start or a second `LLM(...)` on the same machine loads its step programs
instead of compiling them (the warm-up then costs the loads plus one run of each program).

Where: `--compilation_cache_dir` (server, CLI) or `LLM(compilation_cache_dir=...)`; else
$PAGEDJAX_COMPILATION_CACHE_DIR; else `xla/` under the project's cache directory
($PAGEDJAX_CACHE_DIR, default ~/.cache/pagedjax, beside the Orbax params cache). "" or
"none" turns it off.

On the CPU backend too (since 2026-12-01 evening): it had been off there after the test
suite once crashed with a segmentation fault inside `deserialize_executable`, but a second
crash came with no cache at all, and loads then held: the tiny model's API tests from a warm
cache (39 of 39 programs loaded) and SmolLM2's unrolled 30-layer step loaded in three fresh
processes, without a fault (benchmarks/RESULTS.md, "Host overhead and start-up"). Two
fallbacks: an entry JAX cannot read is logged and compiled again (JAX's own behaviour,
tests/test_compilation_cache.py corrupts every entry), and `warmup_guard` marks the
directory while a warm-up loads programs, so if a load ever kills the process, the next
start sets that directory aside (`<dir>.crashed-<time>`) and starts empty instead of
crashing again. Every program is cached, however fast it compiled (JAX's default skips
programs under one second, which would leave most of the tiny model's steps uncached).

NOTE: JAX decides once per process whether the cache is used, at the first compile; when
something compiled before `enable` (a loader, a test), the public `reset_cache` makes the
new directory take effect for later compiles. The cache is trusted input: do not point it
at a directory others can write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import jax

log = logging.getLogger(__name__)

_OFF = ("", "none", "off")


def default_dir() -> str:
    """The cache directory when none is given: $PAGEDJAX_COMPILATION_CACHE_DIR, else `xla/`
    under the project's cache directory."""
    env = os.environ.get("PAGEDJAX_COMPILATION_CACHE_DIR")
    if env is not None:
        return env
    root = os.environ.get("PAGEDJAX_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pagedjax"
    )
    return os.path.join(root, "xla")


def enable(cache_dir: str | None = None) -> str | None:
    """Turn the persistent compilation cache on (`cache_dir` None: `default_dir()`; "" or
    "none": off). Returns the directory in use, or None when off. Idempotent."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = default_dir() if cache_dir is None else cache_dir
    if path.strip().lower() in _OFF:
        if jax.config.jax_compilation_cache_dir is not None:
            jax.config.update("jax_compilation_cache_dir", None)
            cc.reset_cache()
        return None
    path = os.path.abspath(os.path.expanduser(path))
    if jax.config.jax_compilation_cache_dir == path:
        return path
    os.makedirs(path, exist_ok=True)
    _set_aside_if_a_warmup_died(path)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cc.reset_cache()  # take effect even if this process compiled something already
    log.info("persistent compilation cache: %s", path)
    return path


# ---- the crash fallback (hostspeed, #21) ------------------------------------------------------
_MARKER_PREFIX = ".warming-"  # + pid: a warm-up of that process is loading programs now


@contextlib.contextmanager
def warmup_guard():
    """Marks the cache directory while this process warms up (loads cached programs): a
    marker left behind by a process that no longer runs means its warm-up died (a
    segmentation fault inside a cached executable's load, or a kill), and the next
    `enable` sets that directory aside instead of loading the same entries again. A no-op
    when the cache is off. An unreadable entry needs no guard: JAX logs it and compiles."""
    path = jax.config.jax_compilation_cache_dir
    marker = None if path is None else os.path.join(path, f"{_MARKER_PREFIX}{os.getpid()}")
    if marker is not None:
        with open(marker, "w") as f:
            f.write(f"{time.time():.0f}\n")
    try:
        yield
    finally:
        if marker is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(marker)


def _set_aside_if_a_warmup_died(path: str) -> None:
    """Rename `path` to `path.crashed-<time>` (kept for a bug report) and start an empty
    cache there when a warm-up marker names a process that is gone."""
    dead = [
        name
        for name in os.listdir(path)
        if name.startswith(_MARKER_PREFIX) and not _alive(name[len(_MARKER_PREFIX) :])
    ]
    if not dead:
        return
    aside = f"{path}.crashed-{time.strftime('%Y%m%dT%H%M%S')}"
    try:
        os.replace(path, aside)
    except OSError as e:  # another process starting now set it aside first
        log.warning("compilation cache %s: could not set it aside (%s)", path, e)
        return
    os.makedirs(path, exist_ok=True)
    log.warning(
        "compilation cache %s: a warm-up died while loading it (%s); moved to %s, "
        "starting with an empty cache",
        path,
        ", ".join(dead),
        aside,
    )


def _alive(pid_text: str) -> bool:
    try:
        os.kill(int(pid_text), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # exists, another user's
        return True
    return True
