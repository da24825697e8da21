"""Tool-call parsers and the reasoning splitter on model outputs in each family's format:
the whole output parsed at once, and the same output fed one character at a time (every
tag split across deltas) give the same content, calls and reasoning. Incremental (name-first)
reading: every split of every output gives the same calls, each announced before any of its
arguments, the fragments concatenating to the arguments, no markup in content."""

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.chat.call_stream import ToolCallStream, parse
from engine.chat.output import ChatOutput
from engine.chat.reasoning import ReasoningStream, get_reasoning_format, split
from engine.chat.setup import call_schema
from engine.chat.tool_parsers import format_for_template, get_format

WEATHER = {"city": "Paris", "unit": "celsius"}

# (format, model output, expected content, expected [(name, arguments)])
CASES = [
    # hermes (Qwen2.5 / Qwen3 / Hermes 2 Pro outputs)
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>",
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        "I'll look that up.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>\nOne moment.",
        "I'll look that up.One moment.",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'
        "\n</tool_call>",
        "",
        [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})],
    ),
    (  # malformed JSON: the model's text, untouched
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
        [],
    ),
    (  # cut off by max_tokens inside the call
        "hermes",
        'Sure.<tool_call>\n{"name": "get_wea',
        'Sure.<tool_call>\n{"name": "get_wea',
        [],
    ),
    (  # unterminated but complete call at the end of the output (Qwen sometimes stops so)
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {}}',
        "",
        [("get_time", {})],
    ),
    ("hermes", "The capital of France is Paris.\n", "The capital of France is Paris.\n", []),
    ("hermes", "a < b and <tool> is not a call", "a < b and <tool> is not a call", []),
    # llama3_json (Llama 3.1 / 3.2: JSON at the start, or after <|python_tag|>)
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        'Let me check.<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}',
        "Let me check.",
        [("get_time", {"tz": "UTC"})],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"tz": "UTC"}}',
        "",
        [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris",',
        '{"name": "get_weather", "parameters": {"city": "Paris",',
        [],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ("llama3_json", "Paris is the capital.", "Paris is the capital.", []),
    # mistral ([TOOL_CALLS] + JSON list, and the newer name[ARGS]{...})
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "mistral",
        'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]',
        "Checking.",
        [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}[TOOL_CALLS]get_weather[ARGS]'
        '{"city": "Paris", "unit": "celsius"}',
        "",
        [("get_time", {"tz": "UTC"}), ("get_weather", WEATHER)],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }]',
        [],
    ),
]


def _streamed(fmt, text, step=1):
    stream = ToolCallStream(fmt)
    events = []
    for i in range(0, len(text), step):
        events += stream.feed(text[i : i + step])
    events += stream.finish()
    return "".join(e.content for e in events), stream.calls, events


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse_whole_and_streamed(name, text, content, calls):
    fmt = get_format(name)
    got_content, got_calls = parse(fmt, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for step in (1, 3):
        s_content, s_calls, events = _streamed(fmt, text, step)
        assert s_content == content
        assert [(c.name, c.arguments) for c in s_calls] == [
            (c.name, c.arguments) for c in got_calls
        ]
        for e in events:  # nothing of a parsed call's markup leaks into content
            if calls:
                assert fmt.start not in e.content


# outputs that are calls in every reading (CASES with calls, and a few more shapes)
CALL_CASES = [(n, t, c, calls) for n, t, c, calls in CASES if calls] + [
    (  # braces and quotes inside strings, the arguments before the name
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "}{\\"]"}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',
        "",
        [("get_time", {"tz": '}{"]'}), ("get_weather", {"city": "Paris"})],
    ),
    (  # arguments written as a JSON string (some models do)
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>',
        "",
        [("get_time", {"tz": "UTC"})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": -3.5e2, "c": [true, null]}}'
        "\n</tool_call>",
        "",
        [("add", {"a": 12, "b": -350.0, "c": [True, None]})],
    ),
]
MARKUP = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]")


def _incremental(fmt, chunks):
    """Feeds `chunks`; (content, calls, events), checking the OpenAI order on the way: a
    call's announcement (index, name) before any fragment of its arguments."""
    stream = ToolCallStream(fmt, incremental=True)
    events = [e for chunk in chunks for e in stream.feed(chunk)] + stream.finish()
    announced, fragments = [], {}
    for e in events:
        if e.call is not None:
            assert e.index == len(announced) and e.call.name and e.call.id.startswith("call_")
            announced.append(e.call.name)
        elif e.arguments:
            assert e.index < len(announced), "arguments before their call's name"
            fragments[e.index] = fragments.get(e.index, "") + e.arguments
    assert announced == [c.name for c in stream.calls]
    for i, c in enumerate(stream.calls):  # the fragments concatenate to the arguments
        assert fragments.get(i, "") == c.arguments
    content = "".join(e.content for e in events)
    return content, stream.calls, events


