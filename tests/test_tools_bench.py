"""benchmarks/tools_bench.py at smoke size: a real `python -m serving.server` on the tiny model,
two concurrent openai SDK streams per pass. Free text runs to max_tokens without a call;
with tool_choice required every request makes one call that validates, streamed name-first
(announced before it is complete, its arguments in several deltas), and the cost ratio
comes out."""

import pytest

from benchmarks import tools_bench


@pytest.mark.subprocess
@pytest.mark.compile
def test_tools_bench_smoke(tmp_path):
    result = tools_bench.run(
        "tiny",
        concurrency=2,
        requests=2,
        max_tokens=160,  # a forced call is ~120 byte tokens on the tiny model
        server_args=["--max_model_len=2048", "--warmup_max_shapes=0"],
        log_path=str(tmp_path / "server.log"),
        modes=("free", "required"),
    )
    assert result["server_exit_code"] == 0, result
    free, required = result["passes"]["free"], result["passes"]["required"]
    assert free["completion_tokens"] == 2 * 160 and free["calls"] == 0  # ignore_eos
    assert required["requests_with_calls"] == required["calls"] == required["calls_valid"] == 2
    assert 0 < required["first_call_s"]["median"] <= required["first_call_s"]["p90"]
    # name-first: the call is announced before it is complete, its arguments in pieces
    assert required["first_call_s"]["median"] < required["last_call_s"]["median"]
    assert required["argument_deltas_per_call"]["median"] > 1
    assert result["cost"] > 0 and len(result["loadavg_after"]) == 3
