"""One model sharded over several hosts behind one Serve replica: a Ray placement group of
N processes that run `jax.distributed` with the coordinator Ray placed.

    serve run serving.ray_serve:build_multihost_app model=smollm2-135m num_hosts=2 \\
        server_args="--mesh=model:8" resources='{"TPU": 4}'

    Serve creates the replica's placement group (placement_group_bundles: one bundle per
    host, `placement_strategy` STRICT_SPREAD on real hosts) and places the replica in
    bundle 0. The replica (MultiHostReplica, process 0):
      1. picks the coordinator: its own node's IP (the node Ray chose) and a free port
      2. starts one JaxFollower actor in each other bundle i (process i); each calls
         jax.distributed.initialize(coordinator, N, i), builds the engine from the same
         serving.server flags and runs engine/parallel/distributed.follow: the leader's
         device calls, in order, until it stops
      3. calls jax.distributed.initialize(coordinator, N, 0) itself, then builds and starts
         its PagedJaxServer exactly as a single-host replica does (serving/ray_serve/app.py):
         serving/engine_host/build.py sees jax.process_count() > 1 and builds a
         LeaderEngineCore whose runner broadcasts every step to the followers
    Its FastAPI app is the replica's ingress, as for PagedJaxReplica.

This is the pattern vLLM's TPU backend uses on Ray (one SPMD worker per host in a placement
group, the first worker's address as the coordinator), on this engine's own multi-host path
(the one LeaderWorkerSet pods run: engine/parallel/distributed.py, serving/engine_host/
multihost.py). Its limits are that path's: no LoRA, speculative decoding, disaggregated
roles or host KV tier. The replica stopping (Serve scaling down, restarting it) stops the
leader's engine, which tells the followers to stop; the follower actors are killed with it
(and Ray kills them when the replica's process dies: they are its children).

Arguments of `build_multihost_app`: model, server_args (serving.server flags; --mesh must
span every host's devices), num_hosts (default 2), num_cpus / num_gpus / resources (of ONE
bundle = one host's share), placement_strategy (PACK, SPREAD, STRICT_SPREAD; default
SPREAD), env (environment variables of every process, e.g. XLA_FLAGS), ready_timeout_s.
"""

from __future__ import annotations

import socket
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from serving import flags as shared
from serving.ray_serve.app import DEFAULT_READY_TIMEOUT_S, EngineReplica
from serving.ray_serve.disagg import host_port, worker_argv

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def coordinator_address() -> str:
    """host:port of a jax.distributed coordinator on this node (its Ray node IP)."""
    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return host_port(host, port)


def server_flags(argv: list[str]):
    """serving.server's absl FLAGS parsed from `argv`, refused (UsageError) where the
    multi-host path does not support a flag (serving/engine_host/multihost.py)."""
    from absl import flags

    from serving import server as srv
    from serving.engine_host.multihost import refusals

    if "model" not in flags.FLAGS:
        srv.define_flags()
    flags.FLAGS.unparse_flags()
    flags.FLAGS(argv)
    for flag, value, why in refusals(flags.FLAGS):
        raise shared.UsageError(flag, value, why.replace("--distributed_env", "several hosts"))
    return flags.FLAGS


def follower_engine(argv: list[str]):
    """The engine of a process != 0, built from the leader's serving.server flags in the
    same order as the leader builds its own (serving.server's main, follower branch)."""
    from serving import server as srv

    flags = server_flags(argv)
    srv.check_flags()  # after jax.distributed.initialize: --mesh counts every host's devices
    options = {**srv.engine_options_from_flags(), **srv.warmup_options()}
    engine, _ = srv.build_serving_engine(
        flags.model,
        options,
        in_process=True,
        mock_step_time_s=flags.mock_step_time_s,
        max_model_len=flags.max_model_len,
    )
    return engine


@ray.remote
class JaxFollower:
    """Process `process_id` of a multi-host group: runs the leader's steps."""

    def run(self, argv: list[str], coordinator: str, num_processes: int, process_id: int) -> int:
        """Initialize, build, follow until the leader stops; returns the steps run."""
        from engine.parallel.distributed import DistributedConfig, initialize
        from serving.engine_host.multihost import follow

        initialize(DistributedConfig(coordinator, num_processes, process_id))
        return follow(follower_engine(argv))


