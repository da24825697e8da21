"""Served path vs engine alone, same batch, same run (issue 39).

    python -m benchmarks.served_bench                              # the issue's workloads
    python -m benchmarks.served_bench --workloads=1:4:128,16:16:256 --output_len=32  # small
    python -m benchmarks.served_bench --ttft_prompts=128,1000      # TTFT scaling only

1. Starts the real server (`python -m serving.server --http_port=...`, default flags, plus
   `--server_args`), waits for /ready, and drives it over HTTP with the load generator's
   driver (serving/capacity/loadgen/http_driver.py: streamed /v1/completions, ignore_eos,
   temperature 0) at each workload `concurrency:num_requests:prompt_len` (closed loop:
   `concurrency` requests in flight; random token-id prompts of exactly prompt_len tokens,
   like `vllm bench serve --dataset-name random`). Each workload runs a discarded warm pass
   first (`--warm_requests` per workload), then the measured pass.
2. TTFT scaling: at concurrency 1, prompts of each `--ttft_prompts` length with
   max_tokens 1 (median of `--ttft_repeats`); prints each one's TTFT against its share of
   the longest prompt's (issue target: a 128-token prompt within 2x of its share of a
   1,000-token prefill).
3. Stops the server, builds the same engine in this process (the server's defaults and
   warm-up) and runs the same batches through `EngineCore` directly (closed loop, same
   concurrency): the engine-only figure. Prints served / engine-only per workload.

Every line carries `cat /proc/loadavg`; compare ratios within one run only (the machine is
shared and its speed drifts). For vLLM's figures on the same workloads see
benchmarks/vllm_peer.sh.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import httpx
import numpy as np
from absl import app, flags

from serving.capacity.loadgen.http_driver import run_one_http
from serving.capacity.loadgen.workloads import RequestSpec

flags.DEFINE_string("model", "smollm2-135m", "the server's --model")
flags.DEFINE_string(
    "workloads",
    "1:16:128,16:64:256,64:128:256",
    "comma-separated concurrency:num_requests:prompt_len (the issue's three)",
)
flags.DEFINE_integer("output_len", 128, "max_tokens of every request (ignore_eos)")
flags.DEFINE_integer("warm_requests", 0, "requests of each warm pass (0: the concurrency)")
flags.DEFINE_string("ttft_prompts", "128,1000", "TTFT scaling prompt lengths ('' : skip)")
flags.DEFINE_integer("ttft_repeats", 3, "runs per TTFT prompt length (median)")
flags.DEFINE_string("server_args", "", "extra server flags, space-separated")
flags.DEFINE_bool("engine_only", True, "also run the same batches through EngineCore")
flags.DEFINE_integer("ready_timeout_s", 1800, "longest wait for the server's /ready")
F = flags.FLAGS
LOG = os.environ.get("SERVED_BENCH_LOG", "/tmp/served_bench.server.log")


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def parse_workloads(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise app.UsageError(f"--workloads={text!r}: {item!r} is not C:N:LEN (positive ints)")
        out.append(tuple(int(p) for p in parts))
    return out


def prompts(n: int, length: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    """Random token ids of exactly `length` tokens (ids past the specials), reproducible."""
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, length).tolist() for _ in range(n)]


# ---- the served path ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> tuple[subprocess.Popen, float]:
    cmd = [
        sys.executable, "-m", "serving.server", f"--model={F.model}", "--port=0",
        "--metrics_port=-1", f"--http_port={port}", "--host=127.0.0.1",
        *F.server_args.split(),
    ]  # fmt: skip
    t0 = time.perf_counter()
    log_file = open(LOG, "w")  # noqa: SIM115 - the server's lifetime
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_file)
    deadline = t0 + F.ready_timeout_s
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: see {LOG}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"server not ready in {F.ready_timeout_s}s")


async def drive_http(port: int, batch: list[list[int]], concurrency: int, max_tokens: int):
    """Closed loop over HTTP; returns (records, wall seconds)."""
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits) as client:
        todo = list(enumerate(batch))
        records = []

        async def worker():
            while todo:
                i, ids = todo.pop(0)
                spec = RequestSpec(f"r{i}", "served", ids, len(ids), max_tokens)
                records.append(await run_one_http(client, spec, scheduled_s=None, timeout_s=3600))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - t0


def summarize(ttfts, tpots, out_tokens, wall) -> dict:
    return {
        "out_tok_s": out_tokens / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttfts) if ttfts else float("nan"),
        "tpot_p50_ms": 1e3 * statistics.median(tpots) if tpots else float("nan"),
        "wall_s": wall,
    }


def served_summary(records, wall) -> dict:
    ok = [r for r in records if r.outcome == "success"]
    ttfts = [r.first_token_s - r.send_s for r in ok if r.first_token_s]
    tpots = [
        (r.end_s - r.first_token_s) / (r.num_output_tokens - 1)
        for r in ok
        if r.first_token_s and r.num_output_tokens > 1
    ]
    s = summarize(ttfts, tpots, sum(r.num_output_tokens for r in ok), wall)
    s["failed"] = len(records) - len(ok)
    if s["failed"]:
        s["first_failure"] = next(r.reason for r in records if r.outcome != "success")
    return s


# ---- the engine alone --------------------------------------------------------------------------
def build_engine_like_the_server():
    from engine.runner.compilation_cache import enable
    from engine.runner.shapes import DEFAULT_MAX_SHAPES  # the server's --warmup_max_shapes default
    from serving.engine_host.build import build_engine

    enable(None)  # the server's default cache: the programs it built load from there
    options = {
        "page_size": 16,
        "num_pages": None,
        "kv_cache_bytes": int(1.5 * 2**30),
        "max_num_seqs": 64,
        "max_num_batched_tokens": 512,
        "prefill_chunk_size": 256,
        "prefix_caching": True,
        "layer_loop": "scan",
        "warmup_max_shapes": DEFAULT_MAX_SHAPES,
    }  # fmt: skip  (serving/server.py's flag defaults)
    for arg in F.server_args.split():  # the one engine flag an A/B here changes
        if arg.startswith("--attention_impl="):
            options["impl"] = arg.split("=", 1)[1]
    return build_engine(F.model, options)


def drive_engine(core, batch, concurrency: int, max_tokens: int, tag: str) -> dict:
    from engine.api_types import EngineRequest
    from engine.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    todo = list(enumerate(batch))
    sent, first, last, counts = {}, {}, {}, {}
    running = 0
    t0 = time.perf_counter()
    while todo or core.has_unfinished():
        while todo and running < concurrency:
            i, ids = todo.pop(0)
            rid = f"{tag}-{i}"
            sent[rid] = time.perf_counter()
            core.add_request(EngineRequest(rid, ids, params))
            running += 1
        for out in core.step():
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                running -= 1
    wall = time.perf_counter() - t0
    ttfts = [first[r] - sent[r] for r in first]
    tpots = [(last[r] - first[r]) / (counts[r] - 1) for r in first if counts[r] > 1]
    return summarize(ttfts, tpots, sum(counts.values()), wall)


# ---- the run -----------------------------------------------------------------------------------
def row(label: str, s: dict) -> str:
    return (
        f"{label:<34} {s['out_tok_s']:8.1f} out tok/s  TTFT p50 {s['ttft_p50_ms']:8.0f} ms  "
        f"TPOT p50 {s['tpot_p50_ms']:6.1f} ms  wall {s['wall_s']:6.1f} s  load {loadavg()}"
        + (f"  FAILED {s['failed']}: {s.get('first_failure')}" if s.get("failed") else "")
    )


def main(argv) -> None:
    del argv
    workloads = parse_workloads(F.workloads)
    ttft_lens = [int(x) for x in filter(None, F.ttft_prompts.split(","))]
    port = free_port()
    # SIGTERM (e.g. `timeout`) unwinds through the finally below, which stops the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"served_bench: model {F.model}, output_len {F.output_len}, load {loadavg()}")
    proc, ready_s = start_server(port)
    print(f"server ready in {ready_s:.1f} s (default flags {F.server_args!r}), load {loadavg()}")
    served, ttft_served = {}, {}
    try:
        for c, n, plen in workloads:
            warm = prompts(F.warm_requests or c, plen, seed=1000 + c)
            asyncio.run(drive_http(port, warm, c, F.output_len))
            recs, wall = asyncio.run(drive_http(port, prompts(n, plen, seed=c), c, F.output_len))
            served[(c, n, plen)] = served_summary(recs, wall)
            print(row(f"served  c={c} n={n} prompt={plen}", served[(c, n, plen)]), flush=True)
        for plen in ttft_lens:
            # seeds differ per length: prompts of one seed share a prefix (a cache hit)
            asyncio.run(drive_http(port, prompts(1, plen, seed=7 * plen), 1, 1))  # warm it
            runs = [
                served_summary(
                    *asyncio.run(drive_http(port, prompts(1, plen, seed=11 * plen + k), 1, 1))
                )
                for k in range(F.ttft_repeats)
            ]
            ttft_served[plen] = statistics.median(r["ttft_p50_ms"] for r in runs)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if ttft_lens:
        longest = max(ttft_lens)
        for plen in ttft_lens:
            share = ttft_served[longest] * plen / longest
            print(
                f"served TTFT prompt {plen:>5}: {ttft_served[plen]:7.0f} ms; share of the "
                f"{longest}-token prompt's {share:7.0f} ms; ratio {ttft_served[plen] / share:4.2f}"
                f" (target <= 2)  load {loadavg()}"
            )
    if not F.engine_only:
        return
    core = build_engine_like_the_server()
    for c, n, plen in workloads:
        warm = prompts(F.warm_requests or c, plen, seed=1000 + c)
        drive_engine(core, warm, c, F.output_len, f"w{c}")
        alone = drive_engine(core, prompts(n, plen, seed=c), c, F.output_len, f"m{c}")
        print(row(f"engine  c={c} n={n} prompt={plen}", alone))
        s = served[(c, n, plen)]
        print(
            f"  served / engine-only: throughput {s['out_tok_s'] / alone['out_tok_s']:.2f} "
            f"(target >= 0.7), TTFT {s['ttft_p50_ms'] / alone['ttft_p50_ms']:.2f}x, "
            f"TPOT {s['tpot_p50_ms'] / alone['tpot_p50_ms']:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app.run(main)
