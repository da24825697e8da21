"""Tools and reasoning over gRPC, parity with the HTTP API: one real server serves both, its
engine replaying recorded model outputs byte by byte (ScriptedEngine: every tag streams split
across tokens). For the same conversation the gRPC Generate call (streamed and not) and the
openai SDK's chat completion give the same content, reasoning, calls and finish reason, and
the model sees the same prompt. Bad tools fields are INVALID_ARGUMENT naming the field. On
the tiny model (marked compile), tool_choice required through gRPC gives a call that
validates against its schema: the call grammar reaches the engine."""

import json

import jsonschema
import openai
import pytest

from configs.engine_config import EngineConfig
from serving.engine_host.scripted_engine import ScriptedEngine
from serving.frontend.admission import AdmissionConfig
from serving.proto import pagedjax_pb2 as pb
from serving.testing import running_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC"]}}}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'  # noqa: E501
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
MALFORMED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n" + CALL
REPLIES = {"TWO": TWO_CALLS, "MALFORMED": MALFORMED, "THINK": THOUGHT, "WEATHER": "Hm.\n" + CALL}


def _reply(prompt: str) -> str:
    if "<tool_response>" in prompt:
        return "It is sunny."
    last_user = prompt.rsplit("<user>", 1)[-1]
    return next((r for k, r in REPLIES.items() if k in last_user), "Plain answer.")


def pb_tools(tools=TOOLS) -> list[pb.Tool]:
    return [
        pb.Tool(
            type="function",
            function=pb.FunctionDefinition(
                name=t["function"]["name"],
                description=t["function"].get("description", ""),
                parameters=json.dumps(t["function"]["parameters"]),
            ),
        )
        for t in tools
    ]


def chat_request(messages, **fields) -> pb.GenerateRequest:
    req = pb.GenerateRequest(**{"max_tokens": 512, **fields})
    for m in messages:
        calls = [
            pb.ToolCall(
                id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"]
            )
            for c in m.get("tool_calls") or ()
        ]
        req.chat.messages.add(
            role=m["role"],
            content=m.get("content") or "",
            tool_calls=calls,
            tool_call_id=m.get("tool_call_id", ""),
        )
    return req


@pytest.fixture(scope="module")
def served():
    engine = ScriptedEngine(_reply)
    admission = AdmissionConfig(max_prompt_tokens=3000, max_tokens=512, max_model_len=4096)
    with running_server(engine, admission=admission, http_port=0, reasoning_parser="qwen3") as (
        server,
        client,
    ):
        sdk = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0
        )
        yield engine, client, sdk


def _ask(text):
    return [{"role": "user", "content": text}]


def _grpc(client, messages, stream, **fields):
    res = client.generate_request(chat_request(messages, stream=stream, **fields))
    assert res.ok, (res.code, res.details)
    return res


@pytest.mark.parametrize("ask", ["WEATHER", "TWO", "MALFORMED", "THINK", "hello"])
def test_grpc_splits_the_output_as_the_http_api_does(served, ask):
    engine, client, sdk = served
    http = sdk.chat.completions.create(model="mock", messages=_ask(ask), tools=TOOLS)
    want_msg, want_finish = http.choices[0].message, http.choices[0].finish_reason
    want_calls = [(c.function.name, c.function.arguments) for c in want_msg.tool_calls or ()]
    http_prompt = engine.prompts[-1]
    for stream in (False, True):
        res = _grpc(client, _ask(ask), stream, tools=pb_tools())
        assert res.text == REPLIES.get(ask, "Plain answer.")  # `text` stays the raw output
        assert res.content == (want_msg.content or "")
        assert res.reasoning_content == (want_msg.reasoning_content or "")
        assert [(c.name, c.arguments) for c in res.tool_calls] == want_calls
        assert res.finish_reason == want_finish
        assert res.reasoning_tokens == http.usage.completion_tokens_details.reasoning_tokens
        assert engine.prompts[-1] == http_prompt  # the model saw the same prompt
        assert [c.index for c in res.tool_calls] == list(range(len(want_calls)))
        assert all(c.id.startswith("call_") and c.type == "function" for c in res.tool_calls)
    if want_calls:
        assert want_finish == "tool_calls"
        jsonschema.validate(json.loads(want_calls[0][1]), WEATHER)


def test_a_streamed_call_arrives_whole_in_one_message(served):
    _, client, _ = served
    msgs = list(client.stream(chat_request(_ask("TWO"), stream=True, tools=pb_tools())))
    with_calls = [m for m in msgs if m.tool_calls]
    assert [c.name for m in with_calls for c in m.tool_calls] == ["get_weather", "get_time"]
    assert all("<tool_call>" not in m.content for m in msgs)
    assert msgs[-1].final.finish_reason == "tool_calls"


