"""The mock engine's hand-checkable device rule and test hooks (its scheduling, stop handling
and outputs are the real engine's: tests/test_engine_vs_mock.py compares the two)."""

import time

import pytest

from engine.api_types import EngineRequest
from engine.errors import DuplicateRequestError, InvalidRequestError
from engine.interface import Engine
from engine.sampling.params import SamplingParams
from serving.engine_host.mock_engine import MockEngine, expected_continuation


def _req(rid, text, **sp):
    return EngineRequest(rid, list(text.encode()), SamplingParams(**sp))


def _run(engine, max_steps=1000):
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_implements_the_engine_protocol():
    assert isinstance(MockEngine(), Engine)


def test_continuation_is_next_printable_chars():
    e = MockEngine()
    e.add_request(_req("a", "abc", max_tokens=5))
    e.add_request(_req("b", "x}", max_tokens=4))
    outs = _run(e)
    assert "".join(o.new_text for o in outs["a"]) == "defgh"
    assert "".join(o.new_text for o in outs["b"]) == '~ !"'  # wraps after "~"
    assert [t for o in outs["a"] for t in o.new_token_ids] == expected_continuation(ord("c"), 5)
    last = outs["a"][-1]
    assert (last.finished, last.finish_reason, last.num_output_tokens) == (True, "length", 5)
    assert len(outs["a"]) == 5  # one token per step
    assert e.stats()["kv_pages_used"] == 0 and e.stats()["num_steps"] == 5


def test_stop_string_cut_and_held_back():
    e = MockEngine()
    e.add_request(_req("a", "a", max_tokens=20, stop=("efg",)))
    outs = _run(e)["a"]
    assert "".join(o.new_text for o in outs) == "bcd"
    assert outs[-1].finish_reason == "stop"
    # "e" and "f" were held back (they could start "efg"): nothing was emitted for them
    assert [o.new_text for o in outs] == ["b", "c", "d", "", "", ""]


def test_stop_token_and_min_tokens_ban():
    e = MockEngine()
    e.add_request(_req("a", "a", max_tokens=20, stop_token_ids=(ord("c"),)))
    e.add_request(_req("b", "a", max_tokens=4, min_tokens=3, stop_token_ids=(ord("c"),)))
    outs = _run(e)
    assert [t for o in outs["a"] for t in o.new_token_ids] == [ord("b"), ord("c")]
    assert "".join(o.new_text for o in outs["a"]) == "b"
    # As on the device, "c" is banned before min_tokens: "b" is followed by "d".
    assert "".join(o.new_text for o in outs["b"]) == "bdef"
    assert outs["b"][-1].finish_reason == "length"


def test_stop_string_before_min_tokens_does_not_stop():
    """The real StopChecker's rule: an occurrence must end in a token at index >= min_tokens
    (the old mock stopped here after 5 tokens)."""
    e = MockEngine()
    e.add_request(_req("a", "a", max_tokens=8, min_tokens=5, stop=("bc",)))
    outs = _run(e)["a"]
    assert (outs[-1].finish_reason, outs[-1].num_output_tokens) == ("length", 8)
    assert "".join(o.new_text for o in outs) == "bcdefghi"


def test_prefix_cache_counts_whole_pages():
    e = MockEngine(page_size=4)
    e.add_request(_req("a", "abcdefghi", max_tokens=1))
    _run(e)
    e.add_request(_req("b", "abcdefghi", max_tokens=1))
    out = _run(e)["b"][-1]
    assert out.num_cached_tokens == 8


def test_abort_frees_pages_at_next_step_and_is_logged():
    e = MockEngine(page_size=4)
    e.add_request(_req("a", "abc", max_tokens=50))
    e.step()
    e.step()
    assert e.stats()["kv_pages_used"] > 0
    e.abort_request("a")
    outs = e.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "cancelled")]
    assert e.stats()["kv_pages_used"] == 0
    assert e.abort_log == [("a", 2, 3)]


def test_deadline_times_out():
    e = MockEngine()
    req = _req("a", "abc", max_tokens=50)
    req.deadline_s = time.monotonic() - 1.0
    e.add_request(req)
    assert [o.finish_reason for o in e.step()] == ["timed_out"]
    assert not e.has_unfinished()


def test_injected_failure_fails_the_step_requests_as_the_engine_does():
    e = MockEngine()
    e.add_request(_req("a", "abc", max_tokens=5))
    e.fail_next_steps(1)
    [out] = e.step()
    assert (out.request_id, out.finished, out.finish_reason) == ("a", True, "failed")
    assert "engine step failed" in out.error
    assert not e.has_unfinished() and e.stats()["kv_pages_used"] == 0
    e.add_request(_req("b", "abc", max_tokens=2))
    assert _run(e)["b"][-1].finish_reason == "length"  # one failure only


def test_add_request_errors():
    e = MockEngine(max_model_len=10)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        e.add_request(_req("a", "abc", max_tokens=8))
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        e.add_request(EngineRequest("e", [], SamplingParams()))
    e.add_request(_req("a", "abc", max_tokens=2))
    with pytest.raises(DuplicateRequestError):
        e.add_request(_req("a", "abc", max_tokens=2))
