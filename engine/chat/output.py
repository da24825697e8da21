"""One chat choice's output split into reasoning, content and tool calls, as it streams.

    engine delta text --> ReasoningStream (engine/chat/reasoning.py) --> reasoning_content
                                 | answer text
                                 v
                          ToolCallStream (engine/chat/tool_parsers.py) --> content, tool calls

`feed` returns the OpenAI chat-completion `delta` objects for a piece of output, in order;
the same object accumulates the whole message, so a non-streamed response (`message()`) is
exactly the concatenation of the streamed deltas. A tool call streams as OpenAI sends it:

    {"tool_calls": [{"index": 0, "id": "call_...", "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}]}
    {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\": "}}]}
    {"tool_calls": [{"index": 0, "function": {"arguments": "\\"Paris\\"}"}}]}

`incremental` (engine/chat/call_stream.py): the call is announced once its name is complete
and its arguments follow as the model writes them; otherwise it comes whole once it closes
(the head, then all its arguments in one fragment).

and the choice's finish_reason becomes "tool_calls" when it made calls and stopped on its
own ("length" stays "length"). Tool calls inside the thought are not parsed.
"""

from __future__ import annotations

from engine.chat.call_stream import ToolCallStream
from engine.chat.reasoning import ReasoningFormat, ReasoningStream
from engine.chat.tool_parsers import ToolCall, ToolCallFormat


class ChatOutput:
    def __init__(
        self,
        reasoning: ReasoningFormat | None,
        tool_format: ToolCallFormat | None,
        incremental: bool = False,
    ):
        self.reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self.tools = ToolCallStream(tool_format, incremental) if tool_format is not None else None
        self.content = ""
        self.reasoning_content = ""
        self.finished = False

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning.reasoning_tokens if self.reasoning is not None else 0

    def feed(self, text: str, num_tokens: int = 0) -> list[dict]:
        """The deltas for `text` (output of `num_tokens` tokens)."""
        if self.reasoning is None:
            return self._answer("", text, finish=False)
        thought, answer = self.reasoning.feed(text, num_tokens)
        return self._answer(thought, answer, finish=False)

    def feed_outputs(self, outputs, done: bool) -> list[dict]:
        """The deltas of engine outputs (RequestOutput: new_text, new_token_ids), fed one by
        one, plus finish() when `done`; adjacent text deltas of one kind merged."""
        deltas: list[dict] = []
        for o in outputs:
            deltas += self.feed(o.new_text, len(o.new_token_ids))
        deltas += self.finish() if done else []
        merged: list[dict] = []
        for d in deltas:
            _append(merged, d)
        return merged

    def finish(self) -> list[dict]:
        """The deltas of what was held back, once the output ended (idempotent)."""
        if self.finished:
            return []
        self.finished = True
        thought, answer = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._answer(thought, answer, finish=True)

    def _answer(self, thought: str, answer: str, finish: bool) -> list[dict]:
        deltas: list[dict] = []
        if thought:
            self.reasoning_content += thought
            deltas.append({"reasoning_content": thought})
        if self.tools is None:
            if answer:
                self.content += answer
                deltas.append({"content": answer})
            return deltas
        events = self.tools.feed(answer) + (self.tools.finish() if finish else [])
        for e in events:
            if e.call is not None:
                head = {"index": e.index, "id": e.call.id, "type": "function"}
                head["function"] = {"name": e.call.name, "arguments": ""}
                deltas.append({"tool_calls": [head]})
            elif e.arguments:
                part = {"index": e.index, "function": {"arguments": e.arguments}}
                _append(deltas, {"tool_calls": [part]})
            else:
                self.content += e.content
                _append(deltas, {"content": e.content})
        return deltas

    def message(self) -> dict:
        """The non-streamed `message` (after finish())."""
        calls = [c.openai() for c in self.calls]
        msg: dict = {"role": "assistant", "content": self.content or (None if calls else "")}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning_content or None
        if calls:
            msg["tool_calls"] = calls
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if engine_reason == "stop" and self.calls:
            return "tool_calls"
        return engine_reason


def _append(deltas: list[dict], d: dict) -> None:
    """Appends `d`, merged into the last delta when both are text of one kind or both
    are arguments of one call (fewer, longer deltas: the same concatenation)."""
    last = deltas[-1] if deltas else {}
    if _is_text(d) and _is_text(last) and d.keys() == last.keys():
        key = next(iter(d))
        deltas[-1] = {key: last[key] + d[key]}
    elif _arguments_of(d) is not None and _arguments_of(last) == _arguments_of(d):
        (part,) = last["tool_calls"]
        text = part["function"]["arguments"] + d["tool_calls"][0]["function"]["arguments"]
        deltas[-1] = {"tool_calls": [{"index": part["index"], "function": {"arguments": text}}]}
    else:
        deltas.append(d)


def _is_text(delta: dict) -> bool:
    return len(delta) == 1 and ("content" in delta or "reasoning_content" in delta)


def _arguments_of(delta: dict) -> int | None:
    """The call index of an arguments-only delta, else None."""
    calls = delta.get("tool_calls")
    if not calls or len(delta) != 1 or "id" in calls[0]:
        return None
    return calls[0]["index"]
