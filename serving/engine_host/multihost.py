"""Multi-host serving: one server command on every pod of a group (a LeaderWorkerSet group
on a multi-host TPU slice, deploy/k8s/gateway/leaderworkerset.yaml).

    python -m serving.server --distributed_env=lws --mesh=model:16 ...   # on every pod

    every pod:   jax.distributed.initialize(engine/parallel/distributed.config_from_env("lws"))
                 the engine built in the same order (engine/parallel/distributed.py's
                 create_multihost_engine through serving/engine_host/build.py)
    process 0:   serves (gRPC, HTTP, metrics, KV events) as a single-host server does; its
                 LeaderEngineCore broadcasts every device step to the others
    others:      follow(engine): run process 0's steps until it stops, then exit 0

What needs device work off the step path is refused at start (UsageError): LoRA adapters
(create_multihost_engine says so), speculative decoding, disaggregated roles, the engine in
a child process, and SIGHUP reloads (a new engine would be built on process 0 only).
"""

from __future__ import annotations

import logging

log = logging.getLogger("pagedjax.serving")


def initialize(source: str | None) -> bool:
    """jax.distributed.initialize from a launcher's environment (None: single host).
    Returns whether this process is one of several."""
    if not source:
        return False
    from engine.parallel.distributed import config_from_env
    from engine.parallel.distributed import initialize as jax_initialize

    return jax_initialize(config_from_env(source))


def is_follower() -> bool:
    import jax

    return jax.process_count() > 1 and jax.process_index() != 0


def follow(engine) -> int:
    """On processes != 0: run the leader's steps until it stops; returns the steps run."""
    from engine.parallel.distributed import follow as follow_steps

    steps = follow_steps(getattr(engine, "core", engine))  # unwrap KVTransferEngine
    log.info("follower: the leader stopped after %d steps", steps)
    return steps


def refusals(flags) -> list[tuple[str, object, str]]:
    """(flag, value, why) for every server flag multi-host serving does not support."""
    out = []
    if flags.speculative not in (None, "", "off", "none"):
        out.append(("speculative", flags.speculative, "not with --distributed_env"))
    if flags.lora or flags.max_loras:
        out.append(("lora", flags.lora, "not with --distributed_env (multi-host LoRA)"))
    if flags.role != "both":
        out.append(("role", flags.role, "both with --distributed_env"))
    if flags.engine_process:
        out.append(("engine_process", True, "not with --distributed_env"))
    if flags.model == "mock":
        out.append(("model", flags.model, "a real model with --distributed_env"))
    if getattr(flags, "host_kv_gib", 0):  # followers would miss the host tier's copies
        out.append(("host_kv_gib", flags.host_kv_gib, "0 with --distributed_env"))
    return out


def stop_followers(engine) -> None:
    """Process 0, after its engine thread ended: tell the others to stop (STOP broadcast)."""
    shutdown = getattr(getattr(engine, "core", engine), "shutdown", None)
    if shutdown is not None:
        shutdown()
