"""The gate in front of every PagedJax RPC: authentication, message size and parsing, decided
before the service does any work (a server interceptor, run on gRPC's polling thread).

    call arrives -> RequestGuard.intercept_service (metadata only, message not yet parsed)
      unknown / missing x-api-key  -> UNAUTHENTICATED; the message is never parsed
      otherwise the handler's deserializer is wrapped:
        raw bytes > max_request_bytes  -> INVALID_ARGUMENT naming size and limit (not parsed)
        bytes that are not the message -> INVALID_ARGUMENT, one log line, no traceback
      -> the service method (which authenticates again, cheaply, to learn the tenant)

gRPC core itself refuses messages over `core_max_receive_bytes` (RESOURCE_EXHAUSTED, "larger
than max") before Python sees them; the server sets that bound above ours so that sizes
between the two get the clearer INVALID_ARGUMENT.

Generate refusals go through `on_generate_refused(reason, status, details)` so that each one
is still recorded as the call's one outcome (see request_state.RequestLedger).

Health checks and reflection pass without a key: probes must work without credentials and
neither does work on behalf of a caller.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from serving.frontend.tenants import TenantRegistry, UnknownApiKey

log = logging.getLogger("pagedjax.serving")
API_KEY = "x-api-key"


@dataclasses.dataclass(frozen=True)
class Malformed:
    """Stands in for a request message that could not be accepted (too big, unparsable)."""

    details: str


_UNPARSED = Malformed("not parsed")


def _refusing_handler(kind: str, status: grpc.StatusCode, details: str, on_refused):
    """A handler of the same arity that refuses without parsing the request."""

    def refuse(request, context):
        if on_refused is not None:
            on_refused(status, details)
        context.abort(status, details)

    def refuse_stream(request, context):
        refuse(request, context)
        yield  # pragma: no cover - abort raised

    behavior = refuse_stream if kind == "unary_stream" else refuse
    maker = getattr(grpc, f"{kind}_rpc_method_handler")
    # NOTE: gRPC treats a None request as a failed parse (INTERNAL), so the unparsed request
    # is a placeholder object.
    return maker(behavior, request_deserializer=lambda raw: _UNPARSED)


def _kind(handler) -> str:
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        if getattr(handler, kind) is not None:
            return kind
    raise ValueError("handler has no behavior")


class RequestGuard(grpc.ServerInterceptor):
    def __init__(
        self,
        tenants: TenantRegistry,
        service_prefix: str,
        max_request_bytes: int,
        generate_method: str,
        on_generate_refused: Callable[[str, grpc.StatusCode, str], None] | None = None,
    ):
        self.tenants, self.service_prefix = tenants, service_prefix
        self.max_request_bytes, self.generate_method = max_request_bytes, generate_method
        self.on_generate_refused = on_generate_refused

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self.service_prefix):
            return handler
        kind = _kind(handler)
        is_generate = method == self.generate_method
        metadata = dict(handler_call_details.invocation_metadata or ())
        try:
            self.tenants.authenticate(metadata.get(API_KEY))
        except UnknownApiKey as e:
            return _refusing_handler(
                kind,
                grpc.StatusCode.UNAUTHENTICATED,
                str(e),
                self._recorder("unauthenticated") if is_generate else None,
            )
        return self._parsing_handler(handler, kind, method, is_generate)

    def _recorder(self, reason: str):
        if self.on_generate_refused is None:
            return None
        return lambda status, details: self.on_generate_refused(reason, status, details)

    def _parsing_handler(self, handler, kind: str, method: str, is_generate: bool):
        parse = handler.request_deserializer
        limit = self.max_request_bytes

        def deserialize(raw: bytes):
            if len(raw) > limit:
                return Malformed(f"request={len(raw)} bytes is invalid: at most {limit} bytes")
            try:
                return parse(raw)
            except (DecodeError, ValueError, TypeError) as e:
                return Malformed(f"request is invalid: not a valid protobuf message ({e})")

        behavior = getattr(handler, kind)
        record = self._recorder("invalid_argument") if is_generate else None

        def check(request, context):
            if isinstance(request, Malformed):
                # One log line, no traceback: Generate's is its request_end record.
                if record is not None:
                    record(grpc.StatusCode.INVALID_ARGUMENT, request.details)
                else:
                    log.warning("refused %s: %s", method, request.details)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)

        if kind == "unary_stream":

            def guarded_stream(request, context):
                check(request, context)
                yield from behavior(request, context)

            guarded = guarded_stream
        else:

            def guarded_unary(request, context):
                check(request, context)
                return behavior(request, context)

            guarded = guarded_unary
        maker = getattr(grpc, f"{kind}_rpc_method_handler")
        return maker(
            guarded,
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )
