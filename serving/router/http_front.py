"""The router's HTTP front: the server's OpenAI-compatible API over the routed workers.

    python -m serving.router.server --workers=... --port=50051 --http_port=8000 --tokenizer=tiny

No second HTTP implementation: a PagedJaxServer is built over a RoutedEngine
(serving/router/routed_engine.py) and its HttpApi (serving/http/api.py) is served on the router's
host and `--http_port`, so parsing, SSE, delivery accounting, disconnects, tenants,
admission and metrics are the worker's code. The server's own gRPC port is bound to
loopback only and is not advertised (the router's gRPC front is serving/router/server.py).

Start-up, after the worker pool's first round of checks:
    identity   the cluster's reference versions (the first worker seen, or --revision):
               name, revision, tokenizer and chat-template hashes, KV dtype
    tokenizer  `--tokenizer` (a preset: tiny, smollm2-135m; a .gguf; a Hugging Face
               directory) must hash to the cluster's tokenizer_hash and chat_template_hash,
               else RouterHttpError naming the field: the router tokenizes HTTP prompts
    limits     a worker's ServerInfo limits become the router's admission limits (prompt
               and max_tokens bounds, default max_tokens, max_model_len, stop strings), so
               a request the workers would refuse is refused at the router with the same
               error

Tenants: HTTP clients are authenticated and budgeted at the router (`--tenants_config`, the
workers' file format: serving/frontend/tenants.py); the router calls the workers with its own key
(`--worker_api_key_file`), a tenant of the workers' configuration meant for it. (API keys
are stored as digests, so a client's key cannot be recovered to forward; the gRPC front
forwards the client's x-api-key as it is.)
"""

from __future__ import annotations

import os
import time

import grpc

from serving.flags import UsageError
from serving.frontend.admission import AdmissionConfig
from serving.proto import pagedjax_pb2 as pb
from serving.router.client import RouterClient
from serving.router.routed_engine import RoutedEngine
from serving.router.workers import WorkerPool


class RouterHttpError(UsageError):
    """The router cannot serve HTTP for this cluster: the flag, its value, what it needs."""


def load_tokenizer(spec: str):
    """A preset name (tiny, smollm2-135m), a .gguf file or a Hugging Face directory."""
    if spec == "tiny":
        from models.registry import tiny_tokenizer

        return tiny_tokenizer()
    if spec == "smollm2-135m" or spec.endswith(".gguf"):
        from models.loaders.gguf_loader import open_gguf
        from models.loaders.gguf_tokenizer import tokenizer_from_gguf
        from models.registry import smollm2_gguf_path

        path = smollm2_gguf_path() if spec == "smollm2-135m" else spec
        return tokenizer_from_gguf(open_gguf(path))
    if os.path.isdir(spec):
        from models.tokenizer import Tokenizer

        return Tokenizer.from_hf_dir(spec)
    raise RouterHttpError(
        "tokenizer", spec, "tiny, smollm2-135m, a .gguf file or a Hugging Face directory"
    )


def read_key(flag: str, path: str | None) -> str | None:
    """The first line of `path` (None: no file given)."""
    if path is None:
        return None
    try:
        with open(path) as f:
            key = f.readline().strip()
    except OSError as e:
        raise RouterHttpError(flag, path, f"a readable file ({e.strerror})") from None
    if not key:
        raise RouterHttpError(flag, path, "a file whose first line is the key")
    return key


def wait_for_reference(pool: WorkerPool, timeout_s: float) -> dict:
    """The cluster's reference versions, once a worker answered (or RouterHttpError)."""
    end = time.monotonic() + timeout_s
    while pool.reference is None or set(pool.reference) == {"revision"}:
        if time.monotonic() > end:
            raise RouterHttpError(
                "workers", ",".join(pool.specs), f"one answering within {timeout_s}s (for HTTP)"
            )
        time.sleep(min(pool.interval_s, 0.2))
        pool.check_all()
    return dict(pool.reference)


def cluster_identity(reference: dict, tokenizer):
    """The identity the router's HTTP responses name; the tokenizer must be the cluster's."""
    from models.identity import ModelIdentity, engine_version

    mine = {
        "tokenizer_hash": tokenizer.sha256,
        "chat_template_hash": tokenizer.chat_template_sha256 or "",
    }
    for field, value in mine.items():
        if value != reference[field]:
            raise RouterHttpError(
                "tokenizer", f"<{field} {value[:19]}>", f"the workers' {reference[field][:19]}"
            )
    return ModelIdentity(
        name=reference["name"],
        revision=reference["revision"],
        engine_version=engine_version(),
        kv_dtype=reference.get("kv_dtype") or "float32",
        **mine,
    )


def cluster_admission(
    pool: WorkerPool, metadata: tuple | None = None, timeout_s: float = 5.0
) -> AdmissionConfig:
    """The router's admission limits: a routable worker's, as its ServerInfo reports them."""
    for role in ("both", "decode", "prefill"):
        for address in pool.routable(role):
            try:
                info = pool.workers[address].generate.ServerInfo(
                    pb.ServerInfoRequest(), timeout=timeout_s, metadata=metadata
                )
            except grpc.RpcError as e:
                raise RouterHttpError(
                    "worker_api_key_file", "<its key>", f"one {address} accepts ({e.code().name})"
                ) from None
            lim = info.limits
            return AdmissionConfig(
                max_prompt_tokens=int(lim.max_prompt_tokens),
                max_tokens=int(lim.max_tokens),
                default_max_tokens=int(lim.default_max_tokens),
                max_model_len=int(lim.max_model_len),
                max_stop_strings=int(lim.max_stop_strings),
            )
    raise RouterHttpError("workers", ",".join(pool.specs), "a routable one (admission limits)")


class RouterHttp:
    """The HTTP API of the router process (start after the worker pool)."""

    def __init__(
        self,
        client: RouterClient,
        tokenizer,
        *,
        host: str,
        port: int,
        max_inflight: int = 256,
        start_timeout_s: float = 60.0,
        tenants=None,
        worker_api_key: str | None = None,
    ):
        """`tenants` (serving.frontend.tenants.TenantRegistry; None: open) authenticate HTTP
        clients;
        `worker_api_key` is presented to the workers."""
        from serving.http.api import HttpApi
        from serving.http.server import HttpServer
        from serving.server import PagedJaxServer, ServerConfig

        metadata = (("x-api-key", worker_api_key),) if worker_api_key else None
        reference = wait_for_reference(client.pool, start_timeout_s)
        admission = cluster_admission(client.pool, metadata)
        stats = {"max_model_len": admission.max_model_len, "max_num_seqs": max_inflight}
        identity = cluster_identity(reference, tokenizer)
        self.engine = RoutedEngine(client, tokenizer, identity, stats, metadata=metadata)
        config = ServerConfig(
            admission=admission,
            host="127.0.0.1",  # the inner gRPC port: loopback, not advertised
            port=0,
            capacity_probe=False,
            max_inflight=max_inflight,
        )
        self.server = PagedJaxServer(self.engine, config, tenants)
        self.api = HttpApi(self.server.generator, self.server.metrics)
        self._http = HttpServer(self.api.app, host, port)
        self.port = self._http.port

    def start(self) -> RouterHttp:
        self.server.start()
        self._http.start()
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        self.server.generator.draining = True
        self._http.stop(grace_s + 5.0)
        self.engine.close()
        self.server.stop(grace_s)
