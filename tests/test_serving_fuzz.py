"""Hostile input (issue 17 item 5): every field of every request type fuzzed with hypothesis,
raw garbage bytes as messages, HTTP/1.1 and junk on the gRPC port. The server must never
answer INTERNAL or UNKNOWN, every refusal must be INVALID_ARGUMENT (or another documented
code) reading "FIELD=VALUE is invalid: LIMIT" with FIELD a field of the request (garbage
bytes: the guard's parse refusal), every call keeps one outcome, and a normal request works
afterwards. This runs on the byte tokenizer; tests/test_grpc_fuzz_smollm2.py runs the same
checks against SmolLM2's real tokenizer and template, the tools fields included.

FUZZ_EXAMPLES (environment) sets the examples per property: small for `make test`, large
for `make reliability` (benchmarks/reliability.py reports the counts).
"""

import contextlib
import os
import re
import socket
import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.engine_host.mock_engine import MockEngine
from serving.frontend.admission import AdmissionConfig
from serving.proto import pagedjax_pb2 as pb
from serving.testing import calls_seen, outcome_counts, running_server, wait_for

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
# Codes a hostile request may get; never INTERNAL / UNKNOWN.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
GENERATE = "/pagedjax.v1.PagedJax/Generate"
TOKENIZE = "/pagedjax.v1.PagedJax/Tokenize"

int32 = st.integers(-(2**31), 2**31 - 1)
floats = st.floats(width=32, allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, -1.0, 1e30, float("nan"), float("inf"), -float("inf")]
)
texts = st.text(max_size=64) | st.sampled_from(["", "a" * 5000, "<|im_start|>", "\x00\ufffd"])


@st.composite
def sampling_messages(draw):
    fields = {}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if draw(st.booleans()):
            fields[name] = draw(floats)
    for name in ("presence_penalty", "frequency_penalty"):
        if draw(st.booleans()):
            fields[name] = draw(floats)
    for name in ("top_k", "logprobs"):
        if draw(st.booleans()):
            fields[name] = draw(int32)
    if draw(st.booleans()):
        fields["seed"] = draw(st.integers(0, 2**64 - 1))
    return pb.SamplingParams(**fields)


@st.composite
def generate_requests(draw):
    req = pb.GenerateRequest(
        request_id=draw(texts),
        model=draw(st.sampled_from(["", "mock", "other"]) | texts),
        revision=draw(st.sampled_from(["", "mock-rev-1"]) | texts),
        sampling=draw(sampling_messages()),
        stop=draw(st.lists(texts, max_size=20)),
        stop_token_ids=draw(st.lists(int32, max_size=20)),
        min_tokens=draw(int32),
        ignore_eos=draw(st.booleans()),
        priority=draw(int32 | st.integers(0, 3)),
        stream=draw(st.booleans()),
    )
    if draw(st.booleans()):
        req.max_tokens = draw(int32 | st.integers(1, 8))
    kind = draw(st.sampled_from(["text", "token_ids", "chat", "none"]))
    if kind == "text":
        req.text = draw(texts)
    elif kind == "token_ids":
        req.token_ids.ids.extend(draw(st.lists(int32 | st.integers(0, 255), max_size=50)))
    elif kind == "chat":
        roles = st.sampled_from(["user", "system", "assistant", "tool"]) | texts
        for _ in range(draw(st.integers(0, 6))):
            req.chat.messages.add(role=draw(roles), content=draw(texts))
    return req


def _call(port: int, method: str, payload: bytes, stream: bool, timeout_s: float = 20):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
        try:
            if stream:
                list(channel.unary_stream(method, **identity)(payload, timeout=timeout_s))
            else:
                channel.unary_unary(method, **identity)(payload, timeout=timeout_s)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


REFUSAL = re.compile(r"(?P<field>[^=\s]+)=(?P<value>.*) is invalid: (?P<limit>.+)", re.DOTALL)
# what a refusal may name: a field of the request (or a oneof's name, e.g. prompt)
NAMES = {
    m: set(d.fields_by_name) | set(d.oneofs_by_name)
    for m, d in (
        (GENERATE, pb.GenerateRequest.DESCRIPTOR),
        (TOKENIZE, pb.TokenizeRequest.DESCRIPTOR),
    )
}


