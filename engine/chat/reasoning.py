"""Reasoning output: the model's thought (`<think>...</think>`) apart from its answer
(`--reasoning_parser`), as vLLM, SGLang and DeepSeek's API return it: the thought in
`message.reasoning_content` (streamed as `delta.reasoning_content`), the answer in `content`.

    qwen3         the output opens with <think> when the model thinks (Qwen3's template
                  with enable_thinking=false puts an empty <think></think> in the prompt, and
                  the output is all answer); no <think> at the start: no reasoning
    deepseek_r1   the template opens <think> in the prompt, so the output starts inside the
                  thought (a leading <think> is dropped); everything before </think> is
                  reasoning; an output that never closes it is all reasoning

`ReasoningStream` splits text as it arrives, token by token; a tag split across tokens is
held back until it is known to be (or not be) the tag, so a streamed split equals the
non-streamed one. A thinking budget (`max_thinking_tokens`) constrains decoding with
`budget_grammar`: after N thought tokens the closing tag is forced and the answer continues.
The whitespace between </think> and the answer is dropped. Reasoning
tokens are counted per fed delta: the tokens of a delta that arrives while the thought is
open (its closing tag included) are reasoning tokens (exact when deltas are single tokens,
as they are without speculative decoding).
"""

from __future__ import annotations

import dataclasses

from engine.chat.tool_parsers import held_prefix

THINK_START, THINK_END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_inside: bool  # the prompt opened the thought (deepseek_r1)
    start: str = THINK_START
    end: str = THINK_END


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3", starts_inside=False),
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_inside=True),
}


def budget_grammar(fmt: ReasoningFormat, max_thinking_tokens: int) -> str:
    """llguidance Lark grammar of an output whose thought holds at most `max_thinking_tokens`
    tokens: once the budget is spent only the closing tag may follow (the constraint forces
    it), then the answer is free. The thought cannot contain the closing tag itself."""
    opener = "" if fmt.starts_inside else f'"{fmt.start}" '
    end = fmt.end.replace("/", "\\/")
    return (
        f'start: {opener}thought "{fmt.end}" answer\n'
        f"thought[max_tokens={max_thinking_tokens}]: THOUGHT\n"
        f"THOUGHT: /(?s:.*)/ & ~/(?s:.*{end}.*)/\n"
        "answer: /(?s:.*)/\n"
    )


def get_reasoning_format(name: str) -> ReasoningFormat:
    if name not in REASONING_FORMATS:
        raise ValueError(f"reasoning parser {name!r}: known are {sorted(REASONING_FORMATS)}")
    return REASONING_FORMATS[name]


_OPENING, _THINKING, _ANSWER = "opening", "thinking", "answer"


class ReasoningStream:
    """feed(text, num_tokens) -> (reasoning, answer) of that delta; finish() the rest."""

    def __init__(self, fmt: ReasoningFormat):
        self.fmt = fmt
        self.reasoning_tokens = 0
        self._state = _OPENING  # not yet known whether the output opens with the start tag
        self._buf = ""
        self._answer_started = False  # whitespace right after </think> is dropped

    @property
    def thinking(self) -> bool:
        """The thought is open (or may still open)."""
        return self._state != _ANSWER

    def feed(self, text: str, num_tokens: int = 0) -> tuple[str, str]:
        if self._state != _ANSWER:
            self.reasoning_tokens += num_tokens
        self._buf += text
        reasoning, answer = [], []
        while self._step(reasoning, answer):
            pass
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """The end of the output: held text goes where its state says."""
        buf, self._buf = self._buf, ""
        if self._state == _OPENING:
            if self.fmt.starts_inside:
                return buf.removeprefix(self.fmt.start), ""
            return "", buf
        if self._state == _THINKING:
            return buf, ""
        return "", self._answer(buf)

    def _step(self, reasoning: list[str], answer: list[str]) -> bool:
        fmt = self.fmt
        if self._state == _OPENING:
            head = self._buf.lstrip()
            if fmt.start.startswith(head) and len(head) < len(fmt.start):
                return False  # may still become the start tag
            if head.startswith(fmt.start):
                self._state, self._buf = _THINKING, head[len(fmt.start) :]
            else:
                self._state = _THINKING if fmt.starts_inside else _ANSWER
                self._answer_started = not fmt.starts_inside  # no thought: text as it is
            return True
        if self._state == _THINKING:
            i = self._buf.find(fmt.end)
            if i >= 0:
                reasoning.append(self._buf[:i])
                self._state, self._buf = _ANSWER, self._buf[i + len(fmt.end) :]
                return True
            keep = held_prefix(self._buf, fmt.end)
            reasoning.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        answer.append(self._answer(self._buf))
        self._buf = ""
        return False

    def _answer(self, text: str) -> str:
        if not self._answer_started:
            text = text.lstrip()
            self._answer_started = bool(text)
        return text


def split(fmt: ReasoningFormat, text: str) -> tuple[str, str]:
    """(reasoning, answer) of a whole output: the stream fed at once."""
    stream = ReasoningStream(fmt)
    r1, a1 = stream.feed(text)
    r2, a2 = stream.finish()
    return r1 + r2, a1 + a2
