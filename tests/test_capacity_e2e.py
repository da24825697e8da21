"""End to end: the load generator against a real `serving.server --model=mock` on loopback."""

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

import pytest

from serving.capacity.loadgen import arrivals, trace
from serving.capacity.loadgen.metrics import OUTCOMES, parse_slo_policy
from serving.capacity.loadgen.run import RunConfig, check_loopback, run_load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def mock_server():
    """(grpc port, metrics port) of a mock server on ephemeral loopback ports."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serving.server",
            "--model=mock",
            "--host=127.0.0.1",
            "--port=0",
            "--metrics_port=0",
            "--mock_step_time_s=0.01",
            "--max_queue_requests=8",
            "--max_num_seqs=8",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    metrics_port, deadline = None, time.monotonic() + 60
    try:
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if m := re.search(r"metrics port (\d+)", line):
                metrics_port = int(m.group(1))
            if m := re.match(r"serving on (\d+)", line):
                yield int(m.group(1)), metrics_port
                break
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def check_report(out_dir, plots=True):
    report = json.loads((out_dir / "report.json").read_text())
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s"):
        assert {"p50", "p95", "p99"} <= set(report[key]), key
    assert {"input_tps", "output_tps", "rps"} <= set(report["throughput"])
    for key in ("goodput_rps", "slo", "cost_per_success", "requests_sent"):
        assert key in report
    sent = report["requests_sent"]
    assert sent > 0
    assert sum(report["outcomes"][k] for k in OUTCOMES) == sent
    lines = (out_dir / "records.jsonl").read_text().splitlines()
    assert len(lines) == sent
    for name in ("report.md", "latency_cdf.png", "timeline.png")[: 3 if plots else 1]:
        assert (out_dir / name).stat().st_size > 0, name
    return report


@pytest.mark.subprocess
def test_cli_run_bursty_mixed_with_cancellations(mock_server, tmp_path):
    port, metrics_port = mock_server
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "serving.capacity.loadgen",
        f"--target=127.0.0.1:{port}",
        f"--metrics_url=http://127.0.0.1:{metrics_port}/metrics",
        (
            "--workload=short_qa:0.4,long_context:0.2,long_generation:0.1,shared_prefix:0.2,"
            "multi_tenant:0.1"
        ),
        "--length_scale=0.05",
        "--arrival=gamma",
        "--burstiness=4",
        "--rate=12",
        "--duration_s=2.5",
        "--max_requests=40",
        "--cancel_fraction=0.25",
        "--warm_window_s=1",
        "--price_per_device_hour=3.6",
        "--progress=false",
        "--scrape_interval_s=0.25",
        f"--save_trace={tmp_path / 'sent.jsonl'}",
        f"--out={out}",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=120, capture_output=True)
    report = check_report(out)
    assert report["conditions"]["model"] == "mock"
    assert report["conditions"]["revision"]
    assert report["conditions"]["prompt_tokens_per_word"] > 4  # the mock tokenizes bytes
    assert report["outcomes"]["success"] > 0
    assert report["outcomes"]["cancelled"] > 0
    assert report["ttft_s"]["count"] == report["outcomes"]["success"]
    assert report["throughput"]["output_tps"] > 0
    assert report["cost_per_success"] > 0
    assert "running" in report["server_metrics"]["found"]
    assert report["prefix_cache"]["cached_tokens"] > 0  # shared_prefix traffic hit the cache
    assert len((tmp_path / "sent.jsonl").read_text().splitlines()) == report["requests_sent"]


@pytest.mark.subprocess
def test_closed_loop_counts_add_up(mock_server, tmp_path):
    port, _ = mock_server
    cfg = RunConfig(
        target=f"127.0.0.1:{port}",
        workload="long_generation",
        length_scale=0.1,
        duration_s=30.0,
        max_requests=12,
        arrival=arrivals.ArrivalConfig("closed", concurrency=4),
        slo=parse_slo_policy("ttft_s=5,tpot_s=1"),
        progress=False,
        plots=False,
        save_trace=str(tmp_path / "closed.jsonl"),
    )
    report = run_load(cfg, tmp_path)
    check_report(tmp_path, plots=False)
    replay = trace.load_trace(tmp_path / "closed.jsonl")  # a closed loop run as a trace
    assert len(replay) == 12 and all(e.workload == "long_generation" for e in replay)
    assert report["requests_sent"] == 12
    assert report["outcomes"]["success"] == 12
    assert report["conditions"]["concurrency"] == 4


def test_loopback_only():
    check_loopback("127.0.0.1:1")
    check_loopback("localhost:1")
    with pytest.raises(ValueError, match="loopback"):
        check_loopback("8.8.8.8:443")
