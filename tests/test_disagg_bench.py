"""benchmarks/disagg_bench.py's transfer section at smoke sizes (tiny model, in-process
prefill server over loopback gRPC, and over jax.experimental.transfer): it runs and its
figures are consistent with the KV layout (bytes per token = 2 x layers x KV heads x
head_dim x 4 bytes for float32)."""

import pytest

from benchmarks.disagg_bench import Options, transfer
from configs import kv_memory
from configs.model_config import from_name


@pytest.mark.compile
def test_transfer_section_smoke():
    results: dict = {}
    transfer(results, Options(model="tiny", smoke=True, transfer_repeats=1))
    rows = results["transfer"]["rows"]
    per_token = kv_memory.kv_bytes_per_token(from_name("tiny"), "float32")
    assert [(r["transport"], r["prompt_tokens"]) for r in rows] == [
        ("grpc", 64),  # whole pages of 16, a power-of-two count (no bucket padding for jax)
        ("grpc", 256),
        ("jax", 64),
        ("jax", 256),
    ]
    for r in rows:
        assert r["kv_bytes"] == r["prompt_tokens"] * per_token
        assert r["wire_ms_min"] > 0 and r["prefill_ms_median"] > 0 and r["import_ms_median"] > 0
        assert r["export_engine_thread_ms_median"] > 0
        # the host copy + sha256 happen for the gRPC bytes only, off the engine thread
        assert (r["export_host_copy_ms_median"] > 0) == (r["transport"] == "grpc")
    assert len(results["transfer"]["loadavg"]) == 3
