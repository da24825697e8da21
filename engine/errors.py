"""Exceptions that are part of the engine's interface. The serving layer maps each to one
gRPC status code (InvalidRequestError -> INVALID_ARGUMENT, and so on). The base class and
InvalidRequestError live in configs/errors.py (below models/, which raises it too)."""

from __future__ import annotations

from configs.errors import InvalidRequestError, PagedJaxError

__all__ = [
    "DuplicateRequestError",
    "EngineStepError",
    "InvalidRequestError",
    "PagedJaxError",
    "WarmupCancelled",
]


class DuplicateRequestError(InvalidRequestError):
    def __init__(self, request_id: str):
        super().__init__("request_id", request_id, "a request with this id is already running")


class EngineStepError(PagedJaxError):
    """A device step failed; only the requests in that step are failed."""


class WarmupCancelled(PagedJaxError):
    """Warm-up's `stop()` returned True (engine/runner/warmup.py): the programs not yet started
    were not built. Here, not in engine/runner/warmup.py, so the serving layer catches it without
    importing jax (the router imports serving.server)."""
