"""Issue 37's bar on the real model: 300 chat calls at once through the official `openai` SDK
with `timeout=15` against `python -m serving.server --http_port` (SmolLM2) end shed (429 with
Retry-After), served, or ended by the server at their deadline (504); at most 10% are client
timeouts. Before HTTP carried the deadline, 200 such calls ended 64 client timeouts and 0
answers. The same run is `python -m benchmarks.http_deadline_burst` (figures in
benchmarks/RESULTS.md). About 6 minutes: `make test-full-sizes` runs it, `make test` does not
(the mock-engine burst in tests/test_http_deadlines.py is its lighter twin)."""

import os

import pytest

from benchmarks import http_deadline_burst


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.skipif(
    os.environ.get("PAGEDJAX_FULL_SIZES") != "1", reason="SmolLM2 burst: make test-full-sizes"
)
def test_smollm2_http_burst_with_the_sdk_timeout_is_shed_or_served_in_time(tmp_path):
    summary = http_deadline_burst.run(
        "smollm2-135m",
        n=300,
        timeout_s=15.0,
        max_tokens=64,
        server_args=["--max_num_seqs=32"],
        log_path=str(tmp_path / "server.log"),
    )
    assert summary["server_exit_code"] == 0, summary
    assert set(summary["counts"]) <= {"ok", "429", "504", "client_timeout"}, summary
    assert summary["refusals_without_retry_after"] == 0, summary
    assert summary["client_timeout_fraction"] <= 0.10, summary