def test_history_with_calls_and_results_gives_the_http_prompt(served):
    engine, client, sdk = served
    history = [
        {"role": "user", "content": "WEATHER in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]
    r = sdk.chat.completions.create(model="mock", messages=history, tools=TOOLS)
    http_prompt = engine.prompts[-1]
    res = _grpc(client, history, False, tools=pb_tools())
    assert engine.prompts[-1] == http_prompt
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in http_prompt
    assert res.content == r.choices[0].message.content == "It is sunny."
    assert res.finish_reason == "stop" and not res.tool_calls


def test_tool_choice_none_and_plain_prompts(served):
    engine, client, _ = served
    none = _grpc(
        client, _ask("WEATHER"), False, tools=pb_tools(), tool_choice=pb.ToolChoice(mode="none")
    )
    assert none.content == "Hm.\n" + CALL and not none.tool_calls and none.finish_reason == "stop"
    text = client.generate("WEATHER", max_tokens=512)  # a text prompt: never split
    assert text.ok and text.content == "" and not text.tool_calls


def _refused(client, req) -> str:
    res = client.generate_request(req)
    assert res.code == "INVALID_ARGUMENT", (res.code, res.details)
    return res.details


def _tool(name="f", parameters="{}"):
    return pb.Tool(function=pb.FunctionDefinition(name=name, parameters=parameters))


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(tools=[_tool(parameters="{not json")]), "tools[0].function.parameters"),
        (dict(tools=[_tool(parameters='{"type": "array"}')]), "tools[0].function.parameters"),
        (dict(tools=[_tool(name="a b")]), "tools[0].function.name"),
        (dict(tools=[_tool(), _tool()]), "tools[1].function.name"),
        (dict(tools=[pb.Tool(type="web_search")]), "tools[0].type"),
        (dict(tools=[_tool()], tool_choice=pb.ToolChoice(mode="always")), "tool_choice"),
        (
            dict(tools=[_tool()], tool_choice=pb.ToolChoice(function=pb.FunctionName(name="g"))),
            "tool_choice.function.name",
        ),
        (dict(tool_choice=pb.ToolChoice(mode="required")), "tool_choice"),
        (dict(chat_template_kwargs="[1]"), "chat_template_kwargs"),
        (dict(chat_template_kwargs='{"tools": 1}'), "chat_template_kwargs.tools"),
        (dict(max_thinking_tokens=-1), "max_thinking_tokens"),
        (dict(tools=[_tool(parameters=" " * 300_000)]), "tools"),  # bounded before rendering
    ],
)
def test_bad_tool_fields_name_the_field(served, fields, field):
    _, client, _ = served
    details = _refused(client, chat_request(_ask("hi"), **fields))
    assert details.startswith(f"{field}="), details


def test_tools_need_a_chat_prompt_and_history_arguments_must_be_json(served):
    _, client, _ = served
    details = _refused(client, pb.GenerateRequest(text="hi", tools=[_tool()]))
    assert details.startswith("tools=") and "chat prompt" in details
    bad = [
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}],
        }
    ]  # noqa: E501
    details = _refused(client, chat_request(bad, tools=[_tool()]))
    assert details.startswith("chat.messages[0].tool_calls[0].arguments="), details


@pytest.mark.compile
def test_required_on_the_tiny_model_gives_a_valid_call(tiny_model):
    """Real constrained decoding behind gRPC: the random model's call parses and validates."""
    from engine.core import EngineCore

    config = EngineConfig(
        model="tiny", page_size=16, num_pages=256, max_num_seqs=4, max_model_len=2048
    )
    admission = AdmissionConfig(max_prompt_tokens=1800, max_tokens=200, max_model_len=2048)
    engine = EngineCore(tiny_model, config)
    with running_server(engine, admission=admission, capacity_probe=False) as (_, client):
        req = chat_request(
            _ask("Weather in Paris?"),
            tools=pb_tools(),
            tool_choice=pb.ToolChoice(function=pb.FunctionName(name="get_weather")),
            parallel_tool_calls=False,
            sampling=pb.SamplingParams(temperature=1.0, seed=3),
            max_tokens=200,
        )
        res = client.generate_request(req)
    assert res.ok, res.details
    assert res.finish_reason == "tool_calls" and len(res.tool_calls) == 1, res.text
    assert res.tool_calls[0].name == "get_weather"
    jsonschema.validate(json.loads(res.tool_calls[0].arguments), WEATHER)
