"""The burst of issue 34 against what the machine can finish: served / capacity.

    python -m benchmarks.burst_capacity                      # SmolLM2, the server's defaults
    python -m benchmarks.burst_capacity --model=mock --server_args=--mock_step_time_s=0.05

Capacity (the issue: "measure capacity by a closed-loop run first"): the most burst-shaped
calls (the same chat, `max_tokens`, greedy) the server finishes within `deadline_s` of a
start, over closed loops of `concurrency` streams (each sends its next call when one ends,
with a deadline far enough to be admitted); the best level is what a burst arriving at once
could have had served in time.

Bursts (benchmarks/reliability_burst.py: `n` calls at once, deadline `deadline_s`, a light
second client measuring the shedding speed, shed calls retried once after Retry-After):

    server 1, fresh calibration (the start-up probe):  cold burst, then the closed loops,
                                                       then a warm burst
    server 2, restarted on server 1's saved calibration: the first burst after a restart

The calibration goes to a directory of its own (its `xla/` a link to the shared compilation
cache, so the step programs load from it; for the mock an empty directory, beside which the
mock's calibration persists too), so nothing another run left behind seeds it. Before each
burst the server's admission margin (ServerInfo stats `admission_margin`: the measured p90
of actual / predicted finish, or the prior) is recorded.
Targets (issue 34): OK in time >= 0.8 x capacity, <= 10% past deadline, shed p99 < 50 ms,
the burst after a restart as good as a warm one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import grpc

from benchmarks import reliability_burst as rb
from serving.proto import pagedjax_pb2 as pb
from serving.proto import pagedjax_pb2_grpc as pb_grpc


async def closed_loop(port: int, concurrency: int, window_s: float, max_tokens: int) -> dict:
    """`concurrency` streams for `window_s`: calls OK within the window, and every outcome."""
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(min(8, concurrency))]
    stubs = [pb_grpc.PagedJaxStub(c) for c in chans]
    for s in stubs:
        await s.ListModels(pb.ListModelsRequest(), timeout=30)
    start = time.perf_counter()
    done: list[dict] = []
    count = iter(range(10**9))

    async def worker(k: int) -> None:
        while time.perf_counter() - start < window_s:
            r = await rb.chat_call(stubs[k % len(stubs)], next(count), max_tokens, 600.0, "cap")
            r["end_s"] = time.perf_counter() - start
            done.append(r)

    try:
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    finally:
        for c in chans:
            await c.close()
    in_time = [r for r in done if r["code"] == "OK" and r["end_s"] <= window_s]
    codes: dict[str, int] = {}
    for r in done:
        codes[r["code"]] = codes.get(r["code"], 0) + 1
    return {"concurrency": concurrency, "ok_in_window": len(in_time), "codes": codes}


def capacity(port: int, levels: list[int], window_s: float, max_tokens: int) -> dict:
    runs = []
    for c in levels:
        runs.append(asyncio.run(closed_loop(port, c, window_s, max_tokens)))
        print(f"[burst_capacity] closed loop {runs[-1]}", file=sys.stderr, flush=True)
        rb.wait_idle(port)
    best = max(runs, key=lambda r: r["ok_in_window"])
    return {"levels": runs, "capacity": best["ok_in_window"], "best": best["concurrency"]}


def admission_margin(port: int) -> float | None:
    """The factor admission holds estimates to before a burst (the measured p90 of actual /
    predicted finish, or the prior before any was measured)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stats = pb_grpc.PagedJaxStub(channel).ServerInfo(pb.ServerInfoRequest(), timeout=10).stats
    return stats.get("admission_margin")


def calibration_dir(root: str) -> str:
    """`root/xla` linked to the shared compilation cache: the server's calibration then goes
    to `root/capacity`, its own."""
    from engine.runner import compilation_cache

    xla = os.path.join(root, "xla")
    shared = compilation_cache.default_dir()
    os.makedirs(shared, exist_ok=True)  # a fresh machine has none yet: no dangling link
    os.symlink(shared, xla)
    return xla


