"""llm-d's prefill/decode flow over the OpenAI API: the `kv_transfer_params` fields its
routing sidecar sends (vLLM's NIXL connector protocol), served by our KV transfer
(serving/disagg/service.py).

The sidecar, beside a decode pod, makes two calls for one client request:

    1. to the prefill pod the EPP picked: the request with max_tokens=1, stream=false and
       "kv_transfer_params": {"do_remote_decode": true, ...}
       -> the response carries "kv_transfer_params": {"do_remote_prefill": true,
          "remote_host": <its pod IP>, "remote_port": <its gRPC port>, "remote_engine_id",
          "remote_request_id", "remote_block_ids": [], "tp_size": 1}
    2. to its own decode server: the original request with those parameters
       -> the decode server PULLS the prompt's K/V from remote_host:remote_port over the
          KVTransfer.Prefill RPC (the same path as our own router's Decode), stages it, and
          runs the request from the imported K/V and first token.

NOTE: our KVTransfer.Prefill runs the prompt when it is called, so the prefill pod computes
the prompt for call 1 and again for the pull; the second run is served from its prefix cache
for every full page (only the last partial page and the first token are recomputed). A
prefill pod that evicted those pages in between recomputes them: slower, same tokens.

The pull is the KVTransfer service's (serving/disagg/service.py `pull`): over the jax transport
when both pods run `--kv_transport=jax`, counted in WorkerInfo's kv_pulls / kv_jax_pulls. A
client that goes away during the pull cancels it (`cancel_pulls`, called by the HTTP API):
nothing is staged or imported, and the prefill side freed its pages at the export.

Statuses: kv_transfer_params that is not an object of the known fields, or asks for both
directions, or for streaming or n > 1 with do_remote_decode, is 400; a server whose role or
engine cannot move K/V is 409 (FAILED_PRECONDITION); a prefill pod that cannot be reached is
503, a corrupted payload 500 (DATA_LOSS), a K/V layout or model mismatch 409.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading

import grpc

from engine.errors import InvalidRequestError
from engine.kv_transfer.transfer import KVChecksumError, KVTransferMismatchError, check_compatible
from serving.client import build_request
from serving.disagg.jax_transfer import JaxPullError
from serving.disagg.wire import KVWireError
from serving.frontend.generation import GenerateCall, Refusal

FLAGS = ("do_remote_decode", "do_remote_prefill")
KNOWN = {
    *FLAGS,
    "remote_engine_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "remote_request_id",
    "tp_size",
}
API_KEY = "x-api-key"
PULL_TIMEOUT_S = 120.0


def parse(params, *, stream: bool, n: int) -> dict | None:
    """The request's kv_transfer_params checked (None: absent or both flags false)."""
    if params is None:
        return None
    unknown = sorted(set(params) - KNOWN)
    if unknown:
        raise InvalidRequestError("kv_transfer_params", unknown, f"known fields: {sorted(KNOWN)}")
    for flag in FLAGS:
        if not isinstance(params.get(flag, False), bool):
            raise InvalidRequestError(f"kv_transfer_params.{flag}", params[flag], "a boolean")
    decode, prefill = (bool(params.get(f)) for f in FLAGS)
    if decode and prefill:
        raise InvalidRequestError("kv_transfer_params", params, "one of do_remote_decode/prefill")
    if not (decode or prefill):
        return None
    if n != 1:
        raise InvalidRequestError("n", n, "1 with kv_transfer_params")
    if decode and stream:
        raise InvalidRequestError("stream", stream, "false with do_remote_decode")
    if prefill:
        host, port = params.get("remote_host"), params.get("remote_port")
        if not isinstance(host, str) or not host:
            raise InvalidRequestError("kv_transfer_params.remote_host", host, "a host name")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise InvalidRequestError("kv_transfer_params.remote_port", port, "a port number")
    return dict(params)


