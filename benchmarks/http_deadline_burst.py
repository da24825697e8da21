"""Issue 37's burst over HTTP: N chat calls at once through the official `openai` SDK
(AsyncOpenAI, `timeout=T`, no retries) against `python -m serving.server --http_port`.

    python -m benchmarks.http_deadline_burst [--model=smollm2-135m] [--n=300] [--timeout_s=15]
        [--max_tokens=64] [--max_num_seqs=32] [--server_args=--flag=v,...]

The SDK sends its timeout in `x-stainless-read-timeout`, so admission sheds what cannot finish
in time (429 + Retry-After) and the server ends what runs past it (504) before the client
gives up. Each call ends as one of: ok, 429 (with or without Retry-After), 504, client_timeout
(the SDK's own timeout fired: the server kept the client waiting past its deadline), or
another status. Prints one JSON object (counts, latencies, load averages); exit status 1 when
client timeouts pass 10% of the calls or a refusal came without Retry-After (issue 37's bar).
Before the fix, 200 such calls ended 136 x 429 and 64 client timeouts, 0 answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import numpy as np
import openai

from benchmarks.reliability_burst import free_port, start_server

MAX_CLIENT_TIMEOUT_FRACTION = 0.10


async def _one(client: openai.AsyncOpenAI, model: str, i: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    kind, retry_after = "ok", None
    try:
        await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Write a short note about topic number {i}."}],
            max_tokens=max_tokens,
            temperature=0.0,
        )
    except openai.APITimeoutError:
        kind = "client_timeout"
    except openai.APIStatusError as e:
        kind = str(e.status_code)
        retry_after = e.response.headers.get("retry-after")
    except openai.APIConnectionError:
        kind = "connection_error"
    return {"kind": kind, "e2e_s": time.perf_counter() - start, "retry_after": retry_after}


async def burst(port: int, model: str, n: int, timeout_s: float, max_tokens: int) -> list[dict]:
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=timeout_s, max_retries=0
    )
    try:
        await client.models.list()  # one connection up before the clock matters
        return await asyncio.gather(*(_one(client, model, i, max_tokens) for i in range(n)))
    finally:
        await client.close()


def summarize(results: list[dict], timeout_s: float) -> dict:
    counts: dict[str, int] = {}
    for r in results:
        counts[r["kind"]] = counts.get(r["kind"], 0) + 1
    refused = [r for r in results if r["kind"] == "429"]
    e2e = {
        kind: float(np.percentile([r["e2e_s"] for r in results if r["kind"] == kind], 50))
        for kind in counts
    }
    n = max(1, len(results))
    summary = {
        "n": len(results),
        "timeout_s": timeout_s,
        "counts": counts,
        "refusals_without_retry_after": sum(r["retry_after"] is None for r in refused),
        "client_timeout_fraction": counts.get("client_timeout", 0) / n,
        "e2e_p50_s": e2e,
    }
    summary["meets_issue_37"] = (
        summary["client_timeout_fraction"] <= MAX_CLIENT_TIMEOUT_FRACTION
        and summary["refusals_without_retry_after"] == 0
    )
    return summary


def run(
    model: str,
    n: int,
    timeout_s: float,
    max_tokens: int,
    server_args: list[str],
    log_path: str,
) -> dict:
    """Starts the server (gRPC + HTTP), fires the burst once, stops the server (SIGTERM)."""
    http_port = free_port()
    proc, _ = start_server(model, [f"--http_port={http_port}", *server_args], log_path)
    try:
        load_before = os.getloadavg()
        results = asyncio.run(burst(http_port, model, n, timeout_s, max_tokens))
        load_after = os.getloadavg()
    finally:
        proc.terminate()  # the server drains and exits 0
        returncode = proc.wait(120)
    summary = summarize(results, timeout_s)
    summary.update(
        model=model,
        max_tokens=max_tokens,
        server_args=server_args,
        load_avg_before=load_before,
        load_avg_after=load_after,
        server_exit_code=returncode,
    )
    return summary


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--timeout_s", type=float, default=15.0)
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--max_num_seqs", type=int, default=32)
    p.add_argument("--server_args", default="", help="more server flags, comma-separated")
    p.add_argument("--server_log", default=None, help="server stderr (default: a temp file)")
    a = p.parse_args(argv)
    server_args = [f"--max_num_seqs={a.max_num_seqs}"]
    server_args += [x for x in a.server_args.split(",") if x]
    log_path = a.server_log or os.path.join(tempfile.mkdtemp(), "server.log")
    summary = run(a.model, a.n, a.timeout_s, a.max_tokens, server_args, log_path)
    summary["server_log"] = log_path
    print(json.dumps(summary, indent=1))
    return 0 if summary["meets_issue_37"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
