"""One load run end to end: conditions from ServerInfo, requests, scraping, report.

RunConfig --> specs (workload mix + arrival schedule, or a trace)
          --> asyncio loop: open- or closed-loop dispatch over one grpc.aio channel
              (protocol "grpc", driver.py) or one httpx.AsyncClient streaming the
              OpenAI-compatible API (protocol "http", http_driver.py)
          --> records + scraped server metrics --> build_report --> write_report
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import pathlib
import socket
import time

import grpc
import httpx
from google.protobuf.json_format import MessageToDict
from tqdm import tqdm

from serving.capacity.loadgen import arrivals, driver, http_driver, report, trace
from serving.capacity.loadgen.metrics import SloPolicy
from serving.capacity.loadgen.scrape import Scraper, summarize_scrape
from serving.capacity.loadgen.workloads import Corpus, WorkloadGenerator, mix_to_dict, parse_mix
from serving.proto import pagedjax_pb2 as pb
from serving.proto import pagedjax_pb2_grpc as pb_grpc

PROTOCOLS = ("grpc", "http")


@dataclasses.dataclass
class RunConfig:
    target: str = "127.0.0.1:50051"  # gRPC HOST:PORT, or the HTTP API's HOST:PORT
    protocol: str = "grpc"  # or "http": the OpenAI-compatible API (POST /v1/completions)
    metrics_url: str | None = None  # e.g. http://127.0.0.1:9090/metrics; None: no scraping
    workload: str = (
        "short_qa:0.5,long_context:0.2,long_generation:0.1,shared_prefix:0.1,multi_tenant:0.1"
    )
    length_scale: float = 1.0
    arrival: arrivals.ArrivalConfig = dataclasses.field(default_factory=arrivals.ArrivalConfig)
    trace_path: str | None = None
    trace_speedup: float = 1.0
    duration_s: float = 60.0
    max_requests: int = 1000
    cancel_fraction: float = 0.0
    request_timeout_s: float | None = 120.0
    drain_timeout_s: float = 60.0
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    slo: SloPolicy = dataclasses.field(default_factory=SloPolicy)
    cost: report.CostConfig = dataclasses.field(default_factory=report.CostConfig)
    warm_window_s: float = 60.0
    scrape_interval_s: float = 0.5
    save_trace: str | None = None
    api_keys: dict[str, str] = dataclasses.field(default_factory=dict)  # tenant -> x-api-key
    progress: bool = True
    plots: bool = True
    calibrate_prompts: bool = True  # measure tokens/word with the server's Tokenize first


def check_loopback(target: str) -> None:
    """The load generator only drives a server on this machine."""
    host = target.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise ValueError(f"target={target!r}: cannot resolve {host!r}: {e}") from e
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ValueError(f"target={target!r}: only loopback addresses are allowed, got {addrs}")


def server_conditions(target: str) -> dict:
    """Model, revision, engine config and limits from ServerInfo (empty dict if unavailable)."""
    with grpc.insecure_channel(target) as channel:
        try:
            info = pb_grpc.PagedJaxStub(channel).ServerInfo(pb.ServerInfoRequest(), timeout=10)
        except grpc.RpcError as e:
            return {"server_info_error": f"{e.code().name}: {e.details()}"}
    d = MessageToDict(info, preserving_proto_field_name=True)
    versions = d.get("model", {}).get("versions", {})
    return {
        "model": versions.get("name"),
        "revision": versions.get("revision"),
        "tokenizer_hash": versions.get("tokenizer_hash"),
        "engine_version": versions.get("engine_version"),
        "kv_capacity_tokens": d.get("kv_capacity_tokens"),
        "limits": d.get("limits", {}),
        "engine_config": d.get("engine_config", {}),
        "stats_at_start": d.get("stats", {}),
    }


def measure_tokens_per_word(target: str, corpus: Corpus, num_words: int = 2000) -> float | None:
    """The server tokenizer's tokens per corpus word (None if Tokenize is unavailable)."""
    text = " ".join(corpus.words[:num_words])
    with grpc.insecure_channel(target) as channel:
        try:
            resp = pb_grpc.PagedJaxStub(channel).Tokenize(pb.TokenizeRequest(text=text), timeout=30)
        except grpc.RpcError:
            return None
    return len(resp.token_ids) / len(text.split()) if resp.token_ids else None


def make_specs(cfg: RunConfig, corpus: Corpus):
    """(open-loop specs or None, generator for closed loop, workload description)."""
    if cfg.trace_path:
        entries = trace.load_trace(cfg.trace_path)[: cfg.max_requests]
        specs = trace.specs_from_trace(entries, cfg.trace_speedup, cfg.seed, corpus)
        return (
            specs,
            None,
            {"trace": cfg.trace_path, "speedup": cfg.trace_speedup, "entries": len(entries)},
        )
    gen = WorkloadGenerator(
        parse_mix(cfg.workload),
        corpus,
        length_scale=cfg.length_scale,
        cancel_fraction=cfg.cancel_fraction,
        seed=cfg.seed,
    )
    mix = mix_to_dict(gen.mix, cfg.length_scale)
    times = arrivals.schedule(cfg.arrival, cfg.duration_s, cfg.max_requests)
    if times is None:
        return None, gen, mix
    return [gen.next(t) for t in times], None, mix


