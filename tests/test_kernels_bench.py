"""Smoke test of the kernel roofline benchmark at its smallest size (the CPU loops against
the reference)."""

import math

import pytest

from benchmarks import kernels_bench


@pytest.mark.compile
def test_benchmark_main_runs_at_smoke_size(capsys):
    rows = kernels_bench.main(["--sizes=smoke", "--iters=1"])
    impls = {(r["kind"], r["impl"]) for r in rows}
    assert impls == {(k, i) for k in ("decode", "mixed") for i in ("ours", "xla_reference")}
    for r in rows:
        assert r["time_s"] > 0 and math.isfinite(r["gb_s"]) and r["gb_s"] > 0
        assert r["tflop_s"] > 0 and r["ratio_vs_ours"] > 0
    assert {r["ratio_vs_ours"] for r in rows if r["impl"] == "ours"} == {1.0}
    out = capsys.readouterr().out
    assert "peak copy" in out and "GB/s" in out


def test_bytes_and_flops_arithmetic():
    """Decode of 2 sequences x 64 tokens, K=2, hd=64, f32, pages of 16: the K and V pages
    (2 * 2 * 64 * 2 * 64 * 4 bytes) plus q and the output; 4 * keys * H * hd FLOPs."""
    sizes = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "page_size": 16, "chunk": 16}
    inputs = kernels_bench.make_inputs("decode", 2, 64, **sizes, dtype="float32")
    assert inputs.bytes_moved == 2 * 2 * 64 * 2 * 64 * 4 + 2 * (2 * 4 * 64 * 4)
    assert inputs.flops == 4 * (2 * 64) * 4 * 64
    mixed = kernels_bench.make_inputs("mixed", 2, 64, **sizes, dtype="float32")
    assert mixed.q.shape[0] == 17 and mixed.max_query_len == 16
    assert mixed.flops == 4 * (sum(range(49, 65)) + 64) * 4 * 64
