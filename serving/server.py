"""The pagedjax server: assembles engine, engine thread, admission, tenants, metrics, gRPC
health and reflection, and the OpenAI-compatible HTTP API beside gRPC (threads and queues:
see serving/frontend/engine_loop.py; both transports call one Generator,
serving/frontend/generation.py).

    python -m serving.server --model=smollm2-135m --port=50051 --metrics_port=9090 --http_port=8000
    python -m serving.server --model=mock --port=0          # MockEngine, no JAX needed

Prints `serving on PORT` (and `http on PORT`) once listening; warm-up then runs on the engine
thread, and generation is refused (UNAVAILABLE / 503 warming_up, gRPC health NOT_SERVING,
HTTP /ready 503) until it ends. Programmatic use (tests, serving/cli.py):

    server = PagedJaxServer(engine, ServerConfig(...)).start()   # .port, .metrics_port, .http_port
    ...
    server.stop()
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures

import grpc
from absl import app, flags
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.chat.setup import ChatOptions
from engine.errors import WarmupCancelled
from serving import flags as shared
from serving.disagg import service as kv_transfer_service
from serving.engine_host.build import StopFn, Warmup, build_engine, engine_warmup
from serving.frontend import capacity_calibration
from serving.frontend.admission import AdmissionConfig, WaitingQueue
from serving.frontend.breaker import CircuitBreaker
from serving.frontend.capacity_model import probe
from serving.frontend.engine_loop import EngineLoop
from serving.frontend.generation import Generator, ServiceLimits
from serving.frontend.metrics import ServerMetrics, start_metrics_http
from serving.frontend.prefix_shadow import PrefixShadow
from serving.frontend.request_state import RequestLedger, SlowConsumerPolicy
from serving.frontend.shutdown import install_signal_handlers
from serving.frontend.tenants import TenantLimiter, TenantRegistry
from serving.gateway.metrics_compat import COMPAT_MODES, lora_state_of
from serving.grpc_api import convert
from serving.grpc_api.dispatch import DispatchLedger
from serving.grpc_api.guard import RequestGuard
from serving.grpc_api.service import PagedJaxService
from serving.grpc_api.transport import PortInUseError, bind_port, grpc_options
from serving.proto import pagedjax_pb2 as pb
from serving.proto import pagedjax_pb2_grpc as pb_grpc

EXIT_FATAL = 1  # the server cannot become ready (a failed warm-up); usage errors exit 2

log = logging.getLogger("pagedjax.serving")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PagedJax"].full_name
GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    admission: AdmissionConfig = dataclasses.field(default_factory=AdmissionConfig)
    stream_buffer_messages: int = 256  # undelivered deltas before a slow reader is cancelled
    slow_consumer: SlowConsumerPolicy = dataclasses.field(default_factory=SlowConsumerPolicy)
    max_request_bytes: int = 1 << 20  # a request message's size limit (INVALID_ARGUMENT past it)
    # Measure step times at start-up (serving/frontend/capacity_model.py).
    capacity_probe: bool = True
    # Where the capacity calibration persists (the compilation cache directory; the file
    # goes beside it: serving/frontend/capacity_calibration.py); None: not kept across restarts.
    capacity_calibration_dir: str | None = None
    # Requests of a higher priority class than one in the engine fed past max_inflight (the
    # engine must preempt for priority: SchedulerConfig.priority_preemption); 0: off.
    priority_overflow: int = 0
    max_inflight: int | None = None  # requests in the engine at once; None: its max_num_seqs
    breaker_failure_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    max_workers: int | None = None  # gRPC handler threads; None: queue + inflight + 32
    dispatch_timeout_s: float = 5.0  # a call not picked up by then is recorded as dropped
    host: str = "[::]"
    port: int = 0  # 0: ephemeral (see PagedJaxServer.port)
    metrics_port: int | None = None  # None: no HTTP endpoint (metrics still in the registry)
    http_port: int | None = None  # OpenAI-compatible HTTP API; None: off, 0: ephemeral
    engine_config: dict = dataclasses.field(default_factory=dict, hash=False)
    # -- disaggregation (serving/disagg/service.py): prefill | decode | both
    role: str = "both"
    kv_transport: str = "grpc"  # "jax": jax.experimental.transfer (disagg/jax_transfer.py)
    kv_jax_checksum: bool = True  # jax transport: device digest of pages (kv_transfer/digest)
    # LoRA: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (serving/http/lora.py)
    allow_runtime_lora: bool = False
    # -- gateway (serving/gateway/metrics_compat.py): vLLM's metric names as aliases, or "none"
    metrics_compat: str = "vllm"
    # -- gateway (serving/gateway/kv_events_publisher.py): llm-d KV-cache events over ZMQ; None: off
    kv_events_endpoint: str | None = None
    kv_events_topic: str | None = None  # None: kv@<$POD_IP or host name>@<model name>
    kv_events_replay_endpoint: str | None = None
    # issue 39: a per-request timeline as a Chrome/Perfetto trace file (None: off);
    # serving/frontend/request_trace.py
    trace_requests: str | None = None
    # chat tools / reasoning (engine/chat/setup.py): "" = from the model's chat
    # template / off
    tool_call_parser: str = ""
    reasoning_parser: str = ""


class PagedJaxServer:
    def __init__(
        self,
        engine,
        config: ServerConfig | None = None,
        tenants: TenantRegistry | None = None,
        warmup: Warmup | None = None,
    ):
        """`warmup(stop)`: called on the engine thread before it serves (compiles the step
        shapes); generation is refused as warming_up until it returns. `stop()` turns True
        when the server starts shutting down; a warm-up that honours it raises
        engine.runner.warmup.WarmupCancelled (serving/engine_host/build.py's does)."""
        config = config or ServerConfig()
        self.engine, self.config = engine, config
        stats = dict(engine.stats())
        admission = config.admission
        engine_len = stats.get("max_model_len")
        if engine_len:
            admission = dataclasses.replace(
                admission, max_model_len=min(admission.max_model_len, int(engine_len))
            )
        max_inflight = config.max_inflight or int(stats.get("max_num_seqs", 64))
        identity = engine.identity
        self.metrics = ServerMetrics(identity.name, identity.revision, config.metrics_compat)
        self.metrics.set_cache_config(stats)
        self.breaker = CircuitBreaker(config.breaker_failure_threshold, config.breaker_cooldown_s)
        _warm_tokenizer(engine.tokenizer)
        # The capacity probe runs after warm-up (on the engine thread, see _warm_up) when there
        # is one, so that it measures compiled steps.
        self._calibration = None
        if config.capacity_calibration_dir:
            key = capacity_calibration.calibration_key(identity, stats, max_inflight)
            path = capacity_calibration.calibration_path(config.capacity_calibration_dir, key)
            self._calibration = capacity_calibration.CalibrationStore(path, key)
        self.waiting = WaitingQueue(admission)
        if stats.get("prefix_cache_enabled") and stats.get("page_size"):
            self.waiting.prefix_shadow = PrefixShadow(
                int(stats["page_size"]), int(stats.get("kv_pages_total") or 1)
            )
        if config.capacity_probe and warmup is None:
            self.waiting.capacity = self._seed_capacity(engine, max_inflight)
        self.limiter = TenantLimiter()
        self.ledger = RequestLedger(self.metrics, self.limiter, convert.versions_dict(identity))
        self.dispatch = DispatchLedger(
            self.ledger,
            GENERATE_METHOD,
            config.dispatch_timeout_s,
            calls_counter=self.metrics.generate_calls,
        )
        self.loop = EngineLoop(
            engine,
            self.waiting,
            self.ledger,
            self.breaker,
            self.metrics,
            max_inflight=max_inflight,
            on_breaker_change=self._set_health,
            on_tick=self._tick,
            priority_overflow=config.priority_overflow,
            slow_consumer=config.slow_consumer,
            on_start=self._warm_up,
        )
        self._warmup = warmup
        # A failed warm-up: its one-line cause, and who to tell (main stops and exits 1).
        self.fatal_error: str | None = None
        self.on_fatal: Callable[[], None] | None = None
        self.tracer = None
        if config.trace_requests:
            from serving.frontend.request_trace import RequestTrace

            self.tracer = self.loop.tracer = self.ledger.tracer = RequestTrace(
                config.trace_requests
            )
        self.loop.last_stats = stats
        if self.metrics.compat is not None:  # gateway: vllm:lora_requests_info
            self.metrics.compat.lora_state = lambda: lora_state_of(self.loop)
        self.kv_events = None  # gateway: llm-d KV-cache events
        if config.kv_events_endpoint:
            self.kv_events = _kv_event_publisher(engine, config, self.metrics.registry)
            self.loop.on_iteration = self.kv_events.flush
        self.loop.on_swap = self._on_swap
        self.limits = ServiceLimits(admission, config.stream_buffer_messages, max_inflight)
        tenants = tenants or TenantRegistry()
        self.guard = RequestGuard(
            tenants,
            f"/{SERVICE_NAME}/",
            config.max_request_bytes,
            GENERATE_METHOD,
            on_generate_refused=self._record_refused_call,
        )
        self.generator = Generator(
            engine,
            self.limits,
            tenants,
            self.limiter,
            self.waiting,
            self.breaker,
            self.loop,
            self.ledger,
        )
        chat_options = ChatOptions.for_tokenizer(
            engine.tokenizer, config.tool_call_parser, config.reasoning_parser
        )
        self.service = PagedJaxService(self.generator, config.engine_config, chat_options)
        workers = config.max_workers or admission.max_queue_requests + max_inflight + 32
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(workers, thread_name_prefix="grpc"),
            interceptors=(self.dispatch, self.guard),  # dispatch counts, then guard checks
            options=grpc_options(config.max_request_bytes),
        )
        pb_grpc.add_PagedJaxServicer_to_server(self.service, self.grpc_server)
        # -- disaggregation: the KVTransfer service (Prefill / Decode / WorkerInfo)
        self.kv_service = kv_transfer_service.install(
            self, config.role, config.kv_transport, config.host, config.kv_jax_checksum
        )
        # NOTE: grpc's HealthServicer answers SERVING for "" until told otherwise; between
        # the gRPC server's start and the first _set_health a client saw SERVING while the
        # server still warmed up (a test's wait passed and its first call was refused
        # warming_up). The lock keeps a stale NOT_SERVING from landing after warm-up's SERVING.
        self.health = health.HealthServicer()
        self._health_lock = threading.Lock()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc_server
        )
        self.port = bind_port(self.grpc_server, config.host, config.port)
        self.metrics_port: int | None = None
        self._metrics_http = None
        self.http_port: int | None = None
        self._http = None
        if config.http_port is not None:
            from serving.http.server import HttpServer

            self.http_api = self.build_http_api()
            self._http = HttpServer(self.http_api.app, config.host, config.http_port)
            self.http_port = self._http.port

    def build_http_api(self):
        """The OpenAI-compatible API over this server's generator, metrics and tenants (its
        own HTTP port serves it; a Ray Serve replica mounts it as its ingress)."""
        from serving.gateway.http_kv_transfer import KvTransferParams
        from serving.http.api import HttpApi

        config = self.config
        self.generator.allow_runtime_lora = config.allow_runtime_lora
        api = HttpApi(
            self.generator,
            self.metrics,
            tool_call_parser=config.tool_call_parser,
            reasoning_parser=config.reasoning_parser,
        )
        # llm-d's routing sidecar: kv_transfer_params (serving/gateway/http_kv_transfer.py)
        api.kv_transfer = KvTransferParams(self)
        return api

    def _record_refused_call(self, reason: str, status: grpc.StatusCode, details: str) -> None:
        """A Generate call refused by the guard (before parsing): its one outcome."""
        self.ledger.reject(
            f"refused-{uuid.uuid4().hex}", "?", reason, status, details, time.monotonic()
        )

    def start(self) -> PagedJaxServer:
        if self._warmup is None:  # ready at once, not when the engine thread gets to it
            self.generator.ready.set()
        self.loop.start()
        if self.config.metrics_port is not None:
            try:
                self._metrics_http = start_metrics_http(self.metrics, self.config.metrics_port)
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                self.loop.stop()
                raise shared.UsageError(
                    "metrics_port", self.config.metrics_port, "port already in use"
                ) from None
            self.metrics_port = self._metrics_http.server_port
        self.grpc_server.start()
        if self._http is not None:
            self._http.start()
        self._set_health("closed")
        log.info(
            "gRPC server started on port %d (metrics port %s, HTTP port %s)",
            self.port,
            self.metrics_port,
            self.http_port,
        )
        return self

    def _seed_capacity(self, engine, max_inflight: int):
        """The capacity model: the saved calibration of this model and engine shape if
        there is one (a restart starts calibrated, online refinements and the measured
        margin included), else a start-up probe."""
        if self._calibration is not None:
            model = self._calibration.load(max_inflight, self.waiting.tracker)
            if model is not None:
                return model
        return probe(engine, max_inflight)

    def _tick(self) -> None:
        """Every stats interval, on the engine thread."""
        self.dispatch.reap()
        if self._calibration is not None:
            self._calibration.maybe_save(
                self.waiting.capacity, self.waiting.tracker, time.monotonic()
            )

    def _warm_up(self) -> None:
        """On the engine thread, before its first iteration."""
        if self._warmup is None:
            return
        try:
            self._warmup(stop=lambda: self.generator.draining)
            if self.config.capacity_probe:
                self.waiting.capacity = self._seed_capacity(
                    self.loop.engine, self.limits.max_inflight
                )
        except WarmupCancelled:  # SIGTERM while warming: stop after the programs building
            log.warning("warm-up stopped: the server is shutting down")
            return
        except Exception as e:  # fatal: main stops the server and exits non-zero
            self.fatal_error = f"warm-up failed: {type(e).__name__}: {e}"
            log.exception("warm-up failed; the server will exit")
            if self.on_fatal is not None:
                self.on_fatal()
            return
        self.generator.ready.set()
        self._set_health(self.breaker.state)

    def _set_health(self, breaker_state: str) -> None:
        with self._health_lock:
            status = (
                health_pb2.HealthCheckResponse.NOT_SERVING
                if breaker_state == "open"
                or not self.generator.ready.is_set()
                or self.generator.draining
                else health_pb2.HealthCheckResponse.SERVING
            )
            for name in ("", SERVICE_NAME):
                self.health.set(name, status)

    def reload(self, engine, timeout_s: float | None = None) -> bool:
        """Serve from `engine` (e.g. a new revision of the model) without failing a request:
        the current engine finishes what it holds, queued and new requests go to the new one.
        Each final message names the revision that produced it. The tokenizer must be the
        same (prompts already queued were tokenized with the current one)."""
        old, new = self.loop.engine.identity, engine.identity
        if getattr(old, "tokenizer_hash", None) != getattr(new, "tokenizer_hash", None):
            raise ValueError(
                f"reload: tokenizer_hash {new.tokenizer_hash!r} differs from the loaded "
                f"{old.tokenizer_hash!r}; restart the server to change tokenizers"
            )
        return self.loop.request_swap(engine).wait(timeout_s)

    def _on_swap(self, engine) -> None:
        self.ledger.versions = convert.versions_dict(engine.identity)
        if self.kv_events is not None:
            self.kv_events.replace_engine(engine)

    def begin_drain(self) -> None:
        """Refuse new Generate calls (UNAVAILABLE) and report NOT_SERVING; admitted requests
        go on (serving/frontend/shutdown.py finishes the job)."""
        self.generator.draining = True
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def stop(self, grace_s: float = 1.0) -> None:
        self.generator.draining = True
        self.health.enter_graceful_shutdown()
        if self._http is not None:
            self._http.stop(grace_s + 5.0)
        self.grpc_server.stop(grace_s).wait()
        self.loop.stop()
        if self._calibration is not None:
            self._calibration.save(self.waiting.capacity, self.waiting.tracker)
        # -- overload (#17): an engine in a child process ends with the server
        close_engine(self.loop.engine)
        if self.kv_events is not None:
            self.kv_events.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        if self.tracer is not None:
            self.tracer.close()

    def wait(self) -> None:
        self.grpc_server.wait_for_termination()


