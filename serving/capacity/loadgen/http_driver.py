"""The HTTP driver (`--protocol=http`): the same requests as driver.py, sent to the server's
OpenAI-compatible API as streamed `POST /v1/completions` over one httpx.AsyncClient.

Measured the same way as over gRPC: TTFT and E2E on the client clock; ITL and TPOT from
the server's per-token stamps, which each chunk carries in `pagedjax.token_times_unix_ns`
when the request sets `return_token_times` (a pagedjax extension); queue time and usage
come from the final `include_usage` chunk. A planned cancellation closes the connection
(the server cancels the request on disconnect).

HTTP status / error type -> outcome: 429 and 503 -> rejected, 504 -> timed_out, anything
else -> failed; a client-side timeout -> timed_out{deadline_exceeded}.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx

from serving.capacity.loadgen.driver import SUCCESS_REASONS, new_record
from serving.capacity.loadgen.metrics import RequestRecord
from serving.capacity.loadgen.workloads import RequestSpec

logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request

STATUS_OUTCOME = {429: "rejected", 503: "rejected", 504: "timed_out"}
ERROR_TYPE_STATUS = {"rate_limit_error": 429, "service_unavailable": 503, "timeout": 504}


def base_url(target: str) -> str:
    return target if target.startswith("http") else f"http://{target}"


def build_body(spec: RequestSpec, ignore_eos: bool, temperature: float, seed: int | None):
    body = {
        "model": "",
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        "priority": -max(-1, min(1, spec.priority)),  # vLLM's: lower is served earlier
        "return_token_times": True,
    }
    if seed is not None:
        body["seed"] = seed
    return body


def _absorb_chunk(rec: RequestRecord, chunk: dict, now: float) -> None:
    times = chunk.get("pagedjax", {}).get("token_times_unix_ns", [])
    if times:
        rec.first_token_s = rec.first_token_s or now
        rec.chunk_times_s.append(now)
        rec.chunk_tokens.append(len(times))
        rec.token_times_s.extend(t * 1e-9 for t in times)
        rec.num_output_tokens += len(times)
    for choice in chunk.get("choices", []):
        if choice.get("finish_reason"):
            rec.reason = choice["finish_reason"]
            rec.outcome = "success" if rec.reason in SUCCESS_REASONS else "failed"
    usage = chunk.get("usage")
    if usage:
        rec.num_prompt_tokens = usage["prompt_tokens"]
        rec.num_output_tokens = usage["completion_tokens"]
        rec.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        timings = chunk.get("pagedjax", {}).get("timings") or [{}]
        rec.queue_s = timings[0].get("queue_s")


def _absorb_error(rec: RequestRecord, status: int, error: dict) -> None:
    rec.outcome = STATUS_OUTCOME.get(status, "failed")
    rec.reason = f"http_{status} {error.get('code') or error.get('type')}: {error.get('message')}"


async def _stream(client, rec, spec, body, headers, timeout_s) -> None:
    async with client.stream(
        "POST", "/v1/completions", json=body, headers=headers, timeout=timeout_s
    ) as resp:
        if resp.status_code != 200:
            await resp.aread()
            try:
                error = resp.json().get("error", {})
            except json.JSONDecodeError:
                error = {"message": resp.text[:200]}
            _absorb_error(rec, resp.status_code, error)
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                _absorb_error(rec, ERROR_TYPE_STATUS.get(error.get("type"), 500), error)
                return
            _absorb_chunk(rec, chunk, time.perf_counter())
            cancel_at = spec.cancel_after_tokens
            if cancel_at and rec.num_output_tokens >= cancel_at and rec.outcome != "success":
                rec.outcome, rec.reason = "cancelled", "client_cancel"
                return  # leaving the block closes the connection: the server cancels


async def run_one_http(
    client: httpx.AsyncClient,
    spec: RequestSpec,
    *,
    scheduled_s: float | None,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    seed: int | None = None,
    timeout_s: float | None = None,
    early_cancel_s: float = 0.2,
    api_keys: dict[str, str] | None = None,
) -> RequestRecord:
    """Sends one request, reads its SSE stream to the end, returns what it observed. The
    spec's tenant is sent as `Authorization: Bearer KEY` (the server's x-api-key tenants)."""
    rec = new_record(spec, scheduled_s)
    key = (api_keys or {}).get(spec.tenant)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = build_body(spec, ignore_eos, temperature, seed)
    rec.send_s = time.perf_counter()
    stream = _stream(client, rec, spec, body, headers, timeout_s)
    try:
        if spec.cancel_after_tokens == 0:  # cancel before (probably) any token arrives
            try:
                await asyncio.wait_for(stream, early_cancel_s)
            except TimeoutError:
                rec.outcome, rec.reason = "cancelled", "client_cancel"
        else:
            await stream
    except asyncio.CancelledError:  # the drain timeout cancelled this task
        rec.outcome, rec.reason = "timed_out", "client_drain"
        rec.end_s = time.perf_counter()
        raise
    except httpx.TimeoutException as e:
        rec.outcome, rec.reason = "timed_out", f"deadline_exceeded: {type(e).__name__}"
    except httpx.HTTPError as e:
        rec.outcome, rec.reason = "failed", f"transport: {e!r}"
    rec.end_s = time.perf_counter()
    if rec.outcome == "failed" and not rec.reason:
        rec.reason = "stream ended without a final chunk"
    if rec.outcome != "cancelled" and len(rec.token_times_s) != rec.num_output_tokens:
        rec.token_times_s = []  # partial stamps: fall back to chunk times
    return rec


def server_conditions(target: str) -> dict:
    """Model and versions from GET /v1/models (the limits are on gRPC's ServerInfo only)."""
    try:
        models = httpx.get(f"{base_url(target)}/v1/models", timeout=10).json()["data"]
    except (httpx.HTTPError, KeyError, json.JSONDecodeError) as e:
        return {"server_info_error": repr(e)}
    versions = models[0].get("pagedjax", {}).get("versions", {})
    return {
        "model": models[0]["id"],
        "revision": versions.get("revision"),
        "tokenizer_hash": versions.get("tokenizer_hash"),
        "engine_version": versions.get("engine_version"),
        "limits": {"max_model_len": models[0].get("max_model_len")},
    }


def measure_tokens_per_word(target: str, text: str) -> float | None:
    """The server tokenizer's tokens per word of `text`, from POST /tokenize."""
    try:
        r = httpx.post(f"{base_url(target)}/tokenize", json={"prompt": text}, timeout=30)
        count = r.json()["count"]
    except (httpx.HTTPError, KeyError, json.JSONDecodeError):
        return None
    return count / len(text.split()) if count else None
