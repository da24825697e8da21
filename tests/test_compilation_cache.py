"""The persistent compilation cache's defaults (engine/compilation_cache.py)."""

import jax

from engine import compilation_cache


def test_cpu_default_is_off_and_the_variable_opts_in(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDJAX_COMPILATION_CACHE_DIR", raising=False)
    assert jax.default_backend() == "cpu"
    assert compilation_cache.default_dir() == ""  # off on CPU (see the module's NOTE)
    monkeypatch.setenv("PAGEDJAX_COMPILATION_CACHE_DIR", str(tmp_path))
    assert compilation_cache.default_dir() == str(tmp_path)


def test_off_values_turn_it_off():
    before = jax.config.jax_compilation_cache_dir
    try:
        for off in ("", "none", "off"):
            assert compilation_cache.enable(off) is None
            assert jax.config.jax_compilation_cache_dir is None
    finally:
        if before is not None:
            compilation_cache.enable(before)