def _check(code, details, method=GENERATE, parsed=True):
    """`parsed`: the payload is a well-formed message (else the guard's parse refusal)."""
    assert code in ALLOWED, (code, details)
    if code != grpc.StatusCode.INVALID_ARGUMENT:
        return
    if not parsed and "protobuf" in details:
        return  # bytes that are not the message: nothing to name but the message
    m = REFUSAL.fullmatch(details)
    assert m, details  # FIELD=VALUE is invalid: LIMIT
    assert re.split(r"[.\[ ]", m["field"], maxsplit=1)[0] in NAMES[method], details


@pytest.fixture(scope="module")
def served():
    engine = MockEngine(step_time_s=0.0, max_num_seqs=8, num_pages=512)
    admission = AdmissionConfig(max_prompt_tokens=400, max_tokens=16, max_model_len=512)
    with running_server(engine, admission=admission, max_request_bytes=200_000) as (s, c):
        yield s, c


@FUZZ
@given(req=generate_requests())
def test_fuzzed_generate_requests(served, req):
    server, _ = served
    _check(*_call(server.port, GENERATE, req.SerializeToString(), stream=True))


@FUZZ
@given(
    text=texts,
    chat=st.lists(st.tuples(texts, texts), max_size=5),
    use_chat=st.booleans(),
    agp=st.booleans(),
    model=st.sampled_from(["", "mock", "x"]),
)
def test_fuzzed_tokenize_requests(served, text, chat, use_chat, agp, model):
    server, _ = served
    req = pb.TokenizeRequest(model=model, add_generation_prompt=agp)
    if use_chat:
        for role, content in chat:
            req.chat.messages.add(role=role, content=content)
    else:
        req.text = text
    _check(*_call(server.port, TOKENIZE, req.SerializeToString(), stream=False), TOKENIZE)


@FUZZ
@given(payload=st.binary(max_size=300), method=st.sampled_from([GENERATE, TOKENIZE]))
def test_garbage_bytes_as_messages(served, payload, method):
    server, _ = served
    _check(*_call(server.port, method, payload, stream=method == GENERATE), method, parsed=False)


def test_invalid_utf8_in_a_string_field(served):
    server, _ = served
    raw = pb.GenerateRequest(text="abcd", max_tokens=2).SerializeToString()
    code, details = _call(server.port, GENERATE, raw.replace(b"abcd", b"ab\xff\xfe"), True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "protobuf" in details


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda r: r.stop.extend(["s"] * 10_000), "stop"),
        (lambda r: r.chat.messages.extend([pb.ChatMessage(role="user", content="a")] * 10_000),
         "chat.messages"),
        (lambda r: r.token_ids.ids.extend([1] * 10_000), "token_ids"),
        (lambda r: r.stop_token_ids.extend(list(range(10_000))), "stop_token_ids"),
        (lambda r: setattr(r, "request_id", "r" * 10_000), "request_id"),
    ],
)  # fmt: skip
def test_huge_repeated_fields_name_the_field(served, build, field):
    server, _ = served
    req = pb.GenerateRequest(text="abc", max_tokens=2)
    build(req)
    code, details = _call(server.port, GENERATE, req.SerializeToString(), stream=True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, details


def test_duplicate_request_ids_in_flight():
    with running_server(MockEngine(step_time_s=0.01)) as (_, client):
        first = client.stream(
            pb.GenerateRequest(request_id="dup", text="a", max_tokens=50, stream=True)
        )
        next(first)  # "dup" is in flight now (50 steps of 10 ms)
        second = client.generate("b", request_id="dup", max_tokens=2)
        assert second.code == "INVALID_ARGUMENT" and "already in flight" in second.details
        assert sum(len(m.token_ids) for m in first) == 49  # the first one is unharmed


@pytest.mark.parametrize(
    "payload",
    [
        b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
        b"POST /pagedjax.v1.PagedJax/Generate HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 64,
        bytes(range(256)) * 4,
    ],
)
def test_http1_and_junk_on_the_grpc_port(served, payload):
    server, client = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(payload)
        with contextlib.suppress(TimeoutError, ConnectionError):
            sock.recv(4096)  # whatever the server answers (or a close)
    assert client.generate("abc", max_tokens=2).ok


def test_a_normal_request_works_after_the_fuzzing_and_outcomes_add_up(served):
    server, client = served
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(client.generate("abc", max_tokens=4)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [r.code for r in results] == ["OK"] * 4
    wait_for(lambda: sum(outcome_counts(server).values()) == calls_seen(server))
    assert ("rejected", "internal") not in outcome_counts(server)
