"""benchmarks/disagg_bench.py's transfer section at smoke sizes (tiny model, in-process
prefill server over loopback gRPC): it runs and its figures are consistent with the KV
layout (bytes per token = 2 x layers x KV heads x head_dim x 4 bytes for float32)."""

import pytest

from benchmarks.disagg_bench import Options, transfer
from configs import kv_memory
from configs.model_config import from_name


@pytest.mark.compile
def test_transfer_section_smoke():
    results: dict = {}
    transfer(results, Options(model="tiny", smoke=True, transfer_repeats=2))
    rows = results["transfer"]["rows"]
    per_token = kv_memory.kv_bytes_per_token(from_name("tiny"), "float32")
    assert [r["prompt_tokens"] for r in rows] == [64, 256]  # whole pages of 16
    for r in rows:
        assert r["kv_bytes"] == r["prompt_tokens"] * per_token
        assert r["wire_ms_min"] > 0 and r["prefill_ms_median"] > 0 and r["import_ms_median"] > 0
    assert len(results["transfer"]["loadavg"]) == 3
