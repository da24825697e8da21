"""Worker roles for prefill/decode disaggregation: the KVTransfer gRPC service.

`python -m serving.server --role=prefill|decode|both` (default both). Every role serves
PagedJax.Generate as before; the role says which KVTransfer RPCs it serves:

    Prefill(GenerateRequest) -> stream KVChunk          roles prefill, both
        the request runs through the normal admission path with max_tokens=1 (min_tokens
        capped at 1); when it ends, the engine exports its prompt K/V
        (engine/kv_transfer/transfer_engine.py,
        pages freed at once) and the handler streams it (serving/disagg/wire.py).
    Decode(DecodeRequest{request, kv_source}) -> stream GenerateResponse   roles decode, both
        the handler PULLS the K/V: it calls kv_source's Prefill (deadline and x-api-key
        forwarded, cancelled with this call), checks identity / KV dtype / page size
        (FAILED_PRECONDITION) and the sha256 (DATA_LOSS), stages the payload, then runs
        the request exactly as Generate does; the engine imports the K/V when the engine
        thread feeds it (or recomputes the prompt if the pool or the slots are full).
        Transfer figures go to trailing metadata (x-pagedjax-kv-bytes, -kv-transfer-ms,
        -kv-prefill-ms), the log, and WorkerInfo's stats.
    WorkerInfo() -> role, versions, KV dtype, page size, live stats (the router reads it)

Failure paths: a cancel at the router cancels the Decode call, whose callback cancels the
Prefill call; the prefill handler's own cancel callback aborts the request (pages freed by
the next step) and `discard_export` drops a payload nobody will read. A prefill worker
that dies mid-transfer ends Decode with UNAVAILABLE and nothing staged.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import grpc

from engine.kv_transfer.transfer import KVChecksumError, KVTransferMismatchError, check_compatible
from engine.lora.refs import loaded_adapters
from serving.disagg import jax_transfer as kv_transfer_jax
from serving.disagg.wire import KVWireError, payload_chunks, receive_payload
from serving.engine_host.build import StopFn, Warmup
from serving.proto import kv_transfer_pb2 as kv_pb
from serving.proto import kv_transfer_pb2_grpc as kv_grpc
from serving.proto import pagedjax_pb2 as pb

log = logging.getLogger("pagedjax.serving.kv")
ROLES = ("prefill", "decode", "both")
API_KEY = "x-api-key"
EXPORT_WAIT_S = 10.0  # the payload is published before the final delta: normally instant


def time_left_s(context) -> float | None:
    """The call's deadline as seconds left; None without one (gRPC then reports ~inf)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e8 else remaining


def wrap_engine(engine):
    """A real EngineCore gets the KV export/import wrapper; other engines are returned as
    they are (MockEngine has no K/V; DataParallelEngine: not supported yet)."""
    from engine.core import EngineCore

    if isinstance(engine, EngineCore):
        from engine.kv_transfer.transfer_engine import KVTransferEngine

        return KVTransferEngine(engine)
    return engine


def with_transfer_warmup(
    engine, warmup: Warmup | None, role: str, kv_transport: str = "grpc"
) -> Warmup | None:
    """`warmup` (the server's, None: the user asked for none) followed by the K/V gather
    (prefill) or scatter (decode) programs of every page-count bucket, so a worker's first
    transfers do not compile. `both` replicas are left as they are (the router sends them
    whole requests)."""
    if warmup is None or role not in ("prefill", "decode") or not hasattr(engine, "warm_transfer"):
        return warmup

    def run(stop: StopFn | None = None) -> None:
        warmup(stop=stop)
        t0 = time.perf_counter()
        programs = engine.warm_transfer(role, on_device=kv_transport == "jax")
        log.info("warm-up: %d K/V %s programs in %.1fs", programs, role, time.perf_counter() - t0)

    return run


