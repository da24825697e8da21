"""Tool calling and reasoning over the chat-completions API, driven by the official `openai`
SDK against a real server whose engine replies with recorded model outputs (ScriptedEngine:
one token per byte, so every tag streams split across tokens)."""

import json

import httpx
import jsonschema
import openai
import pytest

from engine.chat.setup import ChatOptions
from engine.chat.tool_parsers import get_format
from engine.structured.matcher import StructuredRequests
from models.chat_template import ChatTemplate
from models.registry import tiny_tokenizer
from serving.engine_host.scripted_engine import ScriptedEngine
from serving.frontend.admission import AdmissionConfig
from serving.http.chat import chat_setup
from serving.testing import running_server

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
]
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
MALFORMED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
THOUGHT = "<think>\nThe user wants a greeting.\n</think>\n\nHello there!"


def _reply(prompt: str) -> str:
    """The recorded output for a prompt (keyed by the last user turn's marker)."""
    if "<tool_response>" in prompt:
        return "It is sunny in Paris."
    last_user = prompt.rsplit("<user>", 1)[-1]
    for key, reply in (
        ("TWO", TWO_CALLS),
        ("MALFORMED", MALFORMED),
        ("THINK", THOUGHT),
        ("WEATHER", "Let me check.\n" + CALL),
    ):
        if key in last_user:
            return reply
    return "Plain answer."


@pytest.fixture(scope="module")
def served():
    engine = ScriptedEngine(_reply)
    admission = AdmissionConfig(max_prompt_tokens=3000, max_tokens=512, max_model_len=4096)
    with running_server(engine, admission=admission, http_port=0, reasoning_parser="qwen3") as (
        server,
        _,
    ):
        sdk = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0
        )
        yield server, engine, sdk


def _ask(text):
    return [{"role": "user", "content": text}]


def test_a_call_comes_back_as_tool_calls_with_content_apart(served):
    _, _, sdk = served
    r = sdk.chat.completions.create(model="mock", messages=_ask("WEATHER?"), tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)


def _stream(sdk, messages, **kwargs):
    chunks = list(
        sdk.chat.completions.create(model="mock", messages=messages, stream=True, **kwargs)
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, dict] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            if tc.index not in calls:  # OpenAI's first delta of a call
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index]["arguments"] += tc.function.arguments or ""
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    return chunks, content, list(calls.values()), finish


def test_streamed_calls_equal_the_non_streamed_ones(served):
    _, _, sdk = served
    for ask in ("TWO", "WEATHER"):
        full = sdk.chat.completions.create(model="mock", messages=_ask(ask), tools=TOOLS)
        chunks, content, calls, finish = _stream(sdk, _ask(ask), tools=TOOLS)
        assert finish == ["tool_calls"]
        assert content == (full.choices[0].message.content or "")
        assert "<tool_call>" not in content and "</tool_call>" not in content
        want = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
        assert [(c["name"], c["arguments"]) for c in calls] == want
        for c in calls:
            json.loads(c["arguments"])
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_SCHEMA)


def test_the_sdk_stream_helper_accumulates_our_deltas(served):
    _, _, sdk = served
    with sdk.chat.completions.stream(model="mock", messages=_ask("TWO"), tools=TOOLS) as s:
        final = s.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].function.arguments) == {"tz": "UTC"}


