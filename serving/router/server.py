"""The cache-aware router: one gRPC (and HTTP) endpoint in front of prefill, decode and
`both` workers.

    python -m serving.router.server --workers=127.0.0.1:50061,dns:pagedjax-decode:50051,... \
        --port=50051 \
        [--policy=affinity|round_robin] [--revision=sha256:...] \
        [--http_port=8000 --tokenizer=smollm2-135m]

It serves the same `pagedjax.v1.PagedJax` API as a worker (Generate, Tokenize, ListModels,
ServerInfo) plus gRPC health (SERVING while some route exists), so clients cannot tell it
from a server. Per Generate call:

    key = prefix_key(request)                          serving/router/policy.py
    prefill + decode workers routable?  -> pair:  prefill = bounded-load ring pick by key
                                                  (the prefix cache lives where the prompt
                                                  is computed), decode = least loaded;
                                                  KVTransfer.Decode(request, kv_source=prefill)
                                                  on the decode worker (it pulls the K/V)
    else `both` replicas routable?      -> ring pick by key; PagedJax.Generate on it
    else                                -> UNAVAILABLE + retry-after-ms

The worker's messages are relayed as they are (the final one names the versions that
produced it); x-api-key is forwarded; the call's deadline becomes the worker call's
timeout; a cancel (or the client going away) cancels the worker call, which frees the pages
on every worker involved (the decode worker cancels its pull from the prefill worker). A
call that fails with UNAVAILABLE BEFORE any message was relayed (the worker died, or was
warming up / draining) marks the worker down and is retried once on another route, so a
retry never duplicates a stream; after the first message it ends UNAVAILABLE. Workers are
health-checked and version-checked by serving/router/workers.py; routing, relay and retry
live in serving/router/client.py, shared with the HTTP front (`--http_port`: the server's
OpenAI-compatible API over the same routing, serving/router/http_front.py).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from concurrent import futures

import grpc
from absl import app, flags
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from serving import flags as shared
from serving.proto import pagedjax_pb2 as pb
from serving.proto import pagedjax_pb2_grpc as pb_grpc
from serving.router.client import POLICIES, NoRoute, RouteFailed, RouterClient
from serving.router.workers import WorkerPool

log = logging.getLogger("pagedjax.router")
API_KEY = "x-api-key"
RETRY_AFTER_MS = "1000"


def time_left_s(context) -> float | None:
    """The call's deadline as seconds left; None without one (gRPC then reports ~inf)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e8 else remaining


class RouterService(pb_grpc.PagedJaxServicer):
    """The gRPC front: Generate through the RouterClient, the other RPCs to any worker."""

    def __init__(self, pool: WorkerPool, policy: str = "affinity", load_factor: float = 1.25):
        self.pool = pool
        self.client = RouterClient(pool, policy, load_factor)

    @property
    def counters(self) -> dict:
        return self.client.counters

    def has_route(self) -> bool:
        return self.client.has_route()

    # ---- Generate -----------------------------------------------------------------------------
    def Generate(self, request: pb.GenerateRequest, context):
        req = pb.GenerateRequest()
        req.CopyFrom(request)
        req.request_id = request.request_id or uuid.uuid4().hex
        key = dict(context.invocation_metadata()).get(API_KEY)
        left_s = time_left_s(context)
        try:
            trailing = yield from self.client.generate(
                req,
                deadline_s=None if left_s is None else time.monotonic() + left_s,
                metadata=((API_KEY, key),) if key else None,
                on_call=lambda call: context.add_callback(call.cancel),
                is_active=context.is_active,
            )
        except NoRoute as e:
            context.set_trailing_metadata((("retry-after-ms", RETRY_AFTER_MS),))
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except RouteFailed as e:
            if not context.is_active():
                return  # our client left: the callback cancelled the worker call
            if e.trailing:
                context.set_trailing_metadata(e.trailing)
            context.abort(e.code, e.details)
        if trailing:  # e.g. the decode worker's x-pagedjax-kv-* transfer figures
            context.set_trailing_metadata(trailing)

    # ---- the other RPCs: any routable worker ---------------------------------------------------
    def _any(self, context):
        for role in ("both", "decode", "prefill"):
            routable = self.pool.routable(role)
            if routable:
                return self.pool.workers[routable[0]].generate
        context.abort(grpc.StatusCode.UNAVAILABLE, "no routable worker")

    def _forward(self, method: str, request, context):
        key = dict(context.invocation_metadata()).get(API_KEY)
        try:
            return getattr(self._any(context), method)(
                request,
                timeout=time_left_s(context),
                metadata=((API_KEY, key),) if key else None,
            )
        except grpc.RpcError as e:
            context.abort(e.code(), e.details() or "")

    def Tokenize(self, request, context):
        return self._forward("Tokenize", request, context)

    def ListModels(self, request, context):
        return self._forward("ListModels", request, context)

    def ServerInfo(self, request, context):
        return self._forward("ServerInfo", request, context)


