"""`LLM.chat` with tools and reasoning: the same request checks, prompt rendering, call grammar
and output splitter as the HTTP API and the gRPC service (engine/chat/), over the notebook
API's OpenAI-shaped dicts.

    LLM.chat(messages, tools=[{"type": "function", "function": {...}}], tool_choice="required")
      -> chat_setup(...)          ChatSetup.build: tools and choice checked (InvalidRequestError)
      -> template_messages(conv)  assistant tool_calls' JSON arguments decoded for the template
      -> the engine, with setup.sampling(params): the call grammar when a call is forced
      -> split_completion(c)      c.content, c.reasoning_content, c.tool_calls, c.message,
                                  finish_reason "tool_calls" after calls (engine/chat/output.py)
"""

from __future__ import annotations

import json

from engine.api_types import CompletionOutput
from engine.chat.setup import ChatOptions, ChatSetup, history_call


def chat_setup(
    options: ChatOptions,
    tools,
    tool_choice,
    parallel_tool_calls,
    chat_template_kwargs,
    max_thinking_tokens,
) -> ChatSetup | None:
    """The chat's setup, or None when it asks for nothing beyond plain chat (no tools, no
    template options, no reasoning parser): the plain path then runs unchanged."""
    asked = (tools, tool_choice, parallel_tool_calls, chat_template_kwargs, max_thinking_tokens)
    if all(x is None for x in asked) and options.reasoning is None:
        return None
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(f"chat_template_kwargs: expected a dict; got {chat_template_kwargs!r:.80}")
    return ChatSetup.build(
        options,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        template_kwargs=chat_template_kwargs,
        max_thinking_tokens=max_thinking_tokens,
    )


def template_messages(conversation: list[dict], where: str) -> list[dict]:
    """OpenAI chat messages as the template reads them: each assistant tool call's arguments
    (JSON text, or already a dict) decoded. InvalidRequestError names a bad one."""
    out = []
    for i, m in enumerate(conversation):
        calls = m.get("tool_calls")
        if not calls:
            out.append(dict(m))
            continue
        decoded = []
        for j, c in enumerate(calls):
            f = c["function"]
            args = f.get("arguments", "")
            args = args if isinstance(args, str) else json.dumps(args)
            field = f"{where}[{i}].tool_calls[{j}].function.arguments"
            decoded.append(history_call(field, c.get("id", ""), f["name"], args))
        out.append({**m, "tool_calls": decoded})
    return out


def split_completion(c: CompletionOutput, setup: ChatSetup) -> None:
    """Fills c.content / reasoning_content / tool_calls / message from c.text, as the HTTP
    API's non-streamed message (the whole text fed to one ChatOutput)."""
    out = setup.new_output()
    if out is None:
        return
    out.feed(c.text, len(c.token_ids))
    out.finish()
    c.message = out.message()
    c.content = c.message["content"]
    c.reasoning_content = c.message.get("reasoning_content")
    c.tool_calls = list(out.calls)
    c.finish_reason = out.finish_reason(c.finish_reason)
