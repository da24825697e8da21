"""Issue 21.3: a small, known set of programs, and nothing compiled after warm-up.

The engine's shape set is made much coarser than the reachable product (max_step_shapes
4), so batches are padded across every dimension; warm-up builds each shape's sampler
programs (engine/runner/shapes.py sampler_variants); then a random workload (chunked prefill,
mixed decode, greedy / temperature / top-k / top-p / logprobs / penalties / stop strings,
a structured-output request, prefix-cache hits, preemption, cancellation) must build no
program at all."""

import threading
import time

import numpy as np
import pytest

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest
from engine.core import EngineCore
from engine.runner import compiles
from engine.runner.shapes import reachable_shapes, sampler_variants
from engine.runner.warmup import WarmupCancelled, build_all, step_programs, warmup
from engine.sampling.params import SamplingParams

CONFIG = dict(
    model="tiny",
    num_pages=9,  # 8 usable pages of 8 tokens for up to 4 sequences of 64: preemption
    page_size=8,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    prefill_chunk_size=16,  # prompts up to 40 tokens: chunked
    max_model_len=64,
    max_step_shapes=4,
    layer_loop="scan",  # NOTE: compiles ~4x faster than unrolled; the shape logic is the same
)


def _params(rng: np.random.Generator, i: int) -> SamplingParams:
    seed = int(rng.integers(1 << 30))
    kinds = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.9, max_tokens=10, seed=seed),
        SamplingParams(temperature=0.7, top_k=5, max_tokens=9, seed=seed),
        SamplingParams(temperature=1.0, top_p=0.8, max_tokens=8, seed=seed, logprobs=3),
        SamplingParams(temperature=0, max_tokens=10, logprobs=1),
        SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=12, seed=seed, stop=("a",)),
        SamplingParams(temperature=0, max_tokens=6, structured={"regex": "[0-9]{3}"}),
    ]
    return kinds[i % len(kinds)]


def _drive(core: EngineCore, rng: np.random.Generator, num_requests: int = 24) -> dict:
    """Adds 0-3 requests per step (a third share a 2-page prefix), cancels two mid-way;
    returns the engine's stats at the end."""
    shared = [1] + rng.integers(3, 400, 15).tolist()
    pending = []
    for i in range(num_requests):
        tail = rng.integers(3, 400, int(rng.integers(1, 25))).tolist()
        pending.append((f"r{i}", (shared + tail) if i % 3 == 0 else [1] + tail))
    for step in range(2000):
        for _ in range(int(rng.integers(0, 4))):
            if pending:
                rid, prompt = pending.pop(0)
                core.add_request(EngineRequest(rid, prompt, _params(rng, int(rid[1:]))))
        if step in (6, 15):
            core.abort_request(f"r{step // 3}")
        core.step()
        if not pending and not core.has_unfinished():
            break
    assert not pending and not core.has_unfinished()
    assert core.pool.num_used_pages == 0
    return core.stats()


@pytest.mark.compile
def test_nothing_compiles_after_warmup_with_a_coarse_shape_set(tiny_model):
    core = EngineCore(tiny_model, EngineConfig(**CONFIG))
    shapes = core.shapes.shapes
    assert len(shapes) <= 4 < len(reachable_shapes(core.sched_config))  # padding happens
    programs = step_programs(core, shapes)
    assert len(programs) == sum(len(sampler_variants(s)) for s in shapes)
    before = compiles.count()
    warmup(core)
    assert compiles.count() > before  # the counter sees compiles: the check below can fail
    warmed = compiles.count()
    stats = _drive(core, np.random.default_rng(21))
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["num_steps"] > 20
    assert compiles.count() == warmed
    assert stats["compiles_after_warmup"] == 0


def test_every_max_shapes_is_honoured_by_the_server_default_config():
    """The server's default scheduler config: the set never exceeds --warmup_max_shapes, and
    its default (56) is 70 step programs (16 decode-only shapes x 2 + 38 with a prefill,
    of which 5 are a lone fresh prompt and the rest carry Sp = 1 and a wider Sp rung)."""
    from configs.engine_config import SchedulerConfig
    from engine.batch.builder import BatchShape
    from engine.runner.shapes import DEFAULT_MAX_SHAPES, ShapeSet, step_shapes

    sc = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=8192)
    for max_shapes in (1, 2, 3, 10, 20, 32, 50, 100, 500):
        assert len(step_shapes(sc, max_shapes)) <= max_shapes
    shapes = step_shapes(sc, DEFAULT_MAX_SHAPES)
    assert sum(len(sampler_variants(s)) for s in shapes) == 70
    # a 130-token prompt alone is padded to its own token bucket, not to a 32-sequence step
    fit = ShapeSet(shapes, sc.page_size).fit(BatchShape(0, 130, 1, 9, 130))
    assert (fit.num_decode, fit.num_prefill_tokens, fit.num_prefill_seqs) == (0, 256, 1)
    # one prompt beside 15 decodes is padded to one prefill sequence, not to 32
    assert ShapeSet(shapes, sc.page_size).fit(BatchShape(15, 256, 1, 24, 256)).num_prefill_seqs == 1


