r"""What the router's HTTP front costs per request: one MockEngine replica (no JAX, steps
of `--step_ms`), asked the same completions directly over its own HTTP API, through the
router's HTTP front (serving/router/http_front.py) and through the router's gRPC front; the
medians of `--requests` sequential calls each, with the load average.

    python -m benchmarks.router_http_bench [--requests=100] [--max_tokens=16] [--step_ms=1]

Everything runs in this process (client, router, replica), so on a loaded 2-core machine
the figures are the router's CPU cost plus scheduling noise, not network latency.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import app, flags

F = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_integer("requests", 100, "sequential calls per path")
    flags.DEFINE_integer("max_tokens", 16, "tokens per completion")
    flags.DEFINE_float("step_ms", 1.0, "the mock replica's step time")


def timed(fn, n: int) -> dict:
    fn()  # untimed first call (connections, first-use costs)
    times_ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times_ms.append(1e3 * (time.perf_counter() - t0))
    times_ms.sort()
    return {
        "median_ms": statistics.median(times_ms),
        "p90_ms": times_ms[int(0.9 * (n - 1))],
    }


def measure(requests: int, max_tokens: int, step_s: float) -> dict:
    import openai

    from serving.client import GenerateClient
    from serving.engine_host.mock_engine import ByteTokenizer, MockEngine
    from serving.router.server import Router
    from serving.testing import running_server

    kwargs = dict(model="mock", prompt="the same prompt", max_tokens=max_tokens)
    with running_server(MockEngine(step_time_s=step_s), capacity_probe=False, http_port=0) as (
        replica,
        _,
    ):
        router = Router(
            [f"127.0.0.1:{replica.port}"], http_port=0, tokenizer=ByteTokenizer()
        ).start()
        try:
            direct = openai.OpenAI(
                base_url=f"http://127.0.0.1:{replica.http_port}/v1", api_key="-", max_retries=0
            )
            routed = openai.OpenAI(
                base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="-", max_retries=0
            )
            with GenerateClient(f"127.0.0.1:{router.port}") as grpc_client:
                return {
                    "replica_http": timed(lambda: direct.completions.create(**kwargs), requests),
                    "router_http": timed(lambda: routed.completions.create(**kwargs), requests),
                    "router_grpc": timed(
                        lambda: grpc_client.generate(kwargs["prompt"], max_tokens=max_tokens),
                        requests,
                    ),
                }
        finally:
            router.stop(0)


def main(argv) -> None:
    del argv
    load_before = os.getloadavg()
    figures = measure(F.requests, F.max_tokens, F.step_ms / 1e3)
    figures.update(
        requests=F.requests,
        max_tokens=F.max_tokens,
        step_ms=F.step_ms,
        loadavg_before=load_before,
        loadavg_after=os.getloadavg(),
        when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    print(json.dumps(figures, indent=1), file=sys.stdout)


if __name__ == "__main__":
    define_flags()
    app.run(main)
