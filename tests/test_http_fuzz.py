"""Hostile HTTP bodies (issue 36 item 5): /v1/chat/completions, /v1/completions and
/v1/responses fuzzed with hypothesis against the REAL SmolLM2 tokenizer and chat template
(rebuilt from the GGUF, no weights loaded): wrong types, missing and unknown fields, deep
nesting, huge arrays and strings, enormous numbers, template-breaking message contents and
raw bytes that are not UTF-8 or not JSON. The server must never answer 5xx, and every 4xx
must name what it refuses (`error.param`, a field of the body or the body itself).

The engine is the MockEngine (serving/engine_host/mock_engine.py) with the real tokenizer
swapped in, so everything from the HTTP parser through the chat template, tokenization,
admission and the scheduler is the production code; only the device step is the mock's.
FUZZ_EXAMPLES sets the examples per property (as in tests/test_serving_fuzz.py; the
mostly-valid properties run 8x as many, they are cheap).

Shown (2026-12-04) to catch: a planted 500 (serving/http/api.py raising a plain ValueError
for stream_options without stream: found by the mostly-valid chat property as
`stream_options: {}`), and a real defect, fixed with this test: a JSON body that is not an
object (`null`) was refused with param None and the message "None=None is invalid"
(serving/http/schemas.py validation_message now names "body"). The /v1/responses properties
(2026-12-05) found another: max_output_tokens=0 was refused naming max_tokens, the chat
field it is translated into (serving/http/responses_api.py responses_refusal now names the
field the client sent)."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.frontend.admission import AdmissionConfig
from serving.http.responses_api import ResponsesRequest
from serving.http.schemas import ChatCompletionRequest, CompletionRequest
from serving.testing import RealTokenizerMockEngine, running_server, smollm2_tokenizer

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
# Mostly-valid bodies are cheap (most answer at once) and reach the deep code: more of them.
FUZZ_MUTATED = settings(FUZZ, max_examples=8 * EXAMPLES)
ADMISSION = AdmissionConfig(max_prompt_tokens=200, max_tokens=16, max_model_len=256)
# Statuses a hostile body may get, each with the field it names (or none, for these).
NO_FIELD_NEEDED = {404, 429, 503}  # unknown model / path, rate limit, draining


@pytest.fixture(scope="module")
def server():
    tok = smollm2_tokenizer()
    assert tok.chat_template is not None and tok.vocab_size == 49152
    engine = RealTokenizerMockEngine(tok, page_size=4, num_pages=256, max_model_len=256)
    with (
        running_server(engine, admission=ADMISSION, http_port=0) as (srv, _),
        httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}", timeout=60) as http,
    ):
        yield http


json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([1e308, -1e308, 2**63, -(2**63) - 1, 10**40])
    | st.text(max_size=40)
    | st.sampled_from(["", "a" * 20_000, "<|im_start|>system\n", "{{ raise }}", "\ud800x"])
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


def _deep(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


huge = st.sampled_from([_deep(30), _deep(300), list(range(20_000)), ["x"] * 5000])
weird = json_value | huge

content = (
    st.text(max_size=60)
    | st.sampled_from(["<|im_end|>", "<|im_start|>assistant\n", "{% endfor %}", "\x00"])
    | st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": weird}),
        max_size=3,
    )
    | weird
)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "assistant", "system", "tool", "developer", ""]) | weird,
        "content": content,
        "name": weird,
        "tool_calls": weird,
    },
)
COMMON = {
    "model": st.sampled_from(["", "mock", "smollm2"]) | weird,
    "max_tokens": st.integers(-5, 40) | weird,
    "temperature": st.floats(allow_nan=True) | weird,
    "top_p": weird,
    "top_k": weird,
    "n": st.integers(-1, 20) | weird,
    "stop": st.lists(st.text(max_size=10), max_size=6) | weird,
    "seed": st.integers(-(2**70), 2**70) | weird,
    "stream": st.booleans() | weird,
    "logprobs": weird,
    "response_format": weird,
    "guided_json": weird,
    "stream_options": weird,
}
chat_body = st.fixed_dictionaries(
    {},
    optional={
        **COMMON,
        "messages": st.lists(message, max_size=4) | weird,
        "add_generation_prompt": weird,
        "top_logprobs": weird,
    },
)
completion_body = st.fixed_dictionaries(
    {},
    optional={
        **COMMON,
        "prompt": st.text(max_size=60) | st.lists(st.integers(-3, 60_000), max_size=8) | weird,
        "echo": weird,
        "suffix": weird,
    },
)
input_item = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "x"]) | weird,
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | weird,
        "content": content
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["input_text", "output_text", "input_image", ""])},
                optional={"text": weird},
            ),
            max_size=3,
        ),
        "call_id": weird,
        "name": weird,
        "arguments": weird,
        "output": weird,
    },
)
responses_body = st.fixed_dictionaries(
    {},
    optional={
        "model": COMMON["model"],
        "input": st.text(max_size=60) | st.lists(input_item, max_size=4) | weird,
        "instructions": weird,
        "tools": weird,
        "tool_choice": weird,
        "max_output_tokens": st.integers(-5, 40) | weird,
        "temperature": COMMON["temperature"],
        "top_p": weird,
        "stream": COMMON["stream"],
        "store": weird,
        "previous_response_id": st.sampled_from(["", "resp_x"]) | weird,
        "metadata": weird,
        "include": weird,
        "truncation": weird,
        "text": st.fixed_dictionaries({}, optional={"format": weird}) | weird,
        "reasoning": weird,
    },
)
# Mostly-valid bodies with one or two fields changed, to a well-typed edge value (3 in 4)
# or a hostile one, reach the code past the schema (template, tokenization, admission, the
# engine); fully random bodies rarely get past pydantic.
_floats = st.floats(-5, 1e6) | st.sampled_from([0.0, 1.0, 1e308, -1e-300])
_ints = st.integers(-(2**40), 2**40) | st.integers(-2, 70)
_texts = st.lists(st.text(max_size=8), max_size=5)
TYPED = {
    **dict.fromkeys(["temperature", "top_p", "presence_penalty", "repetition_penalty"], _floats),
    **dict.fromkeys(["max_tokens", "top_k", "n", "seed", "min_tokens", "top_logprobs"], _ints),
    **dict.fromkeys(["stream", "echo", "ignore_eos", "add_generation_prompt"], st.booleans()),
    "priority": _ints,
    "logprobs": st.booleans() | st.integers(-1, 30),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "stop": st.text(max_size=8) | _texts,
    "stop_token_ids": st.lists(st.integers(-2, 60_000), max_size=5),
    "messages": st.lists(message, min_size=1, max_size=3),
    "prompt": st.text(max_size=30) | st.lists(st.integers(-2, 60_000), max_size=6) | _texts,
    "response_format": st.sampled_from(
        [
            {"type": "json_object"},
            {"type": "text"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            {"type": "json_schema"},
            {"type": "regex"},
        ]
    ),
    "guided_json": st.sampled_from([{"type": "object"}, {"type": "nope"}, "{", "{}"]),
    "guided_regex": st.text(max_size=8),
    "guided_choice": _texts,
    "guided_grammar": st.text(max_size=12),
    "model": st.sampled_from(["", "mock", "x"]),
    "user": st.text(max_size=8),
    "suffix": st.text(max_size=8),
}
_field = st.sampled_from(sorted(TYPED))
_change = _field.flatmap(
    lambda f: st.tuples(st.just(f), st.one_of(TYPED[f], TYPED[f], TYPED[f], weird))
)
changes = st.lists(_change, min_size=1, max_size=2).map(dict)
VALID_CHAT = {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
VALID_COMPLETION = {"model": "", "prompt": "hello", "max_tokens": 4}
RESPONSES_TYPED = {
    "input": st.text(max_size=30) | st.lists(input_item, min_size=1, max_size=3),
    "instructions": st.text(max_size=12),
    "max_output_tokens": _ints,
    "temperature": _floats,
    "top_p": _floats,
    "stream": st.booleans(),
    "store": st.booleans(),
    "previous_response_id": st.sampled_from(["", "resp_unknown"]),
    "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
    "include": _texts,
    "truncation": st.sampled_from(["disabled", "auto"]),
    "text": st.sampled_from(
        [
            {"format": {"type": "text"}},
            {"format": {"type": "json_object"}},
            {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            {"format": {"type": "json_schema"}},
            {"format": {"type": "regex"}},
        ]
    ),
    "model": TYPED["model"],
    "user": TYPED["user"],
}
_responses_field = st.sampled_from(sorted(RESPONSES_TYPED))
_responses_change = _responses_field.flatmap(
    lambda f: st.tuples(st.just(f), st.one_of(*[RESPONSES_TYPED[f]] * 3, weird))
)
VALID_RESPONSES = {"model": "", "input": "hi", "max_output_tokens": 4, "store": False}
mutated_responses = st.builds(
    lambda c: {**VALID_RESPONSES, **c},
    st.lists(_responses_change, min_size=1, max_size=2).map(dict),
)
mutated_chat = st.builds(lambda c: {**VALID_CHAT, **c}, changes)
mutated_completion = st.builds(lambda c: {**VALID_COMPLETION, **c}, changes)
unknown_fields = st.dictionaries(st.text(min_size=1, max_size=12), weird, max_size=2)


FIELDS_OF = {  # what a refusal may name: a field of the request (sent, missing or default)
    "/v1/chat/completions": set(ChatCompletionRequest.model_fields),
    "/v1/completions": set(CompletionRequest.model_fields),
    "/v1/responses": set(ResponsesRequest.model_fields),
}


def _check(response: httpx.Response, body, path: str) -> None:
    """No 5xx; a 4xx names what it refuses: a field of the body or of the request schema
    (a missing one, or a default one such as n against the number of prompts), the body
    itself ("body": JSON but not an object), or, for bytes that are not JSON, says so."""
    assert response.status_code < 500, (response.status_code, response.text[:500], body)
    if response.status_code < 400 or response.status_code in NO_FIELD_NEEDED:
        return
    error = response.json()["error"]
    param = error.get("param")
    if param is None and error.get("message", "").startswith("request body is not valid JSON"):
        return  # the refusal names the body: no field of it can be read
    assert isinstance(param, str) and param, (response.status_code, error, body)
    head = re.split(r"[.\[]", param, maxsplit=1)[0]  # input[0].role -> input
    if isinstance(body, dict) and head != "body":
        assert head in body or head in FIELDS_OF[path], (param, sorted(body))
    assert error.get("message"), error


def _post(http, path: str, body, extra: dict | None = None) -> None:
    if isinstance(body, dict) and extra:
        body = {**body, **extra}
    try:
        raw = json.dumps(body).encode()
    except (ValueError, RecursionError):  # not representable as JSON: send it as text
        raw = repr(body).encode()
    _check(http.post(path, content=raw, headers={"content-type": "application/json"}), body, path)


@pytest.mark.slow  # the real tokenizer; minutes of hypothesis on a loaded machine
@FUZZ
@given(body=chat_body, extra=unknown_fields)
def test_chat_completions_bodies_never_5xx_and_name_the_field(server, body, extra):
    _post(server, "/v1/chat/completions", body, extra)


@pytest.mark.slow  # the real tokenizer; minutes of hypothesis on a loaded machine
@FUZZ
@given(body=completion_body, extra=unknown_fields)
def test_completions_bodies_never_5xx_and_name_the_field(server, body, extra):
    _post(server, "/v1/completions", body, extra)


@pytest.mark.slow  # the real tokenizer; minutes of hypothesis on a loaded machine
@FUZZ_MUTATED
@given(body=mutated_chat)
def test_mostly_valid_chat_bodies_never_5xx_and_name_the_field(server, body):
    _post(server, "/v1/chat/completions", body)


@pytest.mark.slow
@FUZZ_MUTATED
@given(body=mutated_completion)
def test_mostly_valid_completion_bodies_never_5xx_and_name_the_field(server, body):
    _post(server, "/v1/completions", body)


@pytest.mark.slow
@FUZZ
@given(body=responses_body, extra=unknown_fields)
def test_responses_bodies_never_5xx_and_name_the_field(server, body, extra):
    _post(server, "/v1/responses", body, extra)


@pytest.mark.slow
@FUZZ_MUTATED
@given(body=mutated_responses)
def test_mostly_valid_responses_bodies_never_5xx_and_name_the_field(server, body):
    _post(server, "/v1/responses", body)


@pytest.mark.slow  # the real tokenizer; minutes of hypothesis on a loaded machine
@FUZZ
@given(
    raw=st.binary(max_size=200)
    | st.sampled_from(
        [b"\xff\xfe{", b'{"prompt": "\xc3\x28"}', b"[" * 10_000, b"{" * 10_000, b"", b"null"]
    )
)
def test_raw_bytes_never_5xx(server, raw):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        r = server.post(path, content=raw, headers={"content-type": "application/json"})
        _check(r, None, path)


def test_a_valid_chat_request_still_works_through_the_real_template(server):
    body = {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 5  # the template's tokens, not just "hi"
