"""Exceptions that are part of the engine's interface. The serving layer maps each to one
gRPC status code (InvalidRequestError -> INVALID_ARGUMENT, and so on)."""

from __future__ import annotations


class PagedJaxError(Exception):
    """Base class of the engine's errors."""


class InvalidRequestError(PagedJaxError, ValueError):
    """A request field is out of range. Names the field, the value and the limit."""

    def __init__(self, field: str, value, limit: str):
        self.field, self.value, self.limit = field, value, limit
        super().__init__(f"{field}={value!r} is invalid: {limit}")


class DuplicateRequestError(InvalidRequestError):
    def __init__(self, request_id: str):
        super().__init__("request_id", request_id, "a request with this id is already running")


class EngineStepError(PagedJaxError):
    """A device step failed; only the requests in that step are failed."""
