"""Tools and reasoning on the request side of a chat: the checks on `tools` /
`tool_choice`, the prompt (the model's own template receives `tools`, as transformers'
`apply_chat_template` passes them), the constraint that makes forced calls valid by
construction, and the per-choice output splitter (engine/chat/output.py). Transport-neutral:
the HTTP API, the gRPC service and `LLM.chat` each turn their request into `ChatSetup.build`'s
arguments (OpenAI-shaped dicts) and share everything below.

    ChatOptions (server: --tool_call_parser, --reasoning_parser, the model's template)
      + request (tools, tool_choice, parallel_tool_calls, chat_template_kwargs)
      -> ChatSetup.build(options, tools=..., ...)    checked: InvalidRequestError
         ChatSetup.prompt_ids(tokenizer, messages)   messages -> template -> token ids
         ChatSetup.sampling(params)                  + the call grammar when forced
         ChatSetup.new_output()                      one ChatOutput per choice

tool_choice: "none" (tools are shown to the model; its output is all content), "auto"
(default with tools; free text until the model opens a call: the format's trigger tag, e.g.
<tool_call>, or a '{' opening a llama3_json output; then constrained to a valid call: lazy,
with the same grammar; a tag the tokenizer holds as a special token is asked for as that
token: ChatOptions.tag_token), "required" or
{"type": "function", "function": {"name": N}}: decoding is constrained with llguidance
(engine/structured/output.py) to the format's call syntax around JSON objects
{"name": <a tool's name>, "arguments": <that tool's parameters schema>}, so each call
parses and validates. parallel_tool_calls=false allows exactly one forced call.

Templates without tool support (no `tools` in their source, e.g. SmolLM2's): NOT a silent
loss. The tool definitions go into the system message with the Hermes instructions Qwen2.5's
template writes (`<tools>` ... `</tools>`, answer with `<tool_call>` tags), assistant
`tool_calls` in the history are written into the content in the parser's syntax, and `tool`
messages become user turns `<tool_response>\\n...\\n</tool_response>`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

import jsonschema

from engine.chat.output import ChatOutput
from engine.chat.reasoning import ReasoningFormat, budget_grammar, get_reasoning_format
from engine.chat.tool_parsers import ToolCallFormat, format_for_template, get_format
from engine.errors import InvalidRequestError
from engine.sampling.params import SamplingParams
from engine.structured.output import StructuredOutput

TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128  # OpenAI's limit on tools per request
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function name rule
MAX_THINKING_TOKENS = 1 << 20
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "documents")

FALLBACK_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """The server's side: which formats, and what the model's template can render."""

    tool_format: ToolCallFormat
    reasoning: ReasoningFormat | None
    template_renders_tools: bool  # the template reads `tools`
    template_renders_calls: bool  # the template reads assistant `tool_calls`
    # the id of the format's opening tag where the tokenizer holds it as one special token
    # (Llama 3's <|python_tag|>, Mistral's [TOOL_CALLS]): the call grammars ask for that token
    tag_token: int | None = None

    @classmethod
    def for_tokenizer(
        cls, tokenizer, tool_call_parser: str = "", reasoning_parser: str = ""
    ) -> ChatOptions:
        """ValueError for an unknown parser name (the server checks its flags with it)."""
        template = getattr(tokenizer, "chat_template", None)
        text = getattr(template, "text", None) or ""
        fmt = get_format(tool_call_parser or format_for_template(text))
        return cls(
            tool_format=fmt,
            reasoning=get_reasoning_format(reasoning_parser) if reasoning_parser else None,
            template_renders_tools="tools" in text,
            template_renders_calls="tool_calls" in text,
            tag_token=special_token_id(tokenizer, fmt.start),
        )


def special_token_id(tokenizer, text: str) -> int | None:
    """The id of `text` when the tokenizer holds it as one special token, else None."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        return None
    for token_id, token in backend.get_added_tokens_decoder().items():
        if token.special and token.content == text:
            return token_id
    return None