def test_attention_bounded_by_lengths_gets_a_set_without_page_table_rungs():
    """With the CPU loops (padding in P costs nothing) the default budget is 39 step programs:
    6 decode-only shapes (every Sd rung at the widest page table) x 2 samplers, 22 prefill
    shapes at Sd 32 and the widest page table (Sp 1, every 4th rung and the top), and the 5
    lone fresh-prompt shapes; every shape has the widest table except those lone ones. An
    engine on CPU builds that set; one forced to the reference keeps the padded set."""
    from configs.engine_config import SchedulerConfig
    from engine.batch.builder import BatchShape
    from engine.runner.shapes import DEFAULT_MAX_SHAPES, ShapeSet, step_shapes

    sc = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=8192)
    shapes = step_shapes(sc, DEFAULT_MAX_SHAPES, padded_attention=False)
    assert sum(len(sampler_variants(s)) for s in shapes) == 39
    assert {s.pages_per_seq for s in shapes if s.num_decode} == {512}
    fit = ShapeSet(shapes, sc.page_size, padded_attention=False).fit
    assert fit(BatchShape(3, 0, 0, 9, 1)) == BatchShape(4, 0, 0, 512, 1)
    assert fit(BatchShape(0, 130, 1, 9, 130)) == BatchShape(0, 256, 1, 16, 256)
    assert fit(BatchShape(15, 512, 2, 17, 256)).num_prefill_seqs == 4


@pytest.mark.parametrize("impl, padded", [("auto", False), ("reference", True)])
def test_the_engine_picks_the_set_of_its_attention(tiny_model, impl, padded):
    from engine.runner.shapes import step_shapes

    core = EngineCore(tiny_model, EngineConfig(**{**CONFIG, "max_step_shapes": 12}), impl=impl)
    sc = core.sched_config
    want, other = (step_shapes(sc, 12, padded_attention=p) for p in (padded, not padded))
    assert sorted(core.shapes.shapes) == sorted(want) != sorted(other)


class _CountingEngine:
    """Just what `build_all` calls: a runner's compile, here a short sleep that counts."""

    def __init__(self):
        self.started = 0
        self.lock = threading.Lock()

    def compile(self, *program):
        with self.lock:
            self.started += 1
        time.sleep(0.01)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_a_stopped_warmup_builds_no_program_after_the_ones_in_flight(workers):
    """stop() turns True after the 3rd program starts: at most `workers` more were already
    submitted, nothing after; WarmupCancelled says it was not a finished warm-up."""
    engine = _CountingEngine()
    with pytest.raises(WarmupCancelled):
        build_all(engine, [(i,) for i in range(40)], workers, stop=lambda: engine.started >= 3)
    assert 3 <= engine.started <= 3 + workers


@pytest.mark.compile
def test_an_executed_warmup_runs_each_program_once_and_changes_no_output(tiny_model):
    """`execute=True` (--warmup_execute) runs every built program once on an all-padding
    batch (no compile beyond the build), and the engine then produces exactly the tokens of
    an engine that was only built: the padding runs leave no state behind (KV, penalty
    counts, last tokens)."""
    built = EngineCore(tiny_model, EngineConfig(**CONFIG))
    warmup(built)
    executed = EngineCore(tiny_model, EngineConfig(**CONFIG))
    runs = []
    run = executed.runner.run
    executed.runner.run = lambda *a: runs.append(a[1]) or run(*a)
    before = compiles.count()
    warmup(executed, execute=True)
    del executed.runner.run
    assert compiles.count() == before  # same programs as `built`'s: all in jit's cache
    assert len(runs) == len(step_programs(executed, executed.shapes.shapes))
    assert set(runs) == set(executed.shapes.shapes)
    rng = np.random.default_rng(5)
    prompts = [[1] + rng.integers(3, 400, int(rng.integers(2, 30))).tolist() for _ in range(8)]
    outputs = []
    for core in (built, executed):
        for i, prompt in enumerate(prompts):
            params = _params(np.random.default_rng(100 + i), i)  # the same for both engines
            core.add_request(EngineRequest(f"x{i}", prompt, params))
        tokens: dict[str, list[int]] = {}
        while core.has_unfinished():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        outputs.append(tokens)
    assert outputs[0] == outputs[1] and len(outputs[0]) == len(prompts)
