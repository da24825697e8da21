"""JAX's persistent compilation cache, on by default on accelerators (issue 21.4).

Compiled XLA programs are written to a directory and read back by later processes, so a
second server start or a second `LLM(...)` on the same machine loads its step programs
instead of compiling them (the warm-up then costs the loads plus one run of each program).

Where: `--compilation_cache_dir` (server, CLI) or `LLM(compilation_cache_dir=...)`; else
$PAGEDJAX_COMPILATION_CACHE_DIR; else `xla/` under the project's cache directory
($PAGEDJAX_CACHE_DIR, default ~/.cache/pagedjax, beside the Orbax params cache). "" or
"none" turns it off. On the CPU backend the default is OFF (opt in with the flag, the option
or the variable): loading a cached XLA:CPU executable crashed the test suite with a
segmentation fault inside `deserialize_executable` (2026-12-01; many-kernel programs such as
the unrolled 30-layer step are the suspects), and a crash at start-up is worse than a slow
one. Every program is cached, however fast it compiled (JAX's default skips
programs under one second, which would leave most of the tiny model's steps uncached).

NOTE: JAX decides once per process whether the cache is used, at the first compile; when
something compiled before `enable` (a loader, a test), the public `reset_cache` makes the
new directory take effect for later compiles. The cache is trusted input: do not point it
at a directory others can write.
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)

_OFF = ("", "none", "off")


def default_dir() -> str:
    """The cache directory when none is given: $PAGEDJAX_COMPILATION_CACHE_DIR, else "" (off)
    on the CPU backend, else `xla/` under the project's cache directory."""
    env = os.environ.get("PAGEDJAX_COMPILATION_CACHE_DIR")
    if env is not None:
        return env
    if jax.default_backend() == "cpu":  # NOTE: see the module docstring (opt in on CPU)
        return ""
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
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cc.reset_cache()  # take effect even if this process compiled something already
    log.info("persistent compilation cache: %s", path)
    return path
