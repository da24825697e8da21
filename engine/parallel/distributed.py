"""Multi-host serving: one program on every host, process 0 schedules, all processes step.

    every host:  initialize(DistributedConfig(coordinator, num_processes, process_id))
                 engine = create_multihost_engine(model, config, mesh="model:8")
    process 0:   a LeaderEngineCore: the normal EngineCore (scheduler, page pool, gRPC
                 server on top) whose LeaderRunner broadcasts each device call to the others
                 before it makes it
    others:      follow(engine) runs the same device calls in the same order until STOP

Why: under multi-controller JAX every process must launch the same jitted computations with
the same static arguments in the same order (the collectives inside them pair up across
hosts). Only process 0 runs the scheduler, so it ships each step's plan, i.e. the host-built
batch (numpy arrays), its BatchShape and sampler flags, to the others with
`multihost_utils.broadcast_one_to_all`: a fixed header [kind, nbytes] and then the pickled
payload padded to a power-of-two byte bucket (so the broadcast itself compiles a handful of
shapes). The step's packed results are replicated (engine/runner/step.py), so process 0 reads them
locally. Construction (param placement, KV zeros) runs on every process in the same order.

Launch (see WORKSPACE.md "Sharding and multi-host"): the same command on every host with
--coordinator_address=host0:PORT --num_processes=N --process_id=i (or none of them on a TPU
slice / SLURM / Kubernetes, where `jax.distributed.initialize()` finds them itself).

    python -m engine.parallel.distributed --model=tiny --mesh=model:4 --prompts="1,2,3;72,101" \
        --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=0   # and =1
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import pickle

import numpy as np

from engine.core import EngineCore
from engine.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)

STEP, RESET_COUNTS, STOP = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str | None = None  # "host:port" of process 0
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        n, i = self.num_processes, self.process_id
        if n is not None and n < 1:
            raise ValueError(f"num_processes={n} is invalid: must be >= 1")
        if n is not None and i is not None and not 0 <= i < n:
            raise ValueError(f"process_id={i} is invalid: must be in [0, {n})")


# -- gateway: LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) gives every pod of a group these
LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")
COORDINATOR_PORT = 8476  # the leader's jax.distributed coordinator (JAX's usual port)
DISTRIBUTED_ENVS = ("lws",)


def config_from_env(source: str, env=None, port: int | None = None) -> DistributedConfig:
    """The DistributedConfig a launcher's environment describes. "lws": a LeaderWorkerSet
    pod, LWS_LEADER_ADDRESS (the leader pod's DNS name) -> coordinator `address:port`,
    LWS_GROUP_SIZE -> num_processes, LWS_WORKER_INDEX -> process_id (the leader is 0).
    `port`: None reads PAGEDJAX_COORDINATOR_PORT, default 8476. A missing or non-integer
    variable raises ValueError naming it."""
    env = os.environ if env is None else env
    if source not in DISTRIBUTED_ENVS:
        raise ValueError(f"distributed_env={source!r} is invalid: one of {DISTRIBUTED_ENVS}")
    values = {}
    for name in LWS_ENV:
        value = env.get(name)
        if not value:
            raise ValueError(f"{name}={value!r} is invalid: set by LeaderWorkerSet on its pods")
        values[name] = value
    ints = {}
    for name in LWS_ENV[1:]:
        try:
            ints[name] = int(values[name])
        except ValueError:
            raise ValueError(f"{name}={values[name]!r} is invalid: an integer") from None
    if port is None:
        port = int(env.get("PAGEDJAX_COORDINATOR_PORT") or COORDINATOR_PORT)
    host = values["LWS_LEADER_ADDRESS"]
    host = f"[{host}]" if ":" in host else host  # an IPv6 literal
    return DistributedConfig(
        coordinator_address=f"{host}:{port}",
        num_processes=ints["LWS_GROUP_SIZE"],
        process_id=ints["LWS_WORKER_INDEX"],
    )


def initialize(cfg: DistributedConfig) -> bool:
    """`jax.distributed.initialize` unless this is a single-process run. Returns whether it
    ran. With every field None it still runs when PAGEDJAX_MULTIHOST=1 (auto-detection on
    TPU slices, SLURM, Open MPI and Kubernetes JobSets)."""
    import jax

    auto = os.environ.get("PAGEDJAX_MULTIHOST") == "1"
    if cfg.num_processes in (None, 1) and cfg.coordinator_address is None and not auto:
        return False
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator_address,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
        local_device_ids=cfg.local_device_ids,
    )
    log.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator_address", default=None, help="host:port of process 0")
    parser.add_argument("--num_processes", type=int, default=None)
    parser.add_argument("--process_id", type=int, default=None)
    parser.add_argument(
        "--distributed_env",
        choices=DISTRIBUTED_ENVS,
        default=None,
        help="read the three above from a launcher's environment (lws: LeaderWorkerSet)",
    )


def config_from_args(args) -> DistributedConfig:
    if args.distributed_env:
        return config_from_env(args.distributed_env)
    return DistributedConfig(args.coordinator_address, args.num_processes, args.process_id)


# ---- the step channel ---------------------------------------------------------------------
class StepChannel:
    """Process 0 sends (kind, payload); the others receive the same, in order."""

    def __init__(self):
        import jax

        self.is_leader = jax.process_index() == 0

    def send(self, kind: int, payload) -> None:
        assert self.is_leader, "only process 0 sends"
        data = np.frombuffer(pickle.dumps(payload, protocol=5), np.uint8)
        self._exchange(kind, data)

    def recv(self):
        assert not self.is_leader, "process 0 sends, the others receive"
        kind, data = self._exchange(0, None)
        return kind, pickle.loads(data.tobytes())

    @staticmethod
    def _exchange(kind: int, data: np.ndarray | None):
        from jax.experimental import multihost_utils as mh

        n = 0 if data is None else data.size
        header = np.asarray(mh.broadcast_one_to_all(np.array([kind, n], np.int64)))
        kind, n = int(header[0]), int(header[1])
        size = 1 << max(10, (n - 1).bit_length())
        buf = np.zeros(size, np.uint8)
        if data is not None:
            buf[:n] = data
        return kind, np.asarray(mh.broadcast_one_to_all(buf))[:n]


# ---- leader and followers --------------------------------------------------------------------
class LeaderRunner(ModelRunner):
    """The ModelRunner of process 0: every device call is announced to the followers first
    (warm-up's own penalty reset is not: each process runs its own)."""

    def __init__(self, *args, channel: StepChannel, **kwargs):
        super().__init__(*args, **kwargs)
        self.channel = channel

    def run(self, batch, shape, program):
        self.channel.send(STEP, (batch, shape, program))
        return super().run(batch, shape, program)

    def reset_slot(self, slot, prompt_token_ids, output_token_ids):
        ids = (slot, list(prompt_token_ids), list(output_token_ids))
        self.channel.send(RESET_COUNTS, ids)
        super().reset_slot(*ids)


class LeaderEngineCore(EngineCore):
    """EngineCore on process 0: its runner announces every device call to the followers."""

    def __init__(self, *args, channel: StepChannel, **kwargs):
        runner_cls = functools.partial(LeaderRunner, channel=channel)
        super().__init__(*args, runner_cls=runner_cls, **kwargs)
        self.channel = channel

    def shutdown(self) -> None:
        self.channel.send(STOP, None)


def create_multihost_engine(model, config, *, mesh, impl: str = "auto"):
    """Every process calls this with the same arguments (same order of device work): process
    0 gets a LeaderEngineCore, the others a plain EngineCore to pass to `follow`."""
    import jax

    if jax.process_count() == 1:
        return EngineCore(model, config, impl=impl, mesh=mesh)
    if config.max_loras:  # NOTE: followers would need each step's adapter rows and loads
        raise ValueError(
            f"max_loras={config.max_loras} is invalid: 0 with several processes (multi-host "
            f"LoRA is not implemented)"
        )
    if config.speculative is not None:  # NOTE: LeaderRunner announces run, not verify
        raise ValueError(
            f"speculative={config.speculative.describe()!r} is invalid: off with several "
            f"processes (multi-host speculative decoding is not implemented)"
        )
    if config.host_kv_gib:  # NOTE: followers would need the host tier's gathers / scatters
        raise ValueError(
            f"host_kv_gib={config.host_kv_gib} is invalid: 0 with several processes "
            "(a multi-host host KV tier is not implemented)"
        )
    if jax.process_index() == 0:
        return LeaderEngineCore(model, config, impl=impl, mesh=mesh, channel=StepChannel())
    return EngineCore(model, config, impl=impl, mesh=mesh)


def follow(engine, channel: StepChannel | None = None) -> int:
    """Runs process 0's device calls until it sends STOP; returns the steps run."""
    channel = channel or StepChannel()
    steps = 0
    while True:
        kind, payload = channel.recv()
        if kind == STOP:
            return steps
        if kind == STEP:
            engine.runner.run(*payload)
            steps += 1
        elif kind == RESET_COUNTS:
            engine.runner.reset_slot(*payload)
        else:
            raise RuntimeError(f"unknown step message kind {kind}")


# ---- a one-generation CLI (used by tests/test_multihost.py) ----------------------------------
def generate_ids(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy generation straight on an engine (no LLM wrapper); outputs in prompt order."""
    from engine.api_types import EngineRequest
    from engine.sampling.params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    out = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", p, sp))
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--mesh", default="model:2")
    p.add_argument("--prompts", default="1,2,3;72,101,108,108,111", help="';'-separated ids")
    p.add_argument("--max_tokens", type=int, default=8)
    p.add_argument("--num_pages", type=int, default=32)
    p.add_argument("--cpu_devices", type=int, default=None, help="virtual CPU devices/process")
    add_arguments(p)
    args = p.parse_args(argv)
    import jax

    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    initialize(config_from_args(args))
    from configs.engine_config import EngineConfig
    from models.registry import load_model

    model = load_model(args.model)
    config = EngineConfig(
        model=args.model,
        num_pages=args.num_pages,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=128,
    )
    engine = create_multihost_engine(model, config, mesh=args.mesh or None)
    if jax.process_index() != 0:
        print("FOLLOWER " + json.dumps({"steps": follow(engine)}), flush=True)
        return
    prompts = [[int(t) for t in s.split(",")] for s in args.prompts.split(";")]
    try:
        out = generate_ids(engine, prompts, args.max_tokens)
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    print(
        "RESULT "
        + json.dumps(
            {
                "tokens": out,
                "steps": engine.num_steps,
                "processes": jax.process_count(),
                "devices": jax.device_count(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
