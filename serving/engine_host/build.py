"""Building the serving engine: the mock, or the real EngineCore (imported lazily: JAX),
and its warm-up (every step program of the engine's shape set, engine/runner/shapes.py).

Kept apart from serving/server.py so the engine's child process (serving/engine_host/process.py)
builds an engine without importing the server that starts it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from serving import flags as shared

StopFn = Callable[[], bool]


class Warmup(Protocol):
    """The one signature of a server's warm-up callable (engine_warmup's, the child process
    engine's, and the prefill/decode wrapper around either): build (and with execute, run)
    the step programs; `stop()` turning True ends it early with engine.errors.WarmupCancelled."""

    def __call__(self, stop: StopFn | None = None) -> None: ...


def build_engine(
    model: str, options: dict, *, mock_step_time_s: float = 0.01, max_model_len: int | None = None
):
    """'mock' -> MockEngine; anything else -> the real EngineCore, imported lazily (JAX).

    `options`: page_size, num_pages, max_num_seqs, max_num_batched_tokens,
    prefill_chunk_size, prefix_caching, quantization, kv_dtype, mesh, impl (the attention
    implementation; see engine_options_from_flags)."""
    options = dict(options)
    if model == "mock":
        from serving.engine_host.mock_engine import MockEngine

        for opt, default in (("quantization", "none"), ("kv_dtype", "float32")):
            if options.get(opt, default) != default:
                raise ValueError(f"{opt}={options[opt]!r}: the mock engine allows {default!r}")
        if options.get("speculative") is not None:
            raise ValueError("speculative: the mock engine does not speculate")
        if options.get("impl", "auto") != "auto":
            raise ValueError(f"attention_impl={options['impl']!r}: the mock engine has none")
        if options.get("max_loras"):
            raise ValueError("LoRA adapters (--lora, --max_loras) need a real --model")
        if options.get("host_kv_gib"):
            raise ValueError("host_kv_gib: the mock engine holds no K/V (needs a real --model)")

        options.pop("kv_cache_bytes", None)  # the mock engine's pool is --num_pages or 4096
        return MockEngine(
            max_num_seqs=options["max_num_seqs"],
            num_pages=options.get("num_pages") or 4096,
            page_size=options["page_size"],
            max_num_batched_tokens=options.get("max_num_batched_tokens") or 512,
            prefill_chunk_size=options.get("prefill_chunk_size"),
            max_model_len=max_model_len or 8192,
            step_time_s=mock_step_time_s,
        )
    import engine as engine_pkg

    if "build_engine" in dir(engine_pkg):
        return engine_pkg.build_engine(model, **options)
    import jax

    from configs.engine_config import EngineConfig
    from engine.factory import create_engine
    from engine.parallel.sharding import loader_shardings
    from models.registry import load_model

    mesh = options.pop("mesh", None)
    impl = options.pop("impl", "auto")
    loras = options.pop("lora", {})  # name -> PEFT directory, loaded below
    warmup_max_shapes = options.pop("warmup_max_shapes", 0)
    warmup_execute = options.pop("warmup_execute", False)
    if warmup_max_shapes:  # the warmed set is the set: every batch is padded to one of them
        options.setdefault("max_step_shapes", warmup_max_shapes)
    config = EngineConfig(model=model, max_model_len=max_model_len, **options)
    shared.progress(f"loading {model} ...")
    t0 = time.perf_counter()
    # With a mesh each param shard goes straight to its devices; "data:N" gives N replicas.
    loaded = load_model(
        model,
        shardings_for=loader_shardings(mesh) if mesh else None,
        quantization=config.quant_config,
    )
    if jax.process_count() > 1:  # multi-host (serving/engine_host/multihost.py): leader or follower
        from engine.parallel.distributed import create_multihost_engine

        core = create_multihost_engine(loaded, config, mesh=mesh, impl=impl)
    else:
        core = create_engine(loaded, config, mesh=mesh, impl=impl)
    for name, path in loras.items():  # before the engine thread starts: no lock needed
        for replica in getattr(core, "replicas", [core]):
            ref = replica.load_adapter(name, path)
        shared.progress(f"LoRA adapter {name} = {ref.content_hash[:19]} (rank {ref.rank})")
    shared.progress(f"loaded {loaded.identity.name} in {time.perf_counter() - t0:.1f}s")
    warm = engine_warmup(core, warmup_max_shapes, execute=warmup_execute)
    if warm is not None:
        warm()
    return core


def engine_warmup(engine, max_shapes: int, *, execute: bool = False) -> Warmup | None:
    """A callable building every step program of `engine`'s shape set (engine/runner/shapes.py;
    its size is EngineConfig.max_step_shapes, which the server sets from
    --warmup_max_shapes), or None: nothing to do (the mock engine, or max_shapes 0).
    `execute` (--warmup_execute): also run each program once (engine/runner/warmup.py says why).
    PagedJaxServer runs it on the engine thread."""
    replicas = getattr(engine, "replicas", [engine])
    if not max_shapes or not hasattr(replicas[0], "runner"):
        return None

    def run(stop: StopFn | None = None) -> None:
        for replica in replicas:
            warmup_with_progress(replica, stop=stop, execute=execute)

    return run


def warmup_with_progress(engine, num_reports: int = 8, stop=None, execute: bool = False) -> None:
    """Builds the engine's whole shape set (engine/runner/shapes.py) in a few chunks, printing a
    line after each, and a last one with the program count (engine/runner/warmup.py lists them).
    `stop()` True: raises engine.errors.WarmupCancelled (a shutdown during warm-up)."""
    from engine.runner import compiles
    from engine.runner.warmup import step_programs, warmup

    shapes = engine.shapes.shapes
    num_programs = len(step_programs(engine, shapes))
    chunk = max(1, -(-len(shapes) // num_reports))
    t0, hits0 = time.perf_counter(), compiles.stats()["compilation_cache_hits_total"]
    # NOTE: warmup() logs a summary per call; the progress lines below replace them.
    warmup_log = logging.getLogger(warmup.__module__)
    level = warmup_log.level
    warmup_log.setLevel(logging.ERROR)
    try:
        for start in range(0, len(shapes), chunk):
            warmup(engine, shapes[start : start + chunk], stop=stop, execute=execute)
            done = min(start + chunk, len(shapes))
            elapsed_s = time.perf_counter() - t0
            what = "compiled and run once" if execute else "compiled"
            shared.progress(f"warm-up: {done}/{len(shapes)} step shapes {what} ({elapsed_s:.0f}s)")
    finally:
        warmup_log.setLevel(level)
    warmup_s = time.perf_counter() - t0
    engine.runner.mark_warm(warmup_s)  # compiles after this count as while serving
    hits = compiles.stats()["compilation_cache_hits_total"] - hits0
    shared.progress(
        f"warm-up: {num_programs} step programs ({len(shapes)} shapes) + 1 penalty reset "
        f"in {warmup_s:.1f}s ({hits} loaded from the compilation cache)"
    )
