"""Engine options that several test files use on purpose, so that their step programs are the
same XLA programs.

`make test` (tests/lanes.py) gives every pytest process of a run one persistent compilation
cache, so a program that two files build is compiled once and loaded by the other. Two
engines build the same step program only when everything that shapes it is equal: the
model, the pool (`num_pages`, `page_size`), the slots, the context (page-table width), the
step shapes (`max_num_batched_tokens`, `prefill_chunk_size`, `max_step_shapes`) and the
layer loop. On SmolLM2 each step program is seconds of compile, so the tests that serve
SmolLM2 where the pool and the shape set are not the point share one config here.

SMOLLM2_SERVED: 32 slots and a 1,024-token context, scan layers (the server's default loop;
unrolled compiles ~5x slower) and a small shape set (`max_step_shapes`): a test compiles
only the shapes its batches meet, and every batch pads to one of these (padding never
changes a result: tests/test_warmup_shapes.py and test_engine.py's oracles hold that).
"""

from __future__ import annotations

SMOLLM2_SERVED = dict(
    page_size=16,
    num_pages=1024,
    max_num_seqs=32,
    max_num_batched_tokens=512,
    prefill_chunk_size=256,
    max_model_len=1024,
    layer_loop="scan",
    max_step_shapes=16,
)
