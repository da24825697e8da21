"""The HTTP API's endpoints besides generation: GET /v1/models, POST /tokenize and
/detokenize (vLLM's shapes), GET /health (503 while the circuit breaker is open), GET /ready
(503 with a reason: warming_up, draining, circuit_open, or the engine's
not_ready_reason(), e.g. the router's no_route) and GET /metrics (the server's
Prometheus registry, the same one gRPC's metrics port serves)."""

from __future__ import annotations

import grpc
import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.chat.setup import chat_token_ids
from engine.errors import InvalidRequestError
from engine.lora.refs import adapter_identity, loaded_adapters
from serving.frontend.generation import Generator, Refusal, invalid
from serving.grpc_api import convert
from serving.http import responses as resp
from serving.http import schemas


class InfoEndpoints:
    def __init__(self, generator: Generator, metrics):
        self.generator, self.metrics = generator, metrics
        self.identity = generator.identity
        self.tokenizer = generator.engine.tokenizer

    def register(self, app: FastAPI) -> None:
        app.get("/v1/models")(self.models)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.get("/health")(self.health)
        app.get("/ready")(self.ready)
        app.get("/metrics")(self.prometheus)

    async def models(self, request: Request) -> Response:
        try:
            self.generator.authenticate(resp.api_key(self.generator.tenants, request))
        except Refusal as e:
            return resp.refusal_response(e)
        model = {
            "id": self.identity.name,
            "object": "model",
            "created": 0,
            "owned_by": "pagedjax",
            "root": self.identity.name,
            "max_model_len": self.generator.limits.admission.max_model_len,
            "pagedjax": {"versions": convert.versions_dict(self.identity)},
        }
        return JSONResponse({"object": "list", "data": [model, *self._adapters(model)]})

    def _adapters(self, base: dict) -> list[dict]:
        """Loaded LoRA adapters, listed as vLLM does: a model whose parent is the base."""
        out = []
        for name, ref in sorted(loaded_adapters(self.generator.engine).items()):
            identity = adapter_identity(self.identity, name, ref.content_hash)
            versions = {"versions": convert.versions_dict(identity)}
            out.append({**base, "id": name, "parent": base["id"], "pagedjax": versions})
        return out

    async def tokenize(self, request: Request) -> Response:
        try:
            self.generator.authenticate(resp.api_key(self.generator.tenants, request))
            body = schemas.parse_body(schemas.TokenizeRequest, await request.body())
            self.generator.check_model(body.model, "")
            ids = self._tokenize(body)
        except Refusal as e:
            return resp.refusal_response(e)
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.generator.limits.admission.max_model_len,
                "tokens": ids,
            }
        )

    def _tokenize(self, body: schemas.TokenizeRequest) -> list[int]:
        if (body.prompt is None) == (body.messages is None):
            raise invalid(
                InvalidRequestError("prompt", None, "set exactly one of prompt, messages")
            )
        try:
            if body.messages is not None:
                dicts = [{"role": m.role, "content": m.text()} for m in body.messages]
                return chat_token_ids(self.tokenizer, dicts, body.add_generation_prompt)
            if body.add_special_tokens:
                return list(self.tokenizer.encode(body.prompt))
            return list(self.tokenizer.encode(body.prompt, add_special_tokens=False))
        except InvalidRequestError as e:
            raise invalid(e) from e
        except ValueError as e:  # e.g. no chat template
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(e)) from e

    async def detokenize(self, request: Request) -> Response:
        try:
            self.generator.authenticate(resp.api_key(self.generator.tenants, request))
            body = schemas.parse_body(schemas.DetokenizeRequest, await request.body())
            self.generator.check_model(body.model, "")
            schemas.prompt_ids(self.tokenizer, body.tokens, self.generator.vocab_size)
        except InvalidRequestError as e:
            return resp.refusal_response(invalid(InvalidRequestError("tokens", e.value, e.limit)))
        except Refusal as e:
            return resp.refusal_response(e)
        return JSONResponse({"prompt": self.tokenizer.decode(body.tokens)})

    async def health(self) -> Response:
        state = self.generator.breaker.state
        return JSONResponse({"status": state}, 503 if state == "open" else 200)

    async def ready(self) -> Response:
        g = self.generator
        reason = (
            "draining"
            if g.draining
            else "warming_up"
            if not g.ready.is_set()
            else "circuit_open"
            if g.breaker.state == "open"
            else None
        )
        # an engine may know more (the router's RoutedEngine: "no_route" without a worker)
        if reason is None and hasattr(g.engine, "not_ready_reason"):
            reason = g.engine.not_ready_reason()
        return JSONResponse({"ready": reason is None, "reason": reason}, 200 if not reason else 503)

    async def prometheus(self) -> Response:
        return Response(self.metrics.exposition(), media_type=prometheus_client.CONTENT_TYPE_LATEST)
