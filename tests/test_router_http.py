"""The router's OpenAI-compatible HTTP front (serving/router/http_front.py over
serving/router/routed_engine.py) with the `openai` SDK, in-process over MockEngine `both` replicas
(no JAX; outputs checkable by hand: serving/engine_host/mock_engine.py). The real pair (prefill +
decode workers on the tiny model) is tested over HTTP in tests/test_router.py."""

import contextlib

import httpx
import openai
import pytest

from engine.api_types import EngineRequest
from engine.sampling.params import SamplingParams
from engine.structured.output import StructuredOutput
from serving.engine_host.mock_engine import ByteTokenizer, MockEngine, expected_continuation
from serving.grpc_api import convert
from serving.router.http_front import RouterHttpError
from serving.router.routed_engine import generate_request
from serving.router.server import Router
from serving.testing import calls_seen, running_server, wait_for


@contextlib.contextmanager
def routed(num_replicas=2, step_time_s=0.002, **router_kwargs):
    """(router, [replica servers], openai client) over `num_replicas` mock replicas."""
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(
                running_server(MockEngine(step_time_s=step_time_s), capacity_probe=False)
            )[0]
            for _ in range(num_replicas)
        ]
        router = Router(
            [f"127.0.0.1:{s.port}" for s in servers],
            http_port=0,
            tokenizer=ByteTokenizer(),
            health_interval_s=0.2,
            **router_kwargs,
        ).start()
        stack.callback(router.stop, 0)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="none", max_retries=0
        )
        yield router, servers, client


def expected_text(prompt: str, n: int) -> str:
    return bytes(expected_continuation(prompt.encode()[-1], n)).decode()


def pages_free(server) -> bool:
    stats = server.loop.engine.stats()
    return stats["kv_pages_used"] == 0 and stats["num_running"] == 0


def test_completions_and_chat_through_the_router_equal_the_replica():
    with routed() as (router, servers, client):
        full = client.completions.create(model="mock", prompt="abc", max_tokens=7)
        assert full.choices[0].text == expected_text("abc", 7) == "defghij"
        assert full.choices[0].finish_reason == "length"
        assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (3, 7)
        assert full.model_extra["pagedjax"]["versions"]["revision"] == "mock-rev-1"
        chunks = list(
            client.completions.create(model="mock", prompt="abc", max_tokens=7, stream=True)
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "defghij"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        chat = client.chat.completions.create(
            model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        templated = ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
        assert chat.choices[0].message.content == expected_text(templated, 4)
        assert router.service.counters["routed_both"] == 3
        for s in servers:
            wait_for(lambda s=s: pages_free(s), 10, "pages free on the replica")


def test_stop_string_kept_in_the_output_through_the_router():
    """include_stop_str_in_output crosses the router to the worker, which applies it."""
    with routed(num_replicas=1) as (router, servers, client):
        ask = dict(model="mock", prompt="abc", max_tokens=7, stop=["fg"])
        assert client.completions.create(**ask).choices[0].text == "de"
        kept = client.completions.create(**ask, extra_body={"include_stop_str_in_output": True})
        assert kept.choices[0].text == "defg"
        assert kept.choices[0].finish_reason == "stop"


def test_http_disconnect_cancels_the_worker_request_and_frees_its_pages():
    with routed(num_replicas=1, step_time_s=0.02) as (router, servers, client):
        stream = client.completions.create(
            model="mock", prompt="cancel me", max_tokens=400, stream=True
        )
        next(iter(stream))  # the replica is generating it
        stream.close()
        engine = servers[0].loop.engine
        wait_for(lambda: engine.abort_log, 10, "the replica's request aborted")
        ((request_id, _, _),) = engine.abort_log
        assert request_id.startswith("cmpl-")
        wait_for(lambda: pages_free(servers[0]), 10, "pages free on the replica")
        wait_for(lambda: not router.http.engine.has_unfinished(), 10, "relay ended")
        assert engine.num_steps < 400  # cancelled long before its 400 tokens


def test_no_routable_worker_is_503_and_not_ready():
    with routed(num_replicas=1) as (router, servers, client):
        ready_url = f"http://127.0.0.1:{router.http_port}/ready"
        assert httpx.get(ready_url).json() == {"ready": True, "reason": None}
        servers[0].stop(0)
        wait_for(lambda: httpx.get(ready_url).status_code == 503, 10, "/ready 503")
        assert httpx.get(ready_url).json() == {"ready": False, "reason": "no_route"}
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="mock", prompt="abc", max_tokens=3)
        assert e.value.status_code == 503
        assert "no routable worker" in e.value.message or "UNAVAILABLE" in e.value.message


def test_router_refuses_a_tokenizer_other_than_the_workers():
    class OtherTokenizer(ByteTokenizer):
        sha256 = "another-tokenizer"

    with running_server(MockEngine(), capacity_probe=False) as (server, _):
        router = Router([f"127.0.0.1:{server.port}"], http_port=0, tokenizer=OtherTokenizer())
        with pytest.raises(RouterHttpError, match="--tokenizer=<tokenizer_hash another"):
            router.start()
        router.stop(0)


def test_engine_request_crosses_the_grpc_api_unchanged():
    sp = SamplingParams(
        temperature=0.5,
        top_k=5,
        top_p=0.875,  # NOTE: the gRPC API's floats are float32; these are exact in it
        min_p=0.0625,
        repetition_penalty=1.125,
        presence_penalty=0.25,
        frequency_penalty=0.375,
        seed=7,
        max_tokens=9,
        stop=("x", "yz"),
        stop_token_ids=(4, 5),
        ignore_eos=True,
        logprobs=3,
        structured=StructuredOutput(json_schema={"type": "object"}),
    )
    req = generate_request(EngineRequest("r", [1, 2, 3], sp, priority=2))
    assert list(req.token_ids.ids) == [1, 2, 3] and req.stream
    assert convert.sampling_params(req, default_max_tokens=1) == sp
    assert convert.ENGINE_PRIORITY[req.priority] == 2
    for other in (
        SamplingParams(structured=StructuredOutput(choice=("a", "b"))),
        SamplingParams(structured=StructuredOutput(json_object=True)),
        SamplingParams(min_tokens=2, temperature=0.0),
        SamplingParams(include_stop_str_in_output=True, skip_special_tokens=False, stop=("c",)),
    ):
        assert (
            convert.sampling_params(generate_request(EngineRequest("c", [1], other)), 16) == other
        )


def test_router_http_bench_runs():
    from benchmarks.router_http_bench import measure

    figures = measure(requests=3, max_tokens=4, step_s=0.0)
    assert set(figures) == {"replica_http", "router_http", "router_grpc"}
    assert all(0 < f["median_ms"] <= f["p90_ms"] for f in figures.values())


def test_http_clients_authenticate_at_the_router_which_presents_its_own_key():
    from serving.frontend.tenants import TenantRegistry

    workers_tenants = TenantRegistry.from_dict(
        {"tenants": [{"name": "router", "api_keys": ["k-r"]}]}
    )
    clients = TenantRegistry.from_dict({"tenants": [{"name": "acme", "api_keys": ["k-acme"]}]})
    with running_server(MockEngine(), tenants=workers_tenants, capacity_probe=False) as (w, _):
        router = Router(
            [f"127.0.0.1:{w.port}"],
            http_port=0,
            tokenizer=ByteTokenizer(),
            tenants=clients,
            worker_api_key="k-r",
        ).start()
        try:
            url = f"http://127.0.0.1:{router.http_port}/v1"
            client = openai.OpenAI(base_url=url, api_key="k-acme", max_retries=0)
            assert client.completions.create(model="mock", prompt="abc", max_tokens=2).choices[
                0
            ].text == expected_text("abc", 2)
            stranger = openai.OpenAI(base_url=url, api_key="k-r", max_retries=0)
            with pytest.raises(openai.AuthenticationError):  # the workers' key is not a client's
                stranger.completions.create(model="mock", prompt="abc", max_tokens=2)
            assert calls_seen(w) == 1
        finally:
            router.stop(0)
        wrong_key = Router(
            [f"127.0.0.1:{w.port}"], http_port=0, tokenizer=ByteTokenizer(), worker_api_key="k-x"
        )
        with pytest.raises(RouterHttpError, match="UNAUTHENTICATED"):
            wrong_key.start()
        wrong_key.stop(0)


ROUTED_CALLS = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
)
ROUTED_TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_time")
]