def _kv_event_publisher(engine, config: ServerConfig, registry):
    from serving.gateway.kv_events_publisher import KvEventPublisher, default_topic

    return KvEventPublisher(
        engine,
        config.kv_events_endpoint,
        config.kv_events_topic or default_topic(engine.identity.name),
        replay_endpoint=config.kv_events_replay_endpoint,
        registry=registry,
    )


# -- overload (#17): the engine in a child process (serving/engine_host/process.py) ---------------
def close_engine(engine) -> None:
    """Stop an engine's child process (in-process engines have nothing to stop; a multi-host
    leader tells its followers to stop)."""
    from serving.engine_host.process import ProcessEngine

    if isinstance(engine, ProcessEngine):
        engine.close()
        return
    from serving.engine_host.multihost import stop_followers

    stop_followers(engine)


def build_serving_engine(
    model: str,
    options: dict,
    *,
    in_process: bool,
    compilation_cache_dir: str | None = None,
    **build_kwargs,
) -> tuple[object, Warmup | None]:
    """(engine, warm-up callable or None) for the server: the engine built here, or in a
    child process (`in_process=False`, then warmed there, with its own compilation cache
    set up from `compilation_cache_dir`). `options` as build_engine's, plus
    warmup_max_shapes and warmup_execute."""
    options = dict(options)
    max_shapes = options.pop("warmup_max_shapes", 0)
    execute = options.pop("warmup_execute", False)
    shapes = {"max_step_shapes": max_shapes} if max_shapes else {}
    if in_process:
        engine = build_engine(model, {**options, **shapes}, **build_kwargs)
        return engine, engine_warmup(engine, max_shapes, execute=execute)
    from serving.engine_host.process import ProcessEngine

    engine = ProcessEngine.start(
        model,
        {**options, **shapes},
        build_kwargs=build_kwargs,
        compilation_cache_dir=compilation_cache_dir,
    )
    if not max_shapes or model == "mock":
        return engine, None

    def run(stop: StopFn | None = None) -> None:
        # NOTE: `stop` is not forwarded: the child's warm-up ends when close() kills the child.
        engine.warmup(max_shapes, execute=execute)

    return engine, run