@pytest.mark.parametrize("name,text,content,calls", CALL_CASES)
def test_incremental_reading_at_every_split(name, text, content, calls):
    fmt = get_format(name)
    whole_content, whole_calls = parse(fmt, text, incremental=True)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    assert [(c.name, json.loads(c.arguments)) for c in parse(fmt, text)[1]] == calls
    want = [(c.name, c.arguments) for c in whole_calls]
    splits = [list(text)] + [[text[:k], text[k:]] for k in range(1, len(text))]
    for chunks in splits:
        got_content, got_calls, events = _incremental(fmt, chunks)
        assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, want)
        assert not any(m in e.content for e in events for m in MARKUP)
    _, _, events = _incremental(fmt, list(text))  # one character at a time: an object's
    for i, c in enumerate(whole_calls):  # arguments come a piece per character written
        pieces = [e.arguments for e in events if e.arguments and e.index == i]
        # held: arguments as a JSON string (given out once complete), or before the name
        held = '"arguments": "' in text or '{"arguments"' in text
        assert len(pieces) >= 1 if held else pieces == list(c.arguments)


# (format, output, content, [(name, arguments as given out)]): what incremental reading makes
# of outputs a call grammar would not let through (a scripted engine, a grammar-less model)
INCREMENTAL_EDGES = [
    (  # announced, then malformed: the rest of the section is its arguments (no markup)
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
        "",
        [("get_weather", '{"city": "Paris"\n')],
    ),
    ("hermes", 'Sure.<tool_call>\n{"name": "get_wea', 'Sure.<tool_call>\n{"name": "get_wea', []),
    (  # cut off by max_tokens inside the arguments: what was written
        "hermes",
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
        "Sure.",
        [("get_weather", '{"city": "Pa')],
    ),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (  # text after a call, inside its section: content
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {}} oops\n</tool_call> done',
        "oopsdone",
        [("f", "{}")],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"name": "f", "parameters": {"n": 1}} then', "then", [("f", '{"n": 1}')]),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }]',
        "",
        [("get_weather", '{"city": }]')],
    ),
    ("mistral", "[TOOL_CALLS]not a name![ARGS]{}", "[TOOL_CALLS]not a name![ARGS]{}", []),
]


@pytest.mark.parametrize("name,text,content,calls", INCREMENTAL_EDGES)
def test_incremental_reading_of_outputs_no_grammar_would_allow(name, text, content, calls):
    fmt = get_format(name)
    for chunks in [[text], list(text)] + [[text[:k], text[k:]] for k in range(1, len(text))]:
        got_content, got_calls, _ = _incremental(fmt, chunks)
        assert got_content == content
        assert [(c.name, c.arguments) for c in got_calls] == calls


_PIECES = st.sampled_from(
    [*MARKUP, "{", "}", "[", "]", '"', "\\", ",", ":", ";", " ", "\n", "name", "arguments",
     "parameters", '"name": "f"', '"arguments": ', '{"a": 1}', "x", "é"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(["hermes", "llama3_json", "mistral"]),
    pieces=st.lists(_PIECES, max_size=24),
    cuts=st.lists(st.integers(0, 200), max_size=6),
)
def test_incremental_reading_of_any_text_never_fails_and_ignores_the_splits(name, pieces, cuts):
    fmt, text = get_format(name), "".join(pieces)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    content, calls = parse(fmt, text, incremental=True)
    got_content, got_calls, _ = _incremental(fmt, chunks)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == [(c.name, c.arguments) for c in calls]


def test_calls_render_back_and_parse_in_every_format():
    calls = [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})]
    for name in ("hermes", "llama3_json", "mistral"):
        fmt = get_format(name)
        content, parsed = parse(fmt, fmt.render(calls))
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in parsed] == calls


def test_parser_defaults_from_the_template():
    assert format_for_template("{{ '<tool_call>' }}") == "hermes"
    assert format_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert format_for_template("{{ '<|python_tag|>' }} ipython") == "llama3_json"
    assert format_for_template(None) == "hermes"
    with pytest.raises(ValueError, match="known are"):
        get_format("nope")


