"""pagedjax as a Ray Serve application: an ingress and N engine replicas behind Serve's proxy.

    serve run deploy/ray/serve.yaml                     # Ray's own CLI; OpenAI routes at /v1
    serve run serving.ray_serve:build_app model=tiny num_replicas=2

Two deployments (serving/ray_serve/ingress.py draws the path of a request):
  ingress   PagedJaxIngress: reads the body, makes the request's RoutingKey, calls the engine
            deployment through a handle and relays the replica's answer as it streams
  pagedjax  PagedJaxReplica: one `PagedJaxServer` each (the same engine, admission, tenants,
            metrics and warm-up as `python -m serving.server`); a call runs through the
            replica's OpenAI-compatible FastAPI app (serving/http/api.py) in-process. Its
            request router is PrefixAffinityRouter (serving/ray_serve/router.py) or Serve's
            default (power of two choices); Serve restarts a replica whose health check fails
            and scales the deployment on the replicas' own load (serving/ray_serve/autoscale.py).
The replica's own gRPC server listens on an ephemeral port (its address is in the replica's
log and in `PagedJaxReplica.grpc_address`).

Arguments of the application builder (`applications[].args` in the Serve config):
  model         the --model of every replica (default smollm2-135m)
  server_args   more serving.server flags for every replica, a list or one string
                ("--max_num_seqs=64 --prefix_caching=true"): one flag vocabulary
  num_cpus, num_gpus, resources   Ray resources of one replica (JAX sees what Ray assigns)
  router        "prefix" (default: PrefixAffinityRouter) or "default" (Serve's own)
  router_kwargs PrefixAffinityRouter's options (imbalance_threshold, max_index_keys, ...)
  block_bytes, block_tokens      the RoutingKey's block sizes (router.py)
  num_replicas  int, or "auto": Serve autoscaling with `autoscaling_config` (Serve's keys:
                min_replicas, max_replicas, target_ongoing_requests, upscale_delay_s, ...;
                our load signals and policy unless it names another `policy`)
  max_ongoing_requests, max_queued_requests, retry_after_s   Serve's per-replica cap and
                queue bound (defaults: the replica's capacity + headroom, 64, 1 s: see
                autoscale.py, so the replica's admission, not Serve, decides what to shed)
  health_check_period_s, health_check_timeout_s             Serve's replica health check
  ingress_replicas, ingress_max_ongoing_requests             the ingress deployment

A replica is ready (Serve routes to it) only once its warm-up has ended; a failed warm-up
fails the replica's constructor with the one-line cause, and Serve reports it.
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from serving import flags as shared
from serving.ray_serve.autoscale import deployment_options, replica_signals
from serving.ray_serve.ingress import HttpCall, PagedJaxIngress, ResponseStart, run_asgi
from serving.ray_serve.router import PrefixAffinityRouter

REPLICA_HEADER = "x-pagedjax-replica"  # on every answer: the replica that served it
DEFAULT_READY_TIMEOUT_S = 1800.0  # only guards against a hang: warm-up on a small CPU box


def _server_argv(model: str, server_args: list[str] | str | None) -> list[str]:
    extra = shlex.split(server_args) if isinstance(server_args, str) else list(server_args or [])
    # The replica's gRPC port is ephemeral and local; Serve's proxy serves HTTP, /metrics
    # included (the replicas of one node cannot share the server's default metrics port).
    base = ["--port=0", "--host=127.0.0.1", "--metrics_port=-1"]
    return ["serving.server", f"--model={model}", *base, *extra]


def _build_server(argv: list[str]):
    """A started PagedJaxServer and its HttpApi, from serving.server's own flags."""
    from absl import flags

    from serving import server as srv
    from serving.disagg import service as kv_transfer_service

    if "model" not in flags.FLAGS:
        srv.define_flags()
    flags.FLAGS.unparse_flags()
    flags.FLAGS(argv)
    srv.check_flags()
    options = srv.engine_options_from_flags()
    engine, warmup = srv.build_serving_engine(
        flags.FLAGS.model,
        {**options, **srv.warmup_options()},
        in_process=True,
        mock_step_time_s=flags.FLAGS.mock_step_time_s,
        max_model_len=flags.FLAGS.max_model_len,
    )
    # -- hook for serving/ray_serve/disagg.py (issue 32 item 4): K/V export/import for --role,
    # as serving.server's main does (a `both` replica is unchanged)
    engine = kv_transfer_service.wrap_engine(engine)
    role, transport = flags.FLAGS.role, flags.FLAGS.kv_transport
    warmup = kv_transfer_service.with_transfer_warmup(engine, warmup, role, transport)
    config = srv.config_from_flags(options)
    server = srv.PagedJaxServer(
        engine, config, srv.TenantRegistry.from_file(flags.FLAGS.tenants_config), warmup=warmup
    )
    return server, server.build_http_api()