# -- end overload (#17) ------------------------------------------------------------------------


def _warm_tokenizer(tokenizer) -> None:
    """One-time costs of the first chat encoding (models/chat_encoding.literal_backend), paid
    before serving rather than by the first burst of calls."""
    if hasattr(tokenizer, "backend") and hasattr(tokenizer, "encode_chat"):
        from models.chat_encoding import literal_backend

        literal_backend(tokenizer)


# ---- command line -------------------------------------------------------------------------
FLAGS = flags.FLAGS


def define_flags() -> None:
    """The server's absl flags; defined on demand so importing this module defines none.
    Names shared with the other commands come from serving/flags.py."""
    shared.define_model(mock=True)
    shared.define_log_level()
    flags.DEFINE_string("host", "[::]", "address to bind")
    flags.DEFINE_integer("port", 50051, "gRPC port (0: any free port)")
    flags.DEFINE_enum(  # disaggregation: serving/disagg/service.py
        "role", "both", list(kv_transfer_service.ROLES), "prefill, decode or both (replica)"
    )
    flags.DEFINE_enum(
        "kv_transport",
        "grpc",
        ["grpc", "jax"],
        "K/V between workers: gRPC bytes, or "
        "jax.experimental.transfer (falls back to gRPC with a peer that has none)",
    )
    flags.DEFINE_bool(
        "kv_jax_checksum",
        True,
        "with --kv_transport=jax: digest the K/V pages on the device at export and check "
        "the pulled ones (one extra read of the pages on each side; off: metadata only)",
    )
    flags.DEFINE_integer("metrics_port", 9090, "Prometheus /metrics port (-1: none, 0: any)")
    flags.DEFINE_integer(
        "http_port", 0, "OpenAI-compatible HTTP API port (0: off; it also serves /metrics)"
    )
    flags.DEFINE_enum(  # gateway: serving/gateway/metrics_compat.py
        "metrics_compat",
        "vllm",
        list(COMPAT_MODES),
        "also expose vLLM's metric names (the Gateway API Inference Extension's model-server "
        "protocol, vLLM dashboards); none: only the pagedjax_* names",
    )
    flags.DEFINE_enum(  # gateway: serving/engine_host/multihost.py
        "distributed_env",
        None,
        ["lws"],
        "multi-host: jax.distributed from the launcher's environment (lws: LeaderWorkerSet's "
        "LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX); process 0 serves",
    )
    flags.DEFINE_string(  # gateway: serving/gateway/kv_events_publisher.py
        "kv_events_endpoint",
        None,
        "publish llm-d KV-cache events on this ZMQ address (tcp://*:5557 binds, "
        "tcp://HOST:PORT connects); unset: off",
    )
    flags.DEFINE_string(
        "kv_events_topic", None, "KV events topic (unset: kv@<$POD_IP or host>@<model name>)"
    )
    flags.DEFINE_string(
        "kv_events_replay_endpoint", None, "ZMQ ROUTER address replaying recent event batches"
    )
    flags.DEFINE_string("tenants_config", None, "JSON file of tenants and API keys")
    flags.DEFINE_enum(
        "tool_call_parser",
        "",
        ["", "hermes", "llama3_json", "mistral"],
        "chat tool-call syntax of the model (default: from its chat template, else hermes)",
    )
    flags.DEFINE_enum(
        "reasoning_parser",
        "",
        ["", "qwen3", "deepseek_r1"],
        "split <think>...</think> into reasoning_content (default: off)",
    )
    flags.DEFINE_string("request_log", None, "file for the per-request JSON lines (None: stderr)")
    # engine
    flags.DEFINE_integer("page_size", 16, "tokens per KV page")
    flags.DEFINE_integer("num_pages", None, "KV pages (None: as many as --kv_cache_gib holds)")
    flags.DEFINE_float(
        "kv_cache_gib",
        1.5,
        "KV pool size in GiB when --num_pages is not given (SmolLM2-135M float32: ~34k tokens)",
    )
    # 64: a decode of 64 rows costs ~2x one of 16 on CPU (weights dominate), so a client at
    # concurrency 64 is served in one batch instead of half of it waiting (benchmarks/RESULTS.md,
    # "CPU attention loops"); on CPU the shape set grows by one decode rung for it.
    flags.DEFINE_integer("max_num_seqs", 64, "requests in one batch")
    flags.DEFINE_integer("max_num_batched_tokens", 512, "tokens in one step")
    flags.DEFINE_integer("prefill_chunk_size", 256, "prompt tokens of one request per step")
    flags.DEFINE_bool("prefix_caching", True, "reuse KV pages of shared prompt prefixes")
    flags.DEFINE_float(
        "host_kv_gib",
        0.0,
        "host memory (GiB, per replica) for prefix-cache pages evicted from the device: "
        "copied back on a later hit instead of recomputed (0 = off)",
    )
    shared.define_quantization()
    shared.define_speculative()
    shared.define_lora()
    flags.DEFINE_string(
        "mesh",
        None,
        "device mesh, e.g. 'model:4', 'data:2,model:4' or 'expert:2' (MoE models; None: one "
        "device)",
    )
    flags.DEFINE_enum(
        "attention_impl",
        "auto",
        ["auto", "reference", "cpu", "gpu", "tpu"],
        "paged attention (pallas_kernels): auto picks by backend (gpu/tpu: the Pallas "
        "kernels, cpu: the data-bounded jnp loops); reference: the jnp oracle",
    )
    flags.DEFINE_float("mock_step_time_s", 0.01, "MockEngine: seconds per step")
    flags.DEFINE_string(
        "compilation_cache_dir",
        None,
        "JAX persistent compilation cache (default: ~/.cache/pagedjax/xla; '' or 'none': off)",
    )
    # NOTE: the server defaults to scan, the engine's "auto" (LLM()) unrolls on CPU. A server
    # warms ~48 step programs before it serves; unrolled layers compile ~5x slower on
    # XLA:CPU (SmolLM2: ~2.3 min per program cold vs ~27 s with scan, 2026-12-01), which
    # makes a cold start take most of an hour, for ~15-30% less batch-1 CPU per step
    # (benchmarks/RESULTS.md). LLM() compiles only the shapes it meets, so it keeps auto.
    flags.DEFINE_enum(
        "layer_loop",
        "scan",
        ["auto", "scan", "unrolled"],
        "the model's layer loop (EngineConfig.layer_loop; auto: unrolled on a CPU device; "
        "scan compiles ~5x faster, unrolled decodes batch 1 ~15-30% faster on CPU)",
    )
    flags.DEFINE_integer(
        "warmup_max_shapes",
        56,
        "step shapes the engine pads every batch to and compiles before serving (0: none;"
        " 56: 70 step programs for the default config, engine/runner/shapes.py)",
    )
    flags.DEFINE_bool(
        "warmup_execute",
        False,
        "also run each warmed step program once before serving: no first-execution set-up"
        " (0.2-0.7 s per SmolLM2 program on CPU) on a first real step, for a longer start"
        " (a second start ready in ~88 s instead of ~29 s on 2 CPU cores; engine/runner/warmup.py)",
    )
    # admission
    flags.DEFINE_integer("max_prompt_tokens", 8192, "longest prompt accepted (tokens)")
    flags.DEFINE_integer("max_tokens_limit", 4096, "largest max_tokens accepted")
    flags.DEFINE_integer("default_max_tokens", 256, "max_tokens of a request that does not set it")
    flags.DEFINE_integer(
        "max_model_len", None, "prompt + max_tokens limit (None: the model's context)"
    )
    flags.DEFINE_integer("max_stop_strings", 16, "most stop strings one request may give")
    flags.DEFINE_integer("max_queue_requests", 256, "waiting queue bound (requests)")
    flags.DEFINE_integer("max_queue_tokens", 2_000_000, "waiting queue bound (prompt + max_tokens)")
    flags.DEFINE_float(
        "queue_timeout_s", 60.0, "a request waiting longer than this is rejected (seconds)"
    )
    flags.DEFINE_float(
        "default_request_timeout_s",
        None,
        "deadline (seconds) of a call that brings none and whose tenant sets none "
        "(None: no deadline; serving/frontend/deadlines.py)",
    )
    flags.DEFINE_float(
        "aging_s", 10.0, "seconds of waiting that raise a request one priority class"
    )
    flags.DEFINE_integer("stream_buffer_messages", 256, "per-stream buffer before cancelling")
    flags.DEFINE_integer(
        "max_inflight", None, "requests in the engine at once (None: max_num_seqs)"
    )
    flags.DEFINE_integer("breaker_failures", 3, "consecutive failed steps that open the breaker")
    flags.DEFINE_float(
        "breaker_cooldown_s", 5.0, "seconds the open breaker waits before trying a step again"
    )
    flags.DEFINE_integer("max_workers", None, "gRPC handler threads (None: queue + inflight + 32)")
    # reliability (issue 17)
    flags.DEFINE_float("drain_timeout_s", 30.0, "SIGTERM: seconds admitted requests get to finish")
    flags.DEFINE_integer("max_request_bytes", 1 << 20, "largest request message accepted")
    flags.DEFINE_integer(
        "max_prompt_bytes", 262_144, "UTF-8 bytes of prompt text, checked before tokenizing"
    )
    flags.DEFINE_integer("max_tokens_ahead", 256, "slow consumer: tokens ahead of the transport")
    flags.DEFINE_float("stream_stall_timeout_s", 5.0, "slow consumer: one message unsent this long")
    flags.DEFINE_bool("capacity_probe", True, "measure step times at start-up for admission")
    flags.DEFINE_string(
        "trace_requests",
        None,
        "write a per-request timeline (parse, admit, queue, prefill, decode, deliver, and "
        "every engine step with its shape) to this Chrome/Perfetto trace JSON file (off: None)",
    )
    flags.DEFINE_bool(
        "engine_process",
        False,
        "run the engine in a child process of its own (its host work then does not hold "
        "the handlers' interpreter lock); False: on a thread of the server process",
    )