class MultiHostReplica(EngineReplica):
    """Process 0 of the group and the Serve replica: its server is the group's front (its
    FastAPI app is this one-replica application's ingress)."""

    def __serve_build_asgi_app__(self):
        return self.http_api.app

    async def __init__(
        self,
        argv: list[str],
        num_hosts: int,
        bundle: dict,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    ):
        from engine.parallel.distributed import DistributedConfig, initialize

        server_flags(argv)  # a flag the multi-host path refuses fails the replica here
        group = ray.util.get_current_placement_group()
        if group is None:
            raise RuntimeError("MultiHostReplica runs in a placement group (build_multihost_app)")
        self.coordinator = coordinator_address()
        self.followers = [
            JaxFollower.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(1, num_hosts)
        ]
        self.follow_refs = [
            f.run.remote(argv, self.coordinator, num_hosts, i)
            for i, f in enumerate(self.followers, start=1)
        ]
        initialize(DistributedConfig(self.coordinator, num_hosts, 0))  # waits for them all
        super().__init__(argv, ready_timeout_s)

    def topology(self) -> dict:
        """Processes, devices, and the processes the engine's mesh spans (per axis)."""
        import jax

        mesh = getattr(self.server.engine, "mesh", None)
        spans = {}
        if mesh is not None:
            for axis in mesh.axis_names:
                spans[axis] = int(mesh.shape[axis])
            spans["processes"] = sorted({d.process_index for d in mesh.devices.flat})
        return {
            "coordinator": self.coordinator,
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(),
            "mesh": spans,
        }

    def __del__(self):
        super().__del__()  # the leader's engine stops and tells the followers to stop
        for actor in getattr(self, "followers", []):
            ray.kill(actor)


MultiHostDeployment = serve.deployment(name="pagedjax-multihost")(serve.ingress()(MultiHostReplica))


def build_multihost_app(args: dict[str, Any]) -> Application:
    """Serve's application builder (`import_path: serving.ray_serve:build_multihost_app`)."""
    args = dict(args)
    model = args.pop("model", shared.DEFAULT_MODEL)
    extra = args.pop("server_args", None)
    server_args = extra.split() if isinstance(extra, str) else list(extra or [])
    num_hosts = int(args.pop("num_hosts", 2))
    if num_hosts < 2:
        raise shared.UsageError("num_hosts", num_hosts, ">= 2 (one host: build_app)")
    bundle: dict[str, float] = {"CPU": float(args.pop("num_cpus", 1))}
    if "num_gpus" in args:
        bundle["GPU"] = float(args.pop("num_gpus"))
    bundle.update({k: float(v) for k, v in dict(args.pop("resources", {})).items()})
    strategy = str(args.pop("placement_strategy", "SPREAD"))
    if strategy not in STRATEGIES:
        raise shared.UsageError("placement_strategy", strategy, f"one of {STRATEGIES}")
    env = {k: str(v) for k, v in dict(args.pop("env", {})).items()}
    ready_timeout_s = float(args.pop("ready_timeout_s", DEFAULT_READY_TIMEOUT_S))
    if args:
        raise shared.UsageError(
            "args",
            ", ".join(sorted(args)),
            "unknown application argument(s) of build_multihost_app",
        )
    actor: dict[str, Any] = {
        "num_cpus": bundle["CPU"],
        "num_gpus": bundle.get("GPU", 0.0),
        "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
    }
    if env:  # the followers inherit the replica's runtime environment
        actor["runtime_env"] = {"env_vars": env}
    argv = worker_argv(model, ["--host=127.0.0.1", *server_args])
    return MultiHostDeployment.options(
        num_replicas=1,
        ray_actor_options=actor,
        placement_group_bundles=[dict(bundle) for _ in range(num_hosts)],
        placement_group_strategy=strategy,
    ).bind(argv, num_hosts, bundle, ready_timeout_s)
