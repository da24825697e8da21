"""--trace_requests (issue 39): the per-request timeline is a trace a viewer can open, and
each request's phases tile its life in order (MockEngine, HTTP API)."""

import json

import httpx

from serving.engine_host.mock_engine import MockEngine
from serving.testing import running_server, wait_for


def _events(path) -> list[dict]:
    """The file as Perfetto reads it: a JSON array whose closing bracket may be missing."""
    text = path.read_text().rstrip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


def test_a_traced_request_has_its_phases_in_order_and_the_engine_steps(tmp_path):
    path = tmp_path / "trace.json"
    with running_server(MockEngine(step_time_s=0.002), http_port=0, trace_requests=str(path)) as (
        server,
        _,
    ):
        url = f"http://127.0.0.1:{server.http_port}/v1/completions"
        for stream in (False, True):
            r = httpx.post(
                url,
                json={"model": "", "prompt": "Hello", "max_tokens": 5, "stream": stream},
                timeout=30,
            )
            assert r.status_code == 200
        wait_for(lambda: len([e for e in _events(path) if e.get("name") == "deliver"]) == 2)
    events = _events(path)
    steps = [e for e in events if e.get("pid") == 1 and e.get("ph") == "X"]
    assert steps and all(e["name"] == "step" and e["dur"] >= 0 for e in steps)
    by_request: dict[int, list[dict]] = {}
    for e in events:
        if e.get("pid") == 2 and e.get("ph") == "X":
            by_request.setdefault(e["tid"], []).append(e)
    assert len(by_request) == 2
    for phases in by_request.values():
        names = [e["name"] for e in phases]
        assert names == ["parse", "admit", "queue", "prefill", "decode", "deliver"]
        for a, b in zip(phases, phases[1:]):  # each phase starts where the previous ended
            assert abs(a["ts"] + a["dur"] - b["ts"]) < 1.0  # microseconds, rounding
        assert phases[-1]["args"]["output_tokens"] == 5
        assert phases[-1]["args"]["outcome"] == "success"
        assert phases[-1]["args"]["prompt_tokens"] > 0