# flag -> (lowest allowed value, None allowed): every numeric server flag, checked at start.
_LOWER_BOUNDS = {
    "page_size": (1, False),
    "num_pages": (2, True),
    "kv_cache_gib": (0.001, False),
    "max_num_seqs": (1, False),
    "max_num_batched_tokens": (1, False),
    "prefill_chunk_size": (1, False),
    "mock_step_time_s": (0, False),
    "warmup_max_shapes": (0, False),
    "max_prompt_tokens": (1, False),
    "max_tokens_limit": (1, False),
    "default_max_tokens": (1, False),
    "max_model_len": (2, True),
    "max_stop_strings": (0, False),
    "max_queue_requests": (0, False),
    "max_queue_tokens": (1, False),
    "stream_buffer_messages": (1, False),
    "max_inflight": (1, True),
    "breaker_failures": (1, False),
    "breaker_cooldown_s": (0, False),
    "max_workers": (1, True),
    "host_kv_gib": (0, False),
}


def check_flags() -> None:
    """Every user mistake the server can see before loading a model (UsageError)."""
    shared.check_model(FLAGS.model, mock=True)
    for name, (low, none_ok) in _LOWER_BOUNDS.items():
        value = getattr(FLAGS, name)
        allowed = f">= {low}" + (" (or unset)" if none_ok else "")
        shared.require(
            name,
            value,
            (value is None and none_ok) or (value is not None and value >= low),
            allowed,
        )
    for name in ("queue_timeout_s", "aging_s"):
        shared.check_positive(name, getattr(FLAGS, name))
    shared.check_positive(
        "default_request_timeout_s", FLAGS.default_request_timeout_s, allow_none=True
    )
    shared.require(
        "default_max_tokens",
        FLAGS.default_max_tokens,
        FLAGS.default_max_tokens <= FLAGS.max_tokens_limit,
        f"<= --max_tokens_limit ({FLAGS.max_tokens_limit})",
    )
    shared.check_host("host", FLAGS.host)
    shared.check_port("port", FLAGS.port, FLAGS.host)
    shared.check_port("metrics_port", FLAGS.metrics_port, allow_none=True)
    shared.check_port("http_port", FLAGS.http_port, FLAGS.host)
    _check_file("tenants_config", FLAGS.tenants_config)
    loras = shared.parse_loras(FLAGS.lora, FLAGS.max_loras)  # LoRA: --lora=NAME=DIR
    if loras or FLAGS.max_loras:
        shared.require("lora", FLAGS.lora, FLAGS.model != "mock", "needs a real --model")
        # NOTE: the handlers resolve adapter names on the engine object in this process
        shared.require("lora", FLAGS.lora, not FLAGS.engine_process, "not with --engine_process")
    if FLAGS.model != "mock":
        shared.check_mesh(FLAGS.mesh)
    _check_role()  # disaggregation
    _check_kv_events()  # gateway
    if FLAGS.distributed_env:  # gateway: multi-host serving
        _check_multihost()
    shared.check_speculative(FLAGS.speculative, mock=FLAGS.model == "mock")
    if FLAGS.host_kv_gib > 0:
        shared.require(
            "host_kv_gib", FLAGS.host_kv_gib, FLAGS.prefix_caching, "needs --prefix_caching"
        )
        shared.require(
            "host_kv_gib", FLAGS.host_kv_gib, FLAGS.model != "mock", "needs a real --model"
        )
    for flag, default in (("quantization", "none"), ("kv_dtype", "float32")):
        value = getattr(FLAGS, flag)
        shared.require(
            flag,
            value,
            FLAGS.model != "mock" or value == default,
            f"the mock engine runs only {default!r} (drop the flag or pass a real --model)",
        )


