"""The burst of issue 17, measured by a real gRPC client in another process.

`python -m serving.server` runs as a subprocess; this process fires N concurrent chat calls
(grpc.aio, spread over a few channels) with a deadline each, twice: cold (the first burst
after start-up) and warm (after the first drained). Reported per burst: outcome counts by
status code and the client-side latency of the rejections (RESOURCE_EXHAUSTED / UNAVAILABLE):
the time from sending the call to receiving the refusal. The burst client is one busy
process (300 streams), so its latencies include its own queueing; a second, light client
process (`shed_probe`) sends sequential calls during the burst that must be shed, and its
latencies are the server's shedding speed as a real client sees it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.client import build_request
from serving.proto import pagedjax_pb2 as pb
from serving.proto import pagedjax_pb2_grpc as pb_grpc

SHED_CODES = ("RESOURCE_EXHAUSTED", "UNAVAILABLE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, extra_args: list[str], log_path: str, timeout_s: float = 1800):
    """Starts `python -m serving.server`; returns (process, port) once it serves."""
    port = free_port()
    args = [sys.executable, "-m", "serving.server", f"--model={model}", "--host=127.0.0.1",
            f"--port={port}", "--metrics_port=-1", *extra_args]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 - the process writes it until it exits
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if line.startswith("serving on"):  # "serving on PORT (metrics port ...)"
            wait_ready(port, end - time.monotonic())
            return proc, port
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
    proc.kill()
    raise TimeoutError(f"server did not start within {timeout_s}s; see {log_path}")


def wait_ready(port: int, timeout_s: float) -> None:
    """Until gRPC health says SERVING: warm-up (compiling the step shapes) runs after the
    server listens, and a burst before it ends would only measure `warming_up` refusals."""
    end = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"server on port {port} not SERVING within {timeout_s:.0f}s")


async def chat_call(stub, i: int, max_tokens: int, deadline_s: float, tag: str) -> dict:
    req = build_request(
        messages=[{"role": "user", "content": f"Write a short note about topic number {i}."}],
        max_tokens=max_tokens,
        request_id=f"{tag}-{i}",
        temperature=0.0,
    )
    start = time.perf_counter()
    code, first_s, tokens, retry_ms = "OK", None, 0, None
    try:
        async for msg in stub.Generate(req, timeout=deadline_s):
            if first_s is None:
                first_s = time.perf_counter() - start
            tokens += len(msg.token_ids)
    except grpc.aio.AioRpcError as e:
        code = e.code().name
        for key, value in e.trailing_metadata() or ():
            if key == "retry-after-ms":
                retry_ms = int(value)
    return {"code": code, "e2e_s": time.perf_counter() - start, "ttft_s": first_s,
            "tokens": tokens, "retry_after_ms": retry_ms}  # fmt: skip


async def _retry_after_hint(stub, i, r, max_tokens, deadline_s):
    await asyncio.sleep(r["retry_after_ms"] / 1e3)
    return await chat_call(stub, i, max_tokens, deadline_s, "retry")


async def burst_and_retry(port: int, n: int, max_tokens: int, deadline_s: float, tag: str):
    """The burst, then every shed call retried once after its retry-after-ms hint."""
    first = await burst(port, n, max_tokens, deadline_s, tag)
    shed = [(i, r) for i, r in enumerate(first) if r["retry_after_ms"] is not None]
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(8)]
    try:
        stubs = [pb_grpc.PagedJaxStub(c) for c in chans]
        retried = await asyncio.gather(
            *(_retry_after_hint(stubs[k % 8], i, r, max_tokens, deadline_s)
              for k, (i, r) in enumerate(shed))
        )  # fmt: skip
    finally:
        for c in chans:
            await c.close()
    return first, retried


async def burst(port: int, n: int, max_tokens: int, deadline_s: float, tag: str, channels=8):
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(channels)]
    try:
        stubs = [pb_grpc.PagedJaxStub(c) for c in chans]
        for s in stubs:  # connect first, so connection set-up is not in the latencies
            await s.ListModels(pb.ListModelsRequest(), timeout=30)
        calls = [chat_call(stubs[i % channels], i, max_tokens, deadline_s, tag) for i in range(n)]
        return await asyncio.gather(*calls)
    finally:
        for c in chans:
            await c.close()


def shed_probe(port: int, n: int, delay_s: float, deadline_s: float, out) -> None:
    """In a process of its own: after `delay_s` (the burst has saturated the server), n calls
    one after another that admission must refuse (64 tokens cannot fit `deadline_s` behind
    the burst); puts [(code, latency_ms)] on `out`. A light client, so the latencies are the
    server's, not a busy client's."""
    time.sleep(delay_s)
    results = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.PagedJaxStub(channel)
        stub.ListModels(pb.ListModelsRequest(), timeout=30)
        for i in range(n):
            req = build_request("probe", max_tokens=64, request_id=f"probe-{i}")
            start = time.perf_counter()
            try:
                for _ in stub.Generate(req, timeout=deadline_s):
                    pass
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            results.append((code, (time.perf_counter() - start) * 1e3))
            time.sleep(0.02)
    out.put(results)


def _percentiles(ms: list[float]) -> dict:
    if not ms:
        return {}
    a = np.array(ms)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)} | {"max": float(a.max())}


def summarize(results: list[dict]) -> dict:
    codes: dict[str, int] = {}
    for r in results:
        codes[r["code"]] = codes.get(r["code"], 0) + 1
    pct = _percentiles([r["e2e_s"] * 1e3 for r in results if r["code"] in SHED_CODES])
    ok = [r for r in results if r["code"] == "OK"]
    return {
        "n": len(results),
        "codes": codes,
        "shed_latency_ms": pct,
        "ok_tokens_mean": float(np.mean([r["tokens"] for r in ok])) if ok else 0.0,
        "deadline_exceeded_fraction": codes.get("DEADLINE_EXCEEDED", 0) / max(1, len(results)),
    }


def wait_idle(port: int, timeout_s: float = 600) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.PagedJaxStub(channel)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            stats = stub.ServerInfo(pb.ServerInfoRequest(), timeout=10).stats
            if stats.get("num_running", 0) == 0 and stats.get("server_queue_requests", 0) == 0:
                return
            time.sleep(0.5)


def burst_with_probe(port, n, max_tokens, deadline_s, tag, probes: int) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    probe = ctx.Process(target=shed_probe, args=(port, probes, 2.0, 1.0, out))
    probe.start()
    first, retried = asyncio.run(burst_and_retry(port, n, max_tokens, deadline_s, tag))
    summary = summarize(first)
    summary["retried_after_hint"] = summarize(retried)["codes"]
    probed = out.get(timeout=600)
    probe.join(60)
    codes: dict[str, int] = {}
    for code, _ in probed:
        codes[code] = codes.get(code, 0) + 1
    shed = [ms for code, ms in probed if code in SHED_CODES]
    summary["probe"] = {"n": len(probed), "codes": codes, "shed_latency_ms": _percentiles(shed)}
    return summary


def run(
    model: str,
    n: int,
    max_tokens: int,
    deadline_s: float,
    server_args: list[str],
    log,
    probes: int = 100,
):
    proc, port = start_server(model, server_args, log)
    try:
        cold = burst_with_probe(port, n, max_tokens, deadline_s, "cold", probes)
        wait_idle(port)
        time.sleep(1.0)
        warm = burst_with_probe(port, n, max_tokens, deadline_s, "warm", probes)
    finally:
        proc.terminate()  # SIGTERM: the server drains and exits 0
        returncode = proc.wait(120)
    return {"cold": cold, "warm": warm, "server_exit_code": returncode}
