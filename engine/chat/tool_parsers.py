"""Tool-call formats: a model family's call markup in its output text <-> OpenAI tool calls.

One `ToolCallFormat` per family (`--tool_call_parser`), each knowing how its calls look:

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen2.5,
                  Qwen3, Hermes, and the fallback for templates without tool support)
    llama3_json   {"name": "f", "parameters": {...}}  at the start of the output, or after
                  <|python_tag|>; several separated by ';'   (Llama 3.1 / 3.2)
    mistral       [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]   or the newer
                  [TOOL_CALLS]f[ARGS]{...}   (Mistral / Mixtral)

`ToolCallStream` turns the output into content text and whole calls as it arrives, token by
token; the non-streamed response is the same stream fed all at once (`parse`), so streamed
and non-streamed answers agree by construction:

    text "Let me check.<tool_call>\\n{...}\\n</tool_call>"
      feed -> [content "Let me check."]  ... markup held back ...  [call get_weather {...}]

Markup is held back until its call is complete and parses: a call section that is not valid
JSON of the format (or is cut off) comes back as content, never as a crash, and nothing of
the markup of a valid call leaks into content. Whitespace next to markup is dropped.
NOTE: holding a call until it closes means its first streamed delta arrives when the call
is complete, not when its name is known: a call is never announced and then retracted.

Each format also renders calls back into its syntax (history in a template without tool
support) and describes its syntax as an llguidance Lark grammar over the tools' parameter
schemas (engine/chat/setup.py: tool_choice required / named).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re
import uuid
from typing import Any, ClassVar


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is JSON text (what OpenAI's API returns)."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=new_call_id)

    def openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclasses.dataclass(frozen=True)
class ToolEvent:
    """One step of a parsed stream, in output order: content text or a whole call."""

    content: str = ""
    call: ToolCall | None = None


class ToolCallFormat(abc.ABC):
    name: ClassVar[str]
    start: ClassVar[str]  # the markup opening a call section
    end: ClassVar[str | None] = None  # closes one call; None: the section runs to the end
    bare_json_start: ClassVar[bool] = False  # an output starting with '{' is a call section
    args_key: ClassVar[str] = "arguments"

    @abc.abstractmethod
    def parse_section(self, body: str) -> list[tuple[str, dict]] | None:
        """(name, arguments) of each call in the text after `start` (up to `end`), or None
        when it is not a well-formed call section."""

    @abc.abstractmethod
    def render(self, calls: list[tuple[str, dict]]) -> str:
        """Calls in this format's syntax (what the model would have written)."""

    @abc.abstractmethod
    def grammar(self, call_schema: dict, parallel: bool) -> str:
        """llguidance Lark grammar of one (or, if parallel, several) calls, each a JSON
        object matching `call_schema` (serving/http/tool_calling.call_schema)."""

    def lazy_grammar(self, call_schema: dict, parallel: bool) -> str | None:
        """tool_choice=auto: free text until the model writes `start` (the trigger), then
        calls exactly as in `grammar`; None when the format has no trigger tag."""
        calls = self.grammar(call_schema, parallel)
        if self.bare_json_start or not calls.startswith(f'start: "{self.start}'):
            return None
        tag = self.start.replace("[", "\\[").replace("]", "\\]").replace("/", "\\/")
        # the text lexeme cannot hold the tag; LEAD is text that ends at the first tag
        start = calls.replace(f'start: "{self.start}', 'start: TEXT | LEAD "', 1)
        return (
            start.replace('LEAD "" ', "LEAD ", 1)
            + f"TEXT: /(?s:.*)/ & ~/(?s:.*{tag}.*)/\n"
            + f"LEAD: /(?s:.*{tag})/ & ~/(?s:.*{tag}.+)/\n"
        )

    def call_object(self, name: str, args: dict) -> dict:
        return {"name": name, self.args_key: args}


