"""Notebook parity of tools and reasoning: `LLM.chat(messages, tools=..., tool_choice=...)`
checks, renders, constrains and parses as the HTTP API does (engine/chat/). On the random
`tiny` model (its template has no tool support: the fallback instructions show the tools),
tool_choice required / named gives calls that parse and validate with jsonschema, each
completion's calls are what the HTTP parser finds in its text, and the history's calls and
tool results reach the prompt. The SmolLM2 twin runs in `make test-full-sizes`."""

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.chat.call_stream import parse
from engine.chat.tool_parsers import get_format
from engine.errors import InvalidRequestError
from tests.conftest import FULL_SIZES_ONLY

pytestmark = pytest.mark.compile  # a tiny engine with a 2048-token context

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "enum": ["UTC", "Europe/Paris"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SAMPLED = SamplingParams(temperature=1.0, seed=3, max_tokens=200, n=4)


@pytest.fixture(scope="module")
def llm(tiny_model):
    # the fallback tool instructions are ~900 byte tokens: a long context for the tiny model
    return LLM(
        tiny_model,
        num_pages=512,
        page_size=16,
        max_num_seqs=8,
        max_model_len=2048,
        reasoning_parser="qwen3",
    )


def _check_calls(c, names=SCHEMAS):
    assert c.finish_reason == "tool_calls", c.text
    assert c.tool_calls and c.content is None, c.text
    for call in c.tool_calls:
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    # the HTTP API's parser finds the same calls in the same text (name-first: a grammar held them)
    content, parsed = parse(get_format("hermes"), c.text, incremental=True)
    assert [(p.name, p.arguments) for p in parsed] == [(t.name, t.arguments) for t in c.tool_calls]
    assert c.message["tool_calls"] == [t.openai() for t in c.tool_calls]


def test_required_gives_calls_that_validate(llm):
    (out,) = llm.chat(ASK, SAMPLED, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(out.outputs) == 4
    for c in out.outputs:
        _check_calls(c)
        assert len(c.tool_calls) == 1  # parallel_tool_calls=False: exactly one
    assert "get_weather" in out.prompt and "<tools>" in out.prompt  # the fallback rendering


def test_a_named_function_is_the_only_one_called(llm):
    named = {"type": "function", "function": {"name": "get_time"}}
    (out,) = llm.chat(ASK, SAMPLED, tools=TOOLS, tool_choice=named)
    for c in out.outputs:
        _check_calls(c, names={"get_time"})


def test_plain_chat_and_tool_choice_none_are_not_split_into_calls(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (plain,) = llm.chat(ASK, greedy)
    (none,) = llm.chat(ASK, greedy, tools=TOOLS, tool_choice="none")
    assert none.outputs[0].tool_calls == [] and none.finish_reason == "length"
    assert none.outputs[0].content == none.text  # all content (no <think> at its start)
    assert plain.outputs[0].reasoning_content is None and "<tools>" not in plain.prompt


def test_history_calls_and_tool_results_reach_the_prompt(llm):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    (out,) = llm.chat(history, greedy, tools=TOOLS)
    assert '{"name": "get_time", "arguments": {"tz": "UTC"}}' in out.prompt
    assert "<tool_response>\n12:00\n</tool_response>" in out.prompt
    bad = [
        *history[:1],
        {**history[1], "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
    ]
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\[1\].tool_calls\[0\]"):
        llm.chat(bad, greedy, tools=TOOLS)


def test_bad_tools_are_refused_naming_the_field(llm):
    with pytest.raises(InvalidRequestError, match="tool_choice.function.name"):
        llm.chat(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(InvalidRequestError, match=r"tools\[0\].function.name"):
        llm.chat(ASK, tools=[{"type": "function", "function": {"name": "a b"}}])
    with pytest.raises(InvalidRequestError, match="tool_choice"):
        llm.chat(ASK, tools=TOOLS, tool_choice="sometimes")
    with pytest.raises(ValueError, match="tool"):
        LLM("tiny", tool_call_parser="nope")  # refused before loading


def test_reasoning_is_split_from_the_answer(llm):
    """With a thinking budget the output opens a thought; it goes to reasoning_content."""
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=24)
    (out,) = llm.chat(ASK, params, max_thinking_tokens=4)
    c = out.outputs[0]
    assert c.text.startswith("<think>") and "</think>" in c.text, c.text
    thought = c.text[len("<think>") : c.text.index("</think>")]
    assert c.reasoning_content == thought and c.message["reasoning_content"] == thought
    assert "<think>" not in (c.content or "")


@pytest.mark.slow
@FULL_SIZES_ONLY  # ~3 min of SmolLM2 compiles; the tiny twins above and the HTTP path's
# SmolLM2 test (tests/test_tools_smollm2.py) run in `make test`
def test_smollm2_required_calls_validate(smollm2):
    llm = LLM(smollm2, num_pages=256, page_size=16, max_num_seqs=8, max_model_len=1024)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=64, n=4)
    # one call each: left free, SmolLM2 goes on calling until max_tokens
    (out,) = llm.chat(ASK, params, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    for c in out.outputs:
        _check_calls(c)
