"""The persistent compilation cache's defaults (engine/runner/compilation_cache.py)."""

import os
import subprocess
import sys

import jax
import pytest

from engine.runner import compilation_cache


def test_default_is_on_under_the_cache_dir_and_the_variable_overrides(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDJAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path / "root"))
    assert jax.default_backend() == "cpu"
    assert compilation_cache.default_dir() == str(tmp_path / "root" / "xla")  # on, CPU too
    monkeypatch.setenv("PAGEDJAX_COMPILATION_CACHE_DIR", str(tmp_path))
    assert compilation_cache.default_dir() == str(tmp_path)
    monkeypatch.setenv("PAGEDJAX_COMPILATION_CACHE_DIR", "")
    assert compilation_cache.default_dir() == ""  # off (the test suite's setting)


def test_off_values_turn_it_off():
    before = jax.config.jax_compilation_cache_dir
    try:
        for off in ("", "none", "off"):
            assert compilation_cache.enable(off) is None
            assert jax.config.jax_compilation_cache_dir is None
    finally:
        if before is not None:
            compilation_cache.enable(before)


# ---- the fallbacks: an unreadable entry is ignored, a warm-up that died sets the cache aside --
_COMPILE_IN_A_FRESH_PROCESS = """
import sys, jax, jax.numpy as jnp
from engine.runner import compilation_cache, compiles
compiles.install()
compilation_cache.enable(sys.argv[1])
f = jax.jit(lambda x: jnp.sin(x) * 3.0 + x @ x.T)
print(float(f(jnp.ones((8, 8))).sum()), compiles.stats()["compilation_cache_hits_total"])
"""


def _compile_in_fresh_process(cache_dir) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _COMPILE_IN_A_FRESH_PROCESS, str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    value, hits = out.stdout.split()
    return value, int(hits)


@pytest.mark.subprocess  # three fresh Python processes that import JAX and compile
def test_a_corrupt_entry_is_compiled_again_not_fatal(tmp_path):
    first, hits = _compile_in_fresh_process(tmp_path)
    assert hits == 0
    value, hits = _compile_in_fresh_process(tmp_path)
    assert (value, hits > 0) == (first, True)  # loaded from the cache
    entries = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert entries
    for p in entries:
        p.write_bytes(b"not an executable" * 10)
    assert _compile_in_fresh_process(tmp_path) == (first, 0)  # ignored, compiled again


def test_a_marker_of_a_dead_warmup_sets_the_cache_aside(tmp_path):
    cache = tmp_path / "xla"
    cache.mkdir()
    (cache / "entry").write_text("cached program")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    (cache / f".warming-{int(gone.stdout)}").write_text("0\n")
    (cache / f".warming-{os.getpid()}").write_text("0\n")  # alive: not a crash by itself
    before = jax.config.jax_compilation_cache_dir
    try:
        assert compilation_cache.enable(str(cache)) == str(cache)
        assert list(cache.iterdir()) == []  # a fresh, empty cache
        (aside,) = tmp_path.glob("xla.crashed-*")
        assert (aside / "entry").read_text() == "cached program"
        with compilation_cache.warmup_guard():
            assert (cache / f".warming-{os.getpid()}").exists()
        assert list(cache.iterdir()) == []  # the marker is gone after a warm-up that ended
    finally:
        compilation_cache.enable(before if before is not None else "")
