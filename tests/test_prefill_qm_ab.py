"""benchmarks/prefill_qm_ab.py: both programs of a case run, and the small max_query_len
is the one with fewer query blocks (tiny model; no timing assertions)."""

import math

import pytest

from benchmarks import prefill_qm_ab


@pytest.mark.compile
def test_smoke_ab_runs_both_programs_and_the_stubbed_step():
    r = prefill_qm_ab.main(["--smoke", "--stub"])["5x7"]
    today, small = r[32], r[8]  # 5 prompts of 7 tokens, Tp 64, Sp 8: Qm 32 vs 8
    # Qm 32: BQ 16, min(4 + 8, 8 * 2) = 12 blocks; Qm 8: every prompt is one block of 8
    assert (today["block_q"], today["blocks"]) == (16, 12)
    assert (small["block_q"], small["blocks"]) == (8, 8)
    assert all(m["cpu_ms"] >= 0 and m["wall_ms"] > 0 for m in (today, small))
    assert math.isfinite(r["attention_share"])  # the stubbed step ran (no timing assertion)
