"""Smoke test of the engine benchmark on the tiny model: every row and ratio is produced and
written as JSON. No timing assertions (the figures depend on the machine and its load)."""

import json
import math

import pytest

from benchmarks import engine_bench


@pytest.mark.compile
def test_smoke_run_prints_every_row_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    r = engine_bench.main(["--smoke", f"--out={out}"])
    table = capsys.readouterr().out
    assert [row["concurrency"] for row in r["concurrency"]] == [1, 2]
    for row in r["concurrency"]:
        for key in (
            "tokens_per_s",
            "decode_tokens_per_s",
            "step_ms",
            "memory_floor_ms",
            "compute_floor_ms",
            "step_over_memory_floor",
            "step_over_compute_floor",
        ):
            assert math.isfinite(row[key]) and row[key] > 0, key
        assert 0.0 <= row["host_fraction"] < 1.0
        assert row["step_cpu_ms"] > 0 and row["compute_floor_over_step_cpu"] > 0
        assert f"CPU time, c={row['concurrency']}: step" in table
        assert row["memory_floor_ms"] > 0 and row["steps"] >= 4  # 1 prefill + 3 decodes
        assert f"| {row['concurrency']} |" in table
    for row in r["concurrency"]:  # every timed step is paired with its own peaks
        assert row["compute_floor_over_step_paired"] > 0, row
        assert row["memory_floor_over_step_paired"] > 0 and row["paired_matmul_gflop_s"] > 0
        assert f"paired floors, c={row['concurrency']}: peaks before each step" in table
    assert r["targets"]["batch1_memory_floor/step>=0.8 (paired)"] > 0
    assert r["targets"]["prefill_compute_floor/step>=0.6 (paired)"] > 0
    ceiling = r["concurrency"][1]  # c=2: the weights-only forward over 2 rows
    assert ceiling["weights_only_ms"] > 0 and ceiling["compute_floor_over_weights_only"] > 0
    assert "ceiling, c=2: the forward over 2 rows" in table
    assert "weights_only_ms" not in r["concurrency"][0]  # c=1 is the memory-floor row
    mixed = r["static_vs_continuous"]
    assert mixed["continuous_over_static"] > 0 and mixed["output_tokens"] > 0
    assert "continuous" in table and "static" in table and "targets (measured value):" in table
    assert "continuous_over_static>=2" in r["targets"]
    pre = r["prefill"]
    assert pre["prompt_len"] == 40 and pre["steps"] >= 1 and pre["tokens_per_s"] > 0
    assert pre["compute_floor_over_step"] > 0 and "prefill 40 tokens" in table
    assert pre["compute_floor_over_step_cpu"] > 0 and "CPU time, prefill:" in table
    for key in (
        "batch1_memory_floor/step>=0.8",
        "prefill_compute_floor/step>=0.6",
        "batch1_memory_floor/step>=0.8 (CPU time)",
        "prefill_compute_floor/step>=0.6 (CPU time)",
    ):
        assert math.isfinite(r["targets"][key]) and r["targets"][key] > 0, key
    before, after = r["peaks_before"]["matmul_gflop_s"], r["peaks_after"]["matmul_gflop_s"]
    assert r["peaks"]["matmul_gflop_s"] == pytest.approx((before + after) / 2)
    assert "mean of before / after the concurrency runs" in table
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))


def test_floors_arithmetic():
    """Memory floor: weights + every attended K/V position over bandwidth; compute floor:
    flops_per_token(context) of each token over FLOP/s."""
    from configs.model_config import from_name

    cfg = from_name("tiny")
    floors = engine_bench.Floors(
        weight_bytes=1000, kv_bytes_per_token=10, bandwidth_b_s=1e4, flop_s=1e6
    )
    rec = engine_bench.StepRecord(
        1.0, 0.9, 0, 0, 0, num_decode=2, num_prefill_tokens=0, contexts=[5, 7]
    )
    assert floors.memory_s(rec) == (1000 + 10 * 12) / 1e4
    assert floors.compute_s(cfg, rec) == (cfg.flops_per_token(5) + cfg.flops_per_token(7)) / 1e6


def test_mixed_workload_is_seeded_and_bounded():
    a = engine_bench.mixed_workload(50, max_prompt=40, max_output=30, vocab=512, seed=3)
    b = engine_bench.mixed_workload(50, max_prompt=40, max_output=30, vocab=512, seed=3)
    assert a == b
    assert all(8 <= len(p) <= 40 for p in a.prompts)
    assert all(4 <= m <= 30 for m in a.max_tokens) and len(set(a.max_tokens)) > 5


