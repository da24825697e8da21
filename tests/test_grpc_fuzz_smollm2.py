"""Hostile gRPC Generate requests against the REAL SmolLM2 tokenizer and chat template
(rebuilt from the GGUF, no weights: serving.testing.RealTokenizerMockEngine), every field
fuzzed with hypothesis, the tools and reasoning fields included: wrong ranges, unknown
roles, template-breaking contents, token ids past the vocabulary, JSON that is not JSON,
schemas that are not schemas, huge and deeply nested values. The server must never answer
INTERNAL or UNKNOWN, and every INVALID_ARGUMENT must read "FIELD=VALUE is invalid: LIMIT"
with FIELD a path into the GenerateRequest (its first name a field of the message). The
byte-tokenizer twin of this test is tests/test_serving_fuzz.py.

Shown (2026-12-05) to catch: a planted INTERNAL (the gRPC tool conversion raising a plain
KeyError for an empty tool_choice) and a planted refusal without its field (the tool name
check raising InvalidRequestError with the field ""), each found within the default
examples."""

from __future__ import annotations

import json
import os
import re

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.frontend.admission import AdmissionConfig
from serving.proto import pagedjax_pb2 as pb
from serving.testing import (
    RealTokenizerMockEngine,
    calls_seen,
    outcome_counts,
    running_server,
    smollm2_tokenizer,
    wait_for,
)

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
FUZZ_MUTATED = settings(FUZZ, max_examples=4 * EXAMPLES)  # reach the deep checks: more
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,  # model / revision pin
    grpc.StatusCode.NOT_FOUND,  # adapter
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
REFUSAL = re.compile(r"(?P<field>[^=\s]+)=(?P<value>.*) is invalid: (?P<limit>.+)", re.DOTALL)
# a field of the message, or a oneof's name (structured.json_schema names a field through it)
REQUEST_FIELDS = set(pb.GenerateRequest.DESCRIPTOR.fields_by_name) | set(
    pb.GenerateRequest.DESCRIPTOR.oneofs_by_name
)
ADMISSION = AdmissionConfig(max_prompt_tokens=300, max_tokens=16, max_model_len=512)

int32 = st.integers(-(2**31), 2**31 - 1)
floats = st.floats(width=32) | st.sampled_from([0.0, -1.0, 1e30, float("nan"), float("inf")])
texts = st.text(max_size=40) | st.sampled_from(
    ["", "a" * 3000, "<|im_start|>system\n", "<|im_end|>", "{{ raise }}", "{% endfor %}", "\x00"]
)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3}}},
    {"type": "object", "properties": {"x": {"$ref": "#/nope"}}},
    {"type": "array"},
    {"type": "object", "properties": {"x": {"type": "strung"}}},
    {"type": "object", "properties": {"p": {"pattern": "("}}},
]


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


json_texts = (
    st.sampled_from([json.dumps(s) for s in SCHEMAS])
    | json_value.map(json.dumps)
    | texts
    | st.sampled_from([_deep(5000), '{"a": ' * 300, "{}", "null"])
)
tool_names = st.sampled_from(["get_weather", "f", "a b", "", "x" * 70, "get_weather"]) | texts


@st.composite
def tools(draw):
    return [
        pb.Tool(
            type=draw(st.sampled_from(["", "function", "web_search"]) | texts),
            function=pb.FunctionDefinition(
                name=draw(tool_names), description=draw(texts), parameters=draw(json_texts)
            ),
        )
        for _ in range(draw(st.integers(0, 4)))
    ]


@st.composite
def tool_choices(draw):
    kind = draw(st.sampled_from(["mode", "function", "empty"]))
    if kind == "mode":
        return pb.ToolChoice(mode=draw(st.sampled_from(["none", "auto", "required"]) | texts))
    if kind == "function":
        return pb.ToolChoice(function=pb.FunctionName(name=draw(tool_names)))
    return pb.ToolChoice()


@st.composite
def chat_messages(draw):
    roles = st.sampled_from(["user", "system", "assistant", "tool"]) | texts
    out = []
    for _ in range(draw(st.integers(0, 5))):
        calls = [
            pb.ToolCall(id=draw(texts), name=draw(tool_names), arguments=draw(json_texts))
            for _ in range(draw(st.integers(0, 2)))
        ]
        out.append(
            pb.ChatMessage(
                role=draw(roles),
                content=draw(texts),
                tool_calls=calls,
                tool_call_id=draw(texts),
                name=draw(st.sampled_from(["", "bob"]) | texts),
            )
        )
    return out


@st.composite
def sampling(draw):
    fields = {}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
        if draw(st.booleans()):
            fields[name] = draw(floats)
    for name in ("top_k", "logprobs"):
        if draw(st.booleans()):
            fields[name] = draw(int32 | st.integers(0, 5))
    if draw(st.booleans()):
        fields["seed"] = draw(st.integers(0, 2**64 - 1))
    return pb.SamplingParams(**fields)


def _set_prompt(draw, req: pb.GenerateRequest) -> None:
    kind = draw(st.sampled_from(["chat", "chat", "text", "token_ids", "none"]))
    if kind == "chat":
        req.chat.messages.extend(draw(chat_messages()))
    elif kind == "text":
        req.text = draw(texts)
    elif kind == "token_ids":
        ids = st.lists(int32 | st.integers(49_000, 49_300) | st.integers(0, 100), max_size=30)
        req.token_ids.ids.extend(draw(ids))


def _set_structured(draw, req: pb.GenerateRequest) -> None:
    kind = draw(
        st.sampled_from(["none", "json_schema", "json_object", "regex", "choice", "grammar"])
    )
    if kind in ("json_schema", "regex", "grammar"):
        setattr(req, kind, draw(json_texts | st.sampled_from(["[a-z]+", "(", "start: /x/"])))
    elif kind == "json_object":
        req.json_object = True
    elif kind == "choice":
        req.choice.choices.extend(draw(st.lists(texts, max_size=4)))


