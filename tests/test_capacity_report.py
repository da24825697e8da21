"""Report building and rendering, scraping parse, and the sweep's knee / operating point."""

import json

import pytest

from serving.capacity.loadgen import gates, report, scrape, sweep
from serving.capacity.loadgen.metrics import RequestRecord, parse_slo_policy

REQUIRED_KEYS = (
    "ttft_s",
    "tpot_s",
    "itl_s",
    "e2e_s",
    "queue_s",
    "outcomes",
    "requests_sent",
    "throughput",
    "goodput_rps",
    "slo",
    "cost_per_success",
)


def rec(i, send, ttft, n_out, gap, outcome="success", workload="short_qa", priority=0, cached=0):
    first = send + ttft
    times = [first + gap * k for k in range(n_out)]
    return RequestRecord(
        f"r{i}",
        workload,
        "default",
        priority,
        send_s=send,
        scheduled_s=send,
        first_token_s=first if n_out else None,
        chunk_times_s=times,
        chunk_tokens=[1] * n_out,
        token_times_s=list(times),
        end_s=(times[-1] if times else send + ttft),
        outcome=outcome,
        queue_s=0.1 if outcome == "success" else None,
        num_prompt_tokens=100 if outcome != "rejected" else 0,
        num_output_tokens=n_out,
        num_cached_tokens=cached,
    )


def sample_records():
    return [
        rec(0, 0.0, 0.5, 11, 0.05),  # E2E 1.0
        rec(1, 0.5, 3.0, 5, 0.05),  # TTFT misses 2 s
        rec(2, 1.0, 0.2, 1, 0.0, workload="long_context", cached=50),  # one token
        rec(3, 1.5, 0.0, 0, 0.0, outcome="rejected"),
        rec(4, 2.0, 0.4, 3, 0.05, outcome="cancelled", priority=1),
        rec(5, 70.0, 0.3, 11, 0.02),
    ]  # steady state (after the 60 s cold window)


def build(records=None, **kw):
    return report.build_report(
        sample_records() if records is None else records,
        conditions={"model": "mock"},
        policy=parse_slo_policy("ttft_s=2,tpot_s=0.1,e2e_s=5"),
        cost=report.CostConfig(price_per_device_hour=3.6),
        **kw,
    )


def test_report_has_required_keys_and_consistent_counts():
    r = build()
    for key in REQUIRED_KEYS:
        assert key in r, key
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s"):
        assert {"p50", "p95", "p99"} <= set(r[key])
    o = r["outcomes"]
    assert r["requests_sent"] == 6
    assert sum(o[k] for k in ("success", "cancelled", "rejected", "timed_out", "failed")) == 6
    assert o["success"] == 4 and o["rejected"] == 1 and o["cancelled"] == 1
    # Wall: first send 0.0 -> last end 70.3 + 10 x 0.02 = 70.5 s.
    assert r["wall_s"] == pytest.approx(70.5)
    assert r["goodput"]["good_requests"] == 3  # r1 misses TTFT
    assert r["goodput_rps"] == pytest.approx(3 / 70.5)
    assert r["slo_misses"] == {"ttft_s": 1, "outcome:rejected": 1, "outcome:cancelled": 1}
    assert r["throughput"]["output_tps"] == pytest.approx((11 + 5 + 1 + 3 + 11) / 70.5)
    assert r["throughput"]["input_tps"] == pytest.approx(500 / 70.5)
    assert r["prefix_cache"]["hit_rate"] == pytest.approx(50 / 500)
    # 70.5 s x $3.6/h = $0.0705, over 4 successes.
    assert r["cost_per_success"] == pytest.approx(0.0705 / 4)
    assert r["ttft_s"]["count"] == 4  # latency over successful requests only


def test_observed_concurrency():
    recs = [
        RequestRecord("a", send_s=0.0, end_s=2.0),
        RequestRecord("b", send_s=1.0, end_s=3.0),
        RequestRecord("c", send_s=5.0, end_s=6.0),
    ]
    # In flight: 1 on [0,1), 2 on [1,2), 1 on [2,3), 0 on [3,5), 1 on [5,6): area 5 over 6 s.
    assert report.observed_concurrency(recs) == {"mean": pytest.approx(5 / 6), "max": 2}