@dataclasses.dataclass(frozen=True)
class ToolSetup:
    """A request's checked tools and choice."""

    tools: tuple[dict, ...]  # OpenAI tool objects {"type": "function", "function": {...}}
    choice: str  # none | auto | required | function
    named: str | None  # the forced function's name (choice == "function")
    parallel: bool

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def constraint(
        self, fmt: ToolCallFormat, tag_token: int | None = None
    ) -> StructuredOutput | None:
        """The call grammar when a call is forced (required / named); with auto, free text
        until the format's trigger (its tag; llama3_json: also '{' opening the output), then
        a valid call (lazy); None for none. `tag_token`: ChatOptions.tag_token."""
        tools = [t for t in self.tools if self.named in (None, t["function"]["name"])]
        schema = call_schema(tools, fmt)
        if self.choice in ("required", "function"):
            return StructuredOutput(grammar=fmt.grammar(schema, self.parallel, tag_token))
        if self.choice == "auto":
            return StructuredOutput(grammar=fmt.lazy_grammar(schema, self.parallel, tag_token))
        return None

    @property
    def constrained(self) -> bool:
        """Whether `constraint` holds the calls' syntax: every choice but none."""
        return self.choice != "none"


def call_schema(tools: Sequence[dict], fmt: ToolCallFormat) -> dict:
    """JSON Schema of one call object of `fmt` to any of `tools` (name first, as written)."""
    options = []
    for t in tools:
        f = t["function"]
        params = f.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, fmt.args_key: params},
                "required": ["name", fmt.args_key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_setup(
    tools: Sequence[dict] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolSetup | None:
    """The request's tools, checked (InvalidRequestError naming field, value and limit)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice", shown(tool_choice), "needs tools")
        if tools is not None:
            raise InvalidRequestError("tools", [], "at least one tool when set")
        return None
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"{len(tools)} tools", f"at most {MAX_TOOLS}")
    names: list[str] = []
    for i, t in enumerate(tools):
        f = t["function"]
        if not TOOL_NAME.fullmatch(f["name"]):
            raise InvalidRequestError(
                f"tools[{i}].function.name", f["name"], "1-64 characters of a-z, A-Z, 0-9, _ -"
            )
        if f["name"] in names:
            raise InvalidRequestError(f"tools[{i}].function.name", f["name"], "unique names")
        names.append(f["name"])
        _check_parameters(i, f.get("parameters"))
    choice, named = _choice(tool_choice, names)
    return ToolSetup(tuple(tools), choice, named, parallel_tool_calls is not False)


def _check_parameters(i: int, params: Any) -> None:
    field = f"tools[{i}].function.parameters"
    if params is None:
        return
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise InvalidRequestError(field, shown(params), "a JSON Schema of type 'object'")
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as e:
        raise InvalidRequestError(
            field, shown(params), f"not a valid JSON Schema: {e.message}"
        ) from None
    try:  # what llguidance can compile (the constraint when the call is forced)
        StructuredOutput(json_schema=params)
    except InvalidRequestError as e:
        raise InvalidRequestError(field, shown(params), e.limit) from None


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise InvalidRequestError("tool_choice", tool_choice, f"one of {TOOL_CHOICES}")
        return tool_choice, None
    name = tool_choice["function"]["name"]
    if name not in names:
        raise InvalidRequestError(
            "tool_choice.function.name", name, f"one of the tools' names {names}"
        )
    return "function", name


def shown(value: Any) -> str:
    """`value` as an error message quotes it (JSON, at most 120 characters)."""
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 120 else text[:117] + "..."


@dataclasses.dataclass(frozen=True)
class ChatSetup:
    """Everything one chat request needs beyond plain text in and out."""

    options: ChatOptions
    tools: ToolSetup | None
    template_kwargs: dict
    max_thinking_tokens: int | None = None

    @classmethod
    def build(
        cls,
        options: ChatOptions,
        *,
        tools: Sequence[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
        template_kwargs: dict | None = None,
        max_thinking_tokens: int | None = None,
    ) -> ChatSetup:
        """From a request's fields in OpenAI's shapes: `tools` as
        [{"type": "function", "function": {"name", "description", "parameters"}}],
        `tool_choice` as none | auto | required or {"type": "function", "function": {"name"}}.
        InvalidRequestError names the field, the value and the limit."""
        kwargs = dict(template_kwargs or {})
        for key in RESERVED_TEMPLATE_KWARGS:
            if key in kwargs:
                raise InvalidRequestError(
                    f"chat_template_kwargs.{key}", "set", "set by the request itself"
                )
        budget = max_thinking_tokens
        if budget is not None:
            if options.reasoning is None:
                raise InvalidRequestError(
                    "max_thinking_tokens", budget, "needs the server's --reasoning_parser"
                )
            if not 0 <= budget <= MAX_THINKING_TOKENS:
                raise InvalidRequestError(
                    "max_thinking_tokens", budget, f"0 <= x <= {MAX_THINKING_TOKENS}"
                )
            if kwargs.get("enable_thinking") is False:
                budget = None  # no thought to bound
        checked = tool_setup(
            None if tools is None else list(tools), tool_choice, parallel_tool_calls
        )
        return cls(options, checked, kwargs, budget)

    @property
    def parses_calls(self) -> bool:
        return self.tools is not None and self.tools.choice != "none"

    @property
    def streams_calls(self) -> bool:
        """Calls stream name-first (engine/chat/call_stream.py `incremental`) exactly when the
        call grammar holds their syntax: a call announced early cannot turn out malformed
        (only cut off by max_tokens). Every choice that parses calls has one (auto: lazy)."""
        return self.parses_calls and self.tools.constrained

    def sampling(self, params: SamplingParams) -> SamplingParams:
        changes: dict[str, Any] = {}
        if self.max_thinking_tokens is not None:
            if params.structured is not None:
                raise InvalidRequestError(
                    "max_thinking_tokens",
                    self.max_thinking_tokens,
                    "not with response_format / guided_*",
                )
            grammar = budget_grammar(self.options.reasoning, self.max_thinking_tokens)
            changes["structured"] = StructuredOutput(grammar=grammar)
        if self.tools is None:
            return dataclasses.replace(params, **changes) if changes else params
        constraint = self.tools.constraint(self.options.tool_format, self.options.tag_token)
        if constraint is not None:
            if params.structured is not None or changes:
                raise InvalidRequestError(
                    "tool_choice",
                    self.tools.choice,
                    "not with response_format / guided_* / max_thinking_tokens",
                )
            changes["structured"] = constraint
        if self.parses_calls and (
            self.options.tool_format.name == "mistral" or self.options.tag_token is not None
        ):
            changes["skip_special_tokens"] = False  # the parser reads the tag's text
        return dataclasses.replace(params, **changes) if changes else params

    def new_output(self) -> ChatOutput | None:
        """The choice's splitter; None when there is nothing to split."""
        if self.options.reasoning is None and not self.parses_calls:
            return None
        return self.output()

    def output(self) -> ChatOutput:
        fmt = self.options.tool_format if self.parses_calls else None
        return ChatOutput(self.options.reasoning, fmt, incremental=self.streams_calls)

    def prompt_ids(self, tokenizer, messages: list[dict]) -> list[int]:
        messages, kwargs = self.render_inputs(messages)
        return chat_token_ids(tokenizer, messages, **kwargs)

    def render_inputs(self, messages: list[dict]) -> tuple[list[dict], dict]:
        """(messages, template kwargs) for the model's template, with the fallback
        rendering where the template cannot show tools or calls."""
        opts, kwargs = self.options, dict(self.template_kwargs)
        if not opts.template_renders_calls:
            messages = [_fallback_message(m, opts.tool_format) for m in messages]
        if self.tools is not None:
            if opts.template_renders_tools:
                kwargs["tools"] = [dict(t) for t in self.tools.tools]
            else:
                messages = _with_tool_instructions(messages, self.tools.tools)
        return messages, kwargs


def chat_token_ids(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
) -> list[int]:
    """The template's text, encoded without adding special tokens again (it wrote its own).
    `template_kwargs` (e.g. tools, enable_thinking) become template variables."""
    if hasattr(tokenizer, "encode_chat"):
        return list(
            tokenizer.encode_chat(
                messages, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
        )
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return list(tokenizer.encode(text))


def history_call(field: str, call_id: str, name: str, arguments: str) -> dict:
    """An assistant message's earlier call as the template reads it: arguments decoded (templates
    write them with `tojson`, as vLLM passes them). `field` names the arguments in the request."""
    try:
        args = json.loads(arguments or "{}")
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidRequestError(field, shown(arguments), f"a JSON object: {e!s}") from None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _fallback_message(m: dict, fmt: ToolCallFormat) -> dict:
    if m.get("tool_calls"):
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
        text = "\n".join(x for x in (m.get("content"), fmt.render(calls)) if x)
        return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    return m


def _with_tool_instructions(messages: list[dict], tools: Sequence[dict]) -> list[dict]:
    listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    text = FALLBACK_INSTRUCTIONS.format(tools=listed)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