def _connect(cfg: RunConfig):
    """An async context manager giving the send(spec, scheduled_s) coroutine function."""

    @contextlib.asynccontextmanager
    async def connection():
        options = dict(
            ignore_eos=cfg.ignore_eos,
            temperature=cfg.temperature,
            seed=cfg.seed,
            timeout_s=cfg.request_timeout_s,
            api_keys=cfg.api_keys,
        )
        if cfg.protocol == "http":
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            async with httpx.AsyncClient(
                base_url=http_driver.base_url(cfg.target), limits=limits, timeout=None
            ) as client:
                yield lambda spec, t: http_driver.run_one_http(
                    client, spec, scheduled_s=t, **options
                )
            return
        async with grpc.aio.insecure_channel(cfg.target) as channel:
            stub = pb_grpc.PagedJaxStub(channel)
            yield lambda spec, t: driver.run_one(stub, spec, scheduled_s=t, **options)

    return connection()


async def _drive(cfg: RunConfig, specs, gen, bar, sent: list) -> list:
    async with _connect(cfg) as send:

        def next_spec():
            sent.append(gen.next())
            return sent[-1]

        on_done = lambda rec: bar.update(1)
        if specs is not None:
            return await driver.dispatch_open_loop(
                specs,
                send,
                start_s=time.perf_counter(),
                duration_s=cfg.duration_s,
                drain_timeout_s=cfg.drain_timeout_s,
                on_done=on_done,
            )
        return await driver.dispatch_closed_loop(
            next_spec,
            send,
            concurrency=cfg.arrival.concurrency,
            duration_s=cfg.duration_s,
            max_requests=cfg.max_requests,
            drain_timeout_s=cfg.drain_timeout_s,
            on_done=on_done,
        )


def _conditions(cfg: RunConfig) -> dict:
    if cfg.protocol == "http":
        return http_driver.server_conditions(cfg.target)
    return server_conditions(cfg.target)


def run_load(cfg: RunConfig, out_dir: str | pathlib.Path) -> dict:
    """Runs the load, writes the report into `out_dir`, returns the report dict."""
    if cfg.protocol not in PROTOCOLS:
        raise ValueError(f"protocol={cfg.protocol!r} is invalid: one of {PROTOCOLS}")
    check_loopback(cfg.target)
    conditions = _conditions(cfg)
    corpus = Corpus()
    if cfg.calibrate_prompts:
        measured = (
            http_driver.measure_tokens_per_word(cfg.target, " ".join(corpus.words[:2000]))
            if cfg.protocol == "http"
            else measure_tokens_per_word(cfg.target, corpus)
        )
        corpus.tokens_per_word = measured or corpus.tokens_per_word
    specs, gen, workload = make_specs(cfg, corpus)
    scraper = Scraper(cfg.metrics_url, cfg.scrape_interval_s).start() if cfg.metrics_url else None
    total = len(specs) if specs is not None else cfg.max_requests
    with tqdm(total=total, desc="requests", unit="req", disable=not cfg.progress) as bar:
        t_start = time.perf_counter()
        sent = list(specs or [])  # closed loop: filled as requests are drawn
        records = asyncio.run(_drive(cfg, specs, gen, bar, sent))
    if scraper:
        scraper.stop()
    conditions.update(
        {
            "target": cfg.target,
            "protocol": cfg.protocol,
            "workload_mix": workload,
            "arrival": arrivals.to_dict(cfg.arrival) if not cfg.trace_path else {"kind": "trace"},
            "duration_s": cfg.duration_s,
            "max_requests": cfg.max_requests,
            "cancel_fraction": cfg.cancel_fraction,
            "request_timeout_s": cfg.request_timeout_s,
            "prompt_tokens_per_word": corpus.tokens_per_word,
            "sampling": {
                "temperature": cfg.temperature,
                "ignore_eos": cfg.ignore_eos,
                "seed": cfg.seed,
                "max_tokens": "sampled output length per request",
            },
            "concurrency": (
                cfg.arrival.concurrency if cfg.arrival.kind == "closed" else "open loop (unbounded)"
            ),
            "server_info_at_end": _conditions(cfg).get("stats_at_start", {}),
        }
    )
    scrape = summarize_scrape(scraper.series, t_start) if scraper else {}
    if scraper:
        scrape["scrape_errors"] = scraper.errors
    rep = report.build_report(
        records,
        conditions=conditions,
        policy=cfg.slo,
        cost=cfg.cost,
        scrape=scrape,
        warm_window_s=cfg.warm_window_s,
    )
    report.write_report(out_dir, rep, records, plots=cfg.plots)
    if cfg.save_trace:
        by_id = {s.request_id: s for s in sent}
        entries = [
            trace.entry_from_spec(by_id[r.request_id], r.send_s - t_start)
            for r in records
            if r.request_id in by_id
        ]
        trace.save_trace(cfg.save_trace, sorted(entries, key=lambda e: e.arrival_s))
    return rep
