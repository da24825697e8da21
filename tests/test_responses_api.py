"""The Responses API (POST /v1/responses) driven by the official `openai` SDK against a real
server replying with recorded outputs (ScriptedEngine), and the OpenAI Agents SDK running
an agent loop with two function tools against both our chat-completions and our Responses
endpoints (the protocol is asserted: calls made, outputs consumed, a final message)."""

import asyncio
import json

import httpx
import openai
import pytest

from serving.engine_host.scripted_engine import ScriptedEngine
from serving.frontend.admission import AdmissionConfig
from serving.frontend.tenants import TenantPolicy, TenantRegistry
from serving.testing import running_server

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]


def _reply(prompt: str) -> str:
    if prompt.count("<tool_response>") >= 2:
        return "Sunny in Paris at noon UTC."
    if "<tool_response>" in prompt:
        return TIME_CALL if "AGENT" in prompt else "It is sunny in Paris."
    if "THINK" in prompt:
        return "<think>\nThey want weather.\n</think>\n\n" + CALL
    if "WEATHER" in prompt or "AGENT" in prompt:
        return "Checking.\n" + CALL
    return "Hello from the mock."


@pytest.fixture(scope="module")
def served():
    engine = ScriptedEngine(_reply)
    tenants = TenantRegistry(
        {"a": TenantPolicy("a"), "b": TenantPolicy("b")},
        api_keys={"key-a": "a", "key-b": "b"},
        allow_anonymous=False,
    )
    admission = AdmissionConfig(max_prompt_tokens=3000, max_tokens=512, max_model_len=4096)
    with running_server(
        engine, tenants=tenants, admission=admission, http_port=0, reasoning_parser="qwen3"
    ) as (server, _):
        yield server, engine


def _sdk(server, key="key-a", cls=openai.OpenAI):
    url = f"http://127.0.0.1:{server.http_port}/v1"
    return cls(base_url=url, api_key=key, max_retries=0)


def test_text_in_text_out_with_usage(served):
    server, _ = served
    r = _sdk(server).responses.create(model="mock", input="hi", instructions="Be brief.")
    assert r.status == "completed" and r.output_text == "Hello from the mock."
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.output_tokens == len("Hello from the mock.") + 1  # + EOS
    assert r.id.startswith("resp_")


def test_function_call_then_output_with_previous_response_id(served):
    server, engine = served
    sdk = _sdk(server)
    first = sdk.responses.create(model="mock", input="WEATHER in Paris?", tools=TOOLS)
    kinds = [item.type for item in first.output]
    assert kinds == ["message", "function_call"]
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    second = sdk.responses.create(
        model="mock",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=TOOLS,
    )
    assert second.output_text == "It is sunny in Paris."
    prompt = engine.prompts[-1]  # the stored conversation, then the tool's output
    assert "WEATHER in Paris?" in prompt and '"name": "get_weather"' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert sdk.responses.retrieve(second.id).output_text == "It is sunny in Paris."


def test_stored_responses_are_tenant_scoped_and_store_false_keeps_nothing(served):
    server, _ = served
    mine = _sdk(server, "key-a").responses.create(model="mock", input="hi")
    with pytest.raises(openai.BadRequestError) as e:
        _sdk(server, "key-b").responses.create(
            model="mock", input="hi", previous_response_id=mine.id
        )
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        _sdk(server, "key-b").responses.retrieve(mine.id)
    unstored = _sdk(server).responses.create(model="mock", input="hi", store=False)
    with pytest.raises(openai.BadRequestError):
        _sdk(server).responses.create(model="mock", input="hi", previous_response_id=unstored.id)