@pytest.mark.parametrize("incremental", [False, True])
def test_streamed_deltas_are_openai_shaped_and_concatenate_to_valid_arguments(incremental):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
    }
    text = CASES[2][1]  # two hermes calls
    out = ChatOutput(None, get_format("hermes"), incremental)
    deltas = []
    for ch in text:
        deltas += out.feed(ch, 1)
    deltas += out.finish()
    assert all("content" not in d for d in deltas)
    pieces = [d["tool_calls"][0]["index"] for d in deltas if "id" not in d["tool_calls"][0]]
    # name-first: each call's arguments in many fragments (one per character fed); whole: one
    assert [pieces.count(i) > 1 for i in (0, 1)] == [incremental] * 2
    calls: dict[int, dict] = {}
    for d in deltas:
        (tc,) = d["tool_calls"]
        if tc["index"] not in calls:  # the first delta of a call: index, id, type, name
            assert set(tc) == {"index", "id", "type", "function"} and tc["type"] == "function"
            assert tc["function"]["name"] and tc["id"].startswith("call_")
            calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
        else:  # then arguments fragments only
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
        calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), schema)
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    msg = out.message()
    assert msg["content"] is None and [c["id"] for c in msg["tool_calls"]] == [
        d["tool_calls"][0]["id"] for d in deltas if "id" in d["tool_calls"][0]
    ]


def test_malformed_call_is_content_with_finish_reason_stop():
    out = ChatOutput(None, get_format("hermes"))
    for ch in CASES[3][1]:
        out.feed(ch)
    out.finish()
    assert out.message() == {"role": "assistant", "content": CASES[3][1]}
    assert out.finish_reason("stop") == "stop"


def test_call_schema_validates_what_each_format_grammar_describes():
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g"}},
    ]
    schema = call_schema(tools, get_format("hermes"))
    jsonschema.validate({"name": "f", "arguments": {"a": 1}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "h", "arguments": {}}, schema)
    llama = call_schema(tools[:1], get_format("llama3_json"))
    jsonschema.validate({"name": "f", "parameters": {}}, llama)


# ---- reasoning --------------------------------------------------------------------------------
R_CASES = [
    # (parser, output, reasoning, answer)
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHi!", "\nThe user greets me.\n", "Hi!"),
    ("qwen3", "Hello!", "", "Hello!"),  # enable_thinking=false: no thought in the output
    ("qwen3", "  Hi <think> there", "", "  Hi <think> there"),  # not at the start: text
    ("qwen3", "<think>\nstill thinking when cut", "\nstill thinking when cut", ""),
    ("qwen3", "<thi", "", "<thi"),
    ("deepseek_r1", "Okay, 2+2 is 4.\n</think>\n\nIt is 4.", "Okay, 2+2 is 4.\n", "It is 4."),
    ("deepseek_r1", "<think>Hmm.</think>Four.", "Hmm.", "Four."),
    ("deepseek_r1", "no end tag at all", "no end tag at all", ""),
]  # fmt: skip


@pytest.mark.parametrize("name,text,reasoning,answer", R_CASES)
def test_reasoning_split_whole_and_streamed(name, text, reasoning, answer):
    fmt = get_reasoning_format(name)
    assert split(fmt, text) == (reasoning, answer)
    stream = ReasoningStream(fmt)
    parts = [stream.feed(ch, 1) for ch in text] + [stream.finish()]
    assert "".join(r for r, _ in parts) == reasoning
    assert "".join(a for _, a in parts) == answer


def test_reasoning_tokens_and_tags_split_across_tokens():
    # recorded as the tokens a Qwen3 tokenizer gives, with the end tag split over three
    tokens = ["<think>", "\n", "Greet", " back", ".", "</", "thin", "k>", "\n\n", "Hi", "!"]
    out = ChatOutput(get_reasoning_format("qwen3"), None)
    deltas = [d for t in tokens for d in out.feed(t, 1)] + out.finish()
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nGreet back."
    assert "".join(d.get("content", "") for d in deltas) == "Hi!"
    assert out.reasoning_tokens == 8  # <think> ... k> (the closing tag's tokens included)
    assert out.message()["reasoning_content"] == "\nGreet back."
    assert out.message()["content"] == "Hi!"


def test_tool_calls_after_the_thought_are_parsed_and_inside_it_are_not():
    text = (
        '<think>\nMaybe <tool_call>{"name": "x", "arguments": {}}</tool_call>?\n</think>\n\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    )
    out = ChatOutput(get_reasoning_format("qwen3"), get_format("hermes"))
    for ch in text:
        out.feed(ch, 1)
    out.finish()
    msg = out.message()
    assert "<tool_call>" in msg["reasoning_content"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time"]
    assert msg["content"] is None
