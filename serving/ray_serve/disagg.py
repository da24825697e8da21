"""Prefill/decode pools on Ray Serve: two worker deployments, the K/V moving by our own
transport between the replicas Serve picked, the pairing done by the ingress deployment.

    serve run serving.ray_serve:build_pd_app model=tiny prefill_replicas=1 decode_replicas=2

    application (three deployments):
      prefill     N PDWorker replicas: a PagedJaxServer with --role=prefill, its gRPC
                  KVTransfer service on the node's IP; request router PrefixAffinityRouter
                  (the prefix cache lives where the prompt is computed)
      decode      M PDWorker replicas, --role=decode; Serve's default router (power of two
                  choices: the less loaded of two)
      pd-ingress  the HTTP ingress (no CPU): a generation becomes llm-d's two calls
                  (serving/gateway/http_kv_transfer.py), each through a Serve handle

    client -> Serve proxy -> pd-ingress
      1. prefill.relay(body with max_tokens 1, stream false, kv_transfer_params
         {do_remote_decode: true}) -> 200 whose kv_transfer_params name the replica that
         answered (remote_host = its node IP, remote_port = its gRPC port)
      2. decode.relay(the client's body + those kv_transfer_params): the decode replica
         pulls the prompt's K/V (KVTransfer.Prefill: gRPC bytes, or device to device with
         --kv_transport=jax in server_args), imports it and answers, streamed back as it is
    any other call (/v1/models, /tokenize, ...): a decode replica.

Why this shape: the answer of call 1 carries the address of the prefill replica Serve chose,
so Serve's own handles and request routers pick both replicas; no registry of addresses and
no router of our own (Ray Serve LLM's P/D proxy makes the same two calls). A call 1 that is
refused (429 + Retry-After from the prefill replica's admission, 400 for a bad body) is the
client's answer as it is. A client that goes away cancels the ingress's handle calls; the
decode replica then cancels its pull (nothing imported) and the prefill replica freed its
pages when it exported them (tests/test_ray_routing.py).

Costs: the prefill replica computes the prompt for call 1 and again for the pull, the second
time from its prefix cache (only the last partial page and the first token recomputed:
`--prefix_caching`, on by default); `n` > 1 is refused with kv_transfer_params (400). Ray's
object store is not used for the K/V.

Arguments of `build_pd_app` (`applications[].args`):
  model                         every worker's --model (default smollm2-135m)
  prefill_replicas, decode_replicas   ints (default 1, 1)
  server_args                   more serving.server flags for every worker (list or string)
  prefill_args, decode_args     flags for one pool only (e.g. --max_num_seqs)
  num_cpus, num_gpus, resources Ray resources of one worker replica
  router, router_kwargs, block_bytes, block_tokens   the prefill pool's routing (as build_app)
"""

# NOTE: no `from __future__ import annotations`: Serve's class ingress rebuilds the route's
# signature, and FastAPI then reads a string annotation `Request` as a query parameter.
import dataclasses
import json
import shlex
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from serving import flags as shared
from serving.ray_serve.app import DEFAULT_READY_TIMEOUT_S, EngineReplica, router_config
from serving.ray_serve.autoscale import deployment_options
from serving.ray_serve.ingress import METHODS, HttpCall, answer, collect, incoming
from serving.ray_serve.router import DEFAULT_BLOCK_BYTES, DEFAULT_BLOCK_TOKENS

ROLES = ("prefill", "decode")


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 in brackets


class PDWorker(EngineReplica):
    """An engine replica with a role: its gRPC server (the KVTransfer service) on the node's
    IP, which its call-1 answers name as `remote_host` (not an HTTP ingress itself)."""

    def __init__(self, argv: list[str], role: str, ready_timeout_s=DEFAULT_READY_TIMEOUT_S):
        if role not in ROLES:
            raise shared.UsageError("role", role, f"one of {ROLES}")
        node_ip = ray.util.get_node_ip_address()
        super().__init__([*argv, f"--role={role}", f"--host={node_ip}"], ready_timeout_s)
        self.role = role
        self.http_api.kv_transfer.host = node_ip  # kv_transfer_params' remote_host
        self.address = host_port(node_ip, self.server.port)

    def grpc_target(self) -> str:
        """The address the other pool reaches this worker's KVTransfer service on."""
        return self.address


