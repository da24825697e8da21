"""Warm-up: build every program the engine can run while serving, before it serves.

The programs are
    the step, for every shape of the engine's ShapeSet (engine/shapes.py: every batch is
      padded to one of them) x each sampler variant: "greedy" (all rows greedy, no
      logprobs), "full" (any sampling or logprobs), "penalties" (full + token counts);
    the penalty state: its allocation and the per-slot reset (one program: token lists are
      padded to max_model_len).
Each program is built ahead of time (`jit.lower(...).compile()` with the engine's own
arguments, which fills the cache a call uses) without running it, so warm-up costs only
compile (or persistent-cache load) time, on `default_workers()` threads at once (XLA
compiles without the interpreter lock); `execute=True` runs each step once on an
all-padding batch instead (what a multi-host leader needs: its followers build their
programs when it announces the steps). After `warmup` nothing compiles:
`EngineCore.stats()["compiles_after_warmup"]` stays 0 (tests/test_engine_overlap.py drives
a random workload to check it). With JAX's persistent compilation cache
(engine/compilation_cache.py) a second start loads these programs from disk instead.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import time

import jax
import numpy as np

from engine import compilation_cache
from engine.batch import BatchShape, StepBatch
from engine.sampling import FULL_FLAGS, GREEDY_FLAGS
from engine.shapes import reachable_shapes  # noqa: F401  (re-exported: the full product)

log = logging.getLogger(__name__)

SAMPLER_VARIANTS = ("greedy", "full", "penalties")
dummy_batch = StepBatch.zeros  # an all-padding batch of a shape


def warmup(
    engine,
    shapes: list[BatchShape] | None = None,
    *,
    sampling: tuple[str, ...] = SAMPLER_VARIANTS,
    max_shapes: int | None = None,
    execute: bool = False,
    workers: int | None = None,
) -> float:
    """Builds the step for `shapes` (default: the engine's whole ShapeSet, or its
    `max_shapes` cheapest) and each variant in `sampling`; returns and logs the seconds.
    `workers`: programs built at once (default `default_workers()`)."""
    variants = {
        "greedy": (GREEDY_FLAGS, False),
        "full": (FULL_FLAGS, False),
        "penalties": (FULL_FLAGS, True),
    }
    unknown = set(sampling) - set(variants)
    if unknown:
        raise ValueError(f"sampling={sampling!r}: unknown variants {sorted(unknown)}")
    if shapes is None:
        shapes = engine.shapes.shapes[:max_shapes]
    t0 = time.perf_counter()
    programs = [(shape, *variants[name]) for shape, name in itertools.product(shapes, sampling)]
    with compilation_cache.warmup_guard():  # a crash while loading sets the cache aside
        if "penalties" in sampling:
            _warm_penalty_state(engine)
        if execute:
            for shape, flags, use_penalties in programs:
                packed = engine.run_step(StepBatch.zeros(shape), shape, flags, use_penalties)
                jax.block_until_ready(packed)
        else:
            _build_all(engine, programs, workers)
        # ---- speculative decoding: its verify (and draft) programs (engine/spec_decode.py)
        if getattr(engine, "spec", None) is not None:
            _call_all(engine.spec.warm_programs([variants[name] for name in sampling]), workers)
        # ---- end speculative decoding
    warmup_s = time.perf_counter() - t0
    engine.mark_warm(warmup_s)
    log.warning(
        "warm-up built %d step programs (%d shapes of %d, %s) in %.1fs",
        len(shapes) * len(sampling),
        len(shapes),
        len(engine.shapes),
        "/".join(sampling),
        warmup_s,
    )
    return warmup_s


def default_workers() -> int:
    """Threads that build programs at once: one per CPU core, at most 8. XLA compiles (and
    loads from the persistent cache) without holding the interpreter lock, so programs
    build in parallel; tracing and lowering, in Python, do not."""
    return max(1, min(8, os.cpu_count() or 1))


def _build_all(engine, programs: list, workers: int | None) -> None:
    """`engine.compile_step` for each (shape, flags, use_penalties), `workers` at a time,
    cheapest first (the order of `programs`); the first error is raised."""
    workers = default_workers() if workers is None else workers
    if workers <= 1 or len(programs) <= 1:
        for program in programs:
            engine.compile_step(*program)
        return
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="warmup") as pool:
        for future in [pool.submit(engine.compile_step, *p) for p in programs]:
            future.result()


def _call_all(builders: list, workers: int | None) -> None:
    """Each zero-argument builder, `workers` at a time; the first error is raised."""
    workers = default_workers() if workers is None else workers
    with concurrent.futures.ThreadPoolExecutor(max(workers, 1)) as pool:
        for future in [pool.submit(build) for build in builders]:
            future.result()


def _warm_penalty_state(engine) -> None:
    """Allocate the token counts and run the slot reset once (slot 0, empty lists): the
    slot a real request takes is reset again when it does."""
    from engine.core import _reset_counts_jit

    engine.init_penalty_state()
    width = engine.sched_config.max_model_len
    empty = np.zeros(width, np.int32)
    engine._counts, engine._prompt_mask = _reset_counts_jit(
        engine._counts, engine._prompt_mask, np.int32(0), empty, np.int32(0), empty, np.int32(0)
    )
    jax.block_until_ready(engine._counts)
