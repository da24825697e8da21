"""A GenerateRequest's tools and reasoning in engine/chat's terms, and a chat's split output in
GenerateResponse fields. The checks, prompt rendering, call grammar and output splitter are
engine/chat's, the same code the HTTP API runs; this module only maps fields.

    request.tools / tool_choice / parallel_tool_calls / chat_template_kwargs /
    max_thinking_tokens + request.chat -> ChatTurn.of(request, options)
      .prompt_ids(tokenizer)      the template with the tools (or the fallback instructions)
      .sampling(params)           + the call grammar when a call is forced
      .new_output()               engine/chat/output.py ChatOutput (None: nothing to split)
    ChatOutput deltas -> fill(msg, deltas): msg.content, msg.reasoning_content, msg.tool_calls
                         (a call's first delta: id and name; later ones: arguments fragments)
"""

from __future__ import annotations

import dataclasses
import json

from engine.chat.output import ChatOutput
from engine.chat.setup import ChatOptions, ChatSetup, history_call
from engine.errors import InvalidRequestError
from engine.sampling.params import SamplingParams
from serving.grpc_api import convert
from serving.proto import pagedjax_pb2 as pb

MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class ChatTurn:
    """A chat GenerateRequest with what engine/chat made of its tools and options."""

    setup: ChatSetup
    messages: list[dict]  # template dicts (tool call arguments decoded)

    @classmethod
    def of(cls, req: pb.GenerateRequest, options: ChatOptions) -> ChatTurn | None:
        """None when the request asks for nothing beyond plain chat and the server splits no
        reasoning (its prompt then goes the plain way). InvalidRequestError names the field."""
        asks = asks_for_tools(req)
        if req.WhichOneof("prompt") != "chat":
            if asks:
                raise InvalidRequestError(asks, "set", "needs a chat prompt (the chat field)")
            return None
        if not asks and options.reasoning is None:
            return None
        setup = ChatSetup.build(
            options,
            tools=tool_dicts(req.tools) if req.tools else None,
            tool_choice=tool_choice(req) if req.HasField("tool_choice") else None,
            parallel_tool_calls=(
                req.parallel_tool_calls if req.HasField("parallel_tool_calls") else None
            ),
            template_kwargs=template_kwargs(req.chat_template_kwargs),
            max_thinking_tokens=(
                req.max_thinking_tokens if req.HasField("max_thinking_tokens") else None
            ),
        )
        return cls(setup, template_messages(req.chat))

    def prompt_ids(self, tokenizer) -> list[int]:
        return self.setup.prompt_ids(tokenizer, self.messages)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        return self.setup.sampling(params)

    def new_output(self) -> ChatOutput | None:
        return self.setup.new_output()


def asks_for_tools(req: pb.GenerateRequest) -> str:
    """The first tools / reasoning field the request sets ("" when none)."""
    if req.tools:
        return "tools"
    for field in ("tool_choice", "parallel_tool_calls", "max_thinking_tokens"):
        if req.HasField(field):
            return field
    return "chat_template_kwargs" if req.chat_template_kwargs else ""


def tool_dicts(tools) -> list[dict]:
    """Protobuf tools as OpenAI tool objects; the parameters' JSON text decoded."""
    out = []
    for i, t in enumerate(tools):
        if t.type not in ("", "function"):
            raise InvalidRequestError(f"tools[{i}].type", t.type, "'function' (or empty)")
        f: dict = {"name": t.function.name}
        if t.function.description:
            f["description"] = t.function.description
        if t.function.parameters:
            f["parameters"] = _json(f"tools[{i}].function.parameters", t.function.parameters)
        out.append({"type": "function", "function": f})
    return out


def tool_choice(req: pb.GenerateRequest) -> str | dict | None:
    kind = req.tool_choice.WhichOneof("choice")
    if kind == "mode":
        return req.tool_choice.mode
    if kind == "function":
        return {"type": "function", "function": {"name": req.tool_choice.function.name}}
    return None  # an empty ToolChoice: the default (auto)


def template_kwargs(text: str) -> dict | None:
    if not text:
        return None
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidRequestError(
            "chat_template_kwargs", f"<{size} bytes>", f"at most {MAX_TEMPLATE_KWARGS_BYTES} bytes"
        )
    value = _json("chat_template_kwargs", text)
    if not isinstance(value, dict):
        raise InvalidRequestError("chat_template_kwargs", text, "a JSON object")
    return value


def _json(field: str, text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidRequestError(field, text, f"JSON text: {e}") from None


def template_messages(chat: pb.ChatMessages) -> list[dict]:
    """The chat's messages as template dicts (engine/chat/setup.py renders them): the roles
    checked as for a plain chat, assistant calls' arguments decoded, empty content beside
    calls as None (as OpenAI clients send it)."""
    plain = convert.chat_messages(chat)  # roles checked
    out = []
    for i, (d, m) in enumerate(zip(plain, chat.messages)):
        if m.tool_calls:
            d["content"] = m.content or None
            d["tool_calls"] = [
                history_call(
                    f"chat.messages[{i}].tool_calls[{j}].arguments", c.id, c.name, c.arguments
                )
                for j, c in enumerate(m.tool_calls)
            ]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        if m.HasField("reasoning_content"):
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def fill(msg: pb.GenerateResponse, deltas: list[dict]) -> None:
    """ChatOutput's OpenAI deltas into the message's split fields: a call's first delta
    (index, id, type, name; arguments "") and its arguments fragments as ToolCall deltas, a
    call's fragments within one message joined into one."""
    for d in deltas:
        msg.content += d.get("content") or ""
        msg.reasoning_content += d.get("reasoning_content") or ""
        for part in d.get("tool_calls", ()):
            f, last = part["function"], msg.tool_calls[-1] if msg.tool_calls else None
            if "id" in part:
                msg.tool_calls.add(
                    index=part["index"], id=part["id"], type=part["type"], name=f["name"]
                )
            elif last is not None and last.index == part["index"] and not last.id:
                last.arguments += f["arguments"]
            else:
                msg.tool_calls.add(index=part["index"], arguments=f["arguments"])
