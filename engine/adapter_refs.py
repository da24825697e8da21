"""What the serving layer asks about LoRA adapters, without importing JAX (the mock server
and the request path stay light): which adapters an engine serves, and the resolved identity
a response reports. The adapters themselves live in engine/adapters.py."""

from __future__ import annotations

import dataclasses

from engine.api_types import AdapterRef, EngineRequest


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
    return dataclasses.replace(engine.identity, adapter=request.adapter, adapter_hash=content_hash)
