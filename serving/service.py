"""The PagedJax gRPC service: one handler thread per call (see engine_loop.py for the
threads and queues). Before a handler runs, serving/guard.py has checked the API key and the
message's size and parse on every RPC. Generate runs admission on its own thread, in this
order, and every refusal is recorded as that request's one outcome before the call ends:

    x-api-key -> tenant            UNAUTHENTICATED         rejected{unauthenticated}
    server draining (SIGTERM)      UNAVAILABLE + retry     rejected{draining}
    model / revision pin           FAILED_PRECONDITION     rejected{model_mismatch}
    raw sizes, enums, token ids    INVALID_ARGUMENT        rejected{invalid_argument}
      (serving/input_limits.py, before any tokenizing)
    prompt, sampling, limits       INVALID_ARGUMENT        rejected{invalid_argument}
    deadline already passed        DEADLINE_EXCEEDED       timed_out{expired_on_arrival}
    circuit breaker                UNAVAILABLE + retry     rejected{circuit_open}
    tenant concurrency / tokens    RESOURCE_EXHAUSTED + retry  rejected{tenant_*}
    waiting queue / est. wait      RESOURCE_EXHAUSTED + retry  rejected{queue_*, deadline}

Outcomes are the client's view: success is recorded only once the final message was handed
to the transport (the handler's yield of it returned); a call that ends earlier is
timed_out{deadline} when it ended within DEADLINE_SLACK_S of its deadline (a client deadline
reaches the server as an HTTP/2 cancel, a little before the server's own deadline), else
cancelled{client}. The handler notes what the transport accepted (`tokens_sent`,
`send_started_s`) so the engine thread can apply the slow-consumer policy
(request_state.SlowConsumerPolicy).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import uuid

import grpc

from engine.api_types import EngineRequest
from engine.errors import InvalidRequestError
from serving import convert, input_limits
from serving.admission import AdmissionConfig, QueuedRequest, Rejected, WaitingQueue, check_limits
from serving.breaker import CircuitBreaker
from serving.engine_loop import EngineLoop
from serving.proto import pagedjax_pb2 as pb
from serving.proto import pagedjax_pb2_grpc as pb_grpc
from serving.request_state import ActiveRequest, RequestLedger, StreamBuffer, Terminal
from serving.tenants import TenantLimiter, TenantRegistry, UnknownApiKey

RETRY_AFTER_KEY = "retry-after-ms"
SHUTDOWN_RETRY_AFTER_MS = 5_000  # a restarted or sibling replica should be up by then
API_KEY = "x-api-key"
MAX_REQUEST_ID_CHARS = 256
DEADLINE_SLACK_S = 0.1  # a call ending this close to its deadline ended by the deadline
_POLL_S = 0.25  # how often a waiting handler checks that its client is still there


class _Refusal(Exception):
    def __init__(
        self,
        status: grpc.StatusCode,
        reason: str,
        details: str,
        retry_after_ms: int | None = None,
        outcome: str = "rejected",
        tenant: str = "?",
    ):
        self.status, self.reason, self.details = status, reason, details
        self.retry_after_ms, self.outcome, self.tenant = retry_after_ms, outcome, tenant
        super().__init__(details)


@dataclasses.dataclass(frozen=True)
class ServiceLimits:
    admission: AdmissionConfig
    stream_buffer_messages: int
    max_inflight: int


class PagedJaxService(pb_grpc.PagedJaxServicer):
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
        engine_config: dict,
    ):
        self.limits, self.tenants, self.limiter = limits, tenants, limiter
        self.waiting, self.breaker, self.loop, self.ledger = waiting, breaker, loop, ledger
        self.engine_config = engine_config
        self.vocab_size = getattr(engine.tokenizer, "vocab_size", None)
        self.draining = threading.Event()  # set by serving/shutdown.py

    @property
    def engine(self):
        """The engine now loaded (a reload swaps it: EngineLoop.request_swap)."""
        return self.loop.engine

    @property
    def identity(self):
        return self.loop.engine.identity

    # ---- Generate -------------------------------------------------------------------------
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        arrival_s = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            r = self._admit_call(request, request_id, context, arrival_s)
        except _Refusal as e:
            self.ledger.reject(
                request_id, e.tenant, e.reason, e.status, e.details, arrival_s, outcome=e.outcome
            )
            if e.retry_after_ms is not None:
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(e.retry_after_ms)),))
            context.abort(e.status, e.details)
        if not context.add_callback(lambda: self._on_call_end(r, context)):
            self._on_call_end(r, context)  # the call already ended (client gone)
        self.loop.wake.set()
        yield from self._relay(r, request.stream, context)

    def _admit_call(self, request, request_id, context, arrival_s) -> ActiveRequest:
        """Admission, with every failure turned into a _Refusal (one recorded outcome)."""
        tenant_name = "?"
        try:
            tenant = self._authenticate(context)
            tenant_name = tenant.name
            return self._admit(request, request_id, tenant, context, arrival_s)
        except _Refusal as e:
            e.tenant = tenant_name
            raise
        except ValueError as e:  # e.g. the model has no chat template
            raise _Refusal(
                grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(e), tenant=tenant_name
            ) from e
        except Exception as e:  # a bug here must still end in one recorded outcome
            raise _Refusal(grpc.StatusCode.INTERNAL, "internal", repr(e), tenant=tenant_name) from e

    def _authenticate(self, context):
        api_key = dict(context.invocation_metadata()).get(API_KEY)
        try:
            return self.tenants.authenticate(api_key)
        except UnknownApiKey as e:
            raise _Refusal(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", str(e)) from e

    def _check_model(self, model: str, revision: str) -> None:
        if model and model != self.identity.name:
            raise _Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                "model_mismatch",
                f"model {model!r} is not served here (loaded: {self.identity.name!r})",
            )
        if revision and revision != self.identity.revision:
            raise _Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                "model_mismatch",
                f"revision {revision!r} is pinned but {self.identity.revision!r} is loaded",
            )

    def _deadline_s(self, context, arrival_s: float) -> float | None:
        remaining = context.time_remaining()
        if remaining is None or remaining > 1e8:
            return None
        if remaining <= 0:
            raise _Refusal(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "expired_on_arrival",
                "deadline passed before the request was admitted",
                outcome="timed_out",
            )
        return arrival_s + remaining

    def _admit(self, request, request_id, tenant, context, arrival_s) -> ActiveRequest:
        if self.draining.is_set():
            raise _Refusal(
                grpc.StatusCode.UNAVAILABLE,
                "draining",
                "server is shutting down; retry on another replica or after a restart",
                SHUTDOWN_RETRY_AFTER_MS,
            )
        self._check_model(request.model, request.revision)
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise _Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                "invalid_argument",
                f"request_id of {len(request.request_id)} characters is invalid: at most "
                f"{MAX_REQUEST_ID_CHARS}",
            )
        try:
            input_limits.check_generate_input(request, self.limits.admission, self.vocab_size)
            prompt = convert.prompt_token_ids(request, self.engine.tokenizer, self.vocab_size)
            a = self.limits.admission
            # NOTE: unset max_tokens is the default, shrunk to what the context leaves.
            default = max(1, min(a.default_max_tokens, a.max_tokens, a.max_model_len - len(prompt)))
            sp = convert.sampling_params(request, default)
            check_limits(a, len(prompt), sp)
        except InvalidRequestError as e:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(e)) from e
        if self.loop.is_active(request_id):
            raise _Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                "invalid_argument",
                f"request_id={request_id!r} is invalid: already in flight",
            )
        deadline_s = self._deadline_s(context, arrival_s)
        retry_ms = self.breaker.allow()
        if retry_ms is not None:
            raise _Refusal(
                grpc.StatusCode.UNAVAILABLE,
                "circuit_open",
                "engine steps are failing; circuit breaker open",
                retry_ms,
            )
        try:
            reservation = self.limiter.acquire(tenant, len(prompt), sp.max_tokens)
        except InvalidRequestError as e:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(e)) from e
        except Rejected as e:
            raise _Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED, e.reason, str(e), e.retry_after_ms
            ) from e
        priority = convert.ENGINE_PRIORITY[request.priority]  # range-checked above
        engine_request = EngineRequest(
            request_id, prompt, sp, priority=priority, tenant=tenant.name, deadline_s=deadline_s
        )
        r = ActiveRequest(
            request_id,
            tenant,
            reservation,
            engine_request,
            arrival_s,
            StreamBuffer(self.limits.stream_buffer_messages),
        )
        self.loop.register(r)
        try:
            self.waiting.offer(
                QueuedRequest(
                    request_id,
                    len(prompt) + sp.max_tokens,
                    priority,
                    arrival_s,
                    deadline_s,
                    payload=None,
                    prompt_tokens=len(prompt),
                    max_tokens=sp.max_tokens,
                )
            )
        except Rejected as e:
            self.loop.unregister(request_id)
            self.limiter.release(tenant, reservation, 0, refund_all=True)
            raise _Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED, e.reason, str(e), e.retry_after_ms
            ) from e
        return r

    def _on_call_end(self, r: ActiveRequest, context) -> None:
        """gRPC callback when the call ends for any reason: a call that ends before its
        request did was cancelled by the client, or its deadline passed."""
        if r.outcome is not None:
            return
        deadline = r.engine_request.deadline_s
        remaining = context.time_remaining()
        late = (deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK_S) or (
            remaining is not None and remaining <= DEADLINE_SLACK_S
        )
        outcome, reason, status = (
            ("timed_out", "deadline", grpc.StatusCode.DEADLINE_EXCEEDED)
            if late
            else ("cancelled", "client", grpc.StatusCode.CANCELLED)
        )
        if self.ledger.settle(r, outcome, reason, status, "call ended by the client"):
            self.loop.abort(r.request_id)

    def _relay(self, r: ActiveRequest, stream: bool, context):
        """Stream buffer -> gRPC messages; ends with the final message or the terminal status."""
        acc = pb.GenerateResponse(request_id=r.request_id)
        while True:
            items, terminal = r.stream.get(_POLL_S)
            if items:
                msg = convert.delta_message(r.request_id, items)
                last = items[-1]
                done = last.finished and last.finish_reason in ("stop", "length")
                if done:
                    msg.final.CopyFrom(
                        convert.final_info(
                            last.finish_reason,
                            r.num_prompt_tokens,
                            r.num_cached_tokens,
                            r.num_output_tokens,
                            r.timings or {},
                            r.identity or self.identity,
                        )
                    )
                if stream and (msg.token_ids or msg.text or done):
                    yield from self._send(r, msg, len(msg.token_ids))
                elif not stream:
                    convert.merge_into(acc, msg)
                    r.tokens_sent += len(msg.token_ids)  # nothing to send until the end
                if done:
                    if not stream:
                        acc.final.CopyFrom(msg.final)
                        yield from self._send(r, acc, 0)
                    # the transport took the final message: only now is it a success
                    self.ledger.settle(r, "success", "", grpc.StatusCode.OK)
                    return
            if terminal is not None:
                self._abort(context, terminal)
            if not context.is_active():
                return

    @staticmethod
    def _send(r: ActiveRequest, msg, num_tokens: int):
        """Yield one message, noting how long the transport takes to accept it: gRPC resumes
        the generator only once the message was written (flow control permitting)."""
        r.send_started_s = time.monotonic()
        yield msg
        r.send_started_s = None
        r.tokens_sent += num_tokens

    def _abort(self, context, terminal: Terminal):
        if terminal.retry_after_ms is not None:
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(terminal.retry_after_ms)),))
        context.abort(terminal.code, terminal.details)

    # ---- the other RPCs -------------------------------------------------------------------
    def Tokenize(self, request: pb.TokenizeRequest, context):
        try:
            self._authenticate(context)
            self._check_model(request.model, "")
            return self._tokenize(request)
        except _Refusal as e:
            context.abort(e.status, e.details)
        except (InvalidRequestError, ValueError) as e:  # ValueError: e.g. no chat template
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        input_limits.check_tokenize_input(request, self.limits.admission)
        if request.WhichOneof("input") == "chat":
            messages = convert.chat_messages(request.chat)
            text = self.engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt
            )
            ids = convert.chat_token_ids(
                self.engine.tokenizer, messages, request.add_generation_prompt
            )
        else:
            text = request.text
            ids = self.engine.tokenizer.encode(text)
        return pb.TokenizeResponse(token_ids=ids, text=text)

    def _authenticate_or_abort(self, context) -> None:
        try:
            self._authenticate(context)
        except _Refusal as e:
            context.abort(e.status, e.details)

    def _model_info(self) -> pb.ModelInfo:
        return pb.ModelInfo(
            versions=convert.versions_message(self.identity),
            max_model_len=self.limits.admission.max_model_len,
        )

    def ListModels(self, request, context):
        self._authenticate_or_abort(context)
        return pb.ListModelsResponse(models=[self._model_info()])

    def ServerInfo(self, request, context):
        self._authenticate_or_abort(context)
        a = self.limits.admission
        stats = dict(self.loop.last_stats)
        limits = pb.Limits(
            max_prompt_tokens=a.max_prompt_tokens,
            max_tokens=a.max_tokens,
            default_max_tokens=a.default_max_tokens,
            max_model_len=a.max_model_len,
            max_stop_strings=a.max_stop_strings,
            max_queue_requests=a.max_queue_requests,
            max_queue_tokens=a.max_queue_tokens,
            queue_timeout_s=a.queue_timeout_s,
            stream_buffer_messages=self.limits.stream_buffer_messages,
            max_inflight=self.limits.max_inflight,
        )
        numeric = {
            k: float(v)
            for k, v in stats.items()
            if isinstance(v, (int, float)) and math.isfinite(float(v))
        }
        numeric["server_queue_requests"] = float(len(self.waiting))
        return pb.ServerInfoResponse(
            model=self._model_info(),
            kv_capacity_tokens=int(stats.get("kv_capacity_tokens", 0)),
            limits=limits,
            engine_config={k: str(v) for k, v in self.engine_config.items()},
            stats=numeric,
            circuit_breaker=self.breaker.state,
        )
