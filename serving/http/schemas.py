"""Request schemas of the OpenAI-compatible HTTP API (pydantic), and their translation into
what the engine takes: prompt token ids and SamplingParams.

Every request model forbids unknown fields, so a field this server does not implement
(`logit_bias`, `echo`, `best_of`, ...) is refused by name with a
400 instead of being silently ignored. Bodies are parsed in strict JSON mode: "5" is not an
integer. Value ranges are checked by SamplingParams and the admission limits, whose errors
name the field, the value and the limit.

Supported fields (OpenAI's, then vLLM's extras):

    model, messages (chat) | prompt (completions: string, list of strings, token ids, list
    of token-id lists), max_tokens, max_completion_tokens (chat), temperature, top_p, n, seed,
    stop, presence_penalty, frequency_penalty, logprobs + top_logprobs (chat: bool + 0..20),
    logprobs (completions: 0..20), stream, stream_options.include_usage, user;
    stream_options.continuous_usage_stats (vLLM's: usage so far in every chunk),
    top_k (-1 or 0 disables), min_p, repetition_penalty, min_tokens, ignore_eos,
    stop_token_ids, priority (vLLM's: lower is served earlier; <0 high, 0 normal, >0 low),
    include_stop_str_in_output, skip_special_tokens,
    revision (a pin: 409 when another revision is loaded; also header x-pagedjax-revision),
    return_token_times (streamed chunks carry pagedjax.token_times_unix_ns: when the server
    produced each token, for the load generator's inter-token latency).

Chat tools and reasoning (engine/chat/setup.py): tools (function type), tool_choice
(none | auto | required | {"type": "function", "function": {"name"}}), parallel_tool_calls,
assistant messages with tool_calls and tool messages (tool_call_id) in the history,
chat_template_kwargs (vLLM's: e.g. {"enable_thinking": false}), max_thinking_tokens (a
thinking budget: after N thought tokens the closing </think> is forced; engine/chat/reasoning.py).

Structured output (engine/structured/output.py), at most one per request: OpenAI's
`response_format` ({"type": "json_schema", "json_schema": {"name", "schema", "strict"}},
{"type": "json_object"}, {"type": "text"} = none), or vLLM's `guided_json` (schema object or
JSON string), `guided_regex`, `guided_choice` (list of strings), `guided_grammar` (Lark or
GBNF). An invalid schema/regex/grammar is a 400 naming the field and llguidance's message.
"""

from __future__ import annotations

from typing import Literal

import grpc
import pydantic
from pydantic import BaseModel, ConfigDict

from configs.errors import MAX_ECHO_CHARS, bounded, echo
from engine.chat.setup import chat_token_ids
from engine.errors import InvalidRequestError
from engine.sampling.params import SamplingParams
from engine.structured.output import StructuredOutput
from serving.frontend.generation import Refusal

MAX_CHOICES = 16  # n (times the number of prompts) per request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallItem(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn of tool calls only
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this answers
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


# ---- tools (engine/chat/setup.py checks names, schemas and the choice) -------------------
class FunctionTool(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema of type object
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionTool


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Strict):
    name: str = ""
    description: str | None = None
    json_schema: dict | bool = pydantic.Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _GenerationFields(_Strict):
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an opaque end-user id; accepted, not used
    # llm-d's routing sidecar (prefill/decode): serving/gateway/http_kv_transfer.py
    kv_transfer_params: dict | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int | None = None  # None: the tenant's default class
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # pagedjax: the revision this request must run on; per-token server times in chunks
    revision: str = ""
    return_token_times: bool = False
    # structured output: OpenAI's response_format, vLLM's guided_* extras
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return None


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # vLLM's: extra variables for the template
    max_thinking_tokens: int | None = None  # thinking budget (needs --reasoning_parser)

    def requested_max_tokens(self) -> int | None:
        a, b = self.max_completion_tokens, self.max_tokens
        if a is not None and b is not None and a != b:
            raise InvalidRequestError(
                "max_completion_tokens", a, f"equal to max_tokens ({b}) when both are set"
            )
        return a if a is not None else b

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", self.top_logprobs, "needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(_Strict):
    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str = ""
    tokens: list[int]