class EngineReplica:
    """One engine replica: the ingress's calls run through its own HTTP API (undecorated, so
    the P/D workers of serving/ray_serve/disagg.py reuse it as deployments of their own)."""

    def __init__(self, argv: list[str], ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S):
        self.name = serve.get_replica_context().replica_id.unique_id
        self.server, self.http_api = _build_server(argv)
        failed = threading.Event()
        self.server.on_fatal = failed.set
        self.server.start()
        self.grpc_address = f"127.0.0.1:{self.server.port}"
        ready = self.server.generator.ready
        while not ready.wait(0.5):
            if failed.is_set() or not ready_timeout_s:
                break
            ready_timeout_s = max(0.0, ready_timeout_s - 0.5)
        if not ready.is_set():
            cause = self.server.fatal_error or "warm-up did not end in time"
            self.server.stop(0)
            raise RuntimeError(f"pagedjax replica not ready: {cause}")
        shared.progress(f"replica ready (gRPC {self.grpc_address})")

    async def relay(self, call: HttpCall) -> AsyncIterator[ResponseStart | bytes]:
        """One HTTP call from the ingress: its ResponseStart, then its body as it is written."""
        async for item in run_asgi(self.http_api.app, call):
            if isinstance(item, ResponseStart):  # which replica answered: for operators, tests
                item = ResponseStart(item.status, (*item.headers, (REPLICA_HEADER, self.name)))
            yield item

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine keeps failing (breaker open) or
        that is shutting down is restarted."""
        if self.server.breaker.state == "open":
            raise RuntimeError("engine circuit breaker open")
        if self.server.generator.draining:
            raise RuntimeError("draining")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics: this replica's load and KV usage."""
        return replica_signals(self.server)

    def stats(self) -> dict:
        """The engine's counters (pages, cache hits, preemptions, K/V exports and imports),
        its K/V pulls (kv_pulls, kv_jax_pulls) and this replica's name (`replica`)."""
        engine = self.server.loop.last_stats or self.server.engine.stats()
        kv_pulls = dict(self.server.kv_service.totals)  # K/V pulled from prefill replicas
        return {**engine, **kv_pulls, "replica": self.name}

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(0)


# The engine deployment; the ingress (serving/ray_serve/ingress.py) is the app's only FastAPI
# ingress (Serve allows one per application), which also lets disagg.py reuse EngineReplica.
PagedJaxReplica = serve.deployment(name="pagedjax")(EngineReplica)


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application builder (`import_path: serving.ray_serve:build_app`)."""
    args = dict(args)
    model = args.pop("model", shared.DEFAULT_MODEL)
    argv = _server_argv(model, args.pop("server_args", None))
    actor: dict[str, Any] = {"num_cpus": float(args.pop("num_cpus", 1))}
    if "num_gpus" in args:
        actor["num_gpus"] = float(args.pop("num_gpus"))
    if "resources" in args:
        actor["resources"] = dict(args.pop("resources"))
    options: dict[str, Any] = {"ray_actor_options": actor, **deployment_options(args, argv)}
    options["request_router_config"] = router_config(
        args.pop("router", "prefix"), args.pop("router_kwargs", None)
    )
    ready_timeout_s = float(args.pop("ready_timeout_s", DEFAULT_READY_TIMEOUT_S))
    ingress_options = {
        "num_replicas": int(args.pop("ingress_replicas", 1)),
        "max_ongoing_requests": int(args.pop("ingress_max_ongoing_requests", 4096)),
        "ray_actor_options": {"num_cpus": 0},
    }
    key_options = {k: int(args.pop(k)) for k in ("block_bytes", "block_tokens") if k in args}
    if args:
        raise shared.UsageError(
            "args", ", ".join(sorted(args)), "unknown application argument(s) of build_app"
        )
    engine = PagedJaxReplica.options(**options).bind(argv, ready_timeout_s)
    return PagedJaxIngress.options(**ingress_options).bind(engine, **key_options)


def router_config(router: str, router_kwargs: dict | None) -> RequestRouterConfig:
    if router == "prefix":
        return RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs=dict(router_kwargs or {}),
        )
    if router == "default":
        if router_kwargs:
            raise shared.UsageError("router_kwargs", router_kwargs, 'only with router: "prefix"')
        return RequestRouterConfig()
    raise shared.UsageError("router", router, '"prefix" or "default"')