def test_streamed_events_follow_the_documented_sequence(served):
    server, _ = served
    events = list(
        _sdk(server).responses.create(
            model="mock", input="THINK about WEATHER", tools=TOOLS, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == ["reasoning", "function_call"] == [i.type for i in done]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"} and done[1].arguments == args
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "\nThey want weather.\n"
    final = events[-1].response
    assert [i.id for i in final.output] == [i.id for i in done]
    assert final.usage.output_tokens_details.reasoning_tokens > 0
    text_events = list(_sdk(server).responses.create(model="mock", input="hi", stream=True))
    order = [e.type for e in text_events if "text" in e.type or "part" in e.type]
    assert order[0] == "response.content_part.added"
    assert order[-2:] == ["response.output_text.done", "response.content_part.done"]
    text = "".join(e.delta for e in text_events if e.type == "response.output_text.delta")
    assert text == "Hello from the mock."


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type", ["web_search_preview"]),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type",
         ["file_search"]),
        ({"tools": [{"type": "computer_use_preview"}]}, "tools[0].type", ["computer_use"]),
        ({"conversation": "conv_1"}, "conversation", ["unsupported field"]),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", ["item_reference"]),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice.function.name", ["nope"]),
    ],
)  # fmt: skip
def test_unsupported_requests_are_400_naming_them(served, body, param, words):
    server, _ = served
    r = httpx.post(
        f"http://127.0.0.1:{server.http_port}/v1/responses",
        json={"model": "mock", "input": "hi", **body},
        headers={"Authorization": "Bearer key-a"},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err["param"] or "") + err["message"], err
    for w in words:
        assert w in err["message"], err


# ---- the OpenAI Agents SDK ------------------------------------------------------------------
def _agent_run(server, responses: bool):
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    seen: list[tuple[str, dict]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(("get_weather", {"city": city}))
        return "sunny"

    @function_tool
    def get_time(tz: str) -> str:
        """The time in a time zone."""
        seen.append(("get_time", {"tz": tz}))
        return "12:00"

    client = _sdk(server, cls=openai.AsyncOpenAI)
    model_cls = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    agent = Agent(
        name="weather",
        instructions="Answer with the tools.",
        model=model_cls(model="mock", openai_client=client),
        tools=[get_weather, get_time],
        # forces the first call; the SDK resets it after a tool use so the loop can end
        model_settings=ModelSettings(tool_choice="get_weather"),
    )
    result = asyncio.run(Runner.run(agent, "AGENT: weather and time in Paris?", max_turns=6))
    return result, seen


@pytest.mark.parametrize("responses", [False, True], ids=["chat_completions", "responses"])
def test_agents_sdk_runs_a_tool_loop_to_a_final_message(served, responses):
    pytest.importorskip("agents")
    server, engine = served
    start = len(engine.prompts)
    result, seen = _agent_run(server, responses)
    assert seen == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    assert result.final_output == "Sunny in Paris at noon UTC."
    prompts = engine.prompts[start:]
    assert len(prompts) == 3  # call, call, answer: each tool output went back to the model
    assert "<tool_response>\nsunny\n</tool_response>" in prompts[1]
    assert "<tool_response>\n12:00\n</tool_response>" in prompts[2]


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_llama3_json_and_mistral_calls_stream_as_function_call_events(parser):
    """auto holds every format's calls with a lazy grammar, so the Responses API streams
    llama3_json and mistral calls as hermes': the function_call item (with its name) is added
    before its argument deltas, which concatenate to the done item's arguments."""
    from engine.chat.tool_parsers import get_format

    fmt = get_format(parser)
    call = fmt.render([("get_weather", {"city": "Paris"})])
    reply = "Checking." + (fmt.start if fmt.bare_json_start else "") + call
    engine = ScriptedEngine(lambda prompt: reply if "WEATHER" in prompt else "Hello.")
    with running_server(engine, http_port=0, tool_call_parser=parser) as (server, _):
        sdk = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0
        )
        events = list(
            sdk.responses.create(model="mock", input="WEATHER?", tools=TOOLS, stream=True)
        )
        whole = sdk.responses.create(model="mock", input="WEATHER?", tools=TOOLS)
    kinds = [e.type for e in events]
    added = next(
        e
        for e in events
        if e.type == "response.output_item.added" and e.item.type == "function_call"
    )
    assert added.item.name == "get_weather"
    first_delta = kinds.index("response.function_call_arguments.delta")
    assert events.index(added) < first_delta
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["message", "function_call"]
    assert json.loads(args) == {"city": "Paris"} and done[1].arguments == args
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Checking."
    assert [i.type for i in whole.output] == ["message", "function_call"]
    assert whole.output[1].arguments == args and whole.output_text == "Checking."
