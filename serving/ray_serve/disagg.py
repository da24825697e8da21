"""Prefill/decode pools on Ray Serve: two worker deployments, the K/V moving by our own
transport between the replicas Ray placed, the pairing done by the ingress deployment.

    serve run serving.ray_serve:build_pd_app model=tiny prefill_replicas=1 decode_replicas=2

    application "pd" (one Serve application, four deployments):
      pd-registry   1 replica, no CPU: the live workers' (role, gRPC address), kept by
                    their heartbeats (an entry not renewed for REGISTRY_TTL_S is gone)
      prefill       N PDWorker replicas: a PagedJaxServer with --role=prefill (the
                    KVTransfer service, serving/disagg/service.py), its gRPC port bound to
                    the node's IP; it joins the registry once warm and every HEARTBEAT_S
      decode        M PDWorker replicas, --role=decode, the same
      router        the ingress: serving/router's RouterHttp (the OpenAI HTTP API over a
                    RoutedEngine) whose WorkerPool resolves "ray:prefill" / "ray:decode"
                    through the registry instead of DNS; its FastAPI app is what Serve's
                    proxy calls

    HTTP client -> Serve proxy -> router replica -> RouterClient.pick: prefill by the
      prompt's prefix ring (bounded load), decode least loaded -> KVTransfer.Decode on the
      decode replica -> it pulls from the prefill replica (KVTransfer.Prefill: gRPC bytes,
      or jax.experimental.transfer with --kv_transport=jax) -> imports the pages, decodes,
      streams back through the router

Why a registry and not Serve's handles: a DeploymentHandle sends one call to a replica Serve
picks; the pairing needs the addresses of particular replicas (the prefill replica whose
prefix cache holds the prompt, the decode replica that pulls from it), and Serve exposes no
public list of a deployment's replicas. Replicas report themselves instead, so a replica
Serve restarts (or adds) joins the pool with its new address, and a dead one leaves it
after REGISTRY_TTL_S (the router's health checks mark it down sooner).

Why not Ray's object store for the K/V: the transport is the one the gRPC workers use
(serving/disagg/), with its checksums, deadlines and cancellation; a cancel at the HTTP
client reaches the decode replica's Decode call, which cancels its pull, so pages are freed
on both sides (tests/test_ray_disagg.py). Ray's object store was not measured against it.

Arguments of `build_pd_app` (`applications[].args`):
  model                         every worker's --model (default smollm2-135m)
  prefill_replicas, decode_replicas   ints (default 1, 1)
  server_args                   more serving.server flags for every worker (list or string)
  prefill_args, decode_args     flags for one pool only (e.g. --max_num_seqs)
  num_cpus, num_gpus, resources Ray resources of one worker replica
  router_num_cpus               of the router replica (default 1)
  tokenizer                     the router's (default: model; it must hash like the workers')
  policy                        affinity | round_robin (serving/router/client.py)
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import threading
import time
from typing import Any

import ray
from ray import serve
from ray.serve import Application

from serving import flags as shared
from serving.frontend.admission import AdmissionConfig
from serving.ray_serve.app import DEFAULT_READY_TIMEOUT_S, EngineReplica

log = logging.getLogger("pagedjax.ray")
ROLES = ("prefill", "decode")
HEARTBEAT_S = 1.0
REGISTRY_TTL_S = 5.0
SPEC_PREFIX = "ray:"  # a WorkerPool spec "ray:prefill": that pool's registered addresses


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 in brackets


@serve.deployment(name="pd-registry", num_replicas=1, ray_actor_options={"num_cpus": 0})
class PDRegistry:
    """The live workers: address -> (role, last heartbeat, time.monotonic())."""

    def __init__(self):
        self.seen: dict[str, tuple[str, float]] = {}

    def heartbeat(self, role: str, address: str) -> None:
        self.seen[address] = (role, time.monotonic())

    def addresses(self, role: str) -> list[str]:
        now = time.monotonic()
        return sorted(
            a for a, (r, t) in self.seen.items() if r == role and now - t < REGISTRY_TTL_S
        )


class PDWorker(EngineReplica):
    """An engine replica with a role: its gRPC server (the KVTransfer service included) on
    the node's IP, reported to the registry while it lives. Not an HTTP ingress (the router
    is the application's one)."""

    def __init__(
        self, argv: list[str], role: str, registry, ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S
    ):
        if role not in ROLES:
            raise shared.UsageError("role", role, f"one of {ROLES}")
        node_ip = ray.util.get_node_ip_address()
        super().__init__([*argv, f"--role={role}", f"--host={node_ip}"], ready_timeout_s)
        self.role, self.registry = role, registry
        self.address = host_port(node_ip, self.server.port)
        self._stopped = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="pd-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stopped.is_set():
            try:
                self.registry.heartbeat.remote(self.role, self.address).result(
                    timeout_s=REGISTRY_TTL_S
                )
            except Exception as e:  # noqa: BLE001 - the registry restarts: beat again
                log.warning("%s worker %s: heartbeat failed: %r", self.role, self.address, e)
            self._stopped.wait(HEARTBEAT_S)

    def grpc_target(self) -> str:
        """The address the router and the other pool reach this worker on."""
        return self.address

    def __del__(self):
        stopped = getattr(self, "_stopped", None)
        if stopped is not None:
            stopped.set()
        super().__del__()


PDWorkerDeployment = serve.deployment(name="pd-worker")(PDWorker)