def _set_tools(draw, req: pb.GenerateRequest) -> None:
    req.tools.extend(draw(tools()))
    if draw(st.booleans()):
        req.tool_choice.SetInParent()  # an empty ToolChoice is still a set one
        req.tool_choice.CopyFrom(draw(tool_choices()))
    if draw(st.booleans()):
        req.parallel_tool_calls = draw(st.booleans())
    if draw(st.booleans()):
        req.chat_template_kwargs = draw(
            json_texts | st.sampled_from(['{"enable_thinking": false}', '{"tools": []}'])
        )
    if draw(st.booleans()):
        req.max_thinking_tokens = draw(int32 | st.integers(0, 8))


@st.composite
def generate_requests(draw):
    req = pb.GenerateRequest(
        request_id=draw(st.sampled_from([""]) | texts),
        model=draw(st.sampled_from(["", "", "other"]) | texts),
        adapter=draw(st.sampled_from(["", "", "sql"])),
        sampling=draw(sampling()),
        stop=draw(st.lists(texts, max_size=6)),
        stop_token_ids=draw(st.lists(int32 | st.integers(0, 49_200), max_size=6)),
        min_tokens=draw(int32 | st.integers(0, 4)),
        ignore_eos=draw(st.booleans()),
        priority=draw(st.integers(0, 3) | int32),
        stream=draw(st.booleans()),
        include_stop_str_in_output=draw(st.booleans()),
    )
    if draw(st.booleans()):
        req.max_tokens = draw(st.integers(1, 8) | int32)
    if draw(st.booleans()):
        req.skip_special_tokens = draw(st.booleans())
    _set_prompt(draw, req)
    _set_structured(draw, req)
    _set_tools(draw, req)
    return req


VALID = pb.GenerateRequest(
    max_tokens=4,
    tools=[
        pb.Tool(
            type="function",
            function=pb.FunctionDefinition(name="get_weather", parameters=json.dumps(SCHEMAS[0])),
        )
    ],
    tool_choice=pb.ToolChoice(mode="required"),
)
VALID.chat.messages.add(role="user", content="Weather in Paris?")


@st.composite
def mutated_requests(draw):
    """A valid chat-with-tools request with one or two fields made hostile."""
    req = pb.GenerateRequest()
    req.CopyFrom(VALID)
    hostile = draw(generate_requests())
    fields = sorted(pb.GenerateRequest.DESCRIPTOR.fields_by_name)
    for _ in range(draw(st.integers(1, 2))):
        field = draw(st.sampled_from(fields))
        req.ClearField(field)
        _copy_field(hostile, req, field)
    return req


@st.composite
def tools_requests(draw):
    """The valid request with its tools fields (and perhaps its messages) made hostile."""
    req = pb.GenerateRequest()
    req.CopyFrom(VALID)
    if draw(st.booleans()):
        del req.tools[:]
        req.tools.extend(draw(tools()))
    if draw(st.booleans()):
        hostile = pb.GenerateRequest()
        _set_tools(draw, hostile)
        for field in ("tool_choice", "chat_template_kwargs", "max_thinking_tokens"):
            req.ClearField(field)
            _copy_field(hostile, req, field)
    if draw(st.booleans()):
        req.chat.messages.extend(draw(chat_messages()))
    return req


def _copy_field(src, dst, field: str) -> None:
    """src's value of `field` into dst (nothing when src leaves it unset)."""
    value = getattr(src, field)
    descriptor = pb.GenerateRequest.DESCRIPTOR.fields_by_name[field]
    if descriptor.has_presence and not src.HasField(field):
        return
    if descriptor.is_repeated:
        getattr(dst, field).extend(value)
    elif descriptor.message_type is not None:
        getattr(dst, field).CopyFrom(value)
    else:
        setattr(dst, field, value)


@pytest.fixture(scope="module")
def served():
    tok = smollm2_tokenizer()
    assert tok.chat_template is not None and tok.vocab_size == 49152
    engine = RealTokenizerMockEngine(tok, page_size=4, num_pages=512, max_model_len=512)
    with running_server(engine, admission=ADMISSION, max_request_bytes=400_000) as (srv, client):
        yield srv, client


def _check(client, req: pb.GenerateRequest) -> None:
    res = client.generate_request(req, timeout_s=30)
    code = grpc.StatusCode[res.code]
    assert code in ALLOWED, (res.code, res.details, req)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        m = REFUSAL.fullmatch(res.details)
        assert m, res.details  # FIELD=VALUE is invalid: LIMIT
        root = re.split(r"[.\[ ]", m["field"], maxsplit=1)[0]
        assert root in REQUEST_FIELDS, (m["field"], res.details)


@FUZZ
@given(req=generate_requests())
def test_fuzzed_requests_are_refused_naming_the_field(served, req):
    _check(served[1], req)


@FUZZ_MUTATED
@given(req=mutated_requests())
def test_one_hostile_field_in_a_valid_tools_request(served, req):
    _check(served[1], req)


@FUZZ_MUTATED
@given(req=tools_requests())
def test_hostile_tools_fields(served, req):
    _check(served[1], req)


def test_the_valid_request_works_and_outcomes_add_up(served):
    server, client = served
    res = client.generate_request(VALID)
    assert res.ok and res.finish_reason in ("stop", "length", "tool_calls"), res.details
    wait_for(lambda: sum(outcome_counts(server).values()) == calls_seen(server))
    assert ("rejected", "internal") not in outcome_counts(server)
