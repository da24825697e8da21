"""What the serving layer asks about LoRA adapters, without importing JAX (the mock server
and the request path stay light): which adapters an engine serves, the resolved identity a
response reports, and the adapter errors. The adapters themselves: engine/lora/adapters.py."""

from __future__ import annotations

import dataclasses

from engine.api_types import AdapterRef, EngineRequest
from engine.errors import InvalidRequestError


class UnknownAdapterError(InvalidRequestError):
    """A request or unload names an adapter that is not loaded (NOT_FOUND / 404)."""

    def __init__(self, name, loaded: list[str]):
        limit = f"not loaded; loaded adapters: {loaded}" if loaded else "no adapter is loaded"
        super().__init__("adapter", name, limit)


class AdapterSlotsFullError(InvalidRequestError):
    """Every slot holds an adapter that is named or still in use."""

    def __init__(self, name: str, max_loras: int):
        super().__init__(
            "adapter", name, f"all max_loras={max_loras} slots are in use (unload one first)"
        )


def loaded_adapters(engine) -> dict[str, AdapterRef]:
    """The adapters an engine serves by name ({} for an engine without LoRA, e.g. the mock;
    data-parallel replicas hold the same adapters)."""
    first = getattr(engine, "replicas", [engine])[0]
    manager = getattr(first, "adapters", None)
    return {} if manager is None else manager.loaded


def request_identity(engine, request: EngineRequest):
    """The identity a response reports: the model's, plus the adapter's name and content
    hash when the request named one (models.identity.ModelIdentity.adapter/adapter_hash)."""
    if request.adapter is None:
        return engine.identity
    ref = loaded_adapters(engine).get(request.adapter)
    content_hash = "" if ref is None else ref.content_hash
    return adapter_identity(engine.identity, request.adapter, content_hash)


def adapter_identity(identity, name: str, content_hash: str):
    """`identity` (a models.identity.ModelIdentity) naming an adapter and its content hash."""
    return dataclasses.replace(identity, adapter=name, adapter_hash=content_hash)
