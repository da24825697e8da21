"""The cache-aware router: one gRPC endpoint in front of prefill, decode and `both` workers.

    python -m serving.router --workers=127.0.0.1:50061,dns:pagedjax-decode:50051,... \
        --port=50051 \
        [--policy=affinity|round_robin] [--revision=sha256:...]

It serves the same `pagedjax.v1.PagedJax` API as a worker (Generate, Tokenize, ListModels,
ServerInfo) plus gRPC health (SERVING while some route exists), so clients cannot tell it
from a server. Per Generate call:

    key = prefix_key(request)                          serving/router_policy.py
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
health-checked and version-checked by serving/router_workers.py.
"""

from __future__ import annotations

import logging
import signal
import threading
import uuid
from concurrent import futures

import grpc
from absl import app, flags
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from serving import flags as shared
from serving.proto import kv_transfer_pb2 as kv_pb
from serving.proto import pagedjax_pb2 as pb
from serving.proto import pagedjax_pb2_grpc as pb_grpc
from serving.router_policy import HashRing, RoundRobin, pick_bounded, prefix_key
from serving.router_workers import WorkerPool

log = logging.getLogger("pagedjax.router")
POLICIES = ("affinity", "round_robin")
API_KEY = "x-api-key"
RETRY_AFTER_MS = "1000"


def time_left_s(context) -> float | None:
    """The call's deadline as seconds left; None without one (gRPC then reports ~inf)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e8 else remaining


class NoRoute(Exception):
    pass


class Route:
    """One attempt: a `both` replica, or a (prefill, decode) pair."""

    def __init__(self, kind: str, prefill: str, decode: str = ""):
        self.kind, self.prefill, self.decode = kind, prefill, decode

    @property
    def addresses(self) -> tuple[str, ...]:
        return (self.prefill, self.decode) if self.decode else (self.prefill,)


class RouterService(pb_grpc.PagedJaxServicer):
    def __init__(self, pool: WorkerPool, policy: str = "affinity", load_factor: float = 1.25):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: one of {POLICIES}")
        self.pool, self.policy, self.load_factor = pool, policy, load_factor
        self._rr = RoundRobin()
        self._lock = threading.Lock()
        self.counters = {"routed_pair": 0, "routed_both": 0, "spilled": 0, "retried": 0}

    # ---- routing ------------------------------------------------------------------------------
    def pick(self, request: pb.GenerateRequest, exclude: tuple[str, ...] = ()) -> Route:
        def usable(a: str) -> bool:
            return a not in exclude and self.pool.is_routable(a)

        prefill = [a for a in self.pool.routable("prefill") if usable(a)]
        decode = [a for a in self.pool.routable("decode") if usable(a)]
        if prefill and decode:
            first = self._choose(prefill, request, usable)
            second = min(decode, key=self.pool.load)
            self._count("routed_pair")
            return Route("pair", first, second)
        both = [a for a in self.pool.routable("both") if usable(a)]
        if both:
            self._count("routed_both")
            return Route("both", self._choose(both, request, usable))
        raise NoRoute("no routable worker (need a prefill + decode pair or a `both` replica)")

    def has_route(self) -> bool:
        """A pair or a replica is routable now (the router's own health)."""
        pool = self.pool
        return bool(pool.routable("prefill") and pool.routable("decode")) or bool(
            pool.routable("both")
        )

    def _choose(self, members: list[str], request, usable) -> str:
        if self.policy == "round_robin":
            return self._rr.pick(sorted(members), usable)
        chosen, spilled = pick_bounded(
            HashRing(sorted(members)), prefix_key(request), self.pool.load, usable, self.load_factor
        )
        if spilled:
            self._count("spilled")
        return chosen

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    # ---- Generate -----------------------------------------------------------------------------
    def Generate(self, request: pb.GenerateRequest, context):
        req = pb.GenerateRequest()
        req.CopyFrom(request)
        req.request_id = request.request_id or uuid.uuid4().hex
        key = dict(context.invocation_metadata()).get(API_KEY)
        metadata = ((API_KEY, key),) if key else None
        tried: tuple[str, ...] = ()
        for attempt in range(2):
            try:
                route = self.pick(req, exclude=tried)
            except NoRoute as e:
                context.set_trailing_metadata((("retry-after-ms", RETRY_AFTER_MS),))
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            relayed = yield from self._relay(route, req, metadata, context, retryable=attempt == 0)
            if relayed:
                return
            tried += route.addresses
            self._count("retried")

    def _relay(self, route: Route, req, metadata, context, retryable: bool):
        """Relay one attempt; returns False when it failed before any message and may be
        retried, True when the call is over (or aborts the context)."""
        timeout = time_left_s(context)
        if not self.pool.acquire(*route.addresses):  # a worker left the pool since pick()
            if retryable:
                return False
            context.abort(grpc.StatusCode.UNAVAILABLE, f"workers {route.addresses} left")
        if route.kind == "both":
            call = self.pool.workers[route.prefill].generate.Generate(
                req, timeout=timeout, metadata=metadata
            )
        else:
            call = self.pool.workers[route.decode].kv.Decode(
                kv_pb.DecodeRequest(request=req, kv_source=route.prefill),
                timeout=timeout,
                metadata=metadata,
            )
        context.add_callback(call.cancel)
        sent = False
        try:
            for msg in call:
                sent = True
                yield msg
            trailing = tuple(call.trailing_metadata() or ())
            if trailing:  # e.g. the decode worker's x-pagedjax-kv-* transfer figures
                context.set_trailing_metadata(trailing)
            return True
        except grpc.RpcError as e:
            if not context.is_active():
                return True  # our client left: the callback cancelled the worker call
            code = e.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                self._mark_failed(route, e.details() or "")
                if retryable and not sent:
                    return False
            trailing = tuple(e.trailing_metadata() or ())
            if trailing:
                context.set_trailing_metadata(trailing)
            context.abort(code, e.details() or code.name)
        finally:
            self.pool.release(*route.addresses)

    def _mark_failed(self, route: Route, details: str) -> None:
        if route.kind == "pair" and details.startswith("prefill worker"):
            self.pool.mark_down(route.prefill)
        else:
            self.pool.mark_down(route.decode or route.prefill)

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
    ):
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
    shared.setup_logging(FLAGS.log_level)
    router = Router(
        FLAGS.workers,
        host=FLAGS.host,
        port=FLAGS.port,
        policy=FLAGS.policy,
        revision=FLAGS.revision,
        health_interval_s=FLAGS.health_interval_s,
    ).start()
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
