"""An HTTP chat request (serving/http/schemas.py) in engine/chat's terms: its tools, choice and
template options as `ChatSetup.build` takes them, its messages as template dicts. The checks,
the prompt, the call grammar and the output splitter are engine/chat's, shared with gRPC and
`LLM.chat`."""

from __future__ import annotations

from typing import Any

from engine.chat.setup import ChatOptions, ChatSetup, history_call
from engine.errors import InvalidRequestError


def chat_setup(options: ChatOptions, body) -> ChatSetup:
    """From a ChatCompletionRequest; InvalidRequestError names the field."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump()
    return ChatSetup.build(
        options,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        template_kwargs=body.chat_template_kwargs,
        max_thinking_tokens=getattr(body, "max_thinking_tokens", None),
    )


def message_dicts(messages) -> list[dict]:
    """Request messages (schemas.ChatMessage) as template dicts: tool call arguments decoded;
    `developer` is `system`."""
    if not messages:
        raise InvalidRequestError("messages", 0, "at least one message")
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": None if m.content is None else m.text(),
        }
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            d["tool_calls"] = [
                history_call(
                    f"messages[{i}].tool_calls[{j}].function.arguments",
                    c.id,
                    c.function.name,
                    c.function.arguments,
                )
                for j, c in enumerate(m.tool_calls)
            ]
        out.append(d)
    return out