def _check_role() -> None:
    """-- disaggregation: K/V moves between workers that are one in-process EngineCore each
    (engine/kv_transfer/transfer_engine.py wraps only that);
    refuse at start what every transfer would refuse."""
    if FLAGS.role == "both":
        return
    why = (
        "needs a real --model (the mock engine holds no K/V)"
        if FLAGS.model == "mock"
        else "not with --engine_process (K/V export/import runs beside the engine in this process)"
        if FLAGS.engine_process
        else "not with data replicas (--mesh=data:N): run one prefill/decode worker per replica"
        if FLAGS.mesh and _mesh_sizes(FLAGS.mesh)["data"] > 1
        else None
    )
    shared.require("role", FLAGS.role, why is None, why or "")


def _check_kv_events() -> None:
    """-- gateway: the events come from the page pool, which must be in this process."""
    for flag in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        value = getattr(FLAGS, flag)
        if value is None:
            continue
        shared.require(
            flag,
            value,
            value.startswith(("tcp://", "ipc://", "inproc://")),
            "a ZMQ address: tcp://HOST:PORT, tcp://*:PORT, ipc://PATH",
        )
        shared.require(flag, value, not FLAGS.engine_process, "not with --engine_process")
        shared.require(flag, value, FLAGS.prefix_caching, "needs --prefix_caching")


