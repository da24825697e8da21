"""Loading and unloading LoRA adapters while the server runs (vLLM's endpoints and bodies):

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Off unless the server runs with `--allow_runtime_lora` (ServerConfig.allow_runtime_lora):
the path is read on the server's filesystem, so this is an operator's switch (403 when off).
The load itself runs on the engine thread between two steps (EngineLoop.run_on_engine_thread):
requests running on an adapter that is unloaded or replaced finish on the weights they
started with (engine/lora/adapters.py). Statuses: 200 with the adapter's name, content hash and
rank; 400 for a bad body or adapter directory (the message names the field, the value and
the limit); 404 unloading a name not loaded; 409 when the engine has no LoRA slots or
they are all in use.
"""

from __future__ import annotations

import asyncio
import json

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from configs.errors import echo
from engine.errors import InvalidRequestError
from engine.lora.refs import AdapterSlotsFullError, UnknownAdapterError
from serving.frontend.generation import Generator, Refusal
from serving.http import responses as resp

LOAD_TIMEOUT_S = 120.0


class LoraEndpoints:
    def __init__(self, generator: Generator):
        self.generator = generator

    def register(self, app: FastAPI) -> None:
        app.post("/v1/load_lora_adapter")(self.load)
        app.post("/v1/unload_lora_adapter")(self.unload)

    async def load(self, request: Request) -> Response:
        return await self._run(request, ("lora_name", "lora_path"), _load)

    async def unload(self, request: Request) -> Response:
        return await self._run(request, ("lora_name",), _unload)

    async def _run(self, request: Request, fields: tuple[str, ...], action) -> Response:
        try:
            self.generator.authenticate(resp.api_key(self.generator.tenants, request))
            if not getattr(self.generator, "allow_runtime_lora", False):
                raise Refusal(
                    grpc.StatusCode.PERMISSION_DENIED,
                    "runtime_lora_off",
                    "runtime LoRA updates are off (start the server with --allow_runtime_lora)",
                )
            args = _fields(await request.body(), fields)
        except Refusal as e:
            return resp.refusal_response(e)
        future = self.generator.loop.run_on_engine_thread(lambda engine: action(engine, *args))
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(future), LOAD_TIMEOUT_S)
        except Exception as e:
            return resp.error_response(*_status_of(e), str(e), param="lora_name")
        return JSONResponse(result)


def _fields(body: bytes, names: tuple[str, ...]) -> list[str]:
    try:
        data = json.loads(body or b"{}")
    except ValueError as e:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", f"body: {e}") from e
    values = [data.get(n) if isinstance(data, dict) else None for n in names]
    for name, value in zip(names, values):
        if not isinstance(value, str) or not value:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                "invalid_argument",
                f"{name}={echo(value)} is invalid: a non-empty string",
                param=name,
            )
    return values


def _replicas(engine) -> list:
    return getattr(engine, "replicas", [engine])


def _load(engine, name: str, path: str) -> dict:
    if not hasattr(_replicas(engine)[0], "load_adapter"):
        raise _NoLora()
    refs = [replica.load_adapter(name, path) for replica in _replicas(engine)]
    ref = refs[0]
    return {"lora_name": ref.name, "content_hash": ref.content_hash, "rank": ref.rank}


def _unload(engine, name: str) -> dict:
    if not hasattr(_replicas(engine)[0], "unload_adapter"):
        raise _NoLora()
    for replica in _replicas(engine):
        replica.unload_adapter(name)
    return {"lora_name": name, "unloaded": True}


class _NoLora(Exception):
    def __str__(self) -> str:
        return "this engine serves no LoRA adapters (the mock engine)"


def _status_of(e: Exception) -> tuple[grpc.StatusCode]:
    if isinstance(e, UnknownAdapterError):
        return (grpc.StatusCode.NOT_FOUND,)
    if isinstance(e, (AdapterSlotsFullError, _NoLora)) or (
        isinstance(e, InvalidRequestError) and e.field == "max_loras"
    ):
        return (grpc.StatusCode.FAILED_PRECONDITION,)
    if isinstance(e, (ValueError, FileNotFoundError)):  # LoraConfigError is a ValueError
        return (grpc.StatusCode.INVALID_ARGUMENT,)
    return (grpc.StatusCode.INTERNAL,)