def validation_message(err: pydantic.ValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem: unsupported fields are named as such."""
    e = err.errors(include_url=False)[0]
    loc = [str(p) for p in e["loc"]]
    name = ".".join(loc)
    # a field's name may be the bad value; no name: the body itself (JSON, not an object)
    param = bounded(name, MAX_ECHO_CHARS) or "body"
    msg = bounded(e["msg"])
    if e["type"] == "extra_forbidden":
        return f"unsupported field {echo(name)}: this server does not implement it", param
    if e["type"] == "missing":
        return f"{param} is required", param
    if e["type"] in ("json_invalid", "json_type"):
        return f"request body is not valid JSON: {msg}", None
    return f"{param}={echo(e.get('input'))} is invalid: {msg}", param


def parse_body(model_cls: type[BaseModel], raw: bytes):
    """The request model, or a Refusal (400) naming the first problem."""
    try:
        return model_cls.model_validate_json(raw or b"{}")
    except pydantic.ValidationError as e:
        message, param = validation_message(e)
        raise Refusal(
            grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", message, param=param
        ) from e


# ---- engine inputs --------------------------------------------------------------------------
def engine_priority(vllm_priority: int | None) -> int | None:
    """vLLM's priority (lower = earlier) -> the engine's class (larger = more important);
    None (not given) stays None: the tenant's default class applies."""
    if vllm_priority is None:
        return None
    return 2 if vllm_priority < 0 else 1 if vllm_priority == 0 else 0


def sampling_params(
    req: _GenerationFields, default_max_tokens: int, choice: int = 0
) -> SamplingParams:
    """SamplingParams for choice `choice` of `req` (raises InvalidRequestError naming the
    field). A seeded request gives choice i the seed + i: n different, reproducible samples."""
    max_tokens = req.requested_max_tokens()
    optional = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "top_k": None if req.top_k is None else max(req.top_k, 0),  # vLLM: -1 disables
        "seed": None if req.seed is None else req.seed + choice,
        "logprobs": req.num_logprobs(),
    }
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        **{k: v for k, v in optional.items() if v is not None},
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        min_tokens=req.min_tokens,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        structured=structured_output(req),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
    )


def structured_output(req: _GenerationFields) -> StructuredOutput | None:
    """The request's one constraint (InvalidRequestError names the HTTP field)."""
    given = {
        name: value
        for name, value in (
            ("response_format", _response_format(req.response_format)),
            ("guided_json", req.guided_json),
            ("guided_regex", req.guided_regex),
            ("guided_choice", req.guided_choice),
            ("guided_grammar", req.guided_grammar),
        )
        if value is not None
    }
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError(
            "response_format", sorted(given), "at most one of response_format / guided_*"
        )
    ((field, value),) = given.items()
    kind = {
        "guided_json": "json_schema",
        "guided_regex": "regex",
        "guided_choice": "choice",
        "guided_grammar": "grammar",
    }.get(field)
    try:
        return value if kind is None else StructuredOutput(**{kind: value})
    except InvalidRequestError as e:  # rename the field to the one the client sent
        raise InvalidRequestError(field, e.value, e.limit) from None


def _response_format(fmt: ResponseFormat | None) -> StructuredOutput | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput(json_object=True)
    if fmt.json_schema is None:
        raise InvalidRequestError(
            "response_format.json_schema", None, "required when type is 'json_schema'"
        )
    try:
        return StructuredOutput(json_schema=fmt.json_schema.json_schema)
    except InvalidRequestError as e:
        raise InvalidRequestError("response_format.json_schema.schema", e.value, e.limit) from None


def check_choices(n: int, num_prompts: int) -> None:
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequestError("n", n, f"1 <= n <= {MAX_CHOICES}")
    if num_prompts < 1:
        raise InvalidRequestError("prompt", num_prompts, "at least one prompt")
    if n * num_prompts > MAX_CHOICES:
        raise InvalidRequestError(
            "n", n, f"n x prompts ({num_prompts}) <= {MAX_CHOICES} choices per request"
        )


def chat_prompt_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    if not messages:
        raise InvalidRequestError("messages", 0, "at least one message")
    dicts = [{"role": m.role, "content": m.text()} for m in messages]
    return chat_token_ids(tokenizer, dicts)


def completion_prompts(prompt) -> list[str | list[int]]:
    """The request's prompts: each a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def prompt_ids(tokenizer, prompt: str | list[int], vocab_size: int | None) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if vocab_size is not None:
        for i in prompt:
            if not 0 <= i < vocab_size:
                raise InvalidRequestError("prompt", i, f"token ids 0 <= id < {vocab_size}")
    return list(prompt)
