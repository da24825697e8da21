"""Protobuf messages <-> engine types (engine/api_types.py, engine/sampling/params.py)."""

from __future__ import annotations

import time

from engine.api_types import RequestOutput
from engine.chat.setup import chat_token_ids
from engine.errors import InvalidRequestError
from engine.sampling.params import SamplingParams
from engine.structured.output import StructuredOutput
from serving.proto import SAMPLING_FIELDS, fold_tool_call
from serving.proto import pagedjax_pb2 as pb

# Priority class -> engine priority (larger = more important).
ENGINE_PRIORITY = {
    pb.PRIORITY_UNSPECIFIED: None,  # the tenant's default (serving/frontend/tenants.py)
    pb.PRIORITY_LOW: 0,
    pb.PRIORITY_NORMAL: 1,
    pb.PRIORITY_HIGH: 2,
}
CHAT_ROLES = ("system", "user", "assistant", "tool")

# Token times cross the wire as unix nanoseconds; the engine stamps time.monotonic().
UNIX_MINUS_MONOTONIC_NS = time.time_ns() - time.monotonic_ns()


def unix_ns(monotonic_s: float) -> int:
    return UNIX_MINUS_MONOTONIC_NS + round(monotonic_s * 1e9)


def chat_messages(chat: pb.ChatMessages) -> list[dict]:
    if not chat.messages:
        raise InvalidRequestError("chat.messages", 0, "at least one message")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError(f"chat.messages[{i}].role", m.role, f"one of {CHAT_ROLES}")
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def prompt_token_ids(req: pb.GenerateRequest, tokenizer, vocab_size: int | None) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt", None, "set one of text, token_ids, chat")
    if kind == "text":
        return list(tokenizer.encode(req.text))
    if kind == "chat":
        return chat_token_ids(tokenizer, chat_messages(req.chat))
    ids = list(req.token_ids.ids)
    if vocab_size is not None:
        for i in ids:
            if not 0 <= i < vocab_size:
                raise InvalidRequestError("token_ids", i, f"0 <= id < vocab size {vocab_size}")
    return ids


def sampling_params(req: pb.GenerateRequest, default_max_tokens: int) -> SamplingParams:
    """Raises InvalidRequestError naming the field (SamplingParams validates itself); a field
    of the `sampling` message is named by its path (sampling.top_p)."""
    s = req.sampling
    kwargs = {f: getattr(s, f) for f in SAMPLING_FIELDS if s.HasField(f)}
    try:
        return _sampling_params(req, kwargs, default_max_tokens)
    except InvalidRequestError as e:
        if e.field in kwargs:
            raise InvalidRequestError(f"sampling.{e.field}", e.value, e.limit) from None
        raise


def _sampling_params(req: pb.GenerateRequest, kwargs: dict, default_max_tokens: int):
    return SamplingParams(
        **kwargs,
        max_tokens=req.max_tokens if req.HasField("max_tokens") else default_max_tokens,
        min_tokens=req.min_tokens,
        stop=tuple(req.stop),
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        structured=structured_output(req),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens
        if req.HasField("skip_special_tokens")
        else True,
    )


def structured_output(req: pb.GenerateRequest) -> StructuredOutput | None:
    """The request's `structured` oneof (validated: InvalidRequestError names the field)."""
    kind = req.WhichOneof("structured")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutput(choice=tuple(req.choice.choices))
    return StructuredOutput(**{kind: getattr(req, kind)})


def delta_message(request_id: str, outputs: list[RequestOutput]) -> pb.GenerateResponse:
    """Several per-step deltas of one request merged into one message."""
    msg = pb.GenerateResponse(request_id=request_id)
    for out in outputs:
        msg.token_ids.extend(out.new_token_ids)
        msg.token_times_unix_ns.extend(unix_ns(t) for t in out.token_times_s)
        msg.text += out.new_text
        for lp in out.logprobs or ():
            msg.logprobs.append(
                pb.TokenLogprob(
                    token_id=lp.token_id,
                    logprob=lp.logprob,
                    top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
                )
            )
    return msg


def merge_into(acc: pb.GenerateResponse, msg: pb.GenerateResponse) -> None:
    acc.token_ids.extend(msg.token_ids)
    acc.token_times_unix_ns.extend(msg.token_times_unix_ns)
    acc.text += msg.text
    acc.logprobs.extend(msg.logprobs)
    acc.content += msg.content
    acc.reasoning_content += msg.reasoning_content
    for call in msg.tool_calls:
        fold_tool_call(acc.tool_calls, call)


def versions_message(identity) -> pb.ModelVersions:
    return pb.ModelVersions(**versions_dict(identity))


def versions_dict(identity) -> dict[str, str]:
    return {
        k: str(getattr(identity, k, ""))
        for k in (
            "name",
            "revision",
            "tokenizer_hash",
            "chat_template_hash",
            "engine_version",
            "adapter",
            "adapter_hash",
            "speculative",
        )
    }


def final_info(summary, identity) -> pb.FinalInfo:
    """`summary`: generation.FinalSummary of the finished request."""
    return pb.FinalInfo(
        finish_reason=summary.finish_reason,
        usage=pb.Usage(
            prompt_tokens=summary.prompt_tokens,
            cached_tokens=summary.cached_tokens,
            completion_tokens=summary.completion_tokens,
            spec_drafted_tokens=summary.spec_drafted_tokens,
            spec_accepted_tokens=summary.spec_accepted_tokens,
        ),
        timings=pb.Timings(
            **{k: summary.timings.get(k) or 0.0 for k in ("queue_s", "ttft_s", "tpot_s", "e2e_s")}
        ),
        versions=versions_message(identity),
    )
