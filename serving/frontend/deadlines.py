"""How long a request's client will wait: its deadline, resolved once when it arrives.

The first of these that is present wins (`timeout_source` in the request log line):

    x-request-timeout-ms       HTTP header of this server: milliseconds, > 0
    x-stainless-read-timeout   HTTP header the official `openai` SDK sends on every call: its
                               `timeout=` in seconds (600 unless the caller set one)
    grpc-timeout               a gRPC call's deadline (serving/grpc_api/service.py)
    tenant                     the tenant's `default_request_timeout_s` (--tenants_config)
    server                     --default_request_timeout_s (off by default)

A header's deadline is taken `lead_s(timeout)` = min(0.5 s, 10%) early (the log's
`timeout_s` is what is left): the client's clock started before the request reached the
server (a busy event loop holds it in uvicorn for a while), and a request ended by the
server's deadline must reach the client as a 504 before the client's own timeout fires.

A bad header value is INVALID_ARGUMENT (HTTP 400) naming the header, its value and the limit.
The resolved timeout becomes the engine request's absolute `deadline_s` (arrival + timeout),
so an HTTP deadline takes the same path as a gRPC one (generation.py): admission sheds a
request whose estimated completion misses it (RESOURCE_EXHAUSTED: 429 + Retry-After), a
request still queued or running when it passes ends timed_out{deadline} with its pages freed
(HTTP 504, or an error event in a stream), and it bounds a stream's whole life, not each read.

NOTE: the SDK's read timeout is, for httpx, the longest wait for one read. For a non-streamed
call that is the whole call (nothing is read before the body), so it is the deadline. For a
stream it is the gap between chunks, yet it is taken here as the whole stream's deadline:
the server cannot tell a client that would keep reading a long stream from one that left, and
the SDK's default (600 s) is long. A streaming client that wants another bound sends
x-request-timeout-ms, which comes first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from engine.errors import InvalidRequestError

REQUEST_TIMEOUT_HEADER = "x-request-timeout-ms"
SDK_TIMEOUT_HEADER = "x-stainless-read-timeout"
GRPC_SOURCE = "grpc-timeout"
TENANT_SOURCE = "tenant"
SERVER_SOURCE = "server"
MAX_LEAD_S, LEAD_FRACTION = 0.5, 0.1  # a header deadline is taken this much early
MAX_TIMEOUT_S = 86_400.0  # a day: longer is a mistake (or "no deadline", which is: no header)

# header -> (seconds per unit, unit)
_HEADERS = {REQUEST_TIMEOUT_HEADER: (1e-3, "milliseconds"), SDK_TIMEOUT_HEADER: (1.0, "seconds")}


@dataclasses.dataclass(frozen=True)
class Deadline:
    timeout_s: float | None  # from arrival; None: no deadline
    source: str = ""  # where it came from (see the module docstring); "" when none


NO_DEADLINE = Deadline(None)


def from_headers(headers: Mapping[str, str]) -> Deadline:
    """The deadline an HTTP request's headers give (NO_DEADLINE when none does); raises
    InvalidRequestError naming the header for a value that is not a number in range."""
    for name, (scale, unit) in _HEADERS.items():
        raw = headers.get(name)
        if raw is not None:
            timeout_s = _parse(name, raw, scale, unit)
            return Deadline(timeout_s - lead_s(timeout_s), name)
    return NO_DEADLINE


def lead_s(timeout_s: float) -> float:
    """How much earlier than a client's timeout the server ends its request."""
    return min(MAX_LEAD_S, LEAD_FRACTION * timeout_s)


def _parse(name: str, raw: str, scale: float, unit: str) -> float:
    limit = f"a number of {unit} > 0 and at most {MAX_TIMEOUT_S / scale:g}"
    try:
        value = float(raw.strip())
    except ValueError:
        raise InvalidRequestError(name, raw, limit) from None
    if not (math.isfinite(value) and value > 0 and value * scale <= MAX_TIMEOUT_S):
        raise InvalidRequestError(name, raw, limit)
    return value * scale


def with_defaults(given: Deadline, tenant_s: float | None, server_s: float | None) -> Deadline:
    """`given` (a client's), else the tenant's default, else the server's, else none."""
    if given.timeout_s is not None:
        return given
    if tenant_s is not None:
        return Deadline(tenant_s, TENANT_SOURCE)
    if server_s is not None:
        return Deadline(server_s, SERVER_SOURCE)
    return NO_DEADLINE


def log_fields(deadline: Deadline) -> dict:
    """The request log line's view of a deadline (nothing when there is none)."""
    if deadline.timeout_s is None:
        return {}
    return {"timeout_s": round(deadline.timeout_s, 3), "timeout_source": deadline.source}
