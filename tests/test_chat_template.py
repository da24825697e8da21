"""Chat templates: rendered byte-for-byte as transformers' `apply_chat_template(...,
tokenize=False)` renders them, in a sandbox, with clear errors for bad messages and templates."""

import hashlib

import pytest

from engine.errors import InvalidRequestError
from models.chat_template import ChatTemplate, ChatTemplateError, template_sha256

# SmolLM2-135M-Instruct's template, as its GGUF stores it (tokenizer.chat_template).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama-3.1 style: bos_token, strftime_now, namespace, tojson(indent), raise_exception, continue,
# tool calls, trimming with "-" modifiers.
LLAMA3_LIKE_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have these tools:\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception("Unknown role: " + message.role) }}
    {%- endif %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
        {%- for call in message.tool_calls %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + call.function | tojson + '<|eot_id|>' }}
        {%- endfor %}
        {%- continue %}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{{- "turns=" ~ ns.turns }}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# No "-" modifiers: the output depends on trim_blocks / lstrip_blocks being set as transformers sets them.
WHITESPACE_TEMPLATE = """{% for m in messages %}
    {% if m.role == 'user' %}
<user>{{ m.content }}</user>
    {% else %}
<bot>{{ m.content }}</bot>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<bot>
{% endif %}
"""

# Content blocks, loop controls (break), dict(), {% generation %}, eos_token.
BLOCKS_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
    "{{ eos_token }}{% endgeneration %}{% elif m.content is string %}{{ m.content }}{% else %}"
    "{% for b in m.content %}{% if b.type == 'text' %}[{{ b.text }}]{% endif %}"
    "{% if loop.index >= 2 %}{% break %}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{{ dict(n=messages|length) | tojson }}"
)

SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}

SYSTEM_USER = [
    {"role": "system", "content": "  You are terse.  "},
    {"role": "user", "content": "What is the capital of France?"},
]
MULTI_TURN = [
    {"role": "user", "content": "Hi 👋"},
    {"role": "assistant", "content": "Hello! ça va?"},
    {"role": "user", "content": 'Write <b>bold</b> & "quotes"\n  with\tindent'},
]
TOOL_CALL = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": "18C"},
]
CONTENT_BLOCKS = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "a"},
            {"type": "image"},
            {"type": "text", "text": "c"},
        ],
    },
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "plain"},
]
TOOLS = [{"name": "weather", "description": "Weather <now> & later", "parameters": {"city": "str"}}]


def render(template: str, messages, **kwargs) -> str:
    return ChatTemplate(template).render(messages, special_tokens=SPECIAL_TOKENS, **kwargs)


# --- hashing -----------------------------------------------------------------------------------


def test_hash_is_sha256_of_the_template_text():
    t = ChatTemplate(SMOLLM2_TEMPLATE)
    assert (
        t.sha256
        == hashlib.sha256(SMOLLM2_TEMPLATE.encode()).hexdigest()
        == template_sha256(SMOLLM2_TEMPLATE)
    )
    assert ChatTemplate(SMOLLM2_TEMPLATE).sha256 == t.sha256


def test_hash_changes_when_the_template_changes():
    edited = SMOLLM2_TEMPLATE.replace("named SmolLM", "named Bob")
    assert ChatTemplate(edited).sha256 != ChatTemplate(SMOLLM2_TEMPLATE).sha256
    whitespace_only = SMOLLM2_TEMPLATE + " "
    assert ChatTemplate(whitespace_only).sha256 != ChatTemplate(SMOLLM2_TEMPLATE).sha256


# --- rendering (no transformers needed) --------------------------------------------------------


def test_smollm2_template_renders_the_expected_prompt():
    assert render(SMOLLM2_TEMPLATE, [{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = render(SMOLLM2_TEMPLATE, SYSTEM_USER, add_generation_prompt=False)
    assert no_prompt == (
        "<|im_start|>system\n  You are terse.  <|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    )


def test_trim_and_lstrip_blocks_are_on():
    assert (
        render(WHITESPACE_TEMPLATE, MULTI_TURN[:2])
        == "<user>Hi 👋</user>\n<bot>Hello! ça va?</bot>\n<bot>\n"
    )


def test_tojson_does_not_html_escape():
    out = render("{{ messages[0].content | tojson }}", [{"role": "user", "content": "<b>&'"}])
    assert out == '"<b>&\'"'


def test_generation_tag_and_loop_controls_and_dict():
    out = render(BLOCKS_TEMPLATE, CONTENT_BLOCKS)
    # trim_blocks eats the newline after each {% endif %}.
    assert out == '[a]ok</s>plain{"n": 3}'


def test_none_valued_keys_are_dropped_like_transformers():
    out = render("{% for m in messages %}{{ m.content is defined }}{% endfor %}", TOOL_CALL)
    assert out == "TrueFalseTrue"


def test_reasoning_is_exposed_under_both_names():
    messages = [{"role": "assistant", "content": "4", "reasoning": "2+2"}]
    out = render("{{ messages[0].reasoning_content }}|{{ messages[0].thinking }}", messages)
    assert out == "2+2|2+2"


def test_extra_template_variables_are_passed_through():
    out = render(
        "{{ date_string }}/{{ tools | length }}",
        [{"role": "user", "content": "x"}],
        date_string="1 Jan 2026",
        tools=TOOLS,
    )
    assert out == "1 Jan 2026/1"


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ("hello", "messages"),
        ([], "messages"),
        (["hi"], r"messages\[0\]"),
        ([{"content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": "", "content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], r"messages\[1\]\.role"),
        ([{"role": "user"}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": 42}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": ["not a block"]}], r"messages\[0\]\.content"),
    ],
)
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(InvalidRequestError, match=field) as err:
        render(SMOLLM2_TEMPLATE, messages)
    assert err.value.field.startswith("messages")


def test_template_raise_exception_is_an_invalid_request():
    with pytest.raises(
        InvalidRequestError, match="rejected by the chat template: Unknown role: robot"
    ):
        render(LLAMA3_LIKE_TEMPLATE, [{"role": "robot", "content": "beep"}])


def test_syntax_error_names_the_source_and_line():
    with pytest.raises(ChatTemplateError, match=r"my.gguf: chat template line 2"):
        ChatTemplate("ok\n{% for m in messages %}", source="my.gguf")


def test_empty_template_is_refused():
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("   ")


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append(1) }}",  # immutable sandbox: no mutating the caller's list
        "{% set ns = namespace(_x=1) %}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ raise_exception.__globals__['os'] }}",
    ],
)
def test_sandbox_refuses_unsafe_templates(template):
    with pytest.raises(ChatTemplateError, match="rendering failed"):
        render(template, [{"role": "user", "content": "x"}])


def test_messages_are_not_mutated():
    messages = [{"role": "user", "content": "x", "tool_calls": None}]
    render(SMOLLM2_TEMPLATE, messages)
    assert messages == [{"role": "user", "content": "x", "tool_calls": None}]


# --- identical to transformers -----------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tokenizer_for():
    """A transformers tokenizer with a given template (a tiny vocabulary: only rendering matters)."""
    transformers = pytest.importorskip("transformers")
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"<s>": 0, "</s>": 1}, merges=[]))

    def make(template: str):
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend, chat_template=template, **SPECIAL_TOKENS
        )

    return make


@pytest.mark.slow
@pytest.mark.parametrize(
    "template",
    [SMOLLM2_TEMPLATE, LLAMA3_LIKE_TEMPLATE, WHITESPACE_TEMPLATE],
    ids=["smollm2", "llama3", "ws"],
)
@pytest.mark.parametrize("messages", [SYSTEM_USER, MULTI_TURN], ids=["system_user", "multi_turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_identical_to_transformers(hf_tokenizer_for, template, messages, add_generation_prompt):
    ours = render(template, messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tokenizer_for(template).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == ref


@pytest.mark.slow
def test_identical_to_transformers_with_tools_blocks_and_tool_calls(hf_tokenizer_for):
    llama3 = hf_tokenizer_for(LLAMA3_LIKE_TEMPLATE)
    for messages in (SYSTEM_USER, TOOL_CALL):
        ours = render(LLAMA3_LIKE_TEMPLATE, messages, tools=TOOLS)
        ref = llama3.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        assert ours == ref
        assert "<now> & later" in ours
    ours = render(BLOCKS_TEMPLATE, CONTENT_BLOCKS)
    ref = hf_tokenizer_for(BLOCKS_TEMPLATE).apply_chat_template(
        CONTENT_BLOCKS, tokenize=False, add_generation_prompt=True
    )
    assert ours == ref
