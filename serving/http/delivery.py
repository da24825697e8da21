"""When an HTTP response counts as delivered: the outcome `success` of an HTTP request is
recorded once its last byte was handed to a connection the client had not left, as gRPC
records it once the transport took the final message (issue 17: "success only when the final
message was sent"). A client that leaves first ends cancelled{client}, even when the engine
had already finished.

    streamed (SSE)   the relay (http_api.HttpApi._sse) yields its last event ("data: [DONE]");
                     Starlette resumes it only after uvicorn's send() returned, which waits
                     for the socket to drain (flow control) -> one loop turn, so that a
                     disconnect uvicorn saw meanwhile is noticed -> `gone` not set: success
    non-streamed     DeliveredJSONResponse checks `gone` (a task watching receive() for
                     http.disconnect) before writing the body and right after the write
                     returned, then calls `on_sent` (else `on_gone`: cancelled{client})

What cannot be seen: bytes in the kernel's socket buffers that the client never reads
(uvicorn's send returns once they are written there); a client that closes after that is
counted a success, as on gRPC.

The relay also tells the slow-consumer policy (request_state.SlowConsumerPolicy) what the
transport accepted: `sending(r)` before a chunk is yielded, `sent(r, tokens)` after
uvicorn took it, exactly as the gRPC handler does around each message.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from fastapi.responses import JSONResponse, StreamingResponse


def sending(r) -> None:
    """A chunk with `r`'s tokens is about to be handed to the transport."""
    r.send_started_s = time.monotonic()


def sent(r, num_tokens: int) -> None:
    """The transport took it (uvicorn's send returned)."""
    r.send_started_s = None
    r.tokens_sent += num_tokens


class DeliveryStreamingResponse(StreamingResponse):
    """StreamingResponse that sets `gone` when the client disconnects, and closes the relay
    generator as soon as the response ends (so its `finally`, which records a disconnected
    client's outcome, runs now rather than whenever the generator is garbage collected)."""

    def __init__(self, content, gone: asyncio.Event, **kwargs):
        super().__init__(content, **kwargs)
        self.gone = gone

    async def listen_for_disconnect(self, receive) -> None:
        await super().listen_for_disconnect(receive)
        self.gone.set()

    async def __call__(self, scope, receive, send) -> None:
        # NOTE: for an ASGI server of spec 2.4+, Starlette stops listening for http.disconnect
        # and learns of a gone client only when a write fails, i.e. not while the relay waits
        # for the engine (a queued request, text held back for a stop string); declaring 2.3
        # keeps the listener, so a disconnect cancels the request at once (issue 37).
        scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.3"}}
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


class DeliveredJSONResponse(JSONResponse):
    """A JSON body whose delivery is recorded: `on_sent()` once written, or `on_gone()` when
    the client had already left (`gone`, set by `watcher`); the watcher ends with it."""

    def __init__(
        self,
        content,
        *,
        gone: asyncio.Event,
        watcher: asyncio.Future,
        on_sent: Callable[[], None],
        on_gone: Callable[[], None],
        **kwargs,
    ):
        super().__init__(content, **kwargs)
        self.gone, self.watcher, self.on_sent, self.on_gone = gone, watcher, on_sent, on_gone

    async def __call__(self, scope, receive, send) -> None:
        delivered = False
        try:
            await asyncio.sleep(0)  # a disconnect already seen by the server is noticed
            if not self.gone.is_set():
                await super().__call__(scope, receive, send)
                # no await since the last write: a disconnect seen before it is in `gone`
                delivered = not self.gone.is_set()
        finally:
            self.watcher.cancel()
            (self.on_sent if delivered else self.on_gone)()