def _check_multihost() -> None:
    from serving.engine_host import multihost

    for flag, value, why in multihost.refusals(FLAGS):
        raise shared.UsageError(flag, value, why)


def _mesh_sizes(spec: str) -> dict:
    from engine.parallel.sharding import parse_mesh_spec

    return parse_mesh_spec(spec)


def _check_file(flag: str, path: str | None) -> None:
    if path is None:
        return
    shared.require(flag, path, os.path.isfile(path), "no such file")
    try:
        TenantRegistry.from_file(path)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise shared.UsageError(flag, path, f"not a valid tenants file: {e!r}") from None


def warmup_options() -> dict:
    return {
        "warmup_max_shapes": FLAGS.warmup_max_shapes,
        "warmup_execute": FLAGS.warmup_execute,
    }


def engine_options_from_flags() -> dict:
    return {
        "page_size": FLAGS.page_size,
        "num_pages": FLAGS.num_pages,
        "kv_cache_bytes": int(FLAGS.kv_cache_gib * 2**30),
        "max_num_seqs": FLAGS.max_num_seqs,
        "max_num_batched_tokens": FLAGS.max_num_batched_tokens,
        "prefill_chunk_size": FLAGS.prefill_chunk_size,
        "prefix_caching": FLAGS.prefix_caching,
        **({"host_kv_gib": FLAGS.host_kv_gib} if FLAGS.host_kv_gib else {}),
        "quantization": FLAGS.quantization,
        "kv_dtype": FLAGS.kv_dtype,
        "mesh": FLAGS.mesh,
        **({} if FLAGS.attention_impl == "auto" else {"impl": FLAGS.attention_impl}),
        "speculative": shared.check_speculative(FLAGS.speculative),  # None: off
        **lora_options_from_flags(),
        # shapes (#21.4): scan compiles each step program ~4x faster than unrolled layers
        **({} if FLAGS.layer_loop == "auto" else {"layer_loop": FLAGS.layer_loop}),
    }


