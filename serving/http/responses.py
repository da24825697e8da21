"""Response bodies of the OpenAI-compatible HTTP API: completions, chat completions, their
streamed chunks, logprobs, usage, the error object (and the status mapping), the model
identity in headers; and the bearer token -> API key rule.

Identity: `system_fingerprint` is "pagedjax-<engine_version>;rev=<revision>;tok=<tokenizer
hash>;tpl=<chat template hash>" on every response and chunk; the same values are in the
x-pagedjax-* response headers and, as a dict, in `pagedjax.versions` of a non-streamed
response and of the last streamed chunk (which also carries `pagedjax.timings`, one dict per
choice: queue_s, ttft_s, tpot_s, e2e_s measured in the server).
"""

from __future__ import annotations

import dataclasses
import math
import time

import grpc
from fastapi.responses import JSONResponse

from engine.api_types import RequestOutput, TokenLogprob
from serving.frontend.generation import FinalSummary, Refusal
from serving.grpc_api import convert

IDENTITY_HEADERS = {
    "name": "x-pagedjax-model",
    "revision": "x-pagedjax-revision",
    "tokenizer_hash": "x-pagedjax-tokenizer-hash",
    "chat_template_hash": "x-pagedjax-chat-template-hash",
    "engine_version": "x-pagedjax-engine-version",
    "speculative": "x-pagedjax-speculative",
}


def system_fingerprint(identity) -> str:
    v = convert.versions_dict(identity)
    return (
        f"pagedjax-{v['engine_version']};rev={v['revision']};tok={v['tokenizer_hash']};"
        f"tpl={v['chat_template_hash']}"
    )


def identity_headers(identity) -> dict[str, str]:
    v = convert.versions_dict(identity)
    return {header: v[key] for key, header in IDENTITY_HEADERS.items()}


def retry_headers(retry_after_ms: int | None) -> dict[str, str]:
    """`Retry-After` in whole seconds (at least 1) and the exact `retry-after-ms`."""
    if retry_after_ms is None:
        return {}
    return {
        "Retry-After": str(max(1, math.ceil(retry_after_ms / 1000))),
        "retry-after-ms": str(retry_after_ms),
    }


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# status -> (HTTP status, OpenAI error type)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.INTERNAL: (500, "internal_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.ABORTED: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def error_response(
    status: grpc.StatusCode,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    retry_after_ms: int | None = None,
) -> JSONResponse:
    http_status, type_ = HTTP_STATUS.get(status, (500, "internal_error"))
    if status == grpc.StatusCode.FAILED_PRECONDITION and param == "model":
        http_status, type_, code = 404, "not_found_error", "model_not_found"
    body = error_body(message, type_, param, code)
    return JSONResponse(body, http_status, headers=retry_headers(retry_after_ms))


def refusal_response(e: Refusal) -> JSONResponse:
    return error_response(
        e.status, e.details, param=e.param, code=e.reason, retry_after_ms=e.retry_after_ms
    )


def api_key(tenants, request) -> str | None:
    """The `Authorization: Bearer KEY` token (or an `x-api-key` header, as on gRPC). Ignored
    when no API keys are configured: the OpenAI SDK always sends one, so anonymous use must
    not fail on it."""
    if not tenants.has_api_keys:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


# ---- logprobs ---------------------------------------------------------------------------------
def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token_id])
    return text, list(text.encode("utf-8"))


def chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> list[dict]:
    """OpenAI's choices[i].logprobs.content entries."""
    content = []
    for lp in lps:
        token, raw = _token(tokenizer, lp.token_id)
        top = []
        for tid, logprob in lp.top:
            t, b = _token(tokenizer, tid)
            top.append({"token": t, "logprob": logprob, "bytes": b})
        content.append({"token": token, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return content


def completion_logprobs(tokenizer, lps: list[TokenLogprob], text_offset: int) -> dict:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs (one
    token text -> logprob dict per position), text_offset (from `text_offset` on).
    NOTE: the format keys alternatives by text, so two ids with the same text (e.g. partial
    UTF-8 bytes, both U+FFFD) are one entry; chat logprobs keep every alternative."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        token, _ = _token(tokenizer, lp.token_id)
        out["tokens"].append(token)
        out["token_logprobs"].append(lp.logprob)
        top: dict[str, float] = {}
        for tid, logprob in lp.top:  # best first; tokens with the same text keep the best
            top.setdefault(_token(tokenizer, tid)[0], logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(token)
    return out


def merge_completion_logprobs(acc: dict | None, new: dict) -> dict:
    if acc is None:
        return new
    return {k: acc[k] + new[k] for k in acc}


# ---- per-choice state -----------------------------------------------------------------------
@dataclasses.dataclass
class ChoiceState:
    """One choice (one engine request) as the HTTP layer assembles it."""

    index: int
    request: object  # serving.frontend.request_state.ActiveRequest
    text: str = ""
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    summary: FinalSummary | None = None
    sent_role: bool = False  # chat streaming: the first delta carries the role
    num_tokens: int = 0  # streamed so far
    chat_output: object = None  # engine.chat.output.ChatOutput: reasoning / tool calls


def delta_of(items: list[RequestOutput]) -> tuple[str, list[TokenLogprob], list[float]]:
    """Several engine deltas merged: text, logprobs, token times (monotonic s)."""
    text = "".join(o.new_text for o in items)
    lps = [lp for o in items for lp in (o.logprobs or ())]
    times = [t for o in items for t in o.token_times_s]
    return text, lps, times


def usage(summaries: list[FinalSummary], num_prompts: int, n: int) -> dict:
    """OpenAI counts each prompt once however many choices it has (n)."""
    prompt = sum(s.prompt_tokens for s in summaries[::n][:num_prompts])
    cached = sum(s.cached_tokens for s in summaries[::n][:num_prompts])
    completion = sum(s.completion_tokens for s in summaries)
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    drafted = sum(s.spec_drafted_tokens for s in summaries)
    if drafted:  # speculative decoding verified drafts for it (a pagedjax extension)
        accepted = sum(s.spec_accepted_tokens for s in summaries)
        out["speculative"] = {"drafted_tokens": drafted, "accepted_tokens": accepted}
    return out


def running_usage(choices: list[ChoiceState], n: int) -> dict:
    """Usage so far of a streamed request (vLLM's continuous_usage_stats)."""
    prompt = sum(c.request.num_prompt_tokens for c in choices[::n])
    completion = sum(c.num_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def extension(identity, summaries: list[FinalSummary]) -> dict:
    """The `pagedjax` object: resolved versions and server timings of every choice."""
    return {
        "versions": convert.versions_dict(identity),
        "timings": [s.timings for s in summaries],
    }


def envelope(kind: str, request_id: str, identity, created: int | None = None) -> dict:
    """The fields every response and chunk of `kind` starts with."""
    return {
        "id": request_id,
        "object": kind,
        "created": created if created is not None else int(time.time()),
        "model": identity.name,
        "system_fingerprint": system_fingerprint(identity),
    }
