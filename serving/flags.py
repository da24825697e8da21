"""One vocabulary of command-line flags for every pagedjax command, and the checks that run on
them before anything slow (a model load, a warm-up, a load run) starts.

    pagedjax (serving.cli) | pagedjax-server | pagedjax-client | serving.capacity.loadgen | planner

A flag that means the same thing is defined here once (name, default, help) and every command
that needs it calls the same `define_*` function; WORKSPACE.md has the table. A user mistake
(a flag value out of range, a missing or wrong-type model file, a port in use, a server that
does not answer) is a `UsageError`: `main_guard` prints it as ONE line naming the flag, the
value and what is allowed, and exits 2. Anything else is a bug and keeps its traceback.

    flags.register(...); app.run(main_guard(main), flags_parser=parse_flags)
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import socket
import sys

from absl import flags

FLAGS = flags.FLAGS
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_TARGET = "127.0.0.1:50051"
LOG_LEVELS = ("debug", "info", "warning", "error")
EXIT_USAGE = 2


class UsageError(ValueError):
    """A user mistake: one line, exit 2."""

    def __init__(self, flag: str, value, allowed: str):
        self.flag, self.value, self.allowed = flag, value, allowed
        if re.match(r"[<>=]|-?\d", allowed):  # a bare limit such as ">= 1" or "0 <= x <= 1"
            allowed = f"must be {allowed}"
        super().__init__(f"--{flag}={value}: {allowed}" if flag else allowed)


def require(flag: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise UsageError(flag, value, allowed)


# ---- definitions (each command defines only what it uses) -----------------------------------
def _define_once(define, name: str, *args, **kwargs) -> None:
    if name not in FLAGS:
        define(name, *args, **kwargs)


def define_model(default: str = DEFAULT_MODEL, mock: bool = False) -> None:
    extra = ", or 'mock' (the MockEngine, no JAX)" if mock else ""
    _define_once(
        flags.DEFINE_string,
        "model",
        default,
        "model preset (smollm2-135m, gemma3-270m, tiny), a .gguf file or a Hugging Face "
        f"directory{extra}",
    )


def define_prompt() -> None:
    _define_once(flags.DEFINE_string, "prompt", "What is the capital of France?", "the prompt")
    _define_once(
        flags.DEFINE_string, "system", None, "system message (chat mode; ignored with --raw)"
    )
    _define_once(
        flags.DEFINE_bool,
        "raw",
        False,
        "send the prompt text as is; default: one user chat message with the model's template",
    )


def define_sampling() -> None:
    _define_once(flags.DEFINE_integer, "max_tokens", 64, "maximum new tokens (>= 1)")
    define_temperature()
    _define_once(flags.DEFINE_float, "top_p", 1.0, "nucleus sampling (0 < x <= 1; 1 = off)")
    _define_once(flags.DEFINE_integer, "top_k", 0, "top-k sampling (0 or -1 = off)")
    _define_once(flags.DEFINE_integer, "seed", None, "sampling seed (default: random)")


def define_temperature() -> None:
    _define_once(flags.DEFINE_float, "temperature", 0.0, "sampling temperature; 0 = greedy")


def define_target() -> None:
    _define_once(flags.DEFINE_string, "target", DEFAULT_TARGET, "server gRPC address HOST:PORT")
    _define_once(
        flags.DEFINE_string, "api_key", None, "API key sent as x-api-key (server --tenants_config)"
    )
    _define_once(
        flags.DEFINE_float,
        "request_timeout_s",
        None,
        "deadline of one request in seconds (default: none)",
    )


def define_quantization() -> None:
    """--quantization (weights) and --kv_dtype (KV cache); configs/quant_config.py."""
    from configs.kv_memory import DTYPE_BYTES
    from configs.quant_config import SCHEMES

    _define_once(
        flags.DEFINE_enum,
        "quantization",
        "none",
        list(SCHEMES),
        "weights: none, int8 (weight-only, per output channel) or w8a8 (int8 activations too)",
    )
    _define_once(
        flags.DEFINE_enum, "kv_dtype", "float32", sorted(DTYPE_BYTES), "KV cache element type"
    )


def define_speculative() -> None:
    """--speculative (configs/spec_config.py): off, "ngram", "ngram:k=4,disable_by_batch_size=8"
    or a JSON object of SpeculativeConfig fields."""
    _define_once(
        flags.DEFINE_string,
        "speculative",
        "off",
        "speculative decoding: off, ngram, ngram:k=4,prompt_lookup_max=4,"
        "disable_by_batch_size=8, layers:k=4,layers=8 (the first 8 layers draft), "
        "draft:k=4,model=NAME (a draft model with the same tokenizer) (or a JSON object)",
    )


def check_speculative(value: str, mock: bool = False):
    """The SpeculativeConfig of --speculative (None: off); a UsageError names the flag."""
    from configs.spec_config import SpeculativeConfig

    try:
        config = SpeculativeConfig.of(value)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise UsageError("speculative", value, str(e)) from None
    require("speculative", value, not (mock and config), "the mock engine does not speculate")
    return config


def define_lora() -> None:
    """--lora=name=path (repeatable), --max_loras, --max_lora_rank (engine/lora/adapters.py)."""
    _define_once(
        flags.DEFINE_multi_string,
        "lora",
        [],
        "a PEFT LoRA adapter to serve, NAME=DIR (repeatable); requests name it in the gRPC "
        "`adapter` field or the HTTP `model` field",
    )
    _define_once(
        flags.DEFINE_integer,
        "max_loras",
        None,
        "adapter slots on the device (None: as many as --lora gives; 0: no LoRA)",
    )
    _define_once(flags.DEFINE_integer, "max_lora_rank", 16, "largest adapter rank served")
    _define_once(
        flags.DEFINE_bool,
        "allow_runtime_lora",
        False,
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (reads server paths)",
    )


def parse_loras(values: list[str], max_loras: int | None) -> dict[str, str]:
    """--lora values -> {name: directory}; UsageError for a malformed, duplicate or missing
    entry, or more adapters than --max_loras slots."""
    out: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        require("lora", value, bool(sep and name and path), "NAME=DIR (a PEFT adapter directory)")
        require("lora", value, name not in out, f"adapter name {name!r} given twice")
        require("lora", value, os.path.isdir(path), f"no such directory {path!r}")
        out[name] = path
    if max_loras is not None:
        require("max_loras", max_loras, max_loras >= len(out), f">= {len(out)} (the --lora count)")
    return out


def define_log_level(default: str = "warning") -> None:
    _define_once(
        flags.DEFINE_enum,
        "log_level",
        default,
        list(LOG_LEVELS),
        "log level of pagedjax, JAX and Orbax messages (progress lines are always printed)",
    )


def setup_logging(level: str) -> None:
    """Python and absl logging at `level` (absl carries Orbax's INFO chatter)."""
    from absl import logging as absl_logging

    numeric = getattr(logging, level.upper())
    logging.basicConfig(
        level=numeric, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger().setLevel(numeric)
    absl_logging.set_verbosity(level)


def progress(message: str) -> None:
    """A progress line for a person watching (stderr, always shown, whatever --log_level)."""
    print(message, file=sys.stderr, flush=True)


# ---- checks ---------------------------------------------------------------------------------
def check_model(model: str, mock: bool = False) -> None:
    """A preset, an existing GGUF file (by its magic bytes) or HF directory; no JAX import."""
    from models.errors import ModelLoadError
    from models.source import check_model_source

    if mock and model == "mock":
        return
    try:
        check_model_source(model)
    except ModelLoadError as e:
        raise UsageError("", model, str(e).replace("model=", "--model=", 1)) from None


def check_mesh(spec: str | None) -> None:
    """A mesh spec the engine can parse, with enough devices for it (imports JAX)."""
    if spec is None:
        return
    import jax

    from engine.parallel.sharding import ShardingConfigError, mesh_devices, parse_mesh_spec

    try:
        sizes = parse_mesh_spec(spec)
    except ShardingConfigError as e:
        raise UsageError("", spec, str(e).replace("mesh=", "--mesh=", 1)) from None
    need, have = mesh_devices(sizes), len(jax.devices())
    require("mesh", spec, need <= have, f"needs {need} devices, {have} available")


def check_sampling(**fields) -> None:
    """The SamplingParams limits, reported against the flag names."""
    from engine.errors import InvalidRequestError
    from engine.sampling.params import SamplingParams

    try:
        SamplingParams(**fields)
    except InvalidRequestError as e:
        raise UsageError(e.field, e.value, e.limit) from None


def check_port(flag: str, port: int, host: str = "", *, allow_none: bool = False) -> None:
    """In range, and free on `host` now (0 = ephemeral; -1 = none when allow_none)."""
    low = -1 if allow_none else 0
    require(
        flag,
        port,
        low <= port <= 65535,
        f"{low} <= port <= 65535"
        + (" (-1: none, 0: any free port)" if allow_none else " (0: any free port)"),
    )
    if port <= 0:
        return
    bind_host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((bind_host, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UsageError(
                flag,
                port,
                "port already in use by another process; pick a free one"
                + (" or -1 for none" if allow_none else ""),
            ) from None
        if e.errno == errno.EACCES:
            raise UsageError(flag, port, "permission denied (ports below 1024 need root)") from None
        # anything else (no IPv6, an address not on this machine): the real bind decides


def check_host(flag: str, host: str) -> None:
    """An address this machine can bind: an IP ('0.0.0.0', '[::]') or a name that resolves."""
    try:
        socket.getaddrinfo(host.strip("[]"), None)
    except (socket.gaierror, UnicodeError):
        raise UsageError(
            flag, host, "cannot resolve; use an address like 0.0.0.0, [::] or 127.0.0.1"
        ) from None


def check_target(flag: str, target: str) -> None:
    host, sep, port = target.rpartition(":")
    require(
        flag,
        target,
        bool(sep and host and port.isdigit() and 0 < int(port) <= 65535),
        "expected HOST:PORT, e.g. 127.0.0.1:50051",
    )


def check_positive(flag: str, value, *, allow_zero: bool = False, allow_none=False) -> None:
    if value is None and allow_none:
        return
    ok = value is not None and (value >= 0 if allow_zero else value > 0)
    require(flag, value, ok, ">= 0" if allow_zero else "> 0")


def check_fraction(flag: str, value, *, low_open: bool = False) -> None:
    ok = (0 < value <= 1) if low_open else (0 <= value <= 1)
    require(flag, value, ok, "0 < x <= 1" if low_open else "0 <= x <= 1")


def wait_for_server(target: str, timeout_s: float = 5.0) -> None:
    """The gRPC health check answers SERVING, else UsageError naming --target."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.FutureTimeoutError:
            raise UsageError(
                "target",
                target,
                f"no server answers there (nothing reachable within {timeout_s:g} s; is "
                "`python -m serving.server` running on that port?)",
            ) from None
        except grpc.RpcError as e:
            raise UsageError("target", target, f"health check failed: {e.code().name}") from None
    if status.status != health_pb2.HealthCheckResponse.SERVING:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
        raise UsageError("target", target, f"server is not serving (health: {name})")


def wait_for_http_server(target: str, timeout_s: float = 5.0) -> None:
    """GET http://TARGET/health answers 200, else UsageError naming --target."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{target}/health", timeout=timeout_s) as resp:
            status = resp.status
    except urllib.error.HTTPError as e:
        status = e.code
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise UsageError(
            "target",
            target,
            f"no HTTP server answers there ({reason}; is `python -m serving.server "
            "--http_port=...` running on that port?)",
        ) from None
    require("target", target, status == 200, f"HTTP health check returned status {status}")


# ---- running a command ----------------------------------------------------------------------
def parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with its errors (unknown flag, bad number) as one line and exit 2."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def main_guard(main):
    """Wraps an absl main: UsageError and ModelLoadError -> one line on stderr, exit 2."""
    from models.errors import ModelLoadError

    @functools.wraps(main)
    def guarded(argv):
        try:
            return main(argv)
        except (UsageError, ModelLoadError) as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE

    return guarded
