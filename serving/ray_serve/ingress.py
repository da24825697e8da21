"""The Serve ingress: HTTP in, routed to an engine replica, the replica's own HTTP answer out.

    client --HTTP--> Serve proxy --> PagedJaxIngress (RoutingKey from the body)
                                       | handle.relay(HttpCall), streamed; the engine
                                       | deployment's request router picks the replica
                                       v
                                     PagedJaxReplica.relay: the call run through the
                                     replica's own OpenAI-compatible FastAPI app
                                     (serving/http/api.py) in-process

Serve's HTTP proxy hands a deployment the raw ASGI request, whose body a request router never
sees; so, like Ray Serve LLM's OpenAI ingress, a light ingress deployment reads the body,
makes its RoutingKey (serving/ray_serve/router.py) and calls the engine deployment through a
handle. The replica answers with its own status, headers and body, streamed chunk by chunk
(`ResponseStart` first): versions, errors, 429 + Retry-After from its admission and SSE
streams reach the client as the server wrote them, and a client that goes away cancels the
handle call, which the replica's app sees as a disconnect (it cancels the request). Serve's
own queue bound (max_queued_requests) answers 429 + Retry-After here.

A replica that dies (its actor killed, its node lost):
  before its answer began   the call is sent once more (Serve's router has dropped the dead
                            replica, so another one takes it); nothing of it reached the client.
                            A second death is 503 + Retry-After, `code: replica_unavailable`
  mid-stream                the stream ends with an OpenAI error event (`data: {"error": ...}`,
                            `code: replica_died`), which the openai SDK raises as an APIError;
                            a non-SSE body is cut short (its client sees a broken response)
Never a hang: Ray fails the handle's stream as soon as it learns the actor is gone.

May import: ray.serve, fastapi/starlette, serving.ray_serve.router.
"""

# NOTE: no `from __future__ import annotations`: Serve's class ingress rebuilds the route's
# signature, and FastAPI then reads a string annotation `Request` as a query parameter.
import asyncio
import contextlib
import dataclasses
import json
import math
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from serving.ray_serve.router import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_BLOCK_TOKENS,
    RoutingKey,
    routing_key,
)

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
REPLICA_GONE = (ActorDiedError, ActorUnavailableError)
RETRY_AFTER_S = 1  # after a replica died: Serve starts another
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


@dataclasses.dataclass(frozen=True)
class HttpCall:
    """One HTTP request as the ingress received it, and its routing key."""

    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    key: RoutingKey | None = None


@dataclasses.dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[str, str], ...]


def call_of(method: str, path: str, query: str, headers, body: bytes, **key_options) -> HttpCall:
    """An HttpCall with the RoutingKey of an OpenAI generation body (None for other paths)."""
    lowered = {k.lower(): v for k, v in headers}
    key = None
    if path in ROUTED_PATHS:
        with contextlib.suppress(ValueError):  # not JSON: no key, the replica answers 400
            parsed = json.loads(body or b"{}")
            if isinstance(parsed, dict):
                key = routing_key(parsed, lowered, **key_options)
    return HttpCall(method, path, query, tuple(headers), body, key)


async def run_asgi(app, call: HttpCall) -> AsyncIterator[ResponseStart | bytes]:
    """`call` through an ASGI app in this process: its ResponseStart, then its body chunks.
    Closing the iterator early (the client left) tells the app the client disconnected."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.create_task(app(_scope(call), receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                raw = message["headers"]
                headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in raw)
                yield ResponseStart(message["status"], headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        if task.done() and task.exception() is not None:
            raise task.exception()
    finally:
        gone.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 5.0)  # the app's own cleanup
        task.cancel()


def _scope(call: HttpCall) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "query_string": call.query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in call.headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }


def _error(message: str, type_: str, code: str) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


async def _chunks(stream, sse: bool) -> AsyncIterator[bytes]:
    done = False
    try:
        async for chunk in stream:
            yield chunk
        done = True
    except REPLICA_GONE as e:
        done = True  # nothing left to cancel
        if not sse:
            raise
        why = f"the replica serving this stream died: {type(e).__name__}"
        event = _error(why, "server_error", "replica_died")
        yield f"data: {json.dumps(event)}\n\n".encode()
    finally:
        if not done:
            stream.cancel()  # the client left mid-stream: the replica's app sees a disconnect


def _unavailable(e: Exception) -> Response:
    why = f"no live replica answered: {type(e).__name__}"
    headers = {"Retry-After": str(RETRY_AFTER_S), "retry-after-ms": str(RETRY_AFTER_S * 1000)}
    body = _error(why, "server_error", "replica_unavailable")
    return JSONResponse(body, status_code=503, headers=headers)


def _backpressure(e: BackPressureError) -> Response:
    retry_after_s = e.retry_after_s or 1.0
    headers = {
        "Retry-After": str(max(1, math.ceil(retry_after_s))),
        "retry-after-ms": str(int(retry_after_s * 1000)),
    }
    body = {"error": {"message": e.message, "type": "overloaded", "code": e.status_code}}
    return JSONResponse(body, status_code=e.status_code, headers=headers)


async def answer(handle: DeploymentHandle, call: HttpCall) -> Response:
    """`call` through `handle` (its `relay`, streamed), the replica's answer as the response:
    Serve's backpressure as 429 + Retry-After, a replica that died before answering tried
    once more (503 after a second death), a client that leaves cancels the call."""
    for attempt in range(2):
        stream = handle.remote(call)
        try:
            start = await stream.__anext__()
            break
        except BackPressureError as e:
            return _backpressure(e)
        except StopAsyncIteration:
            return JSONResponse({"error": {"message": "empty reply from replica"}}, 502)
        except REPLICA_GONE as e:
            if attempt:
                return _unavailable(e)
        except asyncio.CancelledError:
            stream.cancel()  # the client left before the answer began
            raise
    assert isinstance(start, ResponseStart), start
    headers = {k: v for k, v in start.headers if k.lower() not in _HOP_HEADERS}
    kind = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
    sse = kind.startswith("text/event-stream")
    return StreamingResponse(_chunks(stream, sse), status_code=start.status, headers=headers)


async def collect(handle: DeploymentHandle, call: HttpCall) -> tuple[int, dict, bytes]:
    """`call`'s whole answer (status, headers, body), or a Response that ends the request
    (Serve's backpressure, no live replica)."""
    reply = await answer(handle, call)
    if not isinstance(reply, StreamingResponse):
        return reply.status_code, dict(reply.headers), reply.body
    body = b"".join([chunk async for chunk in reply.body_iterator])
    return reply.status_code, dict(reply.headers), body


def incoming(request: Request, path: str, body: bytes, **key_options) -> HttpCall:
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS]
    return call_of(request.method, "/" + path, request.url.query, headers, body, **key_options)


# NOTE: the helpers above are defined before the class: serve.ingress serializes the class
# when it is decorated, with the module globals that exist at that point.
api = FastAPI(title="pagedjax on Ray Serve")
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]


@serve.deployment(name="ingress")
@serve.ingress(api)
class PagedJaxIngress:
    """Reads the body, routes the call to an engine replica, relays the replica's answer."""

    def __init__(
        self,
        engine: DeploymentHandle,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ):
        self.engine = engine.options(method_name="relay", stream=True)
        self.key_options = dict(block_bytes=block_bytes, block_tokens=block_tokens)

    @api.api_route("/{path:path}", methods=METHODS)
    async def relay(self, path: str, request: Request) -> Response:
        call = incoming(request, path, await request.body(), **self.key_options)
        return await answer(self.engine, call)