@pytest.mark.compile
def test_warm_shape_does_not_compile_again_with_committed_params():
    """Loaded weights are committed arrays; the engine's KV cache and penalty state must be
    too, or the first shape warm-up compiles gets compiled again on its first real step
    (found by this benchmark on SmolLM2: committedness is part of the jit cache key)."""
    import dataclasses

    import jax

    from configs.engine_config import EngineConfig
    from engine.batch.builder import BatchShape
    from engine.core import EngineCore
    from engine.runner import compiles
    from engine.runner.programs import GREEDY_PROGRAM
    from engine.runner.warmup import dummy_batch
    from models.registry import load_model

    model = load_model("tiny")
    model = dataclasses.replace(model, params=jax.device_put(model.params, jax.devices()[0]))
    engine = EngineCore(
        model,
        EngineConfig(
            model="tiny", num_pages=16, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64
        ),
    )
    first, second = BatchShape(1, 0, 0, 4, 1), BatchShape(2, 0, 0, 4, 1)
    sizes = []
    for shape in (first, second, first):
        jax.block_until_ready(engine.runner.run(dummy_batch(shape), shape, GREEDY_PROGRAM))
        sizes.append(compiles.count())
    assert sizes[2] == sizes[1]


def test_reached_shapes_dry_run_finds_the_run_shapes():
    """The host-only dry run that picks the shapes to warm: it fakes the engine's device call,
    whose signature grew (structured output's bitmask) without this being noticed, so every
    warmed benchmark compiled during its timed run. No device step runs here."""
    from models.registry import load_model

    model = load_model("tiny")
    engine = engine_bench.make_engine(model, max_num_seqs=4, max_model_len=64, num_tokens=256)
    w = engine_bench.uniform_workload(3, prompt_len=12, output_len=3, vocab=512, seed=1)
    shapes = engine_bench.reached_shapes(engine, w)
    assert any(s.num_prefill_tokens > 0 for s in shapes)  # the prompts' prefill
    assert any(s.num_decode >= 3 and s.num_prefill_tokens == 0 for s in shapes)  # decodes
    assert not engine.has_unfinished() and "run" not in vars(engine.runner)


@pytest.mark.compile
def test_warm_and_run_times_a_second_run_and_keeps_the_first():
    """An ahead-of-time built program is slower on its first execution (XLA:CPU sets up its
    library calls then), so the timed run is the second one after warm-up; the first is
    kept. Both produce every token and neither compiles."""
    from models.registry import load_model

    model = load_model("tiny")
    engine = engine_bench.make_engine(model, max_num_seqs=4, max_model_len=64, num_tokens=256)
    w = engine_bench.uniform_workload(3, prompt_len=12, output_len=3, vocab=512, seed=2)
    res = engine_bench.warm_and_run(engine, w)
    assert res.first_run is not None and res.first_run.first_run is None
    for run in (res, res.first_run):
        assert run.output_tokens == w.output_tokens and run.compiles == 0
        assert any(s.num_prefill_tokens for s in run.steps)
    row = engine_bench.prefill_row(model, _floors(), 40)
    assert row["first_run_tokens_per_s"] > 0 and row["tokens_per_s"] > 0


def _floors():
    return engine_bench.Floors(weight_bytes=1, kv_bytes_per_token=1, bandwidth_b_s=1, flop_s=1)


def test_cpu_floors_use_the_peaks_per_cpu_second():
    """The CPU-time ratios: the same floors at the peaks' rate per CPU-second, over the
    steps' median process CPU time."""
    from configs.model_config import from_name

    cfg = from_name("tiny")
    wall = engine_bench.Floors(weight_bytes=1000, kv_bytes_per_token=10, bandwidth_b_s=1, flop_s=1)
    peaks = {"bandwidth_gb_per_cpu_s": 1e-5, "matmul_gflop_per_cpu_s": 1e-3}  # 1e4 B, 1e6 FLOP
    cpu = engine_bench.cpu_floors(wall, peaks)
    steps = [
        engine_bench.StepRecord(1.0, 0.9, 0, 0, 0, 2, 0, [5, 7], cpu_s=cpu_s)
        for cpu_s in (0.5, 0.2, 0.9)
    ]
    r = engine_bench.cpu_ratios(cfg, cpu, steps)
    assert r["step_cpu_ms"] == 500.0
    assert math.isclose(r["memory_floor_over_step_cpu"], (1000 + 10 * 12) / 1e4 / 0.5)
    flops = cfg.flops_per_token(5) + cfg.flops_per_token(7)
    assert math.isclose(r["compute_floor_over_step_cpu"], flops / 1e6 / 0.5)