class KvTransferParams:
    """The server side of both calls; `server` is the PagedJaxServer (role, gRPC port)."""

    def __init__(self, server, advertise_host: str | None = None):
        self.server = server
        self.host = advertise_host or os.environ.get("POD_IP") or socket.gethostname()
        self._lock = threading.Lock()
        self._pulls: dict[str, grpc.Future] = {}  # request id -> its pull's gRPC call
        self._cancelled: set[str] = set()  # request ids whose client went away

    def _require(self, role: str) -> None:
        """FAILED_PRECONDITION unless this server serves `role`'s side of a transfer."""
        ok_role = self.server.config.role in (role, "both")
        ok_engine = hasattr(self.server.loop.engine, "stage")
        if not (ok_role and ok_engine):
            why = (
                f"this server's role is {self.server.config.role!r}"
                if not ok_role
                else f"this engine ({type(self.server.loop.engine).__name__}) cannot move K/V"
            )
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                "kv_transfer_unavailable",
                f"kv_transfer_params: {why}",
                param="kv_transfer_params",
            )

    # ---- call 1: the prefill pod -----------------------------------------------------------
    def check_prefill(self) -> None:
        self._require("prefill")

    def response_params(self, request_id: str) -> dict:
        """What the decode side needs to pull this prompt's K/V (call 1's response)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.server.loop.engine.identity.revision,
            "remote_block_ids": [],
            "remote_host": self.host,
            "remote_port": self.server.port,
            "remote_request_id": request_id,
            "tp_size": 1,
        }

    # ---- call 2: the decode pod ------------------------------------------------------------
    def with_remote_prefill(self, call: GenerateCall, params: dict, body) -> GenerateCall:
        """`call` whose prompt_ids() also pulls and stages the prompt's K/V (it runs on the
        thread that submits, after the model check; a refusal there is the call's)."""
        self._require("decode")
        target = f"{params['remote_host']}:{params['remote_port']}"
        sampling = {
            k: getattr(body, k)
            for k in ("temperature", "top_p", "top_k", "seed")
            if getattr(body, k, None) is not None
        }

        def prompt_ids() -> list[int]:
            ids = call.prompt_ids()
            self._pull(target, call.request_id, ids, sampling, call.api_key)
            return ids

        return dataclasses.replace(call, prompt_ids=prompt_ids)

    def unstage(self, request_id: str) -> None:
        unstage = getattr(self.server.loop.engine, "unstage", None)
        if unstage is not None:
            unstage(request_id)

    def _pull(self, target: str, request_id: str, ids, sampling: dict, api_key) -> None:
        req = build_request(
            token_ids=ids, max_tokens=1, request_id=request_id, stream=False, **sampling
        )
        service = self.server.kv_service  # serving/disagg/service.py, on every server

        def started(call) -> None:
            with self._lock:
                self._pulls[request_id] = call
                gone = request_id in self._cancelled
            if gone:
                call.cancel()

        try:
            payload, _stats = service.pull(target, req, api_key, PULL_TIMEOUT_S, on_call=started)
            engine = self.server.loop.engine
            check_compatible(payload.meta, engine.core)
        except grpc.RpcError as e:
            self._raise_if_cancelled(request_id)
            code = e.code()
            if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
                code = grpc.StatusCode.UNAVAILABLE
            raise Refusal(code, "kv_pull_failed", f"prefill pod {target}: {e.details()}") from e
        except JaxPullError as e:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "kv_pull_failed", f"{target}: {e}") from e
        except (KVChecksumError, KVWireError) as e:
            raise Refusal(grpc.StatusCode.DATA_LOSS, "kv_pull_corrupt", str(e)) from e
        except KVTransferMismatchError as e:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "kv_mismatch", str(e)) from e
        finally:
            with self._lock:
                self._pulls.pop(request_id, None)
        self._raise_if_cancelled(request_id)  # gone while the pull ended: nothing staged
        engine.stage(request_id, payload)

    def _raise_if_cancelled(self, request_id: str) -> None:
        with self._lock:
            gone = request_id in self._cancelled
        if gone:
            raise Refusal(
                grpc.StatusCode.CANCELLED, "cancelled", "the client went away during the K/V pull"
            )

    def cancel_pulls(self, request_ids) -> None:
        """The client went away: cancel these requests' pulls (running or still to start)."""
        with self._lock:
            for request_id in request_ids:
                self._cancelled.add(request_id)
                call = self._pulls.get(request_id)
                if call is not None:
                    call.cancel()

    def forget(self, request_ids) -> None:
        """These requests' submission ended: their cancellation marks are not needed."""
        with self._lock:
            self._cancelled.difference_update(request_ids)

    def close(self) -> None:
        with self._lock:
            for call in self._pulls.values():
                call.cancel()
