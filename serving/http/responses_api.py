"""OpenAI's Responses API, `POST /v1/responses` (and `GET /v1/responses/{id}` for stored ones),
over the chat-completions machinery: a request becomes a chat request (messages, tools,
tool_choice, sampling) and runs exactly as one (serving/http/api.py: same tenants, limits,
queue, outcomes), its output split by the same ChatOutput (reasoning, content, tool calls).

    input: a string, or items                   ->  chat messages
      {"role": user|system|developer|assistant, "content": str | [input_text|output_text]}
      {"type": "function_call", "call_id", "name", "arguments"}   -> assistant tool_calls
      {"type": "function_call_output", "call_id", "output"}      -> a tool message
      {"type": "reasoning", ...}                                   -> dropped (not replayed)
    instructions                                ->  a system message first
    tools [{"type": "function", "name", "parameters", ...}], tool_choice, parallel_tool_calls
    max_output_tokens, temperature, top_p, text.format (text | json_schema | json_object)

    output items: reasoning (with a --reasoning_parser), message (output_text), function_call

Built-in tools (web_search, file_search, computer_use, code_interpreter, ...) are refused
with a 400 naming them; so are fields this server does not implement (`conversation`,
`prompt`, `background`, ...).

Streaming (`stream: true`) sends the documented events, each `event: <type>` + `data:` with a
sequence_number: response.created, response.in_progress, then per output item
response.output_item.added, (message) response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done,
(function call) response.function_call_arguments.delta / .done, (reasoning)
response.reasoning_text.delta / .done, response.output_item.done; finally
response.completed (or response.incomplete when max_output_tokens cut it, response.failed
on an engine error).

Storing (`store`, default true as in OpenAI's API; `previous_response_id`): the server keeps
the last MAX_STORED responses for STORE_TTL_S in memory, each with the conversation that led
to it, keyed by (tenant, id): a tenant can only continue or read its own responses (another
tenant's id is "not found", as an unknown one). A continued request's messages are the
stored conversation, then its new input; `instructions` are not carried over (OpenAI's rule).
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
import uuid
from typing import Any, Literal

import grpc
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from engine.chat.output import ChatOutput
from engine.errors import InvalidRequestError
from serving.frontend.generation import Refusal, invalid
from serving.http import delivery, schemas
from serving.http import responses as resp
from serving.http.chat import chat_setup
from serving.http.delivery import StreamEnded

MAX_STORED = 1024  # responses kept per server (all tenants), oldest dropped first
STORE_TTL_S = 3600.0  # a stored response is forgotten after this long
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = ""
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None  # accepted when empty (nothing extra to include)
    truncation: Literal["disabled"] | None = None
    text: dict | None = None
    reasoning: dict | None = None  # accepted; the thought's length is the model's own


# ---- the store ------------------------------------------------------------------------------
class ResponseStore:
    """Bounded, expiring, tenant-scoped: (tenant, response id) -> (response, conversation)."""

    def __init__(self, max_responses: int = MAX_STORED, ttl_s: float = STORE_TTL_S):
        self.max_responses, self.ttl_s = max_responses, ttl_s
        self._items: collections.OrderedDict[tuple[str, str], tuple[float, dict, list]] = (
            collections.OrderedDict()
        )

    def put(self, tenant: str, response: dict, conversation: list[dict]) -> None:
        self._expire()
        self._items[(tenant, response["id"])] = (time.monotonic(), response, conversation)
        while len(self._items) > self.max_responses:
            self._items.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> tuple[dict, list[dict]] | None:
        self._expire()
        item = self._items.get((tenant, response_id))
        return None if item is None else (item[1], item[2])

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._items:
            key, (stored_s, _, _) = next(iter(self._items.items()))
            if stored_s >= cutoff:
                break
            del self._items[key]


# ---- request -> chat request ------------------------------------------------------------------
def chat_body(req: ResponsesRequest, history: list[dict]) -> tuple[dict, list[dict]]:
    """(chat-completions request dict, the conversation to store: history + new input)."""
    conversation = history + input_messages(req.input)
    messages = list(conversation)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [_chat_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    optional = {
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "response_format": _response_format(req.text),
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if req.include:
        raise InvalidRequestError("include", req.include, "nothing to include on this server")
    return body, conversation


def input_messages(items: str | list[dict]) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(i, item))
        elif kind == "function_call":
            call = {
                "id": _str(item, "call_id", i),
                "type": "function",
                "function": {
                    "name": _str(item, "name", i),
                    "arguments": _str(item, "arguments", i),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(i, output or [])
            messages.append(
                {"role": "tool", "tool_call_id": _str(item, "call_id", i), "content": text}
            )
        elif kind != "reasoning":  # a thought is not replayed to the model
            raise InvalidRequestError(
                f"input[{i}].type", kind, "message, function_call, function_call_output, reasoning"
            )
    return messages


def _message(i: int, item: dict) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequestError(f"input[{i}].role", role, "user, system, developer, assistant")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(i, content)
    return {"role": role, "content": text}


def _parts_text(i: int, parts: Any) -> str:
    if not isinstance(parts, list):
        raise InvalidRequestError(f"input[{i}].content", parts, "a string or a list of parts")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"input[{i}].content[{j}].type", kind, f"text parts only ({', '.join(TEXT_PARTS)})"
            )
        texts.append(part["text"])
    return "".join(texts)


def _str(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"input[{i}].{key}", value, "a string")
    return value


def _chat_tool(i: int, tool: dict) -> dict:
    kind = tool.get("type")
    if kind != "function":
        raise InvalidRequestError(
            f"tools[{i}].type", kind, "only function tools (no built-in tools on this server)"
        )
    unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if unknown:
        raise InvalidRequestError(f"tools[{i}]", sorted(unknown), "unsupported tool fields")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidRequestError(
            "tool_choice", choice, 'none, auto, required or {"type": "function", "name": ...}'
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    raise InvalidRequestError("text.format.type", fmt.get("type"), "text, json_object, json_schema")


# ---- output -------------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part] if status == "completed" else [],
    }


def call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status == "completed" else "",
        "status": status,
    }


def reasoning_item(item_id: str, text: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def output_items(out: ChatOutput) -> list[dict]:
    msg = out.message()
    items = []
    if msg.get("reasoning_content"):
        items.append(reasoning_item(_id("rs"), msg["reasoning_content"]))
    if msg.get("content"):
        items.append(message_item(_id("msg"), msg["content"]))
    items += [call_item(_id("fc"), c) for c in msg.get("tool_calls", [])]
    return items


class ResponsesApi:
    """POST /v1/responses and GET /v1/responses/{id}, on an HttpApi's machinery."""

    def __init__(self, api, store: ResponseStore | None = None):
        self.api = api
        self.store = store if store is not None else ResponseStore()

    def register(self, app: FastAPI) -> None:
        app.post("/v1/responses")(self.create)
        app.get("/v1/responses/{response_id}")(self.retrieve)

    async def retrieve(self, response_id: str, request: Request) -> Response:
        try:
            tenant = self._tenant(request)
        except Refusal as e:
            return resp.refusal_response(e)
        found = self.store.get(tenant, response_id)
        if found is None:
            return resp.error_response(
                grpc.StatusCode.NOT_FOUND,
                f"Response with id {response_id!r} not found.",
                param="response_id",
            )
        return JSONResponse(found[0])

    def _tenant(self, request: Request) -> str:
        g = self.api.generator
        return g.authenticate(resp.api_key(g.tenants, request)).name

    async def create(self, request: Request) -> Response:
        api, arrival_s = self.api, time.monotonic()
        api.metrics.generate_calls.inc()
        response_id = _id("resp")
        tenant = "?"
        try:
            tenant = self._tenant(request)
            req = self._parse(await request.body())
            body, conversation, setup = self._chat_request(tenant, req)
        except Refusal as e:
            e.tenant = tenant
            api.generator.record_refusal(response_id, e, arrival_s)
            return resp.refusal_response(responses_refusal(e))
        wake = asyncio.Event()
        try:
            choices = api.submit_chat(request, body, setup, response_id, wake, arrival_s)
        except Refusal as e:
            return resp.refusal_response(responses_refusal(e))
        (choice,) = choices
        choice.chat_output = setup.output()
        run = _Run(self, tenant, req, response_id, conversation, choice)
        if req.stream:
            gone = asyncio.Event()
            stream = run.events(wake, gone)
            return delivery.DeliveryStreamingResponse(stream, gone, media_type="text/event-stream")
        return await run.complete(request, wake)

    def _parse(self, raw: bytes) -> ResponsesRequest:
        try:
            return ResponsesRequest.model_validate_json(raw or b"{}")
        except pydantic.ValidationError as e:
            message, param = schemas.validation_message(e)
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", message, param=param
            ) from e

    def _chat_request(self, tenant: str, req: ResponsesRequest):
        history: list[dict] = []
        try:
            if req.previous_response_id is not None:
                found = self.store.get(tenant, req.previous_response_id)
                if found is None:
                    raise InvalidRequestError(
                        "previous_response_id",
                        req.previous_response_id,
                        f"a response stored by this tenant in the last {STORE_TTL_S:.0f} s "
                        f"(the server keeps at most {MAX_STORED}; store=true)",
                    )
                history = found[1]
            body_dict, conversation = chat_body(req, history)
            body = schemas.parse_body(schemas.ChatCompletionRequest, json.dumps(body_dict).encode())
            setup = chat_setup(self.api.chat_options, body)
        except InvalidRequestError as e:
            raise invalid(e) from e
        return body, conversation, setup


