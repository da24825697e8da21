"""Tool-call formats: a model family's call markup in its output text <-> OpenAI tool calls.

One `ToolCallFormat` per family (`--tool_call_parser`), each knowing how its calls look:

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen2.5,
                  Qwen3, Hermes, and the fallback for templates without tool support)
    llama3_json   {"name": "f", "parameters": {...}}  at the start of the output, or after
                  <|python_tag|>; several separated by ';'   (Llama 3.1 / 3.2)
    mistral       [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]   or the newer
                  [TOOL_CALLS]f[ARGS]{...}   (Mistral / Mixtral)

engine/chat/call_stream.py reads calls out of the output as it streams (whole calls, or
OpenAI's name-first deltas when a grammar holds the syntax); `parse_section` is the whole
reading of one call section.

Each format also renders calls back into its syntax (history in a template without tool
support) and describes its syntax as an llguidance Lark grammar over the tools' parameter
schemas (engine/chat/setup.py): forced (tool_choice required / named) and lazy (auto: free
text until the trigger, then the same calls). A trigger that the tokenizer holds as one
special token (Llama 3's <|python_tag|>, Mistral's [TOOL_CALLS]) is written `<[id]>`, the
token itself, which no text lexeme can produce. NOTE: where a grammar forces bytes (the
call's opening), llguidance allows only the tokenizer's canonical tokens for them.
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


class ToolCallFormat(abc.ABC):
    name: ClassVar[str]
    start: ClassVar[str]  # the markup opening a call section
    end: ClassVar[str | None] = None  # closes one call; None: the section runs to the end
    bare_json_start: ClassVar[bool] = False  # an output starting with '{' is a call section
    args_key: ClassVar[str] = "arguments"
    # how a section's calls follow one another, for reading them as they stream
    # (engine/chat/call_stream.py): a list around them, a separator between, a name as markup
    list_open: ClassVar[str | None] = None
    list_close: ClassVar[str | None] = None
    separator: ClassVar[str | None] = None
    named_args: ClassVar[str | None] = None

    @abc.abstractmethod
    def parse_section(self, body: str) -> list[tuple[str, dict]] | None:
        """(name, arguments) of each call in the text after `start` (up to `end`), or None
        when it is not a well-formed call section."""

    @abc.abstractmethod
    def render(self, calls: list[tuple[str, dict]]) -> str:
        """Calls in this format's syntax (what the model would have written)."""

    @abc.abstractmethod
    def body_rules(self, call_schema: dict, parallel: bool) -> str:
        """Lark rule `body` (and its helpers): what follows `start` in a call section, one
        (or, if parallel, several) calls, each a JSON object matching `call_schema`
        (engine/chat/setup.py `call_schema`). It may refer to rule `section` (the tag again,
        then a body)."""

    def grammar(self, call_schema: dict, parallel: bool, tag_token: int | None = None) -> str:
        """llguidance Lark grammar of a forced call section (tool_choice required / named).
        `tag_token`: the id of `start` where the tokenizer holds it as one special token
        (Llama 3's <|python_tag|>, Mistral's [TOOL_CALLS]); the grammar then asks for that
        token, which text can never spell."""
        start = "body" if self.bare_json_start else "section"
        return f"start: {start}\n" + self._section_rules(call_schema, parallel, tag_token)

    def lazy_grammar(self, call_schema: dict, parallel: bool, tag_token: int | None = None) -> str:
        """tool_choice=auto: free text until the model opens a call section (its trigger:
        `start`, and for a bare-JSON format an output that begins with '{'), then calls
        exactly as in `grammar`. The free text is one lexeme that cannot hold the trigger,
        so it is never constrained otherwise; a trigger that is a special token is outside
        every text lexeme already (llguidance's struct-tag construction)."""
        rules = self._section_rules(call_schema, parallel, tag_token)
        not_bare = " & ~/(?s:\\s*\\{.*)/" if self.bare_json_start else ""
        bare = " | WS? body" if self.bare_json_start else ""
        ws = "WS: /\\s+/\n" if self.bare_json_start else ""
        if tag_token is not None:
            return f"start: TEXT | TEXT? section{bare}\n{rules}{ws}TEXT: /(?s:.*)/{not_bare}\n"
        tag = re.escape(self.start).replace("/", "\\/")
        # LEAD is text that ends at the first tag
        return (
            f"start: TEXT | LEAD body{bare}\n{rules}{ws}"
            f"TEXT: /(?s:.*)/ & ~/(?s:.*{tag}.*)/{not_bare}\n"
            f"LEAD: /(?s:.*{tag})/ & ~/(?s:.*{tag}.+)/{not_bare}\n"
        )

    def _section_rules(self, call_schema: dict, parallel: bool, tag_token: int | None) -> str:
        tag = json.dumps(self.start) if tag_token is None else f"<[{tag_token}]>"
        return f"section: {tag} body\n" + self.body_rules(call_schema, parallel)

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


def dumps(obj: Any) -> str:
    """JSON text as the models write it (", " and ": ", characters unescaped)."""
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
            f"{self.start}\n{dumps(self.call_object(n, a))}\n{self.end}" for n, a in calls
        )

    def body_rules(self, call_schema, parallel):
        repeat = ' ("\\n" section)?' if parallel else ""
        return f'body: "\\n" obj "\\n{self.end}"{repeat}\nobj: {_json_rule(call_schema)}\n'


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    start = "<|python_tag|>"
    bare_json_start = True
    args_key = "parameters"
    separator = ";"

    def parse_section(self, body):
        values = _json_values(body, separator=";")
        if not values:
            return None
        calls = [_call_of(v) for v in values]
        return None if any(c is None for c in calls) else calls

    def render(self, calls):
        return "; ".join(dumps(self.call_object(n, a)) for n, a in calls)

    def body_rules(self, call_schema, parallel):
        repeat = ' ("; " obj)*' if parallel else ""
        return f"body: obj{repeat}\nobj: {_json_rule(call_schema)}\n"


class MistralFormat(ToolCallFormat):
    name = "mistral"
    start = "[TOOL_CALLS]"
    list_open, list_close, named_args = "[", "]", "[ARGS]"

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
        return self.start + dumps([self.call_object(n, a) for n, a in calls])

    def body_rules(self, call_schema, parallel):
        array = {"type": "array", "items": call_schema, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        return f"body: {_json_rule(array)}\n"


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
