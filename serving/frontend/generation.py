"""Transport-neutral generation: the ONE implementation of admission, streaming and outcomes
that the gRPC service (service.py) and the OpenAI-compatible HTTP API (serving/http/api.py) call.

    transport parses its request into a GenerateCall (request id, API key, model / revision
    pin, a prompt builder and a sampling builder, priority, time left)
      -> Generator.submit(call, arrival_s) -> ActiveRequest, admitted and queued; or raises
         Refusal, whose outcome is already recorded in the ledger (metrics + one log line)
      -> the transport relays r.stream (StreamBuffer) to its client: `is_done(items)` says
         whether the last delta ended the request successfully, `final_summary(r, reason)`
         gives its usage / timings / versions, a Terminal closes the stream with a status
      -> Generator.client_gone(r) when the transport's client left before the request
         ended: records cancelled{client} (or timed_out{deadline}) and aborts it, so its
         pages are freed by the next engine step

Admission order (each refusal is that request's one outcome):

    API key -> tenant              UNAUTHENTICATED         rejected{unauthenticated}
    draining / warming up          UNAVAILABLE             rejected{draining, warming_up}
    model / revision pin           FAILED_PRECONDITION     rejected{model_mismatch}
    unknown LoRA `adapter`         NOT_FOUND               rejected{adapter_not_found}
    prompt, sampling, limits       INVALID_ARGUMENT        rejected{invalid_argument}
    deadline already passed        DEADLINE_EXCEEDED       timed_out{expired_on_arrival}
    circuit breaker                UNAVAILABLE + retry     rejected{circuit_open}
    tenant concurrency / tokens    RESOURCE_EXHAUSTED + retry  rejected{tenant_*}
    waiting queue / est. wait      RESOURCE_EXHAUSTED + retry  rejected{queue_*, deadline}

Statuses are grpc.StatusCode values: the shared vocabulary of the ledger and the request
log. The HTTP API maps each to an HTTP status (serving/http/api.py: HTTP_STATUS).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import grpc

from configs.errors import bounded, echo
from engine.api_types import EngineRequest, RequestOutput
from engine.errors import InvalidRequestError
from engine.lora.refs import loaded_adapters
from engine.sampling.params import SamplingParams
from serving.frontend.admission import (
    AdmissionConfig,
    QueuedRequest,
    Rejected,
    WaitingQueue,
    check_limits,
)
from serving.frontend.breaker import CircuitBreaker
from serving.frontend.deadlines import Deadline, log_fields, with_defaults
from serving.frontend.engine_loop import EngineLoop
from serving.frontend.request_state import ActiveRequest, RequestLedger, StreamBuffer
from serving.frontend.tenants import TenantLimiter, TenantPolicy, TenantRegistry, UnknownApiKey

MAX_REQUEST_ID_CHARS = 256
# A client deadline reaches the server as an HTTP/2 cancel a little before the server's own
# deadline: 0.11-0.16 s before it in a SmolLM2 burst at load ~20 (0.1 counted those timeouts
# as cancelled{client}); a real cancel that close to the deadline is rare.
DEADLINE_SLACK_S = 0.5
SUCCESS_FINISH_REASONS = ("stop", "length")


class Refusal(Exception):
    """A request refused before it was queued. `param` names the offending request field
    when there is one (HTTP reports it in the error object)."""

    def __init__(
        self,
        status: grpc.StatusCode,
        reason: str,
        details: str,
        retry_after_ms: int | None = None,
        outcome: str = "rejected",
        tenant: str = "?",
        param: str | None = None,
    ):
        details = bounded(details)  # a parser's message may quote a multi-megabyte field
        self.status, self.reason, self.details = status, reason, details
        self.retry_after_ms, self.outcome, self.tenant = retry_after_ms, outcome, tenant
        self.param = param
        super().__init__(details)


def invalid(e: InvalidRequestError) -> Refusal:
    return Refusal(grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(e), param=e.field)


@dataclasses.dataclass(frozen=True)
class ServiceLimits:
    admission: AdmissionConfig
    stream_buffer_messages: int
    max_inflight: int


@dataclasses.dataclass
class GenerateCall:
    """One generation request as a transport hands it over.

    `prompt_ids()` and `sampling(default_max_tokens)` raise InvalidRequestError naming the
    field; they run after authentication and the model check, in that order. The default
    max_tokens passed to `sampling` is the server default shrunk to what the context leaves.
    """

    request_id: str
    api_key: str | None
    prompt_ids: Callable[[], list[int]]
    sampling: Callable[[int], SamplingParams]
    model: str = ""
    revision: str = ""
    priority: int | None = None  # engine class: 0 low, 1 normal, 2 high; None: the tenant's
    time_left_s: float | None = None  # None: no deadline (then the tenant's or server's default)
    deadline_source: str = ""  # where time_left_s came from (serving/frontend/deadlines.py)
    stream_listener: Callable[[], None] | None = None  # called when the stream has news
    success_on_delivery: bool = False  # the transport records success after the final send
    adapter: str = ""  # gRPC `adapter`: a loaded LoRA adapter's name ("" = none given)


@dataclasses.dataclass(frozen=True)
class FinalSummary:
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    timings: dict  # queue_s, ttft_s, tpot_s, e2e_s (None: not measured)
    spec_drafted_tokens: int = 0  # speculative decoding: drafts verified / accepted
    spec_accepted_tokens: int = 0


def _log_extra(call: GenerateCall) -> dict:
    """The deadline fields of a call's request log line (timeout_s, timeout_source)."""
    return log_fields(Deadline(call.time_left_s, call.deadline_source))


