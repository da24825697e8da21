"""The PagedJax gRPC service: one handler thread per call (see engine_loop.py for the
threads and queues). Generate turns the protobuf request into a GenerateCall and hands it to
the transport-neutral Generator (generation.py: admission order, refusals, outcomes), which
the HTTP API shares; a refusal becomes the call's status, with trailing `retry-after-ms`.

Before a handler runs, serving/grpc_api/guard.py has checked the API key and the message's size and
parse on every RPC; the raw fields are bounded (serving/grpc_api/input_limits.py) before tokenizing.
Success is recorded only once the final message was handed to the transport (the handler's
yield of it returned). The handler notes what the transport accepted (`tokens_sent`,
`send_started_s`) for the engine thread's slow-consumer policy
(request_state.SlowConsumerPolicy).

Slow gRPC readers: what the server can and cannot see. The handler's `yield` returns once
gRPC core has taken the message for its HTTP/2 stream, and core takes messages as long as
the *client's* receive window has room. A default grpcio client announces a large window
and grows it by BDP probing (to megabytes), and its core reads the socket on its own,
whatever the application iterates: a Python client reading one message every 0.5 s let the
server's transport accept 4,000 messages (> 1 MB) without pushing back. So:
  - seen at once: cancel, disconnect, deadline (the call's callback -> cancelled{client} or
    timed_out{deadline}); a reader whose window has filled (its messages wait in `yield`:
    the stall timeout and max_tokens_ahead of the policy trip, ABORTED, pages freed);
  - not seen: a default client that reads slowly but whose buffered bytes still fit its
    window (megabytes, i.e. more tokens than max_tokens allows): to the server it is a fast
    reader, its request runs to the end and counts as a success once the final message was
    handed to the transport. The server cannot shrink a client's receive window; a client
    that wants backpressure opens its channel with a small window
    (`grpc.http2.bdp_probe=0`, a small `grpc.http2.lookahead_bytes`), and the policy then
    trips. Acknowledged delivery would need an application-level ack (a bidirectional
    stream), which this API does not have.
"""

from __future__ import annotations

import math
import time
import uuid

import grpc

from engine.chat.output import ChatOutput
from engine.chat.setup import ChatOptions, chat_token_ids
from engine.errors import InvalidRequestError
from serving.frontend.deadlines import GRPC_SOURCE
from serving.frontend.generation import GenerateCall, Generator, Refusal, final_summary, is_done
from serving.frontend.request_state import ActiveRequest, Terminal
from serving.grpc_api import chat, convert, input_limits
from serving.grpc_api.chat import ChatTurn
from serving.proto import pagedjax_pb2 as pb
from serving.proto import pagedjax_pb2_grpc as pb_grpc

RETRY_AFTER_KEY = "retry-after-ms"
API_KEY = "x-api-key"
_POLL_S = 0.25  # how often a waiting handler checks that its client is still there


def _time_left_s(context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e8 else remaining


class PagedJaxService(pb_grpc.PagedJaxServicer):
    def __init__(self, generator: Generator, engine_config: dict, chat_options: ChatOptions):
        """`chat_options`: the server's tool-call and reasoning formats (engine/chat/setup.py),
        the same the HTTP API splits chat output with."""
        self.generator, self.engine_config = generator, engine_config
        self.chat_options = chat_options
        g = generator
        self.limits, self.waiting, self.breaker, self.loop = g.limits, g.waiting, g.breaker, g.loop

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
        turn: list[ChatTurn | None] = [None]  # set by the call's prompt builder
        call = self._call(request, context, turn)
        try:
            r = self.generator.submit(call, arrival_s)
        except Refusal as e:
            if e.retry_after_ms is not None:
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(e.retry_after_ms)),))
            context.abort(e.status, e.details)
        if not context.add_callback(lambda: self.generator.client_gone(r)):
            self.generator.client_gone(r)  # the call already ended (client gone)
        output = turn[0].new_output() if turn[0] is not None else None
        yield from self._relay(r, request.stream, context, output)

    def _call(self, request: pb.GenerateRequest, context, turn: list) -> GenerateCall:
        """`turn[0]` becomes the request's ChatTurn (tools / reasoning) when it has one."""
        tokenizer, vocab_size = self.engine.tokenizer, self.generator.vocab_size
        admission = self.limits.admission

        def prompt_ids() -> list[int]:
            input_limits.check_generate_input(request, admission, vocab_size)  # before tokenizing
            turn[0] = ChatTurn.of(request, self.chat_options)
            if turn[0] is not None:
                return turn[0].prompt_ids(tokenizer)
            return convert.prompt_token_ids(request, tokenizer, vocab_size)

        def sampling(default: int):
            params = convert.sampling_params(request, default)
            return params if turn[0] is None else turn[0].sampling(params)

        return GenerateCall(
            request_id=request.request_id or uuid.uuid4().hex,
            api_key=dict(context.invocation_metadata()).get(API_KEY),
            prompt_ids=prompt_ids,
            success_on_delivery=True,
            sampling=sampling,
            model=request.model,
            revision=request.revision,
            adapter=request.adapter,
            priority=convert.ENGINE_PRIORITY.get(request.priority),
            time_left_s=_time_left_s(context),
            deadline_source=GRPC_SOURCE,  # meaningful only with time_left_s
        )

    def _relay(self, r: ActiveRequest, stream: bool, context, output: ChatOutput | None):
        """Stream buffer -> gRPC messages; ends with the final message or the terminal status.
        `output`: the chat's splitter (tools / reasoning), None for plain text."""
        acc = pb.GenerateResponse(request_id=r.request_id)
        while True:
            items, terminal = r.stream.get(_POLL_S)
            if items:
                msg = convert.delta_message(r.request_id, items)
                done = is_done(items)
                if output is not None:
                    chat.fill(msg, output.feed_outputs(items, done))
                if done:
                    summary = final_summary(r, items[-1].finish_reason)
                    msg.final.CopyFrom(convert.final_info(summary, r.identity or self.identity))
                    if output is not None:
                        msg.final.finish_reason = output.finish_reason(summary.finish_reason)
                        msg.final.usage.reasoning_tokens = output.reasoning_tokens
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
                    self.generator.ledger.settle(r, "success", "", grpc.StatusCode.OK)
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
            self.generator.check_model(request.model, "")
            return self._tokenize(request)
        except Refusal as e:
            context.abort(e.status, e.details)
        except (InvalidRequestError, ValueError) as e:  # ValueError: e.g. no chat template
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _authenticate(self, context) -> None:
        self.generator.authenticate(dict(context.invocation_metadata()).get(API_KEY))

    def _authenticate_or_abort(self, context) -> None:
        try:
            self._authenticate(context)
        except Refusal as e:
            context.abort(e.status, e.details)

    def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        input_limits.check_tokenize_input(request, self.limits.admission)
        if request.WhichOneof("input") == "chat":
            messages = convert.chat_messages(request.chat)
            text = self.engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt
            )
            ids = chat_token_ids(self.engine.tokenizer, messages, request.add_generation_prompt)
        else:
            text = request.text
            ids = self.engine.tokenizer.encode(text)
        return pb.TokenizeResponse(token_ids=ids, text=text)

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
        if self.waiting.capacity is not None:  # the factor admission holds estimates to
            numeric["admission_margin"] = self.waiting.margin()
        return pb.ServerInfoResponse(
            model=self._model_info(),
            kv_capacity_tokens=int(stats.get("kv_capacity_tokens", 0)),
            limits=limits,
            engine_config={k: str(v) for k, v in self.engine_config.items()},
            stats=numeric,
            circuit_breaker=self.breaker.state,
        )