PDWorkerDeployment = serve.deployment(name="pd-worker")(PDWorker)


def prefill_call(call: HttpCall) -> HttpCall | None:
    """Call 1 of a generation (None: not a generation, or the client set kv_transfer_params
    itself): the body with max_tokens 1, not streamed, asking for a remote decode."""
    if call.key is None or call.method != "POST":
        return None
    body = json.loads(call.body)  # call_of made a key: the body is a JSON object
    if "kv_transfer_params" in body:
        return None
    body.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens"):
        body.pop(name, None)
    return dataclasses.replace(call, body=json.dumps(body).encode())


def decode_call(call: HttpCall, params: dict) -> HttpCall:
    body = {**json.loads(call.body), "kv_transfer_params": params}
    return dataclasses.replace(call, body=json.dumps(body).encode(), key=None)


# NOTE: the helpers above are defined before the class: serve.ingress serializes the class
# when it is decorated, with the module globals that exist at that point.
pd_api = FastAPI(title="pagedjax prefill/decode on Ray Serve")


@serve.deployment(name="pd-ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress(pd_api)
class PDIngress:
    """A generation as call 1 to a prefill replica and call 2 to a decode replica."""

    def __init__(
        self,
        prefill: DeploymentHandle,
        decode: DeploymentHandle,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ):
        self.prefill = prefill.options(method_name="relay", stream=True)
        self.decode = decode.options(method_name="relay", stream=True)
        self.key_options = dict(block_bytes=block_bytes, block_tokens=block_tokens)

    @pd_api.api_route("/{path:path}", methods=METHODS)
    async def relay(self, path: str, request: Request) -> Response:
        call = incoming(request, path, await request.body(), **self.key_options)
        first = prefill_call(call)
        if first is None:
            return await answer(self.decode, call)
        reply = await collect(self.prefill, first)
        if isinstance(reply, Response):
            return reply
        status, headers, body = reply
        if status != 200:  # the prefill replica refused: its answer is the client's
            return Response(body, status_code=status, headers=headers)
        params = json.loads(body).get("kv_transfer_params")
        if not isinstance(params, dict):
            error = {"message": "the prefill replica's answer has no kv_transfer_params"}
            return JSONResponse({"error": error}, status_code=502)
        return await answer(self.decode, decode_call(call, params))


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
    router: str = "prefix",
    router_kwargs: dict | None = None,
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    worker=PDWorkerDeployment,
    **key_options,
) -> Application:
    """The P/D application graph. `worker`: the worker deployment (a subclass of PDWorker
    deployed by the tests to slow the transfer down)."""
    common = _flags(server_args)
    pools = {}
    for role, replicas, extra in (
        ("prefill", prefill_replicas, prefill_args),
        ("decode", decode_replicas, decode_args),
    ):
        if not isinstance(replicas, int) or replicas < 1:
            raise shared.UsageError(f"{role}_replicas", replicas, "an int >= 1")
        argv = worker_argv(model, [*common, *_flags(extra)])
        options = deployment_options({"num_replicas": replicas}, argv)
        if role == "prefill":
            options["request_router_config"] = router_config(router, router_kwargs)
        pools[role] = worker.options(
            name=role, ray_actor_options=dict(actor_options or {"num_cpus": 1.0}), **options
        ).bind(argv, role, ready_timeout_s)
    return PDIngress.bind(pools["prefill"], pools["decode"], **key_options)


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
        "router",
        "router_kwargs",
        "ready_timeout_s",
        "block_bytes",
        "block_tokens",
    )
    kwargs = {k: args.pop(k) for k in known if k in args}
    model = args.pop("model", shared.DEFAULT_MODEL)
    if args:
        raise shared.UsageError(
            "args", ", ".join(sorted(args)), "unknown application argument(s) of build_pd_app"
        )
    return pd_application(model, actor_options=actor, **kwargs)