def test_tool_calls_through_the_router_equal_the_worker():
    """A chat with tools through the router. Its gRPC front relays the tools fields to the
    worker and the worker's call deltas back (name-first ToolCall deltas, folded by the
    client into the same calls); its HTTP front splits the output itself and streams the
    same calls name-first, as the worker's own HTTP API does."""
    from serving.client import GenerateClient
    from serving.engine_host.scripted_engine import ScriptedEngine
    from serving.proto import pagedjax_pb2 as pb

    engine = ScriptedEngine(lambda prompt: ROUTED_CALLS, step_time_s=0.002)
    req = pb.GenerateRequest(max_tokens=400, stream=True)
    req.chat.messages.add(role="user", content="Weather and time?")
    for t in ROUTED_TOOLS:
        req.tools.add(type="function", function={"name": t["function"]["name"]})
    with running_server(engine, capacity_probe=False, http_port=0) as (worker, direct):
        router = Router(
            [f"127.0.0.1:{worker.port}"], http_port=0, tokenizer=ByteTokenizer()
        ).start()
        try:
            with GenerateClient(f"127.0.0.1:{router.port}") as via:
                routed_msgs = list(via.stream(req))
                routed_res = via.generate_request(req)
            own = direct.generate_request(req)
            ask = dict(
                model="mock", messages=[{"role": "user", "content": "hi"}], tools=ROUTED_TOOLS
            )
            answers = {}
            for name, port in (("worker", worker.http_port), ("router", router.http_port)):
                sdk = openai.OpenAI(
                    base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
                )
                with sdk.chat.completions.stream(**ask) as s:
                    final = s.get_final_completion().choices[0]
                answers[name] = (
                    final.message.content,
                    [(c.function.name, c.function.arguments) for c in final.message.tool_calls],
                    final.finish_reason,
                )
        finally:
            router.stop(0)
    want = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')]
    for res in (own, routed_res):
        assert res.ok and res.finish_reason == "tool_calls", res.details
        assert res.content == "Checking."
        assert [(c.name, c.arguments) for c in res.tool_calls] == want
    heads = [c for m in routed_msgs for c in m.tool_calls if c.id]
    assert [(c.index, c.name, c.arguments) for c in heads] == [
        (0, want[0][0], ""),
        (1, want[1][0], ""),
    ]
    assert answers["router"] == answers["worker"] == ("Checking.", want, "tool_calls")
