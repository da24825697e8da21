"""Tool calls under load: time to the first call delta, and the throughput cost of
constrained tool calls against free text, at C concurrent streamed chat requests through
`python -m serving.server --http_port` with the official openai SDK (AsyncOpenAI).

    python -m benchmarks.tools_bench                              # SmolLM2, 16 concurrent
    python -m benchmarks.tools_bench --model=tiny --concurrency=2 --requests=2 \\
        --max_tokens=160 --server_args="--max_model_len=2048 --warmup_max_shapes=0"  # smoke

Three passes over the same conversations (a weather question, two function tools; the tools
are in every prompt, so prompts are the same length in all three), after a discarded warm
pass of C requests per mode:
    free      tool_choice="none", ignore_eos: free text, exactly max_tokens tokens
    required  tool_choice="required", parallel_tool_calls=false: decoding constrained to
              one call (engine/chat/setup.py's grammar), ends when the call closes
    auto      tool_choice="auto": free text until the model opens a call, then constrained
Per pass: output tok/s (completion tokens / wall, all requests), the first delta's time
(content or a call, from the request's send; median and p90), the first call delta's time
(its name: calls held by a grammar stream name-first, engine/chat/call_stream.py), the last
call delta's time (the call complete), the argument deltas per call, how many requests made
a call and how many calls validate against their tool's schema (jsonschema).
`cost` = required tok/s / free tok/s.

Prints one JSON object with /proc/loadavg before and after; compare passes within one run
only (the machine is shared and its speed drifts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import jsonschema
import openai

from benchmarks.reliability_burst import free_port, start_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "enum": ["UTC", "Europe/Paris", "Asia/Tokyo"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Riga"]
MODES = {
    "free": {"tool_choice": "none", "extra_body": {"ignore_eos": True}},
    "required": {"tool_choice": "required", "parallel_tool_calls": False},
    "auto": {"tool_choice": "auto"},
}


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def question(i: int) -> list[dict]:
    city = CITIES[i % len(CITIES)]
    return [
        {"role": "user", "content": f"What will the weather be in {city} for {i % 7 + 1} days?"}
    ]


async def one(client: openai.AsyncOpenAI, model: str, i: int, mode: str, max_tokens: int) -> dict:
    """One streamed chat request; its timings, token count and calls."""
    start = time.perf_counter()
    first_delta = first_call = last_call = None
    calls: dict[int, dict] = {}
    tokens = 0
    stream = await client.chat.completions.create(
        model=model,
        messages=question(i),
        tools=TOOLS,
        max_tokens=max_tokens,
        temperature=1.0,
        seed=i,
        stream=True,
        stream_options={"include_usage": True},
        **MODES[mode],
    )
    async for chunk in stream:
        now = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if (delta.content or delta.tool_calls) and first_delta is None:
            first_delta = now
        for tc in delta.tool_calls or ():
            first_call = now if first_call is None else first_call
            last_call = now
            entry = calls.setdefault(
                tc.index, {"name": tc.function.name, "arguments": "", "deltas": 0}
            )
            entry["arguments"] += tc.function.arguments or ""
            entry["deltas"] += bool(tc.function.arguments)
    return {
        "e2e_s": time.perf_counter() - start,
        "first_delta_s": first_delta,
        "first_call_s": first_call,
        "last_call_s": last_call,
        "tokens": tokens,
        "calls": list(calls.values()),
    }


def valid(call: dict) -> bool:
    try:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    except (KeyError, ValueError, jsonschema.ValidationError):
        return False
    return True


def _quantiles(values: list[float]) -> dict:
    if not values:
        return {"median": None, "p90": None}
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {"median": round(statistics.median(ordered), 4), "p90": round(p90, 4)}


def summarize(records: list[dict], wall_s: float) -> dict:
    calls = [c for r in records for c in r["calls"]]
    tokens = sum(r["tokens"] for r in records)
    return {
        "requests": len(records),
        "completion_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "out_tok_s": round(tokens / wall_s, 2),
        "first_delta_s": _quantiles([r["first_delta_s"] for r in records if r["first_delta_s"]]),
        "first_call_s": _quantiles([r["first_call_s"] for r in records if r["first_call_s"]]),
        "last_call_s": _quantiles([r["last_call_s"] for r in records if r["last_call_s"]]),
        "argument_deltas_per_call": _quantiles([c["deltas"] for c in calls]),
        "requests_with_calls": sum(1 for r in records if r["calls"]),
        "calls": len(calls),
        "calls_valid": sum(valid(c) for c in calls),
    }


async def run_pass(port: int, model: str, mode: str, n: int, concurrency: int, max_tokens: int):
    """Closed loop: `concurrency` requests in flight until `n` are done."""
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=3600, max_retries=0
    )
    try:
        todo, records = list(range(n)), []

        async def worker():
            while todo:
                records.append(await one(client, model, todo.pop(0), mode, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - start
    finally:
        await client.close()


def run(
    model: str,
    concurrency: int,
    requests: int,
    max_tokens: int,
    server_args: list[str],
    log_path: str,
    modes: tuple[str, ...] = tuple(MODES),
) -> dict:
    """Starts the server, runs a warm and a measured pass per mode, stops the server."""
    http_port = free_port()
    proc, _ = start_server(model, [f"--http_port={http_port}", *server_args], log_path)
    result: dict = {"model": model, "concurrency": concurrency, "max_tokens": max_tokens}
    result.update(server_args=server_args, loadavg_before=loadavg(), passes={})
    try:
        for mode in modes:  # every mode's shapes and grammars compiled before any is timed
            asyncio.run(run_pass(http_port, model, mode, concurrency, concurrency, max_tokens))
        for mode in modes:
            records, wall_s = asyncio.run(
                run_pass(http_port, model, mode, requests, concurrency, max_tokens)
            )
            result["passes"][mode] = summarize(records, wall_s)
    finally:
        proc.terminate()  # the server drains and exits 0
        result["server_exit_code"] = proc.wait(120)
    result["loadavg_after"] = loadavg()
    passes = result["passes"]
    if "free" in passes and "required" in passes:
        result["cost"] = round(passes["required"]["out_tok_s"] / passes["free"]["out_tok_s"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48, help="measured requests per pass")
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--server_args", default="", help="extra server flags, space-separated")
    ap.add_argument("--modes", default=",".join(MODES), help="passes to run, comma-separated")
    ap.add_argument("--json", default="", help="also write the result here")
    args = ap.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = sorted(set(modes) - set(MODES))
    if unknown or args.concurrency < 1 or args.requests < 1 or args.max_tokens < 1:
        ap.error(f"--modes from {list(MODES)} (unknown: {unknown}); sizes >= 1")
    log_path = os.path.join(tempfile.gettempdir(), "tools_bench.server.log")
    result = run(
        args.model,
        args.concurrency,
        args.requests,
        args.max_tokens,
        args.server_args.split(),
        log_path,
        modes,
    )
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if result["server_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