def _replies(parser: str) -> dict[str, str]:
    """Recorded outputs in `parser`'s syntax: two calls after text, a call that breaks after
    its name, an object that is no call (llama3_json: '{' opening the output)."""
    fmt = get_format(parser)
    two = fmt.render(
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "UTC"})]
    )
    lead = "Let me check." + (fmt.start if fmt.bare_json_start else "")
    if parser == "llama3_json":
        broken = '{"name": "get_weather", "parameters": {"city": }'
    else:
        broken = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }'
    return {"TWO": lead + two, "BROKEN": broken, "NOCALL": '{"location": "Paris"}'}


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_auto_calls_of_every_format_stream_name_first(parser):
    """auto is held by a lazy grammar for every format (engine/chat/tool_parsers.py), so
    llama3_json and mistral calls stream as hermes' do: each call's first delta carries its
    name, then its arguments come in later deltas, equal to the non-streamed answer; no
    markup reaches content. A call that
    breaks after its name stays a call (OpenAI gives a cut-off call so); text that never
    named a call is content, finish_reason stop."""
    replies = _replies(parser)

    def reply(prompt: str) -> str:
        last_user = prompt.rsplit("<user>", 1)[-1]
        return next((v for k, v in replies.items() if k in last_user), "Plain answer.")

    engine = ScriptedEngine(reply)
    with running_server(engine, http_port=0, tool_call_parser=parser) as (server, _):
        sdk = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0
        )
        full = sdk.chat.completions.create(model="mock", messages=_ask("TWO"), tools=TOOLS)
        chunks, content, calls, finish = _stream(sdk, _ask("TWO"), tools=TOOLS)
        assert full.choices[0].message.content == content == "Let me check."
        want = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
        assert [(c["name"], c["arguments"]) for c in calls] == want
        assert [n for n, _ in want] == ["get_weather", "get_time"] and finish == ["tool_calls"]
        jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_SCHEMA)
        fragments = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert fragments[0].function.name == "get_weather" and not fragments[0].function.arguments
        # (the mock's steps outrun the client: the relay joins a call's fragments in a chunk)
        assert all(f.function.name is None for f in fragments[1:] if f.index == 0)
        r = sdk.chat.completions.create(model="mock", messages=_ask("BROKEN"), tools=TOOLS)
        (call,) = r.choices[0].message.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": }')
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        _, content, calls, finish = _stream(sdk, _ask("BROKEN"), tools=TOOLS)
        assert (content, finish) == ("", ["tool_calls"])
        assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": }')]
        r = sdk.chat.completions.create(model="mock", messages=_ask("NOCALL"), tools=TOOLS)
        assert r.choices[0].message.content == replies["NOCALL"]
        assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
        _, content, calls, finish = _stream(sdk, _ask("NOCALL"), tools=TOOLS)
        assert (content, calls, finish) == (replies["NOCALL"], [], ["stop"])


def test_a_call_announced_under_a_grammar_stays_a_call(served):
    """hermes' auto is held by the lazy call grammar, so calls stream name-first; the scripted
    engine ignores grammars and writes a call that breaks after its name: it stays a call,
    the rest of its section its arguments as written (OpenAI gives a cut-off call so), and
    nothing of the markup reaches content, streamed or not."""
    _, _, sdk = served
    r = sdk.chat.completions.create(model="mock", messages=_ask("MALFORMED"), tools=TOOLS)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": \n')
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    _, content, calls, finish = _stream(sdk, _ask("MALFORMED"), tools=TOOLS)
    assert (content, finish) == ("", ["tool_calls"])
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": \n')]


def test_tool_choice_none_leaves_the_output_as_content(served):
    _, _, sdk = served
    r = sdk.chat.completions.create(
        model="mock", messages=_ask("WEATHER"), tools=TOOLS, tool_choice="none"
    )
    assert r.choices[0].message.content == "Let me check.\n" + CALL
    assert r.choices[0].finish_reason == "stop"


