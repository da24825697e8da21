"""Bounded echoes (issue 37 item 3): an error message or a log line quotes at most ~200
characters of an offending value, with its length, never the whole field; tested with
multi-megabyte invalid fields over HTTP (error body and request log line)."""

import json
import logging

import httpx
import pytest

from configs.errors import MAX_ECHO_CHARS, InvalidRequestError, bounded, echo
from serving.testing import running_server

BIG = 4 << 20  # characters of each offending value
NEAR_LIMIT = 150_000  # under the structured-output size limit: reaches llguidance's parser


def test_echo_cuts_long_values_and_says_how_long():
    assert echo("abc") == "'abc'" and echo(12) == "12"
    shown = echo("x" * BIG)
    assert shown.startswith("'xxx") and shown.endswith(f"... ({BIG} characters)")
    assert len(shown) < MAX_ECHO_CHARS + 40
    assert echo({"k": "v" * 1000}).endswith(f"({len(repr({'k': 'v' * 1000}))} as text)")
    assert bounded("short") == "short" and bounded("m" * 5000, 100).endswith("(5000 characters)")
    e = InvalidRequestError("guided_grammar", "g" * BIG, "l" * BIG)
    assert len(str(e)) < 1500 and f"({BIG} characters)" in str(e)


@pytest.fixture(scope="module")
def server():
    with running_server(http_port=0) as (server, _):
        yield server


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{server.http_port}{path}", json=body, timeout=120)


BAD = {"type": "q" * NEAR_LIMIT}  # not a JSON Schema type


def _grammar(n):
    return "start: " + "x" * n + " ???"  # invalid Lark after n characters


CASES = {  # name -> (path, body, the offending run of characters)
    "grammar_too_long": ("/v1/completions", {"guided_grammar": _grammar(BIG)}, "x"),
    "grammar_invalid": ("/v1/completions", {"guided_grammar": _grammar(NEAR_LIMIT)}, "x"),
    "regex_invalid": ("/v1/completions", {"guided_regex": "(" * NEAR_LIMIT}, "("),
    "schema_invalid": (
        "/v1/completions",
        {"guided_json": {"type": "object", "properties": {"a" * NEAR_LIMIT: {"type": "?"}}}},
        "a",
    ),
    "response_format": (
        "/v1/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": BAD}}},
        "q",
    ),
    "max_tokens_type": ("/v1/completions", {"max_tokens": "t" * BIG}, "t"),
    "model": ("/v1/completions", {"model": "m" * BIG}, "m"),
    "unknown_field_name": ("/v1/completions", {"b" * BIG: 1}, "b"),
    "chat_role": (
        "/v1/chat/completions",
        {"messages": [{"role": "r" * BIG, "content": "hi"}]},
        "r",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_multi_megabyte_invalid_field_is_not_echoed_whole(server, caplog, case):
    caplog.set_level(logging.INFO, logger="pagedjax.requests")
    path, fields, char = CASES[case]
    body = {"model": "mock", "max_tokens": 4, **fields}
    if path == "/v1/completions":
        body.setdefault("prompt", "abc")
    r = _post(server, path, body)
    assert r.status_code in (400, 404), r.text[:300]
    message = r.json()["error"]["message"]
    run = char * (MAX_ECHO_CHARS + 50)  # more of the value than an echo may quote
    assert len(r.content) < 2500 and run not in r.text, message[:300]
    assert "characters" in message or "chars" in message  # its length is given instead
    lines = [x.getMessage() for x in caplog.records if x.name == "pagedjax.requests"]
    assert len(lines) == 1 and json.loads(lines[0])["outcome"] == "rejected"
    assert len(lines[0]) < 3000 and run not in lines[0]
