"""The OpenAI-compatible HTTP API (FastAPI), beside gRPC in the same server process.

    POST /v1/chat/completions   POST /v1/completions   (this module)
    GET /v1/models  POST /tokenize  POST /detokenize  GET /health /ready /metrics
                                                       (serving/http/endpoints.py)

One request contract, two transports: a generation request is parsed (serving/http/schemas.py),
turned into one GenerateCall per choice (n choices x prompts; each its own engine request,
so the n choices of a prompt share its prefix-cache pages once computed) and handed to the
same Generator as gRPC (generation.py): same tenants (`Authorization: Bearer KEY` is gRPC's
`x-api-key`), budgets, breaker, waiting queue, engine thread, metrics and one outcome per
engine request. A deadline comes from `x-request-timeout-ms` or the SDK's
`x-stainless-read-timeout` header (serving/frontend/deadlines.py) and bounds the whole response.

    uvicorn event loop (one thread, serving/http/server.py)
      | authenticate -> parse -> Generator.submit per choice (refusal: OpenAI error object)
      v
    StreamBuffer per choice  <-- engine thread pushes deltas; its listener wakes the loop
      | relay: chunks as SSE (stream=true) or one JSON body; a slow SSE reader stops the
      | relay draining the buffer, so the buffer's bound cancels it exactly as on gRPC
      v
    client disconnect -> Generator.client_gone for every unfinished choice (pages freed by
    the next engine step)

Statuses (grpc.StatusCode in the ledger) map to HTTP (serving/http/responses.py): INVALID_ARGUMENT
400, UNAUTHENTICATED 401, unknown model 404, revision pin 409, RESOURCE_EXHAUSTED 429 and
UNAVAILABLE 503 (both with `Retry-After` seconds and `retry-after-ms`), DEADLINE_EXCEEDED
504, INTERNAL 500.
Calls: every generation POST counts once in pagedjax_generate_calls_total, plus once per
further choice submitted, so at rest the outcome counters still sum to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import Response

from engine.chat.setup import ChatOptions, ChatSetup
from engine.errors import InvalidRequestError
from serving.frontend import deadlines
from serving.frontend.generation import (
    GenerateCall,
    Generator,
    Refusal,
    final_summary,
    invalid,
    is_done,
)
from serving.frontend.request_state import Terminal
from serving.gateway import http_kv_transfer
from serving.grpc_api import convert
from serving.http import delivery, schemas
from serving.http import responses as resp
from serving.http.chat import chat_setup, message_dicts
from serving.http.delivery import StreamEnded
from serving.http.endpoints import InfoEndpoints
from serving.http.lora import LoraEndpoints
from serving.http.responses_api import ResponsesApi

REVISION_HEADER = "x-pagedjax-revision"
_POLL_S = 0.25  # a waiting relay re-checks its buffers at least this often
_EXPIRED = "deadline passed before the response was complete"


class HttpApi:
    def __init__(
        self, generator: Generator, metrics, tool_call_parser: str = "", reasoning_parser: str = ""
    ):
        self.generator, self.metrics = generator, metrics
        self.kv_transfer = None  # http_kv_transfer.KvTransferParams (set by the server)
        self.identity = generator.identity
        self.tokenizer = generator.engine.tokenizer
        # tools and reasoning (engine/chat/setup.py): the formats, from flags or template
        self.chat_options = ChatOptions.for_tokenizer(
            self.tokenizer, tool_call_parser, reasoning_parser
        )
        self.app = self._build_app()

    # ---- the app -------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="pagedjax", docs_url=None, redoc_url=None, openapi_url=None)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/completions")(self.completions)
        InfoEndpoints(self.generator, self.metrics).register(app)
        LoraEndpoints(self.generator).register(app)
        ResponsesApi(self).register(app)  # POST /v1/responses (serving/http/responses_api.py)
        return app

    # ---- what another API surface reuses (the Responses API) ----------------------------------
    def submit_chat(self, request, body, setup: ChatSetup, request_id, wake, arrival_s) -> list:
        """The choices (ChoiceState) of a parsed chat request, submitted; raises Refusal
        (the request's deadline header too, as for chat completions)."""
        deadline = _deadline(request)
        calls = self._calls(request, body, setup, [body.messages], request_id, wake, deadline)
        return self._submit_all(calls, arrival_s)

    def relay(self, choices, wake: asyncio.Event, gone=None) -> AsyncIterator:
        """(choice, text, logprobs, token times, chat parts) per delta (see _deltas)."""
        return self._deltas(choices, wake, gone)

    def cancel(self, choices, reason: str = "client") -> None:
        self._cancel_unfinished(choices, reason)

    def delivered(self, choices) -> None:
        self._delivered(choices)

    # ---- generation ----------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, schemas.ChatCompletionRequest, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, schemas.CompletionRequest, chat=False)

    async def _generate(self, request: Request, model_cls, chat: bool) -> Response:
        arrival_s = time.monotonic()
        self.metrics.generate_calls.inc()
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        tenant = "?"
        try:
            tenant = self.generator.authenticate(resp.api_key(self.generator.tenants, request)).name
            body = schemas.parse_body(model_cls, await request.body())
            prompts = self._prompts(body, chat)
            if self.generator.ledger.tracer is not None:  # --trace_requests
                self.generator.ledger.tracer.mark(request_id, "parse")
            setup = self._chat_setup(body) if chat else None
            deadline = _deadline(request)
        except Refusal as e:
            e.tenant = tenant
            self.generator.record_refusal(request_id, e, arrival_s)
            return resp.refusal_response(e)
        wake = asyncio.Event()
        try:
            calls = self._calls(request, body, setup, prompts, request_id, wake, deadline)
            # llm-d's P/D sidecar: serving/gateway/http_kv_transfer.py
            kv = self._kv_transfer_params(body)
            if kv is not None and kv.get("do_remote_prefill"):
                calls = [self.kv_transfer.with_remote_prefill(c, kv, body) for c in calls]
                choices = await self._pull_and_submit(request, calls, arrival_s)
            else:
                choices = self._submit_all(calls, arrival_s)
        except Refusal as e:
            return resp.refusal_response(e)
        if self.generator.ledger.tracer is not None:  # --trace_requests
            self.generator.ledger.tracer.mark(request_id, "admit")
        for c in choices:  # tools / reasoning: each choice's output splitter
            c.chat_output = setup.new_output() if setup is not None else None
        headers = resp.identity_headers(self.identity)
        if body.stream:
            gone = asyncio.Event()  # overload (#17): set when the client disconnects
            stream = self._sse(body, chat, request_id, choices, len(prompts), wake, gone)
            return delivery.DeliveryStreamingResponse(
                stream, gone, media_type="text/event-stream", headers=headers
            )
        return await self._complete(request, body, chat, request_id, choices, len(prompts), wake)

    def _prompts(self, body, chat: bool) -> list:
        """What each prompt's choices will be built from (messages or one prompt)."""
        prompts = [body.messages] if chat else schemas.completion_prompts(body.prompt)
        try:
            schemas.check_choices(body.n, len(prompts))
            if body.stream_options is not None and not body.stream:
                raise InvalidRequestError("stream_options", "set", "only with stream=true")
        except InvalidRequestError as e:
            raise invalid(e) from e
        return prompts

    def _chat_setup(self, body) -> ChatSetup:
        try:
            return chat_setup(self.chat_options, body)
        except InvalidRequestError as e:
            raise invalid(e) from e

    def _calls(
        self, request, body, setup, prompts, request_id, wake, deadline
    ) -> list[GenerateCall]:
        """One call per choice; `deadline` bounds each one's whole response, streamed or not.
        `setup`: a chat request's tools / reasoning (engine/chat/setup.py); None:
        completions."""
        loop = asyncio.get_running_loop()
        chat = setup is not None
        vocab = self.generator.vocab_size

        def listener():
            with contextlib.suppress(RuntimeError):  # the event loop already closed
                loop.call_soon_threadsafe(wake.set)

        def prompt_fn(p):
            if chat:
                return lambda: setup.prompt_ids(self.tokenizer, message_dicts(p))
            return lambda: schemas.prompt_ids(self.tokenizer, p, vocab)

        def sampling_fn(i):
            if chat:
                return lambda d: setup.sampling(schemas.sampling_params(body, d, choice=i))
            return lambda d: schemas.sampling_params(body, d, choice=i)

        calls = []
        for p_index, p in enumerate(prompts):
            for i in range(body.n):
                calls.append(
                    GenerateCall(
                        request_id=f"{request_id}-{p_index * body.n + i}",
                        api_key=resp.api_key(self.generator.tenants, request),
                        prompt_ids=prompt_fn(p),
                        sampling=sampling_fn(i),
                        model=body.model,
                        revision=body.revision or request.headers.get(REVISION_HEADER, ""),
                        priority=schemas.engine_priority(body.priority),
                        stream_listener=listener,
                        success_on_delivery=True,  # overload (#17): serving/http/delivery.py
                        time_left_s=deadline.timeout_s,
                        deadline_source=deadline.source,
                    )
                )
        return calls

    def _kv_transfer_params(self, body) -> dict | None:
        """The request's kv_transfer_params, checked (None: none); Refusal when invalid or
        when this server cannot serve its side."""
        try:
            kv = http_kv_transfer.parse(body.kv_transfer_params, stream=body.stream, n=body.n)
        except InvalidRequestError as e:
            raise invalid(e) from e
        if kv is not None and self.kv_transfer is None:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                "kv_transfer_unavailable",
                "kv_transfer_params: this server moves no K/V",
                param="kv_transfer_params",
            )
        if kv is not None and kv.get("do_remote_decode"):
            self.kv_transfer.check_prefill()
        return kv

    async def _pull_and_submit(self, request, calls: list[GenerateCall], arrival_s: float):
        """_submit_pulling on a thread; a client that goes away meanwhile cancels the pulls
        (nothing is imported; the prefill pod freed its pages when it exported them)."""
        ids = [c.request_id for c in calls]
        pulling = asyncio.ensure_future(asyncio.to_thread(self._submit_pulling, calls, arrival_s))
        pulling.add_done_callback(lambda _: self.kv_transfer.forget(ids))
        try:
            while not pulling.done():
                await asyncio.wait({pulling}, timeout=_POLL_S)
                if not pulling.done() and await request.is_disconnected():
                    self.kv_transfer.cancel_pulls(ids)
            return pulling.result()
        except asyncio.CancelledError:
            self.kv_transfer.cancel_pulls(ids)
            pulling.add_done_callback(self._cancel_late)
            raise

    def _cancel_late(self, pulling: asyncio.Future) -> None:
        """Choices admitted after their client went away (the pull had just ended)."""
        if not pulling.cancelled() and pulling.exception() is None:
            self._cancel_unfinished(pulling.result())

    def _submit_pulling(self, calls: list[GenerateCall], arrival_s: float) -> list:
        """_submit_all off the event loop (each admission pulls K/V from the prefill pod);
        a refused call's staged K/V is dropped."""
        try:
            return self._submit_all(calls, arrival_s)
        except Refusal:
            for c in calls:
                self.kv_transfer.unstage(c.request_id)
            raise

    def _submit_all(self, calls: list[GenerateCall], arrival_s: float) -> list:
        """One engine request per choice. If choice k is refused, the choices already
        admitted are cancelled (outcome cancelled{sibling_refused}) and k's refusal raised."""
        choices = []
        for k, call in enumerate(calls):
            if k:
                self.metrics.generate_calls.inc()
            try:
                r = self.generator.submit(call, arrival_s)
            except Refusal:
                for c in choices:
                    self.generator.client_gone(c.request, reason="sibling_refused")
                raise
            choices.append(resp.ChoiceState(k, r))
        return choices

    # ---- relaying deltas -----------------------------------------------------------------------
    async def _deltas(self, choices, wake: asyncio.Event, gone=None) -> AsyncIterator:
        """(choice, text, logprobs, token times, parts) per delta until every choice is done
        or `gone` is set; raises StreamEnded when a choice ends otherwise or the deadline
        passes with a choice unfinished. `parts`: the chat delta objects of a choice with an
        output splitter (reasoning / tool calls; fed per engine output, so reasoning tokens
        are counted per token), else None."""
        pending = list(choices)
        while pending and not (gone is not None and gone.is_set()):
            wake.clear()  # before draining: a push after the drain sets it again
            progressed = False
            for c in list(pending):
                items, terminal = c.request.stream.get(0)
                if items:
                    progressed = True
                    if is_done(items):
                        c.summary = final_summary(c.request, items[-1].finish_reason)
                        pending.remove(c)
                    parts = None
                    if c.chat_output is not None:
                        parts = c.chat_output.feed_outputs(items, done=c.summary is not None)
                    yield (c, *resp.delta_of(items), parts)
                if not is_done(items) and terminal is not None:
                    raise StreamEnded(terminal)
            if not progressed:
                left_s = _time_left_s(choices)
                if left_s is not None and left_s <= 0:
                    # NOTE: as gRPC's runtime ends a call at its deadline whatever the engine
                    # does (a step compiling a new shape can take longer than the deadline)
                    raise StreamEnded(Terminal(grpc.StatusCode.DEADLINE_EXCEEDED, _EXPIRED))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), min(_POLL_S, left_s or _POLL_S))

    def _cancel_unfinished(self, choices, reason: str = "client") -> None:
        for c in choices:
            self.generator.client_gone(c.request, reason)

    async def _complete(self, request, body, chat, request_id, choices, num_prompts, wake):
        """Non-streamed: collect every choice; a client that leaves cancels them."""
        gone = asyncio.Event()

        async def watch_disconnect():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone.set()
            wake.set()

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            async for c, text, lps, times, _ in self._deltas(choices, wake, gone):
                c.text += text
                c.logprobs += lps
                delivery.sent(c.request, len(times))  # nothing is sent until the end
        except StreamEnded as e:
            watcher.cancel()
            self._cancel_unfinished(choices, "sibling_failed")
            t = e.terminal
            return resp.error_response(t.code, t.details, retry_after_ms=t.retry_after_ms)
        except BaseException:
            watcher.cancel()
            raise
        if gone.is_set():
            watcher.cancel()
            self._cancel_unfinished(choices)
            return Response(status_code=499)
        body_json = self._full_body(body, chat, request_id, choices, num_prompts)
        # overload (#17): success once the body was written to a connection still open
        return delivery.DeliveredJSONResponse(
            body_json,
            gone=gone,
            watcher=watcher,
            on_sent=lambda: self._delivered(choices),
            on_gone=lambda: self._cancel_unfinished(choices),
            headers=resp.identity_headers(self.identity),
        )

    def _delivered(self, choices) -> None:
        """Every choice's last byte went to the transport: the requests' outcome is success."""
        for c in choices:
            self.generator.ledger.settle(c.request, "success", "", grpc.StatusCode.OK)

    def _full_body(self, body, chat, request_id, choices, num_prompts) -> dict:
        out = resp.envelope(
            "chat.completion" if chat else "text_completion", request_id, self.identity
        )
        out["choices"] = [self._full_choice(body, chat, c) for c in choices]
        summaries = [c.summary for c in choices]
        out["usage"] = self._usage(choices, num_prompts, body.n)
        out["pagedjax"] = resp.extension(_answered_by(choices, self.identity), summaries)
        if (body.kv_transfer_params or {}).get("do_remote_decode"):  # llm-d P/D: call 1
            out["kv_transfer_params"] = self.kv_transfer.response_params(request_id)
        return out

    def _usage(self, choices, num_prompts: int, n: int) -> dict:
        out = resp.usage([c.summary for c in choices], num_prompts, n)
        if self.chat_options.reasoning is not None and any(c.chat_output for c in choices):
            reasoning = sum(c.chat_output.reasoning_tokens for c in choices if c.chat_output)
            out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return out

    def _full_choice(self, body, chat, c) -> dict:
        choice = {"index": c.index, "finish_reason": c.summary.finish_reason}
        wants_logprobs = body.num_logprobs() is not None
        if chat and c.chat_output is not None:
            c.chat_output.finish()
            choice["message"] = c.chat_output.message()
            choice["finish_reason"] = c.chat_output.finish_reason(c.summary.finish_reason)
        elif chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        if chat:
            choice["logprobs"] = (
                {"content": resp.chat_logprobs(self.tokenizer, c.logprobs)}
                if wants_logprobs
                else None
            )
        else:
            choice["text"] = c.text
            choice["logprobs"] = (
                resp.completion_logprobs(self.tokenizer, c.logprobs, 0) if wants_logprobs else None
            )
        return choice

    async def _sse(self, body, chat, request_id, choices, num_prompts, wake, gone):
        """Server-sent events; ends with `data: [DONE]`, or with an error event. A client
        that disconnects cancels this generator (Starlette), which cancels the choices; one
        still there when [DONE] was taken by the transport makes them successes."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        offsets = {c.index: 0 for c in choices}
        try:
            async for c, text, lps, times, parts in self._deltas(choices, wake):
                c.num_tokens += len(times)
                if parts is not None:  # reasoning / tool calls: split deltas
                    for part in parts[:-1]:  # e.g. a call's name, then its arguments
                        chunk = resp.envelope(kind, request_id, self.identity, created)
                        chunk["choices"] = [
                            self._stream_choice(body, chat, c, part, [], offsets, final=False)
                        ]
                        yield _event(chunk)
                    text = parts[-1] if parts else ""
                if not (text or lps or c.summary or (times and body.return_token_times)):
                    delivery.sent(c.request, len(times))
                    continue  # e.g. text held back while it may still become a stop string
                chunk = resp.envelope(kind, request_id, self.identity, created)
                chunk["choices"] = [self._stream_choice(body, chat, c, text, lps, offsets)]
                if body.include_usage:
                    chunk["usage"] = (
                        resp.running_usage(choices, body.n) if body.continuous_usage else None
                    )
                if body.return_token_times:
                    chunk["pagedjax"] = {"token_times_unix_ns": [convert.unix_ns(t) for t in times]}
                last = all(x.summary is not None for x in choices)
                if last and not body.include_usage:
                    chunk["pagedjax"] = {
                        **chunk.get("pagedjax", {}),
                        **resp.extension(
                            _answered_by(choices, self.identity), [x.summary for x in choices]
                        ),
                    }
                delivery.sending(c.request)
                yield _event(chunk)
                delivery.sent(c.request, len(times))
            if body.include_usage:
                chunk = resp.envelope(kind, request_id, self.identity, created)
                summaries = [x.summary for x in choices]
                chunk["choices"] = []
                chunk["usage"] = self._usage(choices, num_prompts, body.n)
                chunk["pagedjax"] = resp.extension(_answered_by(choices, self.identity), summaries)
                yield _event(chunk)
            yield "data: [DONE]\n\n"
            await asyncio.sleep(0)  # a disconnect uvicorn saw meanwhile cancels us here
            if not gone.is_set():
                self._delivered(choices)
        except StreamEnded as e:
            self._cancel_unfinished(choices, "sibling_failed")
            t = e.terminal
            err = resp.error_response(t.code, t.details, retry_after_ms=t.retry_after_ms)
            yield f"data: {err.body.decode()}\n\n"
        finally:  # runs on disconnect too (the generator is cancelled / closed)
            self._cancel_unfinished(choices)

    def _stream_choice(self, body, chat, c, text, lps, offsets, final: bool = True) -> dict:
        """`text`: the delta's text, or (chat with a splitter) its delta object."""
        finish = c.summary.finish_reason if c.summary is not None and final else None
        if c.chat_output is not None:
            finish = c.chat_output.finish_reason(finish)
        wants_logprobs = body.num_logprobs() is not None
        choice = {"index": c.index}
        if chat:
            delta = {"content": text} if isinstance(text, str) else dict(text)
            if not c.sent_role:
                delta["role"], c.sent_role = "assistant", True
            choice["delta"] = delta
            choice["logprobs"] = (
                {"content": resp.chat_logprobs(self.tokenizer, lps)} if wants_logprobs else None
            )
        else:
            choice["text"] = text
            choice["logprobs"] = (
                resp.completion_logprobs(self.tokenizer, lps, offsets[c.index])
                if wants_logprobs
                else None
            )
            offsets[c.index] += len(text)
        choice["finish_reason"] = finish
        return choice


def _time_left_s(choices) -> float | None:
    """Seconds until the response's deadline (every choice has the same), None: no deadline."""
    deadline_s = choices[0].request.engine_request.deadline_s
    return None if deadline_s is None else deadline_s - time.monotonic()


def _deadline(request: Request) -> deadlines.Deadline:
    """The request's own deadline (headers); the tenant's or server's default is the
    Generator's (serving/frontend/deadlines.py)."""
    try:
        return deadlines.from_headers(request.headers)
    except InvalidRequestError as e:
        raise invalid(e) from e


def _event(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


def _answered_by(choices, identity):
    """The resolved identity of a response: its requests' (LoRA: with the adapter's name and
    content hash, set when the engine took them), else the server's model."""
    return next((c.request.identity for c in choices if c.request.identity is not None), identity)
