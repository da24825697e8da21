"""Exception types every layer may raise (configs, models, engine, serving): kept at the
bottom of the import graph so models/ (tokenizer, chat template) can reject bad input without
importing engine/. engine.errors re-exports them next to the engine's own errors; the
serving layer maps each to one status code (InvalidRequestError -> INVALID_ARGUMENT)."""

from __future__ import annotations

MAX_ECHO_CHARS = 200  # of an offending value quoted in an error message or a log line
MAX_MESSAGE_CHARS = 1000  # of a whole message (a parser's, which may quote the input)


def echo(value) -> str:
    """repr(value) for an error message or a log line, cut to MAX_ECHO_CHARS characters with
    its length when longer: a 4 MB field is never written back whole (issue 37)."""
    text = repr(value)
    if len(text) <= MAX_ECHO_CHARS:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} as text"
    return f"{text[:MAX_ECHO_CHARS]}... ({size})"


def bounded(text: str, max_chars: int = MAX_MESSAGE_CHARS) -> str:
    """`text` (a message, a field name) cut to `max_chars` characters with its length."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}... ({len(text)} characters)"


class PagedJaxError(Exception):
    """Base class of the engine's errors."""


class InvalidRequestError(PagedJaxError, ValueError):
    """A request field is out of range. Names the field, the value and the limit."""

    def __init__(self, field: str, value, limit: str):
        self.field, self.value, self.limit = field, value, limit
        super().__init__(
            f"{bounded(field, MAX_ECHO_CHARS)}={echo(value)} is invalid: {bounded(str(limit))}"
        )
