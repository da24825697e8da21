"""The router's view of its workers: role, versions, health, load (serving/router/server.py).

A `WorkerPool` polls every worker every `interval_s` on one thread: the standard gRPC health
check (`grpc.health.v1`, overall service "") and KVTransfer.WorkerInfo (role, versions, KV
dtype, page size, live stats). A worker is *routable* when its last check said SERVING and
its versions match the pool's reference. The reference is `--revision` when given, else
the versions of the first worker that answered; a worker with other versions (revision,
tokenizer, chat template, KV dtype or page size) is REFUSED, logged once, and never routed
to, so one stream never mixes K/V or outputs of two models. A call that fails with
UNAVAILABLE marks its worker unhealthy at once (`mark_down`); the next successful check
brings it back.

Discovery: a `dns:NAME:PORT` entry (a Kubernetes headless Service, deploy/k8s/) is resolved
again every round; each address it returns is a worker, and one that disappears from the
answer leaves the pool once it has no request in flight. Another `resolver` (spec ->
addresses) may stand in for DNS: Ray Serve's replicas (serving/ray_serve/disagg.py).

Load = requests this router has in flight on the worker (`acquire` / `release`), exact for
the traffic it sends and free to read.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.proto import kv_transfer_pb2 as kv_pb
from serving.proto import kv_transfer_pb2_grpc as kv_grpc
from serving.proto import pagedjax_pb2_grpc as pb_grpc

log = logging.getLogger("pagedjax.router")
VERSION_FIELDS = ("revision", "tokenizer_hash", "chat_template_hash")


@dataclasses.dataclass
class Worker:
    address: str
    channel: grpc.Channel
    role: str = "?"
    versions: dict = dataclasses.field(default_factory=dict)
    healthy: bool = False
    refused: str = ""  # why this worker is never routed to (version mismatch)
    inflight: int = 0
    stats: dict = dataclasses.field(default_factory=dict)
    adapters: dict = dataclasses.field(default_factory=dict)  # LoRA name -> content hash
    checks_failed: int = 0

    @property
    def generate(self) -> pb_grpc.PagedJaxStub:
        return pb_grpc.PagedJaxStub(self.channel)

    @property
    def kv(self) -> kv_grpc.KVTransferStub:
        return kv_grpc.KVTransferStub(self.channel)

    @property
    def routable(self) -> bool:
        return self.healthy and not self.refused


def resolve(spec: str) -> list[str]:
    """`host:port` -> [it]; `dns:NAME:PORT` -> every address NAME resolves to, now."""
    if not spec.startswith("dns:"):
        return [spec]
    host, _, port = spec[4:].rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    hosts = sorted({info[4][0] for info in infos})
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts]


class WorkerPool:
    def __init__(
        self,
        specs: list[str],
        revision: str = "",
        interval_s: float = 0.5,
        resolver: Callable[[str], list[str]] = resolve,
    ):
        """`resolver`: one spec -> the worker addresses it names now (called every round)."""
        if not specs:
            raise ValueError("workers: at least one host:port or dns:NAME:PORT")
        self.specs, self.resolver = list(specs), resolver
        self.workers: dict[str, Worker] = {}
        self.reference: dict | None = {"revision": revision} if revision else None
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="router-health", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> WorkerPool:
        self.check_all()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for w in self.workers.values():
            w.channel.close()

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check_all()

    # ---- checks ----------------------------------------------------------------------------
    def check_all(self) -> None:
        self._discover()
        for w in list(self.workers.values()):
            self.check(w)

    def _discover(self) -> None:
        found = [a for spec in self.specs for a in self.resolver(spec)]
        with self._lock:
            for a in found:
                if a not in self.workers:
                    self.workers[a] = Worker(a, grpc.insecure_channel(a))
            for a in [a for a, w in self.workers.items() if a not in found and not w.inflight]:
                log.info("worker %s left the resolver's answer", a)
                self.workers.pop(a).channel.close()

    def check(self, w: Worker, timeout_s: float = 2.0) -> None:
        try:
            status = (
                health_pb2_grpc.HealthStub(w.channel)
                .Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
                .status
            )
            info = w.kv.WorkerInfo(kv_pb.WorkerInfoRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            if w.healthy:
                log.warning("worker %s unhealthy: %s", w.address, e.code().name)
            w.healthy, w.checks_failed = False, w.checks_failed + 1
            return
        versions = {f: getattr(info.versions, f) for f in ("name", *VERSION_FIELDS)}
        versions.update(kv_dtype=info.kv_dtype, page_size=info.page_size)
        with self._lock:
            w.role, w.versions, w.stats = info.role, versions, dict(info.stats)
            w.adapters = dict(info.adapters)
            self._check_versions(w)
            was = w.healthy
            w.healthy = status == health_pb2.HealthCheckResponse.SERVING
        if w.healthy != was:
            log.info("worker %s (%s) %s", w.address, w.role, "up" if w.healthy else "down")

    def _check_versions(self, w: Worker) -> None:
        if self.reference is None or set(self.reference) == {"revision"}:
            pinned = self.reference["revision"] if self.reference else ""
            if pinned and w.versions["revision"] != pinned:
                self._refuse(w, "revision", w.versions["revision"], pinned)
                return
            self.reference = dict(w.versions)
        for field, want in self.reference.items():
            if field != "name" and w.versions.get(field) != want:
                self._refuse(w, field, w.versions.get(field), want)
                return
        w.refused = ""

    @staticmethod
    def _refuse(w: Worker, field: str, value, want) -> None:
        reason = f"{field}={value!r}, the cluster serves {want!r}"
        if w.refused != reason:
            log.error("worker %s refused: %s", w.address, reason)
        w.refused = reason

    def mark_down(self, address: str) -> None:
        w = self.workers.get(address)
        if w is not None and w.healthy:
            log.warning("worker %s marked down after a failed call", address)
            w.healthy = False

    # ---- routing state ---------------------------------------------------------------------
    def routable(self, role: str) -> list[str]:
        return [a for a, w in self.workers.items() if w.routable and w.role == role]

    def is_routable(self, address: str) -> bool:
        w = self.workers.get(address)
        return w is not None and w.routable

    def load(self, address: str) -> int:
        w = self.workers.get(address)
        return w.inflight if w is not None else 0

    def acquire(self, *addresses: str) -> bool:
        """Count one more request on each worker (False, counting none: one has left)."""
        with self._lock:
            if any(a not in self.workers for a in addresses):
                return False
            for a in addresses:
                self.workers[a].inflight += 1
            return True

    def release(self, *addresses: str) -> None:
        with self._lock:
            for a in addresses:
                self.workers[a].inflight -= 1

    def snapshot(self) -> list[dict]:
        return [
            {
                "address": w.address,
                "role": w.role,
                "healthy": w.healthy,
                "refused": w.refused,
                "inflight": w.inflight,
                "revision": w.versions.get("revision", ""),
            }
            for w in self.workers.values()
        ]