@serve.deployment(name="router")
@serve.ingress()
class PDRouter:
    """The ingress: the router's OpenAI HTTP API over the registered prefill/decode pairs."""

    async def __init__(
        self,
        registry,
        prefill,
        decode,
        tokenizer: str,
        policy: str = "affinity",
        start_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        interval_s: float = 0.5,
    ):
        self.registry = registry
        self.pools = {"prefill": prefill, "decode": decode}  # handles (operators, tests)
        self._known: dict[str, list[str]] = {}
        # NOTE: off the replica's event loop: the start waits for the registry's answers
        # (handle calls) and for a worker to answer
        await asyncio.to_thread(self._start, tokenizer, policy, start_timeout_s, interval_s)

    def _start(self, tokenizer: str, policy: str, start_timeout_s: float, interval_s: float):
        from serving.router.client import RouterClient
        from serving.router.http_front import RouterHttp, load_tokenizer
        from serving.router.workers import WorkerPool

        specs = [SPEC_PREFIX + role for role in ROLES]
        self.pool = WorkerPool(specs, interval_s=interval_s, resolver=self._resolve).start()
        client = RouterClient(self.pool, policy)
        # NOTE: RouterHttp also serves its API on a loopback ephemeral port (a side door
        # for debugging); Serve's proxy calls the same FastAPI app in this replica.
        self.http = RouterHttp(
            client,
            load_tokenizer(tokenizer),
            host="127.0.0.1",
            port=0,
            start_timeout_s=start_timeout_s,
        ).start()
        # ready (Serve routes to it) once a prefill + decode pair is routable, not once the
        # first worker answered: a request in between would be refused as no_route (503)
        end = time.monotonic() + start_timeout_s
        while not client.has_route():
            if time.monotonic() > end:
                raise RuntimeError(f"no prefill + decode pair within {start_timeout_s}s")
            time.sleep(interval_s)
        shared.progress(f"pd router ready: {self.pool.snapshot()}")

    def _resolve(self, spec: str) -> list[str]:
        """A spec's addresses from the registry (the last answer while it does not reply)."""
        role = spec.removeprefix(SPEC_PREFIX)
        try:
            self._known[role] = self.registry.addresses.remote(role).result(timeout_s=2.0)
        except Exception as e:  # noqa: BLE001 - keep routing to the workers known
            log.warning("registry unreachable (%r): keeping %s", e, self._known.get(role))
        return self._known.get(role, [])

    def __serve_build_asgi_app__(self):
        return self.http.api.app

    def workers(self) -> list[dict]:
        """The router's view of its workers (role, health, in flight)."""
        return self.pool.snapshot()

    def __del__(self):
        http = getattr(self, "http", None)
        if http is not None:
            http.stop(0)
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.stop()


def _flags(value: list[str] | str | None) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value or [])


def worker_argv(model: str, server_args: list[str]) -> list[str]:
    """serving.server's argv of one worker (its gRPC port ephemeral; Serve's proxy is the
    HTTP front, so no metrics port of its own)."""
    return ["serving.server", f"--model={model}", "--port=0", "--metrics_port=-1", *server_args]


def pd_application(
    model: str,
    *,
    prefill_replicas: int = 1,
    decode_replicas: int = 1,
    server_args: list[str] | str | None = None,
    prefill_args: list[str] | str | None = None,
    decode_args: list[str] | str | None = None,
    actor_options: dict | None = None,
    router_num_cpus: float = 1.0,
    tokenizer: str | None = None,
    policy: str = "affinity",
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    worker=PDWorkerDeployment,
) -> Application:
    """The P/D application graph. `worker`: the worker deployment (a subclass of PDWorker
    deployed by the tests to slow the transfer down)."""
    common = _flags(server_args)
    registry = PDRegistry.bind()
    pools = {}
    for role, replicas, extra in (
        ("prefill", prefill_replicas, prefill_args),
        ("decode", decode_replicas, decode_args),
    ):
        if int(replicas) < 1:
            raise shared.UsageError(f"{role}_replicas", replicas, ">= 1")
        argv = worker_argv(model, [*common, *_flags(extra)])
        pools[role] = worker.options(
            name=role,
            num_replicas=int(replicas),
            ray_actor_options=dict(actor_options or {"num_cpus": 1.0}),
        ).bind(argv, role, registry, ready_timeout_s)
    # NOTE: the router's own admission sheds, not Serve's small default of 5 in flight
    ongoing = AdmissionConfig().max_queue_requests + 64
    router = PDRouter.options(
        ray_actor_options={"num_cpus": float(router_num_cpus)}, max_ongoing_requests=ongoing
    )
    return router.bind(
        registry, pools["prefill"], pools["decode"], tokenizer or model, policy, ready_timeout_s
    )


def build_pd_app(args: dict[str, Any]) -> Application:
    """Serve's application builder (`import_path: serving.ray_serve:build_pd_app`)."""
    args = dict(args)
    actor: dict[str, Any] = {"num_cpus": float(args.pop("num_cpus", 1))}
    if "num_gpus" in args:
        actor["num_gpus"] = float(args.pop("num_gpus"))
    if "resources" in args:
        actor["resources"] = dict(args.pop("resources"))
    known = (
        "prefill_replicas",
        "decode_replicas",
        "server_args",
        "prefill_args",
        "decode_args",
        "router_num_cpus",
        "tokenizer",
        "policy",
        "ready_timeout_s",
    )
    kwargs = {k: args.pop(k) for k in known if k in args}
    model = args.pop("model", shared.DEFAULT_MODEL)
    if args:
        raise shared.UsageError(
            "args", ", ".join(sorted(args)), "unknown application argument(s) of build_pd_app"
        )
    return pd_application(model, actor_options=actor, **kwargs)