# chat-completions fields a Responses request was translated into -> the field it sent
RESPONSES_FIELD = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}


def responses_refusal(e: Refusal) -> Refusal:
    """`e` naming the Responses field the client sent instead of the chat field it became
    (max_output_tokens, not max_tokens): param and the message's leading FIELD=."""
    head = re.match(r"[A-Za-z_]+", e.param or "")
    if head is None or head.group(0) not in RESPONSES_FIELD:
        return e
    name = RESPONSES_FIELD[head.group(0)]
    if e.details.startswith(e.param + "="):
        e.details = name + e.details[len(e.param) :]
    e.param = name
    return e


class _Run:
    """One Responses request in flight: its choice, the response object, the events."""

    def __init__(self, api: ResponsesApi, tenant, req, response_id, conversation, choice):
        self.owner, self.tenant, self.req = api, tenant, req
        self.id, self.conversation, self.choice = response_id, conversation, choice
        self.created_at = int(time.time())
        self.seq = 0  # the events' sequence_number
        self.output: list[dict] | None = None  # the streamed items (their ids), when streamed

    def response(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        req = self.req
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.owner.api.identity.name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store,
            "temperature": req.temperature,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def final(self) -> dict:
        """The finished response (stored when asked), from the choice's summary."""
        c, out = self.choice, self.choice.chat_output
        out.finish()
        s = c.summary
        usage = {
            "input_tokens": s.prompt_tokens,
            "input_tokens_details": {"cached_tokens": s.cached_tokens},
            "output_tokens": s.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": out.reasoning_tokens},
            "total_tokens": s.prompt_tokens + s.completion_tokens,
        }
        status = "incomplete" if s.finish_reason == "length" else "completed"
        return self.response(status, self.output or output_items(out), usage)

    def remember(self, response: dict) -> None:
        if not self.req.store:
            return
        msg = self.choice.chat_output.message()
        said = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            said["tool_calls"] = msg["tool_calls"]
        self.owner.store.put(self.tenant, response, [*self.conversation, said])

    async def complete(self, request: Request, wake: asyncio.Event) -> Response:
        api, c = self.owner.api, self.choice
        try:
            async for _ in api.relay([c], wake):
                pass
        except StreamEnded as e:
            t = e.terminal
            return resp.error_response(t.code, t.details, retry_after_ms=t.retry_after_ms)
        except BaseException:
            api.cancel([c])
            raise
        response = self.final()
        self.remember(response)
        api.delivered([c])
        return JSONResponse(response, headers=resp.identity_headers(api.identity))

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    async def events(self, wake: asyncio.Event, gone: asyncio.Event):
        api, c = self.owner.api, self.choice
        items = _ItemEvents(self)
        try:
            yield self.event("response.created", response=self.response("in_progress", []))
            yield self.event("response.in_progress", response=self.response("in_progress", []))
            async for _, _, _, _, parts in api.relay([c], wake):
                for part in parts or []:
                    for e in items.on(part):
                        yield e
            for e in items.close():
                yield e
            self.output = items.done
            response = self.final()
            self.remember(response)
            kind = (
                "response.completed"
                if response["status"] == "completed"
                else ("response.incomplete")
            )
            yield self.event(kind, response=response)
            await asyncio.sleep(0)
            if not gone.is_set():
                api.delivered([c])
        except StreamEnded as e:
            failed = self.response("failed", items.done)
            failed["error"] = {"code": "server_error", "message": e.terminal.details}
            yield self.event("response.failed", response=failed)
        finally:
            api.cancel([c])


class _ItemEvents:
    """Chat delta objects -> Responses output items and their events, in order."""

    def __init__(self, run: _Run):
        self.run = run
        self.done: list[dict] = []  # finished items
        self.open: dict | None = None  # the item being streamed
        self.text = ""  # its text or arguments so far

    def on(self, delta: dict) -> list[str]:
        if "reasoning_content" in delta:
            return self._text("reasoning", delta["reasoning_content"])
        if "content" in delta:
            return self._text("message", delta["content"])
        (tc,) = delta["tool_calls"]
        if "id" in tc:  # a new call
            out = self.close()
            call = {"id": tc["id"], "function": {"name": tc["function"]["name"]}}
            self.open, self.text = call_item(_id("fc"), call, "in_progress"), ""
            return out + [self._added()]
        self.text += tc["function"]["arguments"]
        return [
            self.run.event(
                "response.function_call_arguments.delta",
                item_id=self.open["id"],
                output_index=len(self.done),
                delta=tc["function"]["arguments"],
            )
        ]

    def _added(self) -> str:
        return self.run.event(
            "response.output_item.added", output_index=len(self.done), item=self.open
        )

    def _text(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            out += self.close()
            self.text = ""
            if kind == "message":
                self.open = message_item(_id("msg"), "", "in_progress")
                out.append(self._added())
                out.append(self._part_event("response.content_part.added", ""))
            else:
                self.open = reasoning_item(_id("rs"), "")
                out.append(self._added())
        self.text += text
        name = "output_text" if kind == "message" else "reasoning_text"
        out.append(
            self.run.event(
                f"response.{name}.delta",
                item_id=self.open["id"],
                output_index=len(self.done),
                content_index=0,
                delta=text,
            )
        )
        return out

    def _part_event(self, kind: str, text: str) -> str:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return self.run.event(
            kind, item_id=self.open["id"], output_index=len(self.done), content_index=0, part=part
        )

    def close(self) -> list[str]:
        """Events that finish the open item, if any."""
        item, text = self.open, self.text
        if item is None:
            return []
        common = {"item_id": item["id"], "output_index": len(self.done)}
        out = []
        if item["type"] == "message":
            out.append(
                self.run.event("response.output_text.done", **common, content_index=0, text=text)
            )
            out.append(self._part_event("response.content_part.done", text))
            item = message_item(item["id"], text)
        elif item["type"] == "reasoning":
            out.append(
                self.run.event("response.reasoning_text.done", **common, content_index=0, text=text)
            )
            item = reasoning_item(item["id"], text)
        else:
            out.append(
                self.run.event(
                    "response.function_call_arguments.done",
                    **common,
                    name=item["name"],
                    arguments=text,
                )
            )
            item = {**item, "arguments": text, "status": "completed"}
        out.append(
            self.run.event("response.output_item.done", output_index=len(self.done), item=item)
        )
        self.done.append(item)
        self.open, self.text = None, ""
        return out
