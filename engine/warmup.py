"""Warm-up: compile the step for every batch shape the scheduler can produce, before serving.

The reachable shapes (engine/batch.py) are the product of
    decode bucket Sd in {0, 1, 2, 4, ..., max_num_seqs}
    prefill token bucket Tp in {0, 16, 32, ..., max_num_batched_tokens}
    prefill sequence bucket Sp in {1, 2, 4, ...} with Sp <= Tp / 2 (a chunk has >= 2 tokens)
    page-table bucket P in {4, 8, ..., max_pages_per_seq}
(max_query_len is a function of Tp). A step over an all-padding batch of a shape compiles
exactly the program a real batch of that shape uses, so after warming the reachable set no
step compiles. Large configs warm a frequent subset (`startup_shapes`); a shape outside it
compiles once, on first use, and the engine logs it.
"""

from __future__ import annotations

import itertools
import logging
import time

import jax
import numpy as np

from engine.batch import BatchShape, StepBatch, pow2_bucket, query_len_bound
from engine.sampling import SAMPLER_VARIANTS, SamplingTensors

log = logging.getLogger(__name__)


def _pow2_range(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi] if hi >= lo else out


def reachable_shapes(sched_config, max_pages_per_seq: int | None = None) -> list[BatchShape]:
    sc = sched_config
    seqs = [0] + _pow2_range(1, pow2_bucket(sc.max_num_seqs))
    max_tp = pow2_bucket(sc.max_num_batched_tokens, 16, sc.max_num_batched_tokens)
    tokens = [0] + _pow2_range(16, max_tp)
    max_p = pow2_bucket(
        min(max_pages_per_seq or sc.max_pages_per_seq, sc.max_pages_per_seq),
        4,
        sc.max_pages_per_seq,
    )
    pages = _pow2_range(4, max_p)
    shapes = []
    for sd, tp, p in itertools.product(seqs, tokens, pages):
        if sd == 0 and tp == 0:
            continue
        sps = [0] if tp == 0 else [s for s in seqs[1:] if s <= max(1, tp // 2)]
        for sp in sps:
            shapes.append(BatchShape(sd, tp, sp, p, query_len_bound(tp, sc.prefill_chunk_size)))
    return shapes


def startup_shapes(
    sched_config, max_shapes: int = 64, max_context_tokens: int = 2048
) -> list[BatchShape]:
    """What to compile at start-up: every reachable shape when there are at most
    `max_shapes`; otherwise the most frequent ones, in order: decode-only steps and steps with
    one prefill sequence (with any decode bucket), for contexts up to `max_context_tokens`.

    NOTE: on CPU the jnp reference needs the page-table width P in the shape (its gather cost
    grows with P), so the full reachable set of a large config runs into the thousands; the
    rest compile on first use, and the engine logs each such compile as a warning.
    """
    every = reachable_shapes(sched_config)
    if len(every) <= max_shapes:
        return every
    max_pages = -(-max_context_tokens // sched_config.page_size)
    frequent = [s for s in every if s.num_prefill_seqs <= 1 and s.pages_per_seq <= max_pages]
    frequent.sort(
        key=lambda s: (
            s.num_prefill_tokens > 0,
            s.pages_per_seq,
            s.num_decode,
            s.num_prefill_tokens,
        )
    )
    return frequent[:max_shapes]


def dummy_batch(shape: BatchShape) -> StepBatch:
    """An all-padding batch of `shape` (no sequence, every token writes the null page)."""
    T, R = shape.num_decode + shape.num_prefill_tokens, shape.num_decode + shape.num_prefill_seqs
    z = lambda *s: np.zeros(s, np.int32)  # noqa: E731
    return StepBatch(
        z(T),
        z(T),
        z(T),
        z(shape.num_decode),
        z(shape.num_decode, shape.pages_per_seq),
        z(shape.num_prefill_seqs),
        z(shape.num_prefill_seqs, shape.pages_per_seq),
        z(shape.num_prefill_seqs + 1),
        z(1),
        z(R),
        np.zeros(R, bool),
        z(R),
        SamplingTensors.from_params([None] * R, [0] * R, None, R),
    )


def warmup(
    engine,
    shapes: list[BatchShape] | None = None,
    *,
    sampling=("greedy", "full"),
    max_shapes: int = 64,
) -> float:
    """Compiles the step for `shapes` (default: `startup_shapes`) and each sampler variant in
    `sampling` ("greedy", "full"). Returns and logs the time taken."""
    shapes = shapes or startup_shapes(engine.sched_config, max_shapes)
    flags = [SAMPLER_VARIANTS[s] for s in sampling]
    t0 = time.perf_counter()
    for shape, f in itertools.product(shapes, flags):
        batch = dummy_batch(shape)
        packed = engine.run_step(batch, shape, f, use_penalties=False)
        jax.block_until_ready(packed)
    engine.warmup_s = time.perf_counter() - t0
    log.warning(
        "warm-up compiled %d step programs in %.1fs", len(shapes) * len(flags), engine.warmup_s
    )
    return engine.warmup_s