def test_history_with_calls_and_results_reaches_the_model(served):
    """SmolLM2-like template without tool support (the mock's): the fallback rendering puts
    the tools, the earlier call and its result into the prompt; nothing is dropped."""
    _, engine, sdk = served
    messages = [
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
    r = sdk.chat.completions.create(model="mock", messages=messages, tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert r.choices[0].finish_reason == "stop"
    prompt = engine.prompts[-1]
    assert prompt.startswith("<system># Tools") and '"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in prompt


def test_reasoning_content_and_reasoning_tokens(served):
    _, _, sdk = served
    r = sdk.chat.completions.create(model="mock", messages=_ask("THINK"))
    msg = r.choices[0].message
    assert msg.content == "Hello there!"
    assert msg.reasoning_content == "\nThe user wants a greeting.\n"
    thought_bytes = len(THOUGHT.split("</think>")[0].encode()) + len("</think>")
    assert r.usage.completion_tokens_details.reasoning_tokens == thought_bytes
    chunks = list(
        sdk.chat.completions.create(
            model="mock",
            messages=_ask("THINK"),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (
        msg.reasoning_content
    )
    assert "".join(d.content or "" for d in deltas) == "Hello there!"
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thought_bytes
    plain = sdk.chat.completions.create(model="mock", messages=_ask("hi"))
    assert plain.choices[0].message.content == "Plain answer."
    assert plain.choices[0].message.reasoning_content is None


@pytest.mark.parametrize(
    "extra,param,words",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", ["nope", "get_weather"]),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", ["web_search", "function"]),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": 5}}}]},
         "tools[0].function.parameters", ["not a valid JSON Schema"]),
        ({"tool_choice": "required"}, "tool_choice", ["needs tools"]),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ["sometimes"]),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", ["unique"]),
        ({"tools": TOOLS, "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice", ["response_format"]),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", ["request"]),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400_naming_field_and_value(served, extra, param, words):
    server, _, _ = served
    body = {"model": "mock", "messages": _ask("hi"), **extra}
    r = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err["param"] or "") + err["message"], err
    for w in words:
        assert w in err["message"], err


# ---- the model's own template receives the tools --------------------------------------------
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


class _TemplateOnly:
    def __init__(self, text):
        self.chat_template = ChatTemplate(text)


class _Body:
    tools = None
    tool_choice = None
    parallel_tool_calls = None
    chat_template_kwargs = None

    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_a_template_with_tool_support_renders_tools_and_calls_itself():
    from serving.http.chat import message_dicts
    from serving.http.schemas import ChatCompletionRequest

    options = ChatOptions.for_tokenizer(_TemplateOnly(QWEN_LIKE))
    assert options.tool_format.name == "hermes" and options.template_renders_tools
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": TOOLS,
        }
    )  # fmt: skip
    setup = chat_setup(options, req)
    messages, kwargs = setup.render_inputs(message_dicts(req.messages))
    assert [t["function"]["name"] for t in kwargs["tools"]] == ["get_weather", "get_time"]
    text = ChatTemplate(QWEN_LIKE).render(messages, **kwargs)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert '"description": "Current weather in a city"' in text


def test_chat_template_kwargs_reach_the_template():
    template = ChatTemplate(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>{% endif %}"
    )
    setup = chat_setup(
        ChatOptions.for_tokenizer(object()), _Body(chat_template_kwargs={"enable_thinking": False})
    )
    messages, kwargs = setup.render_inputs([{"role": "user", "content": "hi"}])
    assert template.render(messages, **kwargs) == "hi<think>\n\n</think>"


def test_forced_call_grammar_accepts_only_valid_calls():
    """The grammar of tool_choice=named, checked with llguidance on whole strings."""
    setup = chat_setup(
        ChatOptions.for_tokenizer(object()),
        _Body(
            tools=[openai_tool(t) for t in TOOLS],
            tool_choice=_Named("get_weather"),
            parallel_tool_calls=False,
        ),
    )
    ok = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    assert _matches(setup, ok) and not _matches(setup, bad)


def _matches(setup, text: str) -> bool:
    """The tiny model's byte tokenizer walks `text` through the compiled call grammar."""
    tokenizer = tiny_tokenizer()
    reqs = StructuredRequests(tokenizer, 512)
    m = reqs.compile(setup.tools.constraint(get_format("hermes")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(m.consume_token(t) for t in ids) and m.is_accepting()


class _Named:
    def __init__(self, name):
        self.name = name

    def model_dump(self):
        return {"type": "function", "function": {"name": self.name}}


class openai_tool:  # noqa: N801 - stands in for the pydantic Tool
    def __init__(self, d):
        self.d = d

    def model_dump(self, exclude_none=True):
        return self.d


@pytest.mark.parametrize("name", ["hermes", "mistral"])
def test_auto_grammar_is_free_text_until_the_trigger_then_a_valid_call(name):
    fmt = get_format(name)
    setup = chat_setup(
        ChatOptions.for_tokenizer(object(), tool_call_parser=name),
        _Body(tools=[openai_tool(t) for t in TOOLS]),
    )
    grammar = setup.tools.constraint(fmt)
    good = fmt.render([("get_weather", {"city": "Paris"})])
    assert _walk(grammar, "Plain text, even <tool or [TOOL_ half tags.") == "accepted"
    assert _walk(grammar, "Let me check. " + good) == "accepted"
    assert _walk(grammar, "Let me check. " + fmt.render([("nope", {})])) == "refused"
    assert _walk(grammar, fmt.render([("get_weather", {"town": 1})])) == "refused"


def _walk(constraint, text: str) -> str:
    tokenizer = tiny_tokenizer()
    m = StructuredRequests(tokenizer, 512).compile(constraint)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not all(m.consume_token(t) for t in ids):
        return "refused"
    return "accepted" if m.is_accepting() else "incomplete"