def is_done(items: list[RequestOutput]) -> bool:
    """True when the last delta finished the request successfully (stop / length)."""
    return bool(items) and items[-1].finished and items[-1].finish_reason in SUCCESS_FINISH_REASONS


def final_summary(r: ActiveRequest, finish_reason: str) -> FinalSummary:
    timings = {k: (r.timings or {}).get(k) for k in ("queue_s", "ttft_s", "tpot_s", "e2e_s")}
    return FinalSummary(
        finish_reason,
        r.num_prompt_tokens,
        r.num_cached_tokens,
        r.num_output_tokens,
        timings,
        r.spec_drafted_tokens,
        r.spec_accepted_tokens,
    )


class Generator:
    def __init__(
        self,
        engine,
        limits: ServiceLimits,
        tenants: TenantRegistry,
        limiter: TenantLimiter,
        waiting: WaitingQueue,
        breaker: CircuitBreaker,
        loop: EngineLoop,
        ledger: RequestLedger,
    ):
        self.limits, self.tenants, self.limiter = limits, tenants, limiter
        self.waiting, self.breaker, self.loop, self.ledger = waiting, breaker, loop, ledger
        self.vocab_size = getattr(engine.tokenizer, "vocab_size", None)
        self.ready = threading.Event()  # set when warm-up has ended
        self.draining = False  # set when the server stops taking new requests

    @property
    def engine(self):
        """The engine now loaded (a reload swaps it: EngineLoop.request_swap)."""
        return self.loop.engine

    @property
    def identity(self):
        return self.loop.engine.identity

    # ---- admission --------------------------------------------------------------------------
    def submit(self, call: GenerateCall, arrival_s: float) -> ActiveRequest:
        """Admit and queue `call`, or raise Refusal after recording its one outcome."""
        tenant_name = "?"
        try:
            tenant = self.authenticate(call.api_key)
            tenant_name = tenant.name
            r = self._admit(call, tenant, arrival_s)
        except Refusal as e:
            e.tenant = tenant_name
            self.record_refusal(call.request_id, e, arrival_s, _log_extra(call))
            raise
        except ValueError as e:  # e.g. the model has no chat template
            refusal = Refusal(
                grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(e), tenant=tenant_name
            )
            self.record_refusal(call.request_id, refusal, arrival_s)
            raise refusal from e
        except Exception as e:  # a bug here must still end in one recorded outcome
            refusal = Refusal(grpc.StatusCode.INTERNAL, "internal", repr(e), tenant=tenant_name)
            self.record_refusal(call.request_id, refusal, arrival_s)
            raise refusal from e
        self.loop.wake.set()
        return r

    def record_refusal(
        self, request_id: str, e: Refusal, arrival_s: float, log_extra: dict | None = None
    ) -> None:
        """The one outcome of a request refused before it was queued."""
        self.ledger.reject(
            request_id,
            e.tenant,
            e.reason,
            e.status,
            e.details,
            arrival_s,
            outcome=e.outcome,
            extra=log_extra,
        )

    def authenticate(self, api_key: str | None) -> TenantPolicy:
        try:
            return self.tenants.authenticate(api_key)
        except UnknownApiKey as e:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", str(e)) from e

    def check_serving(self) -> None:
        if self.draining:
            raise Refusal(
                grpc.StatusCode.UNAVAILABLE, "draining", "server is draining", retry_after_ms=1000
            )
        if not self.ready.is_set():
            raise Refusal(
                grpc.StatusCode.UNAVAILABLE,
                "warming_up",
                "server is warming up (compiling step shapes)",
                retry_after_ms=1000,
            )

    def resolve_adapter(self, call: GenerateCall):
        """The LoRA adapter `call` runs with (engine/lora/adapters.py): the gRPC `adapter` field,
        or, as vLLM does, an HTTP `model` naming a loaded adapter. None: the base model.
        An unknown `adapter` is NOT_FOUND; an unknown `model` is check_model's refusal."""
        loaded = loaded_adapters(self.engine)
        if call.adapter:
            if call.adapter not in loaded:
                raise Refusal(
                    grpc.StatusCode.NOT_FOUND,
                    "adapter_not_found",
                    f"adapter {echo(call.adapter)} is not loaded (loaded: {sorted(loaded)})",
                    param="adapter",
                )
            return loaded[call.adapter]
        return loaded.get(call.model) if call.model != self.identity.name else None

    def check_model(self, model: str, revision: str) -> None:
        if model and model != self.identity.name:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                "model_mismatch",
                f"model {echo(model)} is not served here (loaded: {self.identity.name!r})",
                param="model",
            )
        if revision and revision != self.identity.revision:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                "model_mismatch",
                f"revision {echo(revision)} is pinned but {self.identity.revision!r} is loaded",
                param="revision",
            )

    def _validated(self, call: GenerateCall) -> tuple[list[int], SamplingParams]:
        try:
            prompt = call.prompt_ids()
            a = self.limits.admission
            # NOTE: unset max_tokens is the default, shrunk to what the context leaves.
            default = max(1, min(a.default_max_tokens, a.max_tokens, a.max_model_len - len(prompt)))
            sp = call.sampling(default)
            check_limits(a, len(prompt), sp)
        except InvalidRequestError as e:
            raise invalid(e) from e
        rid = call.request_id
        if len(rid) > MAX_REQUEST_ID_CHARS:
            raise invalid(
                InvalidRequestError(
                    "request_id", f"<{len(rid)} characters>", f"at most {MAX_REQUEST_ID_CHARS}"
                )
            )
        if self.loop.is_active(rid):
            raise invalid(InvalidRequestError("request_id", rid, "already in flight"))
        return prompt, sp

    def _resolve_deadline(self, call: GenerateCall, tenant: TenantPolicy) -> None:
        """A call without a deadline of its own takes its tenant's default, else the server's."""
        d = with_defaults(
            Deadline(call.time_left_s, call.deadline_source),
            tenant.default_request_timeout_s,
            self.limits.admission.default_request_timeout_s,
        )
        call.time_left_s, call.deadline_source = d.timeout_s, d.source

    def _deadline_s(self, time_left_s: float | None, arrival_s: float) -> float | None:
        if time_left_s is None:
            return None
        if time_left_s <= 0:
            raise Refusal(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "expired_on_arrival",
                "deadline passed before the request was admitted",
                outcome="timed_out",
            )
        return arrival_s + time_left_s

    def _admit(self, call: GenerateCall, tenant: TenantPolicy, arrival_s: float) -> ActiveRequest:
        self.check_serving()
        adapter = self.resolve_adapter(call)  # LoRA; an HTTP `model` may name the adapter
        self.check_model("" if adapter is not None else call.model, call.revision)
        prompt, sp = self._validated(call)
        self._resolve_deadline(call, tenant)
        deadline_s = self._deadline_s(call.time_left_s, arrival_s)
        retry_ms = self.breaker.allow()
        if retry_ms is not None:
            raise Refusal(
                grpc.StatusCode.UNAVAILABLE,
                "circuit_open",
                "engine steps are failing; circuit breaker open",
                retry_ms,
            )
        try:
            reservation = self.limiter.acquire(tenant, len(prompt), sp.max_tokens)
        except InvalidRequestError as e:
            raise invalid(e) from e
        except Rejected as e:
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED, e.reason, str(e), e.retry_after_ms
            ) from e
        priority = tenant.priority if call.priority is None else call.priority
        engine_request = EngineRequest(
            call.request_id,
            prompt,
            sp,
            priority=priority,
            tenant=tenant.name,
            deadline_s=deadline_s,
            adapter=None if adapter is None else adapter.name,
        )
        stream = StreamBuffer(self.limits.stream_buffer_messages, call.stream_listener)
        r = ActiveRequest(call.request_id, tenant, reservation, engine_request, arrival_s, stream)
        r.success_on_delivery = call.success_on_delivery
        r.log_extra = _log_extra(call)
        self._enqueue(r, priority)
        return r

    def _enqueue(self, r: ActiveRequest, priority: int) -> None:
        self.loop.register(r)
        er = r.engine_request
        # the prompt's share the prefix cache is expected to serve
        r.prefix_keys, r.expected_cached_tokens = self.waiting.expected_cached(
            er.prompt_token_ids, (er.tenant, er.adapter)
        )
        item = QueuedRequest(
            r.request_id,
            len(er.prompt_token_ids) + er.sampling.max_tokens,
            priority,
            r.arrival_s,
            er.deadline_s,
            prompt_tokens=len(er.prompt_token_ids),
            max_tokens=er.sampling.max_tokens,
            cached_tokens=r.expected_cached_tokens,
        )
        try:
            self.waiting.offer(item)
        except Rejected as e:
            self.loop.unregister(r.request_id)
            self.limiter.release(r.tenant, r.reservation, 0, refund_all=True)
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED, e.reason, str(e), e.retry_after_ms
            ) from e

    # ---- ending -------------------------------------------------------------------------------
    def client_gone(self, r: ActiveRequest, reason: str = "client") -> None:
        """The transport's client left (cancel, disconnect, deadline) before `r` ended."""
        if r.outcome is not None:
            return
        deadline = r.engine_request.deadline_s
        # NOTE: a client deadline reaches the server as an HTTP/2 cancel a little before the
        # server's own deadline: a call ending this close to it ended by the deadline.
        late = deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK_S
        outcome, reason, status = (
            ("timed_out", "deadline", grpc.StatusCode.DEADLINE_EXCEEDED)
            if late
            else ("cancelled", reason, grpc.StatusCode.CANCELLED)
        )
        if self.ledger.settle(r, outcome, reason, status, "call ended by the client"):
            self.loop.abort(r.request_id)
