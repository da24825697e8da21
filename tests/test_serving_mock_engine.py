"""The mock engine's hand-checkable arithmetic (serving tests rely on it)."""

import time

import pytest

from engine.api_types import EngineRequest
from engine.errors import DuplicateRequestError, EngineStepError, InvalidRequestError
from engine.sampling_params import SamplingParams
from serving.mock_engine import MockEngine, expected_continuation


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


def test_pages_follow_token_count():
    e = MockEngine(page_size=4, num_pages=100)
    e.add_request(_req("a", "abcdefg", max_tokens=10))  # 7 prompt tokens
    e.step()  # 7 + 1 output = 8 tokens -> ceil(8/4) = 2 pages
    assert e.stats()["kv_pages_used"] == 2
    e.step()  # 9 tokens -> 3 pages
    assert e.stats()["kv_pages_used"] == 3
    _run(e)
    s = e.stats()
    assert (s["kv_pages_used"], s["kv_pages_free"], s["kv_usage"]) == (0, 100, 0.0)


def test_slots_limit_running():
    e = MockEngine(max_num_seqs=2)
    for i in range(3):
        e.add_request(_req(str(i), "a", max_tokens=3))
    e.step()
    assert (e.stats()["num_running"], e.stats()["num_waiting"]) == (2, 1)


def test_preemption_when_pages_run_out():
    e = MockEngine(page_size=2, num_pages=4, max_num_seqs=4)
    e.add_request(_req("a", "a", max_tokens=6))
    e.add_request(_req("b", "b", max_tokens=6))
    outs = _run(e)
    assert e.stats()["num_preemptions"] >= 1
    assert "".join(o.new_text for o in outs["b"]) == "cdefgh"  # recomputed, same text
    assert e.stats()["kv_pages_used"] == 0


def test_abort_frees_pages_at_next_step():
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


def test_stop_string_cut_and_held_back():
    e = MockEngine()
    e.add_request(_req("a", "a", max_tokens=20, stop=("efg",)))
    outs = _run(e)["a"]
    assert "".join(o.new_text for o in outs) == "bcd"
    assert outs[-1].finish_reason == "stop"
    # "e" and "f" were held back (they could start "efg"): nothing was emitted for them
    assert [o.new_text for o in outs] == ["b", "c", "d", "", "", ""]


def test_stop_token_and_min_tokens():
    e = MockEngine()
    e.add_request(_req("a", "a", max_tokens=20, stop_token_ids=(ord("c"),)))
    e.add_request(_req("b", "a", max_tokens=20, min_tokens=3, stop_token_ids=(ord("c"),)))
    outs = _run(e)
    assert [t for o in outs["a"] for t in o.new_token_ids] == [ord("b"), ord("c")]
    assert "".join(o.new_text for o in outs["a"]) == "b"
    assert outs["b"][-1].finish_reason == "length"  # "c" came before min_tokens


def test_prefix_cache_counts_page_aligned_prefixes():
    e = MockEngine(page_size=4)
    e.add_request(_req("a", "abcdefghi", max_tokens=1))
    _run(e)
    e.add_request(_req("b", "abcdefghi", max_tokens=1))
    out = _run(e)["b"][-1]
    assert out.num_cached_tokens == 8
    s = e.stats()
    assert (s["prefix_cache_queries_tokens"], s["prefix_cache_hit_tokens"]) == (18, 8)


def test_injected_failure_drops_running_requests():
    e = MockEngine()
    e.add_request(_req("a", "abc", max_tokens=5))
    e.fail_next_steps(1)
    with pytest.raises(EngineStepError) as info:
        e.step()
    assert info.value.request_ids == ["a"]
    assert not e.has_unfinished() and e.stats()["kv_pages_used"] == 0


def test_add_request_errors():
    e = MockEngine(max_model_len=10)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        e.add_request(_req("a", "abc", max_tokens=8))
    e.add_request(_req("a", "abc", max_tokens=2))
    with pytest.raises(DuplicateRequestError):
        e.add_request(_req("a", "abc", max_tokens=2))
