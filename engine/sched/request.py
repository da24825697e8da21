"""A request as the scheduler sees it: token ids, how many are computed, its page table.

There is no prefill or decode "phase" (vLLM v1): `all_token_ids` = prompt + outputs so far,
and each step computes some of the tokens from `num_computed_tokens` on. A request whose
computed tokens reach `num_tokens` after a step samples one new token, which makes it one
token behind again (a decode is "1 new token").

    prompt: p0 p1 p2 p3 p4 | outputs: o0 o1
            [------ computed (KV in pages) -----)[o1: next step's input]
    num_computed_tokens = 6, num_tokens = 7

Preemption by recompute sets `num_computed_tokens` back to 0 and empties `page_ids`; the
outputs are kept and recomputed along with the prompt.

Overlapped steps (engine/core.py): the scheduler advances `num_computed_tokens` when it
schedules a step, and a sampling step adds a *pending* output: a token that exists on the
device but whose value the host learns one step later. `num_tokens` counts it, so the next
step already schedules the decode that consumes it (its token id is gathered on device).

    prompt: p0 p1 p2 p3 p4 | outputs: o0 | pending: ?
            [------ computed (advanced at schedule) --)[?: next step's input, on device]
"""

from __future__ import annotations

import dataclasses
import enum

from engine.api_types import EngineRequest, FinishReason
from engine.errors import InvalidRequestError
from engine.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"  # see Request.finish_reason for which way


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    priority: int = 0  # larger = more important
    tenant: str = "default"
    # Extra prefix-cache key, derived by the server from the authenticated tenant
    # (engine.sched.page_pool.cache_salt_for); requests with different salts never share pages.
    cache_salt: str | None = None
    adapter_id: str | None = None  # LoRA adapter content hash; part of the prefix-cache key
    deadline_s: float | None = None  # absolute, time.monotonic() clock
    arrival_s: float = 0.0

    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in this request's pages
    page_ids: list[int] = dataclasses.field(default_factory=list)  # the page table
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache; -1: not admitted
    first_scheduled_s: float | None = None
    token_times_s: list[float] = dataclasses.field(default_factory=list)  # one per output
    finish_s: float | None = None
    # Prefix-cache keys of the full pages of all_token_ids (filled by the page pool).
    page_keys: list[int] = dataclasses.field(default_factory=list, repr=False)
    page_keys_generation: int = -1
    num_registered_pages: int = 0  # leading pages already offered to the prefix cache
    # Outputs sampled by dispatched steps whose values the host has not read yet (0 or 1).
    num_pending_outputs: int = 0
    # ---- speculative decoding (engine/spec/decode.py) ----
    # Drafted tokens to verify after the last known token in the next step (set by the
    # proposer right before schedule(); the scheduler computes them with the decode).
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    spec_drafted_tokens: int = 0  # drafts verified over the request's life
    spec_accepted_tokens: int = 0  # of which accepted
    # Backoff (engine/spec/decode.py): consecutive verify steps that accepted nothing, and
    # the output count before which the request is not drafted for again.
    spec_misses: int = 0
    spec_resume_at: int = 0

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids", [], "must hold at least one token")
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    @classmethod
    def from_engine_request(
        cls,
        request: EngineRequest,
        *,
        now_s: float,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> Request:
        """`now_s` is the arrival time when the EngineRequest has none."""
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=request.sampling,
            priority=request.priority,
            tenant=request.tenant,
            cache_salt=cache_salt,
            adapter_id=adapter_id,
            deadline_s=request.deadline_s,
            arrival_s=now_s if request.arrival_s is None else request.arrival_s,
        )

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs. A live view: do not mutate it, use append_output_token."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs, the pending ones included."""
        return len(self._all_token_ids) + self.num_pending_outputs

    @property
    def num_known_tokens(self) -> int:
        """Prompt + outputs whose values the host holds (len(all_token_ids))."""
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to compute before this request can sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_outputs_reached(self) -> bool:
        """Known + pending outputs reach max_tokens: nothing more to schedule."""
        return self.num_output_tokens + self.num_pending_outputs >= self.sampling.max_tokens

    def append_output_token(self, token_id: int, now_s: float) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self.token_times_s.append(now_s)