def test_report_groups_and_warm_vs_cold():
    r = build()
    assert set(r["by_class"]) == {"short_qa", "long_context"}
    assert r["by_class"]["long_context"]["tpot_s"]["count"] == 0  # one token: no TPOT
    assert set(r["by_priority"]) == {"0", "1"}
    assert r["warm_vs_cold"]["cold"]["requests"] == 5
    assert r["warm_vs_cold"]["steady"]["requests"] == 1
    assert r["warm_vs_cold"]["steady"]["ttft_s"]["p50"] == pytest.approx(0.3)


def test_write_report_files(tmp_path):
    records = sample_records()
    paths = report.write_report(tmp_path, build(records), records)
    names = {p.name for p in paths}
    assert {"report.json", "report.md", "records.jsonl", "latency_cdf.png", "timeline.png"} <= names
    for p in paths:
        assert p.stat().st_size > 0
    assert json.loads((tmp_path / "report.json").read_text())["requests_sent"] == 6
    md = (tmp_path / "report.md").read_text()
    assert "goodput" in md and "| class short_qa |" in md
    assert (tmp_path / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_report_refuses_empty_run():
    with pytest.raises(ValueError, match="no requests"):
        build(records=[])


def test_scrape_parse_and_pick():
    text = (
        "# TYPE pagedjax_kv_cache_usage_ratio gauge\npagedjax_kv_cache_usage_ratio 0.5\n"
        "# TYPE pagedjax_num_requests_running gauge\npagedjax_num_requests_running 3\n"
        "# TYPE pagedjax_num_requests_waiting gauge\n"
        'pagedjax_num_requests_waiting{tenant="a"} 2\n'
        "# TYPE pagedjax_preemptions counter\npagedjax_preemptions_total 4\n"
    )
    sample = scrape.parse_samples(text)
    assert sample["pagedjax_num_requests_waiting{tenant=a}"] == 2.0
    series = [(1.0, sample), (2.0, {**sample, "pagedjax_preemptions_total": 6.0})]
    s = scrape.summarize_scrape(series, t0=1.0)
    assert s["found"]["kv_usage"]["max"] == 0.5
    assert s["found"]["running"]["points"] == [(0.0, 3.0), (1.0, 3.0)]
    assert s["preemptions"] == 2.0
    assert "prefix_hit_tokens" in s["missing"]


def fake_step_report(rate, ttft_p95, success_frac, tpot=0.05):
    sent = int(rate * 10)
    ok = round(sent * success_frac)
    lat = lambda v: {"p50": v / 2, "p95": v, "p99": v * 1.2}
    return {
        "ttft_s": lat(ttft_p95),
        "tpot_s": lat(tpot),
        "e2e_s": lat(ttft_p95 + 1),
        "itl_s": lat(tpot),
        "queue_s": lat(0.1),
        "throughput": {"rps": ok / 10, "output_tps": ok * 5.0},
        "goodput_rps": ok / 10,
        "goodput": {"good_requests": ok},
        "outcomes": {
            "success": ok,
            "cancelled": 0,
            "rejected": sent - ok,
            "timed_out": 0,
            "failed": 0,
        },
        "requests_sent": sent,
        "slo": {"default": {"ttft_s": 2.0, "tpot_s": 0.2, "e2e_s": 10.0}},
        "cost_per_success": 0.01,
    }


def test_sweep_knee_and_operating_point(tmp_path):
    table = {
        1.0: (0.3, 1.0),
        2.0: (0.4, 1.0),
        4.0: (0.9, 1.0),
        8.0: (3.0, 0.8),
        16.0: (9.0, 0.5),
        32.0: (20.0, 0.2),
    }
    result = sweep.run_sweep(
        list(table), lambda r, d: fake_step_report(r, *table[r]), tmp_path, gates.Gates()
    )
    assert result["knee_rate"] == 4.0  # 0.9 > 2 x 0.3
    assert result["operating_rate"] == 4.0  # 8 fails TTFT p95 and error rate
    assert [s["rate"] for s in result["steps"]] == [1.0, 2.0, 4.0, 8.0, 16.0]  # stop after 2
    assert result["operating_goodput_rps"] == pytest.approx(4.0)
    for name in ("sweep.json", "sweep.md", "latency_vs_rate.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "FAIL" in (tmp_path / "sweep.md").read_text()


def test_operating_point_needs_every_lower_rate_to_pass():
    steps = [
        {"rate": 1.0, "gates": {"a": True}},
        {"rate": 2.0, "gates": {"a": False}},
        {"rate": 4.0, "gates": {"a": True}},
    ]
    assert sweep.operating_point(steps) == 1.0
    assert sweep.geometric_rates(0.5, 2.0, 4) == [0.5, 1.0, 2.0, 4.0]


def test_gates_pass_undefined_tpot_but_not_missing_ttft():
    step = gates.step_summary(1.0, fake_step_report(1.0, 0.3, 1.0))
    step["tpot_s"] = {"p50": None, "p95": None, "p99": None}
    assert all(gates.check_gates(step, gates.Gates()).values())
    step["ttft_s"] = {"p50": None, "p95": None, "p99": None}
    assert not gates.check_gates(step, gates.Gates())["ttft_s_p95"]


def test_report_md_opens_with_the_answer_and_tables(tmp_path):
    records = sample_records()
    r = build(records)
    r["conditions"] = {
        "model": "mock",
        "workload_mix": {"short_qa": {"weight": 0.75}, "long_context": {"weight": 0.25}},
        "arrival": {"kind": "poisson", "rate": 2.0},
    }
    report.write_report(tmp_path, r, records, plots=False)
    md = (tmp_path / "report.md").read_text()
    title = "short_qa 75%, long_context 25% | poisson 2 req/s | SLO TTFT<=2s, TPOT<=0.1s, E2E<=5s"
    assert md.splitlines()[0] == f"# Capacity report: {title}"
    answer, appendix = md.index("## Answer"), md.index("## Appendix A: conditions")
    assert answer < md.index("### Outcomes") < md.index("### SLO misses") < appendix
    assert "**goodput 0.043 req/s**" in md[answer:appendix]
    assert "Beyond capacity at this load" in md  # 1 rejection of 6 > 1% errors
    assert "| ttft_s | 2 s | 1 | 16.7% |" in md  # SLO misses as a table, not a dict
    assert "| outcome:rejected | must succeed | 1 | 16.7% |" in md


def test_default_warm_window_is_a_fifth_of_the_run():
    recs = [rec(i, float(i), 0.2, 3, 0.05) for i in range(10)]  # sends at 0..9 s
    wc = build(recs)["warm_vs_cold"]
    assert wc["warm_window_s"] == pytest.approx(0.2 * (9.3 - 0.0))
    assert (wc["cold"]["requests"], wc["steady"]["requests"]) == (2, 8)


def test_sweep_says_when_the_knee_was_not_reached(tmp_path):
    flat = {1.0: (0.3, 1.0), 2.0: (0.31, 1.0)}
    result = sweep.run_sweep(list(flat), lambda r, d: fake_step_report(r, *flat[r]), tmp_path)
    assert result["knee_rate"] is None and not result["knee_reached"]
    assert result["operating_rate"] == 2.0
    assert "knee was not reached" in result["advice"]
    assert "--sweep_start=2" in result["advice"]
    assert "not reached" in (tmp_path / "sweep.md").read_text()


def test_sweep_says_when_even_the_lowest_rate_failed(tmp_path):
    bad = {4.0: (5.0, 0.5), 8.0: (9.0, 0.3)}
    result = sweep.run_sweep(list(bad), lambda r, d: fake_step_report(r, *bad[r]), tmp_path)
    assert result["operating_rate"] is None
    assert "no operating point" in result["advice"] and "--sweep_start=1" in result["advice"]