def lora_options_from_flags() -> dict:
    """LoRA engine options and the adapters to load (--lora, --max_loras, --max_lora_rank);
    nothing when no adapter is served, so the plain engine is built exactly as before."""
    loras = shared.parse_loras(FLAGS.lora, FLAGS.max_loras)
    max_loras = len(loras) if FLAGS.max_loras is None else FLAGS.max_loras
    if not max_loras:
        return {}
    return {"max_loras": max_loras, "max_lora_rank": FLAGS.max_lora_rank, "lora": loras}


def config_from_flags(engine_config: dict) -> ServerConfig:
    admission = AdmissionConfig(
        max_prompt_tokens=FLAGS.max_prompt_tokens,
        max_tokens=FLAGS.max_tokens_limit,
        default_max_tokens=FLAGS.default_max_tokens,
        max_model_len=FLAGS.max_model_len or AdmissionConfig.max_model_len,
        max_stop_strings=FLAGS.max_stop_strings,
        max_queue_requests=FLAGS.max_queue_requests,
        max_queue_tokens=FLAGS.max_queue_tokens,
        queue_timeout_s=FLAGS.queue_timeout_s,
        aging_s=FLAGS.aging_s,
        max_prompt_bytes=FLAGS.max_prompt_bytes,
        default_request_timeout_s=FLAGS.default_request_timeout_s,
    )
    return ServerConfig(
        max_request_bytes=FLAGS.max_request_bytes,
        slow_consumer=SlowConsumerPolicy(FLAGS.max_tokens_ahead, FLAGS.stream_stall_timeout_s),
        capacity_probe=FLAGS.capacity_probe,
        admission=admission,
        stream_buffer_messages=FLAGS.stream_buffer_messages,
        max_inflight=FLAGS.max_inflight,
        breaker_failure_threshold=FLAGS.breaker_failures,
        breaker_cooldown_s=FLAGS.breaker_cooldown_s,
        max_workers=FLAGS.max_workers,
        allow_runtime_lora=FLAGS.allow_runtime_lora,
        tool_call_parser=FLAGS.tool_call_parser,
        reasoning_parser=FLAGS.reasoning_parser,
        metrics_compat=FLAGS.metrics_compat,
        kv_events_endpoint=FLAGS.kv_events_endpoint,
        kv_events_topic=FLAGS.kv_events_topic,
        kv_events_replay_endpoint=FLAGS.kv_events_replay_endpoint,
        host=FLAGS.host,
        port=FLAGS.port,
        metrics_port=None if FLAGS.metrics_port < 0 else FLAGS.metrics_port,
        http_port=FLAGS.http_port or None,
        engine_config={"model": FLAGS.model, **engine_config},
        role=FLAGS.role,
        kv_transport=FLAGS.kv_transport,
        kv_jax_checksum=FLAGS.kv_jax_checksum,
        trace_requests=FLAGS.trace_requests,
    )


