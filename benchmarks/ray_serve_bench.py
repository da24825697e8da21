r"""What Ray Serve costs and what prefix routing buys (serving/ray_serve/), on this machine.

    python -m benchmarks.ray_serve_bench [--model=tiny] [--requests=40] [--concurrency=4]
        [--replicas=3] [--prefixes=20] [--per_prefix=5] [--skip_prefix] [--skip_latency]
        [--ceiling_requests=400] [--ceiling_concurrency=32]

1. Latency added per request: the same completions (`--requests`, `--concurrency` at once,
   `--max_tokens` each) sent straight to one engine (`python -m serving.server --http_port`,
   a process of its own) and through Serve (proxy -> ingress -> one replica with the same
   server flags); p50 / p99 of each and their difference.
2. Prefix hit rate: `--replicas` replicas, `--prefixes` distinct system prompts, each asked
   `--per_prefix` times (shuffled, `--concurrency` at once), with PrefixAffinityRouter and
   with Serve's default router (power of two choices), on fresh replicas each; hit rate =
   prefix tokens served from the replicas' caches (their engine stats) / the prefix tokens a
   single engine would have served (every request after its prefix's first).

3. Throughput ceiling of the ingress (`--ceiling_requests` > 0): the mock engine (no model,
   no step time), 1-token completions, `--ceiling_concurrency` at once with one pooled
   httpx client, straight to one server's HTTP API and through Serve (proxy -> ingress -> 1
   replica, same flags): completed requests per second of each (429s counted apart). The
   engine does next to nothing, so each figure is the HTTP path's own ceiling on the cores
   it shares with the client.

Everything shares this machine's cores (the client, Ray's proxy, the ingress, the replicas):
the added latency is Serve's CPU cost plus scheduling noise under that sharing, not network
latency; compare figures only within one run, with its load average.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

from absl import app, flags

F = flags.FLAGS
ENGINE_ARGS = [
    "--page_size=4",
    "--num_pages=512",
    "--max_num_seqs=8",
    "--max_num_batched_tokens=256",
    "--prefill_chunk_size=128",
    "--max_model_len=256",
    "--warmup_max_shapes=4",
    "--capacity_probe=false",
    "--log_level=warning",
]
SYSTEM = "T{i}: you are a helpful assistant for this team. Answer in one short line, please."


def define_flags() -> None:
    flags.DEFINE_string("model", "tiny", "the --model of the engine(s)")
    flags.DEFINE_integer("requests", 40, "completions per path (latency)")
    flags.DEFINE_integer("concurrency", 4, "requests in flight at once")
    flags.DEFINE_integer("max_tokens", 8, "tokens per completion")
    flags.DEFINE_integer("replicas", 3, "replicas for the prefix hit-rate run")
    flags.DEFINE_integer("prefixes", 20, "distinct system prompts")
    flags.DEFINE_integer("per_prefix", 5, "requests per system prompt")
    flags.DEFINE_bool("skip_prefix", False, "skip the prefix hit-rate runs")
    flags.DEFINE_bool("skip_latency", False, "skip the added-latency runs")
    flags.DEFINE_integer("ceiling_requests", 0, "requests per path for the throughput ceiling")
    flags.DEFINE_integer("ceiling_concurrency", 32, "requests in flight (throughput ceiling)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def percentiles(times_ms: list[float]) -> dict:
    times_ms = sorted(times_ms)
    return {
        "p50_ms": statistics.median(times_ms),
        "p99_ms": times_ms[min(len(times_ms) - 1, round(0.99 * (len(times_ms) - 1)))],
    }


def drive(
    base_url: str, prompts: list[str], concurrency: int, max_tokens: int, warm: bool = True
) -> list:
    """(latency_ms, reply) per prompt, `concurrency` at once, with the official SDK; `warm`:
    one untimed call first."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)

    def one(prompt):
        t0 = time.perf_counter()
        reply = client.completions.create(
            model=F.model, prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        return 1e3 * (time.perf_counter() - t0), reply

    if warm:
        one(prompts[0])  # untimed: connections, first-use costs
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def wait_http(base_url: str, proc=None, timeout_s: float = 900.0) -> None:
    import httpx

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base_url.removesuffix("/v1") + "/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(base_url)


CEILING_ARGS = ["--max_num_seqs=64", "--capacity_probe=false", "--log_level=warning"]


def throughput(base_url: str, requests: int, concurrency: int) -> dict:
    """Completed 1-token completions per second, `concurrency` at once (mock engine)."""
    import httpx

    body = {"model": "mock", "prompt": "abc", "max_tokens": 1}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(limits=limits, timeout=120) as client:
        client.post(f"{base_url}/completions", json=body)  # untimed: connections

        def one(_):
            return client.post(f"{base_url}/completions", json=body).status_code

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            codes = list(pool.map(one, range(requests)))
        wall_s = time.perf_counter() - t0
    ok = codes.count(200)
    return {"req_per_s": ok / wall_s, "ok": ok, "shed_429": codes.count(429), "wall_s": wall_s}


def direct_ceiling() -> dict:
    port = free_port()
    argv = [sys.executable, "-m", "serving.server", "--model=mock", "--port=0"]
    argv += [f"--http_port={port}", "--metrics_port=-1", *CEILING_ARGS]
    proc = subprocess.Popen(argv, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        base = f"http://127.0.0.1:{port}/v1"
        wait_http(base, proc)
        return throughput(base, F.ceiling_requests, F.ceiling_concurrency)
    finally:
        proc.terminate()
        proc.wait(60)


def serve_ceiling(port: int) -> dict:
    from ray import serve

    from serving.ray_serve import build_app

    args = dict(model="mock", num_replicas=1, server_args=CEILING_ARGS, num_cpus=0.5)
    serve.run(build_app(args), name="ceiling", route_prefix="/")
    try:
        base = f"http://127.0.0.1:{port}/v1"
        return throughput(base, F.ceiling_requests, F.ceiling_concurrency)
    finally:
        serve.delete("ceiling")


def direct_latency(prompts: list[str]) -> dict:
    port = free_port()
    argv = [sys.executable, "-m", "serving.server", f"--model={F.model}", "--port=0"]
    argv += [f"--http_port={port}", "--metrics_port=-1", *ENGINE_ARGS]
    proc = subprocess.Popen(argv, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        base = f"http://127.0.0.1:{port}/v1"
        wait_http(base, proc)
        return percentiles([t for t, _ in drive(base, prompts, F.concurrency, F.max_tokens)])
    finally:
        proc.terminate()
        proc.wait(60)


def deploy(name: str, replicas: int, router: str):
    from ray import serve

    from serving.ray_serve import build_app

    args = dict(model=F.model, num_replicas=replicas, server_args=ENGINE_ARGS, router=router)
    serve.run(build_app({**args, "num_cpus": 0.5, "block_bytes": 16}), name=name, route_prefix="/")


def replica_stats(app_name: str, replicas: int) -> dict[str, dict]:
    from ray import serve

    engine = serve.get_deployment_handle("pagedjax", app_name=app_name)
    seen: dict[str, dict] = {}
    for _ in range(50 * replicas):
        stats = engine.stats.remote().result()
        seen[stats["replica"]] = stats
        if len(seen) == replicas:
            return seen
    raise RuntimeError(f"stats reached {len(seen)} of {replicas} replicas")


def serve_latency(port: int, prompts: list[str]) -> dict:
    from ray import serve

    deploy("latency", 1, "prefix")
    try:
        base = f"http://127.0.0.1:{port}/v1"
        return percentiles([t for t, _ in drive(base, prompts, F.concurrency, F.max_tokens)])
    finally:
        serve.delete("latency")


def prefix_hit_rate(port: int, router: str) -> dict:
    from ray import serve

    from models.registry import tiny_tokenizer

    rng = random.Random(0)
    systems = [SYSTEM.format(i=i) for i in range(F.prefixes)]
    asks = [(p, j) for p in range(F.prefixes) for j in range(F.per_prefix)]
    rng.shuffle(asks)
    prompts = [f"{systems[p]} Q{j}: item {p * 31 + j}?" for p, j in asks]
    app_name = f"prefix-{router}"
    deploy(app_name, F.replicas, router)
    try:
        before = replica_stats(app_name, F.replicas)
        t0 = time.perf_counter()
        drive(f"http://127.0.0.1:{port}/v1", prompts, F.concurrency, 4, warm=False)
        wall_s = time.perf_counter() - t0
        after = replica_stats(app_name, F.replicas)
    finally:
        serve.delete(app_name)
    key = "prefix_cache_hit_tokens"
    hit = sum(after[r][key] - before[r][key] for r in after)
    tok = tiny_tokenizer()  # NOTE: the tiny model's byte tokenizer: one token per byte
    page, first, reusable = 4, {}, 0
    for (p, _), prompt in zip(asks, prompts):
        ids = tok.encode(prompt)
        if p in first:
            reusable += len(os.path.commonprefix([first[p], ids])) // page * page
        else:
            first[p] = ids
    return {
        "hit_rate": hit / reusable,
        "hit_tokens": hit,
        "reusable_tokens": reusable,
        "wall_s": wall_s,
    }


def main(argv) -> None:
    del argv
    import ray
    from ray import serve

    if F.model != "tiny" and not F.skip_prefix:
        raise app.UsageError("--model: the prefix run counts bytes as tokens (tiny only)")
    prompts = [f"question {i}: what is {i} plus {i}?" for i in range(F.requests)]
    out = {"load_before": loadavg()}
    if not F.skip_latency:
        out["direct"] = direct_latency(prompts)
    if F.ceiling_requests:
        out["ceiling_direct"] = direct_ceiling()
    port = free_port()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])
    )
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        if not F.skip_latency:
            out["serve"] = serve_latency(port, prompts)
            out["added_p50_ms"] = out["serve"]["p50_ms"] - out["direct"]["p50_ms"]
            out["added_p99_ms"] = out["serve"]["p99_ms"] - out["direct"]["p99_ms"]
        if F.ceiling_requests:
            out["ceiling_serve"] = serve_ceiling(port)
            ratio = out["ceiling_serve"]["req_per_s"] / out["ceiling_direct"]["req_per_s"]
            out["ceiling_serve_over_direct"] = ratio
        if not F.skip_prefix:
            out["prefix_affinity"] = prefix_hit_rate(port, "prefix")
            out["prefix_default"] = prefix_hit_rate(port, "default")
    finally:
        serve.shutdown()
        ray.shutdown()
    out["load_after"] = loadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    define_flags()
    app.run(main)
