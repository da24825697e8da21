"""Metric definitions on hand-made timelines (serving/capacity/loadgen/metrics.py)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.capacity.loadgen import metrics as m
from serving.capacity.loadgen.metrics import RequestRecord, Slo, SloPolicy


def seed_timeline(send_s=10.0, ttft_s=0.8, gaps=(0.02,) * 10, tail_s=0.0, **kw):
    """The seed's example: TTFT 0.8 s then ten 0.02 s gaps; tokens stamped one per chunk."""
    first = send_s + ttft_s
    times = [first]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(
        "r",
        send_s=send_s,
        first_token_s=first,
        chunk_times_s=list(times),
        chunk_tokens=[1] * len(times),
        token_times_s=list(times),
        end_s=times[-1] + tail_s,
        outcome="success",
        num_output_tokens=len(times),
        **kw,
    )


def test_seed_example_last_token_at_one_second():
    rec = seed_timeline()
    assert m.ttft(rec) == pytest.approx(0.8)
    assert rec.token_times_s[-1] - rec.send_s == pytest.approx(1.0)
    assert m.e2e(rec) == pytest.approx(1.0)
    assert m.itl(rec) == pytest.approx([0.02] * 10)
    # TPOT = (T_last - T_first) / (N_out - 1) = 0.2 / 10
    assert m.tpot(rec) == pytest.approx(0.02)


def test_e2e_is_ttft_plus_gaps_plus_tail():
    rec = seed_timeline(gaps=(0.01, 0.05, 0.02), tail_s=0.3)
    assert m.e2e(rec) == pytest.approx(m.ttft(rec) + sum(m.itl(rec)) + 0.3)


def test_tpot_undefined_for_one_token_and_zero_tokens():
    assert m.tpot(seed_timeline(gaps=())) is None
    empty = RequestRecord("r", send_s=0.0, end_s=1.0, outcome="rejected")
    assert m.tpot(empty) is None and m.ttft(empty) is None and m.itl(empty) == []
    assert m.e2e(empty) == pytest.approx(1.0)


def test_tpot_uses_server_token_stamps_not_chunks():
    # Two chunks of 3 tokens; the server stamped each token 0.01 s apart (other clock).
    rec = RequestRecord(
        "r",
        send_s=0.0,
        first_token_s=0.5,
        chunk_times_s=[0.5, 0.6],
        chunk_tokens=[3, 3],
        token_times_s=[100.0 + 0.01 * i for i in range(6)],
        end_s=0.6,
        outcome="success",
    )
    assert rec.itl_source == "token"
    assert m.itl(rec) == pytest.approx([0.01] * 5)
    assert m.tpot(rec) == pytest.approx(0.01)
    assert m.chunk_itl(rec) == pytest.approx([0.1])
    assert m.ttft(rec) == pytest.approx(0.5)


def test_itl_falls_back_to_chunk_times_without_server_stamps():
    rec = RequestRecord(
        "r",
        send_s=0.0,
        first_token_s=0.5,
        chunk_times_s=[0.5, 0.6],
        chunk_tokens=[2, 1],
        end_s=0.6,
        outcome="success",
    )
    assert rec.itl_source == "chunk"
    assert m.itl(rec) == pytest.approx([0.0, 0.1])
    assert m.tpot(rec) == pytest.approx(0.05)


def test_percentiles_match_linear_interpolation():
    vals = list(range(1, 101))  # 1..100
    assert m.percentile(vals, 50) == pytest.approx(50.5)
    assert m.percentile(vals, 95) == pytest.approx(95.05)
    assert m.percentile(vals, 99) == pytest.approx(99.01)
    assert m.percentile([], 50) is None
    assert m.percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError, match="q=101"):
        m.percentile(vals, 101)
    s = m.summarize([None, 1.0, 3.0])
    assert s["count"] == 2 and s["mean"] == 2.0 and s["max"] == 3.0


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_between_min_and_max(vals, q):
    p = m.percentile(vals, q)
    assert min(vals) <= p <= max(vals) or math.isclose(p, min(vals)) or math.isclose(p, max(vals))


@pytest.mark.parametrize(
    "slo,missed",
    [
        (Slo(ttft_s=0.5), ["ttft_s"]),
        (Slo(ttft_s=0.9), []),
        (Slo(tpot_s=0.01), ["tpot_s"]),
        (Slo(tpot_s=0.03), []),
        (Slo(e2e_s=0.9), ["e2e_s"]),
        (Slo(e2e_s=1.1), []),
        (Slo(itl_max_s=0.015), ["itl_max_s"]),
        (Slo(ttft_s=0.5, tpot_s=0.01, e2e_s=0.9), ["ttft_s", "tpot_s", "e2e_s"]),
    ],
)
def test_each_slo_gate(slo, missed):
    assert slo.misses(seed_timeline()) == missed


def test_one_token_answer_passes_tpot_gate_and_failures_never_count():
    assert Slo(tpot_s=1e-9).met(seed_timeline(gaps=()))
    cancelled = seed_timeline()
    cancelled.outcome = "cancelled"
    assert Slo().misses(cancelled) == ["outcome:cancelled"]


def test_goodput_counts_only_successes_within_their_class_slo():
    fast = seed_timeline(workload="short_qa")  # TTFT 0.8, E2E 1.0
    slow = seed_timeline(ttft_s=3.0, workload="short_qa")
    long_gen = seed_timeline(ttft_s=3.0, workload="long_generation")
    failed = seed_timeline(workload="short_qa")
    failed.outcome = "failed"
    policy = m.parse_slo_policy("ttft_s=2,e2e_s=10", ["long_generation:ttft_s=5"])
    assert policy.for_class("long_generation") == Slo(ttft_s=5.0, e2e_s=10.0)
    g = m.goodput([fast, slow, long_gen, failed], policy, duration_s=2.0)
    assert g["good_requests"] == 2  # fast, and long_gen under its looser TTFT
    assert g["rps"] == pytest.approx(1.0)
    assert g["output_tps"] == pytest.approx(11.0)  # 2 x 11 tokens / 2 s
    assert g["fraction_of_sent"] == pytest.approx(0.5)
    assert m.goodput([slow], SloPolicy(), 1.0)["good_requests"] == 1  # no gates: success


def test_parse_slo_rejects_unknown_field():
    with pytest.raises(ValueError, match="ttfb"):
        m.parse_slo("ttfb=1")


def test_outcome_counts_add_up_and_break_down_reasons():
    recs = [
        RequestRecord(str(i), outcome=o, reason=r)
        for i, (o, r) in enumerate(
            [
                ("success", "stop"),
                ("rejected", "queue_full"),
                ("rejected", "queue_full"),
                ("rejected", "tenant_budget"),
                ("timed_out", ""),
                ("cancelled", "client_cancel"),
            ]
        )
    ]
    c = m.outcome_counts(recs)
    assert sum(c[k] for k in m.OUTCOMES) == len(recs)
    assert c["by_reason"]["rejected"] == {"queue_full": 2, "tenant_budget": 1}
    assert c["by_reason"]["timed_out"] == {"unspecified": 1}
    with pytest.raises(ValueError, match="oom"):
        m.outcome_counts([RequestRecord("x", outcome="oom")])


def test_reason_key_folds_numbers():
    assert m.reason_key("wait 5.000s exceeds the deadline (2.998s left)") == (
        "wait #s exceeds the deadline (#s left)"
    )
    assert m.reason_key("") == "unspecified"
