"""Exception types every layer may raise (configs, models, engine, serving): kept at the
bottom of the import graph so models/ (tokenizer, chat template) can reject bad input without
importing engine/. engine.errors re-exports them next to the engine's own errors; the
serving layer maps each to one status code (InvalidRequestError -> INVALID_ARGUMENT)."""

from __future__ import annotations


class PagedJaxError(Exception):
    """Base class of the engine's errors."""


class InvalidRequestError(PagedJaxError, ValueError):
    """A request field is out of range. Names the field, the value and the limit."""

    def __init__(self, field: str, value, limit: str):
        self.field, self.value, self.limit = field, value, limit
        super().__init__(f"{field}={value!r} is invalid: {limit}")