def _call_of(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")):
    """(name, arguments) of a decoded call object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], args


def _json_values(text: str, separator: str = "") -> list[Any] | None:
    """The JSON values in `text` (whitespace and `separator` between them), or None."""
    decoder, values, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError):  # a model's output: never a crash
            return None
        values.append(value)
        while i < len(text) and (text[i].isspace() or (separator and text[i] == separator)):
            i += 1
    return values


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


# Lark: the JSON separators written between keys and items, as the models' own templates do
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE})


class HermesFormat(ToolCallFormat):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse_section(self, body):
        values = _json_values(body)
        if values is None or len(values) != 1:
            return None
        call = _call_of(values[0])
        return None if call is None else [call]

    def render(self, calls):
        return "\n".join(
            f"{self.start}\n{_dumps(self.call_object(n, a))}\n{self.end}" for n, a in calls
        )

    def grammar(self, call_schema, parallel):
        repeat = ' ("\\n" call)*' if parallel else ""
        return (
            f'start: "{self.start}\\n" obj "\\n{self.end}"{repeat}\n'
            f'call: "{self.start}\\n" obj "\\n{self.end}"\n'
            f"obj: {_json_rule(call_schema)}\n"
        )


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    start = "<|python_tag|>"
    bare_json_start = True
    args_key = "parameters"

    def parse_section(self, body):
        values = _json_values(body, separator=";")
        if not values:
            return None
        calls = [_call_of(v) for v in values]
        return None if any(c is None for c in calls) else calls

    def render(self, calls):
        return "; ".join(_dumps(self.call_object(n, a)) for n, a in calls)

    def grammar(self, call_schema, parallel):
        repeat = ' ("; " obj)*' if parallel else ""
        return f"start: obj{repeat}\nobj: {_json_rule(call_schema)}\n"


class MistralFormat(ToolCallFormat):
    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse_section(self, body):
        if body.lstrip().startswith("["):  # [TOOL_CALLS][{...}, {...}]
            values = _json_values(body)
            if values is None or len(values) != 1 or not isinstance(values[0], list):
                return None
            calls = [_call_of(v) for v in values[0]]
        else:  # [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
            calls = [_args_call(part) for part in body.split(self.start)]
        return None if not calls or any(c is None for c in calls) else calls

    def render(self, calls):
        return self.start + _dumps([self.call_object(n, a) for n, a in calls])

    def grammar(self, call_schema, parallel):
        array = {"type": "array", "items": call_schema, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        return f'start: "{self.start}" calls\ncalls: {_json_rule(array)}\n'


def _args_call(part: str):
    name, sep, args = part.partition("[ARGS]")
    values = _json_values(args) if sep else None
    if not values or len(values) != 1 or not re.fullmatch(r"[\w.-]+", name.strip()):
        return None
    return _call_of({"name": name.strip(), "arguments": values[0]})


FORMATS: dict[str, type[ToolCallFormat]] = {
    f.name: f for f in (HermesFormat, Llama3JsonFormat, MistralFormat)
}


def get_format(name: str) -> ToolCallFormat:
    """The format called `name` (ValueError naming the known ones)."""
    if name not in FORMATS:
        raise ValueError(f"tool call parser {name!r}: known are {sorted(FORMATS)}")
    return FORMATS[name]()


def format_for_template(template_text: str | None) -> str:
    """The parser a chat template's own tool syntax implies (hermes when it has none: the
    fallback rendering teaches the model hermes' syntax)."""
    text = template_text or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Output text in, content and whole tool calls out (see the module docstring)."""

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet given out
        self._opener: str | None = None  # inside a call section: the markup that opened it
        self._started = False  # any non-whitespace output seen (bare JSON starts only there)
        self._after_call = False  # drop the whitespace right after a call
        self._held_ws = ""  # trailing whitespace of content (dropped if markup follows)

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        out: list[ToolEvent] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ToolEvent]:
        """The end of the output: an open call section is parsed (or given back as content),
        held text is given out."""
        out: list[ToolEvent] = []
        if self._opener is not None:
            self._close_section(self._buf, "", out)
        else:
            self._content(self._buf, out, before_markup=False)
            if self._held_ws and not self._after_call:
                out.append(ToolEvent(content=self._held_ws))
        self._buf, self._held_ws = "", ""
        return out

    def _step(self, out: list[ToolEvent]) -> bool:
        """Consumes what it can of the buffer; True when it should run again."""
        fmt = self.fmt
        if self._opener is not None:
            if fmt.end is None or (i := self._buf.find(fmt.end)) < 0:
                return False
            body, self._buf = self._buf[:i], self._buf[i + len(fmt.end) :]
            self._close_section(body, fmt.end, out)
            return True
        if fmt.bare_json_start and not self._started:
            stripped = self._buf.lstrip()
            if not stripped:
                return False
            self._started = True
            if stripped.startswith("{"):
                self._opener, self._buf = "", stripped
                return True
        i = self._buf.find(fmt.start)
        if i >= 0:
            self._content(self._buf[:i], out, before_markup=True)
            self._opener, self._buf = fmt.start, self._buf[i + len(fmt.start) :]
            return True
        keep = held_prefix(self._buf, fmt.start)
        self._content(self._buf[: len(self._buf) - keep], out, before_markup=False)
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _close_section(self, body: str, closer: str, out: list[ToolEvent]) -> None:
        opener, self._opener = self._opener or "", None
        calls = self.fmt.parse_section(body)
        if calls is None:  # not a call after all: the model's text, as it wrote it
            self._content(opener + body + closer, out, before_markup=False)
            return
        self._held_ws = ""
        for name, args in calls:
            call = ToolCall(name, _dumps(args))
            self.calls.append(call)
            out.append(ToolEvent(call=call))
        self._after_call = True

    def _content(self, text: str, out: list[ToolEvent], before_markup: bool) -> None:
        if text and not text.isspace():
            self._started = True
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text, self._held_ws = self._held_ws + text, ""
        trimmed = text.rstrip()
        if not before_markup:
            self._held_ws = text[len(trimmed) :]
        if trimmed:
            out.append(ToolEvent(content=trimmed))


def parse(fmt: ToolCallFormat, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output: the stream fed at once."""
    stream = ToolCallStream(fmt)
    events = stream.feed(text) + stream.finish()
    return "".join(e.content for e in events), stream.calls