class Router:
    """The router process's parts: worker pool, service, gRPC server, own health."""

    def __init__(
        self,
        workers: list[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        policy: str = "affinity",
        revision: str = "",
        health_interval_s: float = 0.5,
        max_workers: int = 256,
        http_port: int | None = None,
        tokenizer=None,
        tenants=None,
        worker_api_key: str | None = None,
    ):
        """`http_port` (None: no HTTP) with `tokenizer` (the workers'): the OpenAI-compatible
        HTTP API over the same routing (serving/router/http_front.py), built in start()."""
        if http_port is not None and tokenizer is None:
            raise ValueError("http_port: needs the workers' tokenizer (--tokenizer)")
        self.host, self.http_port, self.tokenizer = host, http_port, tokenizer
        self._http_auth = {"tenants": tenants, "worker_api_key": worker_api_key}
        self.http = None
        self.pool = WorkerPool(workers, revision, health_interval_s)
        self.service = RouterService(self.pool, policy)
        self.grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers, "router"))
        pb_grpc.add_PagedJaxServicer_to_server(self.service, self.grpc_server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        self.port = self.grpc_server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise shared.UsageError("port", port, "a free port (this one is taken)")
        self._stop = threading.Event()

    def start(self) -> Router:
        self.pool.start()
        self._update_health()  # from the first call on, not after one interval
        self.grpc_server.start()
        threading.Thread(target=self._publish_health, daemon=True).start()
        if self.http_port is not None:
            from serving.router.http_front import RouterHttp

            try:
                self.http = RouterHttp(
                    self.service.client,
                    self.tokenizer,
                    host=self.host,
                    port=self.http_port,
                    **self._http_auth,
                ).start()
            except BaseException:
                self.stop(0)  # no half-started router (the program exits with the error)
                raise
            self.http_port = self.http.port
        return self

    def _publish_health(self) -> None:
        while not self._stop.wait(self.pool.interval_s):
            self._update_health()

    def _update_health(self) -> None:
        serving = self.service.has_route()
        self.health.set(
            "",
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING,
        )

    def stop(self, grace_s: float = 1.0) -> None:
        self._stop.set()
        if self.http is not None:
            self.http.stop(grace_s)
        self.grpc_server.stop(grace_s).wait()
        self.pool.stop()


# ---- the program -------------------------------------------------------------------------------
FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_list(
        "workers", [], "host:port or dns:NAME:PORT (re-resolved) entries; roles are asked"
    )
    flags.DEFINE_string("host", "[::]", "address to bind")
    flags.DEFINE_integer("port", 50051, "gRPC port (0: any free port)")
    flags.DEFINE_enum("policy", "affinity", list(POLICIES), "how a worker is chosen")
    flags.DEFINE_string("revision", "", "serve only this model revision (default: the first seen)")
    flags.DEFINE_float("health_interval_s", 0.5, "seconds between health checks of a worker")
    flags.DEFINE_integer("http_port", 0, "OpenAI-compatible HTTP API port (0: off)")
    flags.DEFINE_string(
        "tokenizer", "", "the workers' tokenizer for HTTP: tiny, smollm2-135m, a .gguf, a dir"
    )
    flags.DEFINE_string("tenants_config", None, "HTTP: tenants JSON (as the server's)")
    flags.DEFINE_string("worker_api_key_file", None, "HTTP: the key the router presents")
    shared.define_log_level("info")


def main(argv) -> None:
    if len(argv) > 1:
        raise shared.UsageError("", " ".join(argv[1:]), "the router takes only flags")
    if not FLAGS.workers:
        raise shared.UsageError("workers", "", "at least one host:port")
    for i, target in enumerate(FLAGS.workers):
        shared.check_target(f"workers[{i}]", target.removeprefix("dns:"))
    shared.check_port("port", FLAGS.port, FLAGS.host)
    shared.check_positive("health_interval_s", FLAGS.health_interval_s)
    if FLAGS.http_port:
        shared.check_port("http_port", FLAGS.http_port, FLAGS.host)
        if not FLAGS.tokenizer:
            raise shared.UsageError("tokenizer", "", "the workers' model, with --http_port")
    shared.setup_logging(FLAGS.log_level)
    tokenizer, http_auth = None, {}
    if FLAGS.http_port:
        from serving.frontend.tenants import TenantRegistry
        from serving.router.http_front import load_tokenizer, read_key

        tokenizer = load_tokenizer(FLAGS.tokenizer)
        http_auth = dict(
            tenants=TenantRegistry.from_file(FLAGS.tenants_config),
            worker_api_key=read_key("worker_api_key_file", FLAGS.worker_api_key_file),
        )
    router = Router(
        FLAGS.workers,
        host=FLAGS.host,
        port=FLAGS.port,
        policy=FLAGS.policy,
        revision=FLAGS.revision,
        health_interval_s=FLAGS.health_interval_s,
        http_port=FLAGS.http_port or None,
        tokenizer=tokenizer,
        **http_auth,
    ).start()
    if router.http is not None:
        print(f"http on {router.http_port}", flush=True)
    print(f"routing on {router.port}", flush=True)
    for w in router.pool.snapshot():
        print(f"worker {w}", flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    router.stop()


def run() -> None:
    define_flags()
    app.run(shared.main_guard(main), flags_parser=shared.parse_flags)


if __name__ == "__main__":
    run()
