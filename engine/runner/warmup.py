"""Warm-up: build every program the engine can run while serving, before it serves.

The programs (engine/runner/shapes.py holds the design):
    the step, for every shape of the engine's ShapeSet (every batch is padded to one of
      them) x each sampler variant the shape can run (`sampler_variants`): "greedy" and
      "full" for a decode-only shape, "full" for a shape with a prefill. "full" covers
      sampling, top-k/top-p, logprobs, penalties and structured output's token bitmask, so
      no request needs a program of its own. With the server's default config (32
      sequences, 512 tokens, 8,192-token context, --warmup_max_shapes 56) that is 16
      decode-only + 38 prefill shapes = 70 step programs;
    the penalty state's per-slot reset (one program: token lists padded to max_model_len);
    with a host KV tier, its gather and scatter per page-count bucket (kv_offload.py).
LoRA adapters ride in the step's arguments (same programs). Not built here: speculative
verify steps (engine/spec/decode.py's own shape set) and KV transfer gather/scatter
(engine/kv_transfer/transfer.py), which their features warm.
Each program is built ahead of time (`jit.lower(...).compile()` with the engine's own
arguments, which fills the cache a call uses) without running it, so warm-up costs only
compile (or persistent-cache load) time, on `default_workers()` threads at once (XLA
compiles without the interpreter lock). `execute=True` then also runs each program once on
an all-padding batch, cheapest first:
- an ahead-of-time built program is slower on its FIRST execution: XLA:CPU sets up its
  library calls (the YNN dot fusions) then, 0.3-0.7 s per SmolLM2 prefill program and
  ~0.2 s per 64-row decode program on this 2-core CPU; a server that does not execute pays
  that once per program, on the first real step that uses it (a stall for every running
  request, like a compile's, only shorter);
- running costs each shape's own step time on padding: with the server's defaults (48
  programs, 32 sequences, 8,192-token context, scan layers) a second start's warm-up takes
  70.7 s instead of 10.3 s and the server is ready at 88 s instead of 29 s
  (benchmarks/RESULTS.md, 2026-12-02). So it is off by default (`--warmup_execute` on the
  server);
- it is also what a multi-host leader needs: its followers build their programs when it
  announces the steps.

`stop` (a zero-argument callable) is checked before each program: once it returns True,
warm-up raises `WarmupCancelled` after the programs already building finish (an XLA
compile cannot be interrupted), so a server told to shut down while warming exits within
one program's compile time instead of the whole set's. After `warmup` nothing compiles:
`EngineCore.stats()["compiles_after_warmup"]` stays 0 (tests/test_warmup_shapes.py drives
a random workload to check it). With JAX's persistent compilation cache
(engine/runner/compilation_cache.py) a second start loads these programs from disk instead.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time

import jax

from engine.batch.builder import BatchShape, StepBatch
from engine.errors import WarmupCancelled
from engine.runner import compilation_cache
from engine.runner.programs import GREEDY_PROGRAM, StepProgram
from engine.runner.shapes import reachable_shapes, sampler_variants  # noqa: F401  (re-exported)
from engine.sampling.sampler import FULL_FLAGS

log = logging.getLogger(__name__)

SAMPLER_VARIANTS = ("greedy", "full")
dummy_batch = StepBatch.zeros  # an all-padding batch of a shape


def warmup(
    engine,
    shapes: list[BatchShape] | None = None,
    *,
    sampling: tuple[str, ...] = SAMPLER_VARIANTS,
    max_shapes: int | None = None,
    execute: bool = False,
    workers: int | None = None,
    stop=None,
) -> float:
    """Builds the step for `shapes` (default: the engine's whole ShapeSet, or its
    `max_shapes` cheapest) in each variant of `sampling` a shape can run (a shape with a
    prefill always gets "full": it has no other); returns and logs the seconds.
    `workers`: programs built at once (default `default_workers()`); `stop`: see the
    module docstring (raises WarmupCancelled)."""
    unknown = set(sampling) - set(SAMPLER_VARIANTS)
    if unknown:
        raise ValueError(f"sampling={sampling!r}: unknown variants {sorted(unknown)}")
    if shapes is None:
        shapes = engine.shapes.shapes[:max_shapes]
    t0 = time.perf_counter()
    runner = engine.runner
    programs = step_programs(engine, shapes, sampling)
    with compilation_cache.warmup_guard():  # a crash while loading sets the cache aside
        runner.warm_reset()
        if getattr(engine, "offload", None) is not None:  # the host tier's gather / scatter
            engine.offload.warm(runner.state.kv)
        build_all(runner, programs, workers, stop)
        if execute:
            for shape, program in programs:
                _check(stop)
                jax.block_until_ready(runner.run(StepBatch.zeros(shape), shape, program))
        # ---- speculative decoding: its verify (and draft) programs (engine/spec/decode.py)
        if getattr(engine, "spec", None) is not None:
            _check(stop)
            variants = {"greedy": GREEDY_PROGRAM, "full": StepProgram(FULL_FLAGS, False)}
            _call_all(engine.spec.warm_programs([variants[name] for name in sampling]), workers)
        # ---- end speculative decoding
    warmup_s = time.perf_counter() - t0
    runner.mark_warm(warmup_s)
    log.warning(
        "warm-up built %d step programs%s + 1 penalty reset (%d shapes of %d) in %.1fs",
        len(programs),
        " and ran each once" if execute else "",
        len(shapes),
        len(engine.shapes),
        warmup_s,
    )
    return warmup_s


def step_programs(
    engine, shapes: list[BatchShape], sampling=SAMPLER_VARIANTS
) -> list[tuple[BatchShape, StepProgram]]:
    """(shape, StepProgram) of every step program of `shapes`, cheapest shape first (see
    the module docstring)."""
    programs = []
    for shape in shapes:
        # a mesh keeps greedy on every shape (ModelRunner.full_program says why)
        names = ("greedy", "full") if getattr(engine, "mesh", None) else sampler_variants(shape)
        for name in names:
            if name == "greedy" and "greedy" in sampling:
                programs.append((shape, GREEDY_PROGRAM))
            elif name == "full" and ("full" in sampling or shape.num_prefill_tokens):
                programs.append((shape, engine.runner.full_program(shape)))
    return programs


def default_workers() -> int:
    """Threads that build programs at once: one per CPU core, at most 8. XLA compiles (and
    loads from the persistent cache) without holding the interpreter lock, so programs
    build in parallel; tracing and lowering, in Python, do not."""
    return max(1, min(8, os.cpu_count() or 1))


def build_all(runner, programs: list, workers: int | None, stop=None) -> None:
    """`runner.compile` for each (shape, StepProgram), `workers` at a time, cheapest first
    (the order of `programs`); the first error is raised. At most `workers` programs are
    submitted at once, so a `stop()` leaves only those to finish."""
    workers = default_workers() if workers is None else workers
    if workers <= 1 or len(programs) <= 1:
        for program in programs:
            _check(stop)
            runner.compile(*program)
        return
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="warmup") as pool:
        building: set[concurrent.futures.Future] = set()
        for program in programs:
            if len(building) >= workers:
                done, building = concurrent.futures.wait(
                    building, return_when=concurrent.futures.FIRST_COMPLETED
                )
                for future in done:
                    future.result()
            _check(stop)
            building.add(pool.submit(runner.compile, *program))
        for future in concurrent.futures.as_completed(building):
            future.result()


def _check(stop) -> None:
    if stop is not None and stop():
        raise WarmupCancelled("warm-up stopped before every program was built")


def _call_all(builders: list, workers: int | None) -> None:
    """Each zero-argument builder, `workers` at a time; the first error is raised."""
    workers = default_workers() if workers is None else workers
    with concurrent.futures.ThreadPoolExecutor(max(workers, 1)) as pool:
        for future in [pool.submit(build) for build in builders]:
            future.result()
