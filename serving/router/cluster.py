"""A local disaggregated cluster in one command: workers + router as processes.

    python -m serving.router.cluster --prefill=1 --decode=1 --replicas=0 --port=50051 \
        --worker_args="--model=tiny --max_num_seqs=8" [--pin_cpus=true] [--logs_dir=DIR] \
        [--http_port=8000]

starts `--prefill` prefill workers, `--decode` decode workers and `--replicas` `both`
replicas (`python -m serving.server --role=...` on free loopback ports), then
`python -m serving.router.server` over all of them on `--port`, prints `routing on PORT` and one
line per worker, and stops everything on SIGTERM / SIGINT. Each worker is pinned to one
core (os.sched_setaffinity on the fresh child, so every thread it starts inherits it),
round-robin over the cores this process may use; the router is not pinned. Worker logs go
to `--logs_dir` (default: a temporary directory, printed).

`LocalCluster` is the same thing as a context manager (tests, benchmarks/disagg_bench.py).
For the real thing see deploy/k8s/ (a Deployment per role, the router in front).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags

from serving import flags as shared

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@dataclasses.dataclass
class Proc:
    name: str
    role: str
    port: int
    proc: subprocess.Popen
    cpus: tuple[int, ...] | None
    log_path: str

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The router's OpenAI-compatible base URL (needs `http_port`)."""
        return f"http://127.0.0.1:{self.http_port}/v1"


def spawn(name, role, args, port, log_dir, cpus=None) -> Proc:
    """Start `python -m ...args` pinned to `cpus` (None: not pinned); stdout+stderr to a log."""
    log_path = os.path.join(log_dir, f"{name}.log")
    log = open(log_path, "w")  # noqa: SIM115 - the child writes it until it exits
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    log.close()
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        # NOTE: set right after exec, while the new interpreter has one thread; the threads
        # it starts later (JAX, gRPC) inherit it. (A preexec_fn would fork a threaded parent.)
        os.sched_setaffinity(proc.pid, cpus)
    return Proc(name, role, port, proc, tuple(cpus) if cpus else None, log_path)


def wait_ready(p: Proc, pattern: str, timeout_s: float) -> None:
    """Until the log shows `pattern` (the program prints it once listening)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with open(p.log_path) as f:
            if re.search(pattern, f.read(), re.M):
                return
        if p.proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited with {p.proc.returncode}; see {p.log_path}")
        time.sleep(0.1)
    raise TimeoutError(f"{p.name} not ready within {timeout_s}s; see {p.log_path}")


def wait_serving(address: str, timeout_s: float) -> None:
    """Until the gRPC health check of `address` says SERVING (warm-up over)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not SERVING within {timeout_s}s")


