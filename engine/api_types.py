"""The types that cross the engine's interface: what goes in (EngineRequest) and what comes
out of each step (RequestOutput deltas). Shared by the real engine and serving's mock engine."""

from __future__ import annotations

import dataclasses
from typing import Literal

from engine.sampling.params import SamplingParams

FinishReason = Literal["stop", "length", "cancelled", "timed_out", "failed", "rejected"]
# Outcome of a finished request, as recorded in metrics: "stop" and "length" are successes.
OUTCOME_OF_FINISH = {
    "stop": "success",
    "length": "success",
    "cancelled": "cancelled",
    "timed_out": "timed_out",
    "failed": "failed",
    "rejected": "rejected",
}


@dataclasses.dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    priority: int = 0  # larger = more important
    tenant: str = "default"
    deadline_s: float | None = None  # absolute, time.monotonic() clock
    arrival_s: float | None = None  # time.monotonic(); set by the engine if None
    adapter: str | None = None  # LoRA adapter name (engine/lora/adapters.py); None = base model


@dataclasses.dataclass(frozen=True)
class AdapterRef:
    """A loaded LoRA adapter as responses name it (engine/lora/adapters.py)."""

    name: str
    content_hash: str  # "sha256:<hex>" of its files: part of every prefix-cache key
    path: str
    rank: int
    slot: int  # row slot id in the device stack (1..max_loras)


@dataclasses.dataclass
class RequestMetrics:
    """Per-request timings in seconds, measured inside the engine (time.monotonic())."""

    queue_s: float | None = None  # arrival -> first scheduled
    ttft_s: float | None = None  # arrival -> first output token
    tpot_s: float | None = None  # (t_last - t_first) / (n_out - 1); None for one token
    itl_s: list[float] = dataclasses.field(default_factory=list)  # gaps between tokens
    e2e_s: float | None = None  # arrival -> finish
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    # speculative decoding (engine/spec/decode.py): drafts verified / accepted
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-N alternatives (token id, logprob)


@dataclasses.dataclass
class RequestOutput:
    """What one step produced for one request (a delta). Metrics are final when finished."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_times_s: list[float]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when finish_reason == "failed"


# ---- what LLM.generate returns (vLLM's shapes) ----------------------------------------------
@dataclasses.dataclass
class CompletionOutput:
    """One of a prompt's `n` completions (vLLM's CompletionOutput)."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | Literal["tool_calls"] | None = None
    logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics | None = None
    request_id: str = ""  # the engine request that produced it
    # LLM.chat with tools or a reasoning parser: `text` split as the HTTP API splits it
    # (engine/chat/output.py); finish_reason is then "tool_calls" when it stopped after calls.
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list = dataclasses.field(default_factory=list)  # engine.chat ToolCall
    message: dict | None = None  # the OpenAI assistant message: append it to continue the chat

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the sampled tokens' logprobs (None unless logprobs were requested)."""
        return None if self.logprobs is None else sum(t.logprob for t in self.logprobs)


@dataclasses.dataclass
class GenerateOutput:
    """One prompt's result: vLLM's RequestOutput (`.prompt`, `.prompt_token_ids`, `.outputs`).

    The flat fields of the first completion (`.text`, `.token_ids`, `.finish_reason`,
    `.logprobs`, `.metrics`) stay readable on the result itself, as before `n` existed.
    """

    request_id: str
    prompt: str | None  # the text given or rendered from chat messages; None for token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    adapter: AdapterRef | None = None  # the LoRA adapter that answered (None: base model)

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def metrics(self) -> RequestMetrics | None:
        return self.outputs[0].metrics