def _setup_request_log(path: str | None) -> None:
    """One bare JSON object per line (no log prefix), so the lines parse as JSON."""
    handler = logging.FileHandler(path) if path else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    request_log = logging.getLogger("pagedjax.requests")
    request_log.addHandler(handler)
    request_log.setLevel(logging.INFO)
    request_log.propagate = False


def main(argv) -> None:
    if len(argv) > 1:
        raise shared.UsageError("", " ".join(argv[1:]), "the server takes no arguments, only flags")
    shared.setup_logging(FLAGS.log_level)
    from serving.engine_host import multihost

    if FLAGS.distributed_env:  # gateway: before check_flags counts the (global) devices
        _check_multihost()
        try:
            multihost.initialize(FLAGS.distributed_env)
        except ValueError as e:  # a launcher variable missing or malformed
            raise shared.UsageError("distributed_env", FLAGS.distributed_env, str(e)) from None
    check_flags()
    _setup_request_log(FLAGS.request_log)
    cache_dir = None  # the compilation cache in use; the capacity calibration goes beside it
    if FLAGS.model != "mock":
        from engine.runner.compilation_cache import enable as enable_compilation_cache

        try:
            cache_dir = enable_compilation_cache(FLAGS.compilation_cache_dir)  # before compiling
        except OSError as e:  # e.g. a file, or a link to a missing directory, in its place
            raise shared.UsageError(
                "compilation_cache_dir",
                FLAGS.compilation_cache_dir,
                f"cannot be used as a directory ({e.strerror}: {e.filename})",
            ) from None
    elif FLAGS.compilation_cache_dir not in (None, "", "none"):  # the mock: calibration only
        cache_dir = FLAGS.compilation_cache_dir
    options = engine_options_from_flags()
    # Warm-up runs on the engine thread once the server listens (/ready says when it ended).
    build_kwargs = dict(mock_step_time_s=FLAGS.mock_step_time_s, max_model_len=FLAGS.max_model_len)
    engine, warmup = build_serving_engine(
        FLAGS.model,
        {**options, **warmup_options()},
        in_process=not FLAGS.engine_process,
        compilation_cache_dir=FLAGS.compilation_cache_dir,
        **build_kwargs,
    )
    if FLAGS.distributed_env and multihost.is_follower():
        multihost.follow(engine)  # gateway: process != 0 runs the leader's steps, serves nothing
        return
    engine = kv_transfer_service.wrap_engine(engine)  # disaggregation: KV export/import
    warmup = kv_transfer_service.with_transfer_warmup(
        engine, warmup, FLAGS.role, FLAGS.kv_transport
    )
    try:
        config = config_from_flags(options)
        if cache_dir is not None:
            config = dataclasses.replace(config, capacity_calibration_dir=cache_dir)
        server = PagedJaxServer(
            engine,
            config,
            TenantRegistry.from_file(FLAGS.tenants_config),
            warmup=warmup,
        )
    except PortInUseError as e:
        log.error("%s", e)
        close_engine(engine)
        sys.exit(2)

    def rebuild():
        engine, warm = build_serving_engine(
            FLAGS.model,
            {**options, **warmup_options()},
            in_process=not FLAGS.engine_process,
            compilation_cache_dir=FLAGS.compilation_cache_dir,
            **build_kwargs,
        )
        engine = kv_transfer_service.wrap_engine(engine)  # disaggregation: KV export/import
        warm = kv_transfer_service.with_transfer_warmup(
            engine, warm, FLAGS.role, FLAGS.kv_transport
        )
        if warm is not None:
            warm()
        return engine

    # NOTE: multi-host: no SIGHUP reload (a new engine would be built on process 0 only)
    reload = None if FLAGS.distributed_env else rebuild
    stopped = install_signal_handlers(server, FLAGS.drain_timeout_s, build_engine=reload)
    server.on_fatal = stopped.set
    server.start()
    print(f"serving on {server.port} (metrics port {server.metrics_port})", flush=True)
    if server.http_port is not None:
        print(f"http on {server.http_port}", flush=True)
    stopped.wait()  # SIGTERM / SIGINT: drained and stopped (serving/frontend/shutdown.py)
    if server.fatal_error is not None:  # a server that can never become ready exits loudly
        server.stop(grace_s=0.0)
        print(f"error: {server.fatal_error}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FATAL)
    log.info("server stopped")


def run() -> None:
    define_flags()
    app.run(shared.main_guard(main), flags_parser=shared.parse_flags)


if __name__ == "__main__":
    run()