class LocalCluster:
    def __init__(
        self,
        prefill: int = 1,
        decode: int = 1,
        replicas: int = 0,
        *,
        worker_args: list[str] = (),
        router_args: list[str] = (),
        port: int = 0,
        pin_cpus: bool = True,
        log_dir: str | None = None,
        start_timeout_s: float = 600.0,
        http_port: int | None = None,
    ):
        """`http_port` (None: none; 0: a free one): the router's OpenAI-compatible HTTP API,
        with the tokenizer of the workers' `--model` (serving/router/http_front.py)."""
        if prefill < 0 or decode < 0 or replicas < 0:
            raise ValueError(f"prefill={prefill}, decode={decode}, replicas={replicas}: >= 0")
        if (prefill == 0) != (decode == 0):
            raise ValueError(f"prefill={prefill}, decode={decode}: both zero or both >= 1")
        if prefill + replicas == 0:
            raise ValueError("no workers: give --prefill and --decode, or --replicas")
        self.roles = ["prefill"] * prefill + ["decode"] * decode + ["both"] * replicas
        self.worker_args, self.router_args = list(worker_args), list(router_args)
        self.port = port or free_port()
        self.pin_cpus, self.start_timeout_s = pin_cpus, start_timeout_s
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="pagedjax-cluster-")
        self.workers: list[Proc] = []
        self.router: Proc | None = None
        self.http_port = (http_port or free_port()) if http_port is not None else None
        if self.http_port is not None:
            models = [a.split("=", 1)[1] for a in self.worker_args if a.startswith("--model=")]
            model = models[-1] if models else shared.DEFAULT_MODEL
            self.router_args += [f"--http_port={self.http_port}", f"--tokenizer={model}"]

    def start(self) -> LocalCluster:
        cpus = usable_cpus()
        try:
            for i, role in enumerate(self.roles):
                port = free_port()
                args = ["serving.server", f"--role={role}", "--host=127.0.0.1", f"--port={port}"]
                pinned = [cpus[i % len(cpus)]] if self.pin_cpus else None
                self.workers.append(
                    spawn(
                        f"{role}-{i}",
                        role,
                        [*args, "--metrics_port=-1", *self.worker_args],
                        port,
                        self.log_dir,
                        pinned,
                    )
                )
            for w in self.workers:  # listening, then warmed up
                wait_ready(w, r"^serving on \d+", self.start_timeout_s)
                wait_serving(w.address, self.start_timeout_s)
            workers = ",".join(w.address for w in self.workers)
            router_cmd = ["serving.router.server", f"--workers={workers}", "--host=127.0.0.1"]
            self.router = spawn(
                "router",
                "router",
                [*router_cmd, f"--port={self.port}", *self.router_args],
                self.port,
                self.log_dir,
            )
            wait_ready(self.router, r"^routing on \d+", 60)
            wait_serving(self.address, 60)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The router's OpenAI-compatible base URL (needs `http_port`)."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    def kill(self, p: Proc) -> None:
        """SIGKILL one process (tests: a worker dying)."""
        p.proc.kill()
        p.proc.wait(10)

    def stop(self) -> None:
        procs = [*self.workers, *([self.router] if self.router else [])]
        for p in procs:
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in procs:
            try:
                p.proc.wait(15)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait(5)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- the program -------------------------------------------------------------------------------
FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_integer("prefill", 1, "prefill workers (0 with --decode=0: replicas only)")
    flags.DEFINE_integer("decode", 1, "decode workers")
    flags.DEFINE_integer("replicas", 0, "`both` replicas (prefill + decode in one engine)")
    flags.DEFINE_integer("port", 50051, "the router's gRPC port")
    flags.DEFINE_integer("http_port", 0, "the router's OpenAI-compatible HTTP port (0: off)")
    flags.DEFINE_string(
        "worker_args", f"--model={shared.DEFAULT_MODEL}", "flags for every serving.server"
    )
    flags.DEFINE_string("router_args", "", "extra flags for serving.router.server")
    flags.DEFINE_bool("pin_cpus", True, "pin each worker to one core (sched_setaffinity)")
    flags.DEFINE_string("logs_dir", None, "worker and router logs (default: a temp dir)")


def main(argv) -> None:
    if len(argv) > 1:
        raise shared.UsageError("", " ".join(argv[1:]), "the cluster takes only flags")
    for name in ("prefill", "decode", "replicas"):
        shared.check_positive(name, getattr(FLAGS, name), allow_zero=True)
    shared.check_port("port", FLAGS.port, "127.0.0.1")
    try:
        cluster = LocalCluster(
            FLAGS.prefill,
            FLAGS.decode,
            FLAGS.replicas,
            worker_args=shlex.split(FLAGS.worker_args),
            router_args=shlex.split(FLAGS.router_args),
            port=FLAGS.port,
            pin_cpus=FLAGS.pin_cpus,
            log_dir=FLAGS.logs_dir,
            http_port=FLAGS.http_port or None,
        )
    except ValueError as e:
        raise shared.UsageError("prefill/decode/replicas", "", str(e)) from None
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    with cluster:
        print(f"routing on {cluster.port} (logs in {cluster.log_dir})", flush=True)
        if cluster.http_port is not None:
            print(f"http on {cluster.http_port} ({cluster.http_url})", flush=True)
        for w in cluster.workers:
            print(f"worker {w.role} {w.address} cpus={w.cpus} pid={w.proc.pid}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stopped.wait()


def run() -> None:
    define_flags()
    app.run(shared.main_guard(main), flags_parser=shared.parse_flags)


if __name__ == "__main__":
    run()
