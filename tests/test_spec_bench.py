"""benchmarks/spec_bench.py's smoke sizes (tiny model): it runs, speculation keeps the
greedy outputs, and the policy is derived from the rows."""

import pytest

from benchmarks import spec_bench

pytestmark = pytest.mark.compile  # builds its own engine configurations


def test_spec_bench_smoke(capsys):
    rows = spec_bench.main(
        ["--smoke", "--batches=1,2", "--workloads=quote", "--modes=off,ngram,layers"]
    )
    assert {(r["batch"], r["mode"]) for r in rows} == {
        (b, m) for b in (1, 2) for m in ("off", "ngram", "layers")
    }
    ngram = [r for r in rows if r["mode"] != "off"]
    assert all(r["identical_outputs"] and r["verify_steps"] > 0 for r in ngram)
    assert all(r["tok_s"] > 0 and r["compiles"] == 0 for r in rows)
    assert "policy: disable_by_batch_size=" in capsys.readouterr().out


def test_policy_is_the_largest_batch_that_gains_somewhere_and_loses_little_everywhere():
    rows = [
        dict(workload=w, batch=b, mode=m, tok_s=t)
        for w, b, m, t in [
            ("quote", 1, "off", 10), ("quote", 1, "ngram", 30),
            ("story", 1, "off", 10), ("story", 1, "ngram", 11),
            ("quote", 8, "off", 50), ("quote", 8, "ngram", 60),
            ("story", 8, "off", 50), ("story", 8, "ngram", 46),
            ("quote", 32, "off", 90), ("quote", 32, "ngram", 95),
            ("story", 32, "off", 90), ("story", 32, "ngram", 70),
        ]
    ]  # fmt: skip
    assert spec_bench.policy(rows) == 8
