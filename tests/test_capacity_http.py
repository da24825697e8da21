"""The load generator over the OpenAI-compatible HTTP API (`--protocol=http`) against a real
server (MockEngine): same workloads and report as gRPC, every request one record, and the
server's outcome counters agree with the client's records."""

import json
import subprocess
import sys

import pytest

from serving.capacity.loadgen import arrivals
from serving.capacity.loadgen.metrics import OUTCOMES, parse_slo_policy
from serving.capacity.loadgen.run import RunConfig, run_load
from serving.engine_host.mock_engine import MockEngine
from serving.frontend.admission import AdmissionConfig
from serving.testing import calls_seen, outcome_counts, running_server, wait_for


@pytest.fixture()
def http_server():
    engine = MockEngine(max_num_seqs=8, page_size=4, num_pages=1024, step_time_s=0.005)
    with running_server(
        engine, admission=AdmissionConfig(max_queue_requests=8), http_port=0, metrics_port=0
    ) as (server, _):
        yield server


def _config(server, **overrides):
    base = dict(
        target=f"127.0.0.1:{server.http_port}",
        protocol="http",
        metrics_url=f"http://127.0.0.1:{server.http_port}/metrics",
        workload="short_qa:0.5,shared_prefix:0.3,long_generation:0.2",
        length_scale=0.05,
        arrival=arrivals.ArrivalConfig("gamma", rate=15, burstiness=4, seed=3),
        duration_s=2.0,
        max_requests=30,
        cancel_fraction=0.3,
        warm_window_s=0.5,
        scrape_interval_s=0.25,
        slo=parse_slo_policy("ttft_s=5,tpot_s=1"),
        progress=False,
        plots=False,
    )
    return RunConfig(**{**base, **overrides})


def test_http_run_report_and_server_outcomes_agree(http_server, tmp_path):
    server = http_server
    report = run_load(_config(server), tmp_path)
    sent = report["requests_sent"]
    assert sent > 0 and sum(report["outcomes"][k] for k in OUTCOMES) == sent
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == sent
    assert report["outcomes"]["success"] > 0 and report["outcomes"]["cancelled"] > 0
    assert report["conditions"]["protocol"] == "http"
    assert report["conditions"]["model"] == "mock" and report["conditions"]["revision"]
    assert report["conditions"]["prompt_tokens_per_word"] > 4  # /tokenize of the mock: bytes
    assert report["ttft_s"]["count"] == report["outcomes"]["success"]
    assert report["itl_s"]["count"] > 0
    assert "running" in report["server_metrics"]["found"]
    assert report["prefix_cache"]["cached_tokens"] > 0
    records = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    ok = [r for r in records if r["outcome"] == "success"]
    assert all(r["num_output_tokens"] == r["max_tokens"] for r in ok)  # ignore_eos
    wait_for(lambda: sum(outcome_counts(server).values()) == calls_seen(server))
    counts = outcome_counts(server)
    by_outcome = {o: sum(v for (k, _), v in counts.items() if k == o) for o in OUTCOMES}
    assert calls_seen(server) == sent
    assert by_outcome["success"] == report["outcomes"]["success"]
    assert by_outcome["cancelled"] == report["outcomes"]["cancelled"]
    assert by_outcome["rejected"] == report["outcomes"]["rejected"]


@pytest.mark.subprocess
def test_http_closed_loop_and_cli_flag(http_server, tmp_path):
    cfg = _config(
        http_server,
        workload="long_generation",
        arrival=arrivals.ArrivalConfig("closed", concurrency=4),
        cancel_fraction=0.0,
        max_requests=8,
        duration_s=30.0,
    )
    report = run_load(cfg, tmp_path)
    assert report["requests_sent"] == 8 and report["outcomes"]["success"] == 8
    out = tmp_path / "cli"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "serving.capacity.loadgen",
            "--protocol=http",
            f"--target=127.0.0.1:{http_server.http_port}",
            "--workload=short_qa",
            "--length_scale=0.05",
            "--arrival=constant",
            "--rate=10",
            "--duration_s=0.5",
            "--max_requests=4",
            "--progress=false",
            f"--out={out}",
        ],
        check=True,
        timeout=120,
        capture_output=True,
    )
    report = json.loads((out / "report.json").read_text())
    assert report["requests_sent"] == 4 and report["outcomes"]["success"] == 4


def test_unknown_protocol_is_refused(tmp_path):
    with pytest.raises(ValueError, match="protocol='quic' is invalid"):
        run_load(RunConfig(protocol="quic"), tmp_path)
