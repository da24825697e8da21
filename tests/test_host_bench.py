"""Smoke test of the host-overhead benchmark (tiny model): every row, phase and ratio is
produced and written as JSON. No timing assertions (the figures depend on the load)."""

import json
import math
import os
import subprocess
import sys

import jax
import pytest

from benchmarks import host_bench


@pytest.mark.compile
def test_smoke_run_reports_every_phase_and_ratio(tmp_path, capsys):
    out = tmp_path / "host.json"
    r = host_bench.main(["--smoke", f"--out={out}"])
    table = capsys.readouterr().out
    assert [row["num_seqs"] for row in r["rows"]] == [1, 4]
    for row in r["rows"]:
        assert row["device_steps_per_s"] > 0 and row["shapes"]
        for name in ("sync", "overlap"):
            run = row[name]
            assert run["steps_per_s"] > 0 and math.isfinite(run["over_device"])
            assert run["cpu_ms_per_step"] > 0 and len(run["rounds_cpu_ms"]) == 1
            assert set(run["host_ms"]) == set(host_bench.PHASES)
            assert all(v >= 0 for v in run["host_ms"].values())
            assert 0 < row["projection"][name]["engine_over_device"] <= 1
        assert f"| {row['num_seqs']} |" in table
    assert "projection for a 3.3 ms device step" in table
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))


def test_projection_arithmetic():
    """Synchronous: device / (host + device); overlapped: device / max(host, device)."""
    host = {p: 0.0 for p in host_bench.PHASES}
    row = {
        name: {"host_ms": dict(host, schedule=1.0, build=1.0, wait=5.0)}
        for name in ("sync", "overlap")
    }
    p = host_bench.projection(row, step_ms=3.0)
    assert p["sync"]["engine_over_device"] == 3.0 / 5.0
    assert p["overlap"]["engine_over_device"] == 1.0
    assert host_bench.projection(row, step_ms=1.0)["overlap"]["engine_over_device"] == 0.5


@pytest.mark.compile
@pytest.mark.subprocess
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_device_cores_splits_xla_from_the_host(tmp_path):
    """--device_cores=1: XLA's threads stay on core 0 and the host thread moves to the rest
    (a fresh process: the split must happen before a JAX backend starts)."""
    out = tmp_path / "host.json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.host_bench", "--smoke", "--num_seqs=4",
         "--device_cores=1", f"--out={out}"],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    r = json.loads(out.read_text())
    cores = sorted(os.sched_getaffinity(0))
    assert r["cores"] == {"device_cores": cores[:1], "host_cores": cores[1:]}
    assert r["rows"][0]["overlap"]["steps_per_s"] > 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_device_cores_refuses_a_started_backend():
    jax.devices()
    with pytest.raises(RuntimeError, match="already started"):
        host_bench.dedicate_device_cores(1)
