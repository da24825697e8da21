"""Structured output: the constraint a request puts on its output, validated on creation.

    SamplingParams(structured=StructuredOutput(json_schema={...}))     # or a JSON string
    StructuredOutput(json_object=True)      any JSON object
    StructuredOutput(regex=r"[a-z]+@[a-z]+\\.com")
    StructuredOutput(choice=["yes", "no"])  exactly one of the strings
    StructuredOutput(grammar="start: ...")  Lark (llguidance's dialect); GBNF ("::=") is
                                            converted with llguidance.gbnf_to_lark

Exactly one field is set. Each is turned into one llguidance grammar string
(`grammar_text`), which is validated here, without a tokenizer, so a bad schema, regex or
grammar fails when the request is built: InvalidRequestError naming the field
("structured.json_schema", ...) and llguidance's own message (which names unsupported
schema features, e.g. "Unknown format: ..."). Compiling against the model's tokenizer and
matching tokens is engine/structured/matcher.py; the device side is engine/structured/mask.py.

Why llguidance (measured against xgrammar 0.2.9 with SmolLM2's tokenizer; WORKSPACE.md
"Structured output"): correct on every random constrained walk for both, masks in ~20 us
(median) vs ~1 us for xgrammar, both negligible beside a decode step (tens of ms here), and
llguidance has no dependencies while xgrammar pulls torch, triton and transformers into the
runtime. Bounded compile: llguidance's parser limits (lexer fuel, grammar size, Earley items
per step) turn a pathological constraint into an error instead of a hang.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from configs.errors import InvalidRequestError, bounded

MAX_CHOICES = 1024
MAX_CONSTRAINT_CHARS = 200_000  # a schema / regex / grammar longer than this is refused
# JSON Schema output is compact (no free whitespace): shorter outputs, fewer tokens.
JSON_OPTIONS = {"whitespace_flexible": False}
_FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def parser_limits() -> llguidance.LLParserLimits:
    """The bounds on compile and per-token work (llguidance's defaults, written down)."""
    return llguidance.LLParserLimits(
        initial_lexer_fuel=1_000_000,  # ~20 ms of regex analysis when a matcher is built
        step_lexer_fuel=200_000,  # ~15 ms per mask at worst
        step_max_items=50_000,
        max_lexer_states=250_000,
        max_grammar_size=500_000,
    )


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """One output constraint; `json_schema` is stored canonical (a sorted-keys JSON string),
    so the object is hashable and equal constraints share a compiled grammar."""

    json_schema: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _canonical_schema(self.json_schema))
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidRequestError(f"structured.{name}", value, "must be a string")
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError("structured.json_object", self.json_object, "a bool")
        set_fields = [f for f in _FIELDS if getattr(self, f) not in (None, False)]
        if len(set_fields) != 1:
            raise InvalidRequestError(
                "structured", set_fields, f"exactly one of {', '.join(_FIELDS)} must be set"
            )
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and len(value) > MAX_CONSTRAINT_CHARS:
                raise InvalidRequestError(
                    f"structured.{name}", f"{len(value)} chars", f"<= {MAX_CONSTRAINT_CHARS}"
                )
        _validated_grammar(self.kind, self.value)

    @classmethod
    def from_dict(cls, d: dict) -> StructuredOutput:
        """{"json_schema": {...}} and the like (the wire form of HTTP / gRPC)."""
        unknown = set(d) - set(_FIELDS)
        if unknown:
            raise InvalidRequestError("structured", sorted(unknown), f"fields are {_FIELDS}")
        return cls(**d)

    @property
    def kind(self) -> str:
        return next(f for f in _FIELDS if getattr(self, f) not in (None, False))

    @property
    def value(self):
        return getattr(self, self.kind)

    @property
    def schema(self) -> dict | None:
        return None if self.json_schema is None else json.loads(self.json_schema)

    @property
    def grammar_text(self) -> str:
        """The llguidance grammar (validated on creation; cached per constraint)."""
        return _validated_grammar(self.kind, self.value)


def _canonical_schema(schema) -> str:
    field = "structured.json_schema"
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(field, schema, f"not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidRequestError(field, schema, "JSON nested less deeply") from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(field, schema, "a JSON Schema is an object (dict) or a bool")
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def _choices(choice) -> tuple[str, ...]:
    field = "structured.choice"
    if isinstance(choice, str) or not isinstance(choice, Sequence):
        raise InvalidRequestError(field, choice, "a list of strings")
    items = tuple(choice)
    if not 1 <= len(items) <= MAX_CHOICES:
        raise InvalidRequestError(field, len(items), f"1 to {MAX_CHOICES} strings")
    for s in items:
        if not isinstance(s, str) or not s:
            raise InvalidRequestError(field, s, "each choice must be a non-empty string")
    return items


def _grammar_for(kind: str, value) -> str:
    M = llguidance.LLMatcher
    if kind == "json_schema":
        return M.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return M.grammar_from_regex(value)
    if kind == "choice":
        # NOTE: Lark string literals are JSON-quoted in llguidance's dialect.
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in value))
    if "::=" in value:  # GBNF (llama.cpp's grammar format)
        try:
            value = gbnf_to_lark(value)
        except (GbnfToLarkError, ValueError) as e:
            raise InvalidRequestError("structured.grammar", value, f"GBNF: {e}") from None
    return M.grammar_from_lark(value)


_MAX_MESSAGE_LINES, _MESSAGE_LINE_CHARS = 8, 80  # of llguidance's error message


@functools.lru_cache(maxsize=1024)
def _validated_grammar(kind: str, value) -> str:
    """The grammar of a constraint, or InvalidRequestError with llguidance's message."""
    grammar = _grammar_for(kind, value)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=parser_limits()
    )
    if is_error:
        # NOTE: llguidance quotes the offending line whole (a 4 MB one-line grammar), and the
        # error already echoes the value: each line of its message keeps 80 characters.
        lines = messages[0].strip().splitlines()[:_MAX_MESSAGE_LINES]
        message = "\n".join(bounded(line, _MESSAGE_LINE_CHARS) for line in lines)
        raise InvalidRequestError(f"structured.{kind}", value, message)
    return grammar