def run(a) -> dict:
    root = tempfile.mkdtemp(prefix="burst_capacity-")
    args = [*a.server_args.split(",")] if a.server_args else []
    # the mock compiles nothing: its "cache" is a directory of its own, beside which the
    # calibration persists
    xla = calibration_dir(root) if a.model != "mock" else os.path.join(root, "xla")
    args.append(f"--compilation_cache_dir={xla}")
    log = lambda name: os.path.join(a.out_dir, f"{name}.log")
    out = {"loadavg": {"start": os.getloadavg()}, "server_args": args}
    proc, port = rb.start_server(a.model, args, log("server1"))
    try:
        out["margin"] = {"cold": admission_margin(port)}
        out["cold"] = rb.burst_with_probe(port, a.n, a.max_tokens, a.deadline_s, "cold", a.probes)
        out["loadavg"]["cold"] = os.getloadavg()
        rb.wait_idle(port)
        out["capacity"] = capacity(port, a.concurrency, a.deadline_s, a.max_tokens)
        out["loadavg"]["capacity"] = os.getloadavg()
        out["margin"]["warm"] = admission_margin(port)
        out["warm"] = rb.burst_with_probe(port, a.n, a.max_tokens, a.deadline_s, "warm", a.probes)
        out["loadavg"]["warm"] = os.getloadavg()
    finally:
        proc.terminate()  # SIGTERM: drains, saves the calibration, exits 0
        out["server1_exit_code"] = proc.wait(120)
    proc, port = rb.start_server(a.model, args, log("server2"))
    try:
        out["margin"]["restart"] = admission_margin(port)
        out["restart"] = rb.burst_with_probe(
            port, a.n, a.max_tokens, a.deadline_s, "restart", a.probes
        )
        out["loadavg"]["restart"] = os.getloadavg()
    finally:
        proc.terminate()
        out["server2_exit_code"] = proc.wait(120)
    saved = os.path.join(root, "capacity")  # the calibration server 1 saved (real models)
    out["calibration_files"] = sorted(os.listdir(saved)) if os.path.isdir(saved) else []
    return out


def render(r: dict, a) -> str:
    cap = r["capacity"]["capacity"]
    rows = [
        (
            f"Burst vs capacity: {a.model}, {a.n} calls at once, {a.max_tokens} max tokens, "
            f"{a.deadline_s:g} s deadline; server args {' '.join(r['server_args']) or '-'}"
        ),
        "closed loops (OK within the window): "
        + ", ".join(
            f"{x['concurrency']} streams: {x['ok_in_window']}" for x in r["capacity"]["levels"]
        )
        + f" -> capacity {cap}",
        "| burst | load (1 min) | margin | OK | shed | DEADLINE_EXCEEDED | other | OK / capacity | "
        "shed p50 / p99 ms (light client) | retried after hint |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for name in ("cold", "warm", "restart"):
        b = r[name]
        codes = dict(b["codes"])
        ok, de = codes.pop("OK", 0), codes.pop("DEADLINE_EXCEEDED", 0)
        shed = sum(codes.pop(c, 0) for c in rb.SHED_CODES)
        p = b["probe"]["shed_latency_ms"]
        rows.append(
            f"| {name} | {r['loadavg'][name][0]:.1f} | {r['margin'].get(name) or 0:.3f} | {ok} "
            f"| {shed} | {de} ({de / b['n']:.0%}) "
            f"| {sum(codes.values())} | {ok / max(1, cap):.2f} | {p.get('p50', 0):.1f} / "
            f"{p.get('p99', 0):.1f} | {b['retried_after_hint']} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--deadline_s", type=float, default=15.0)
    p.add_argument("--concurrency", default="8,16,24,32,48,64", help="closed-loop stream counts")
    p.add_argument("--probes", type=int, default=100)
    p.add_argument("--server_args", default="", help="more server flags, comma-separated")
    p.add_argument("--out_dir", default="burst_capacity")
    a = p.parse_args(argv)
    a.concurrency = [int(x) for x in a.concurrency.split(",")]
    os.makedirs(a.out_dir, exist_ok=True)
    result = run(a)
    text = render(result, a)
    print(text)
    with open(os.path.join(a.out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