def install(
    server, role: str, kv_transport: str = "grpc", host: str = "127.0.0.1", jax_checksum=True
):
    """Add the KVTransfer service to a PagedJaxServer (before it starts). `kv_transport`
    "jax" starts a jax.experimental.transfer server on `host` (serving/disagg/jax_transfer.py;
    `jax_checksum`: the device digest of the pages, engine/kv_transfer/digest.py)."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: one of {ROLES}")
    jax_transport = None
    if role != "both" and hasattr(server.engine, "expect_export"):
        jax_transport = kv_transfer_jax.start(kv_transport, host.strip("[]"), jax_checksum)
    service = KVTransferService(server, role, jax_transport)
    kv_grpc.add_KVTransferServicer_to_server(service, server.grpc_server)
    return service


class KVTransferService(kv_grpc.KVTransferServicer):
    def __init__(self, server, role: str, jax_transport=None):
        self.server, self.role, self.jax = server, role, jax_transport
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self.totals = {"kv_pulls": 0, "kv_pull_bytes": 0, "kv_pull_s": 0.0, "kv_jax_pulls": 0}

    @property
    def engine(self):
        return self.server.loop.engine

    # ---- Prefill ------------------------------------------------------------------------------
    def Prefill(self, request: pb.GenerateRequest, context):
        engine = self._transfer_engine("prefill", context)
        t0 = time.monotonic()
        req = pb.GenerateRequest()
        req.CopyFrom(request)
        req.request_id = request.request_id or uuid.uuid4().hex
        req.max_tokens, req.min_tokens, req.stream = 1, min(req.min_tokens, 1), False
        engine.expect_export(req.request_id)
        # NOTE: counted as a Generate call, so the outcome counters still sum to the calls
        self.server.metrics.generate_calls.inc()
        try:
            for _ in self.server.service.Generate(req, context):
                pass  # the first token travels in the payload
            wanted = dict(context.invocation_metadata()).get(kv_transfer_jax.TRANSPORT_METADATA)
            if wanted == "jax" and self.jax is not None:  # device to device, no host copy
                pending = engine.take_pending(req.request_id, EXPORT_WAIT_S)
                if pending is None:
                    context.abort(grpc.StatusCode.INTERNAL, "the finished request was not exported")
                yield from self.jax.offer(pending, time.monotonic() - t0)
                return
            payload = engine.take_export(req.request_id, EXPORT_WAIT_S)
            if payload is None:
                context.abort(grpc.StatusCode.INTERNAL, "the finished request was not exported")
            yield from payload_chunks(payload, time.monotonic() - t0)
        finally:
            engine.discard_export(req.request_id)

    # ---- Decode -------------------------------------------------------------------------------
    def Decode(self, request: kv_pb.DecodeRequest, context):
        engine = self._transfer_engine("decode", context)
        inner = request.request
        if not inner.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request.request_id: required")
        if not request.kv_source:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "kv_source: required (host:port)")
        payload, stats = self._pull(request, context)
        try:
            check_compatible(payload.meta, engine.core)
        except KVTransferMismatchError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        context.set_trailing_metadata(
            (
                ("x-pagedjax-kv-bytes", str(stats.num_bytes)),
                ("x-pagedjax-kv-transfer-ms", f"{1e3 * stats.transfer_s:.3f}"),
                ("x-pagedjax-kv-prefill-ms", f"{1e3 * stats.prefill_s:.3f}"),
            )
        )
        engine.stage(inner.request_id, payload)
        self.server.metrics.generate_calls.inc()  # as in Prefill
        try:
            yield from self.server.service.Generate(inner, context)
        finally:
            engine.unstage(inner.request_id)

    def _pull(self, request: kv_pb.DecodeRequest, context):
        key = dict(context.invocation_metadata()).get(API_KEY)
        try:
            return self.pull(
                request.kv_source,
                request.request,
                key,
                time_left_s(context),
                on_call=lambda call: context.add_callback(call.cancel),
            )
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
                code = grpc.StatusCode.UNAVAILABLE  # the prefill side went away
            context.abort(code, f"prefill worker {request.kv_source}: {e.details()}")
        except (KVChecksumError, KVWireError) as e:
            context.abort(grpc.StatusCode.DATA_LOSS, str(e))
        except kv_transfer_jax.JaxPullError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill worker {request.kv_source}: {e}")

    def pull(
        self,
        kv_source: str,
        request: pb.GenerateRequest,
        api_key: str | None,
        timeout_s: float | None,
        on_call=None,
    ):
        """`request`'s prompt K/V from the prefill worker at `kv_source` (its KVTransfer.Prefill),
        device to device when both sides run the jax transport; counted in WorkerInfo's
        stats. The Decode RPC and llm-d's kv_transfer_params (serving/gateway/
        http_kv_transfer.py, also what the P/D pools on Ray Serve use) both pull here.
        `on_call(call)`: the started gRPC call (the caller may cancel it). Raises
        grpc.RpcError, KVChecksumError, KVWireError, JaxPullError."""
        stub = kv_grpc.KVTransferStub(self._channel(kv_source))
        metadata = ((API_KEY, api_key),) if api_key else ()
        if self.jax is not None:  # the prefill side falls back to gRPC bytes without one
            metadata += ((kv_transfer_jax.TRANSPORT_METADATA, "jax"),)
        call = stub.Prefill(request, timeout=timeout_s, metadata=metadata)
        if on_call is not None:
            on_call(call)
        payload, stats = receive_payload(call, self.jax, timeout_s)
        with self._lock:
            self.totals["kv_pulls"] += 1
            self.totals["kv_pull_bytes"] += stats.num_bytes
            self.totals["kv_pull_s"] += stats.transfer_s
            self.totals["kv_jax_pulls"] += int(payload.on_device)
        log.info(
            "kv pull %s from %s: %d bytes in %.2f ms (%.3f GB/s), prefill %.1f ms",
            request.request_id,
            kv_source,
            stats.num_bytes,
            1e3 * stats.transfer_s,
            stats.gb_per_s,
            1e3 * stats.prefill_s,
        )
        return payload, stats

    def _channel(self, target: str) -> grpc.Channel:
        with self._lock:
            if target not in self._channels:
                self._channels[target] = grpc.insecure_channel(target)
            return self._channels[target]

    # ---- WorkerInfo -------------------------------------------------------------------------
    def WorkerInfo(self, request, context):
        engine = self.engine
        stats = dict(self.server.loop.last_stats or {})
        with self._lock:
            stats.update(self.totals)
        ident = engine.identity
        return kv_pb.WorkerInfoResponse(
            role=self.role,
            versions=pb.ModelVersions(
                name=ident.name,
                revision=ident.revision,
                tokenizer_hash=ident.tokenizer_hash,
                chat_template_hash=ident.chat_template_hash,
                engine_version=ident.engine_version,
            ),
            kv_dtype=getattr(ident, "kv_dtype", "float32"),
            page_size=int(stats.get("page_size", 0)),
            stats={
                k: float(v)
                for k, v in stats.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            },
            adapters={n: ref.content_hash for n, ref in loaded_adapters(engine).items()},
        )

    def _transfer_engine(self, rpc: str, context):
        if self.role not in (rpc, "both"):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{rpc.capitalize()}: this worker's role is {self.role!r}",
            )
        engine = self.engine
        if not hasattr(engine, "expect_export"):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{rpc.capitalize()}: this engine ({type(engine).__name__}) cannot move K/V",
            )
        return engine
