"""Soak: N requests through the whole serving stack, a fraction cancelled at random points,
then the books must balance: zero KV pages in use, every call that reached the server has
exactly one recorded outcome (one `request_end` log line per request id, and the outcome
counters sum to the calls seen).

Cancellation points (chosen at random for `cancel_fraction` of the requests):
    before_admission  cancelled right after it is sent (may never reach a handler)
    queued            cancelled after 0-20 ms (the queue is long during the soak)
    before_first      cancelled at a random time before its first token (mid-prefill)
    mid_decode        cancelled after 1-3 messages
    disconnect        its own channel is closed after its first message
The server runs in this process (its metrics, engine and log are read directly); the client
is grpc.aio with `concurrency` calls in flight.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import time

import grpc

from serving.client import build_request
from serving.proto import pagedjax_pb2_grpc as pb_grpc
from serving.testing import calls_seen, outcome_counts

CANCEL_POINTS = ("before_admission", "queued", "before_first", "mid_decode", "disconnect")


class _RequestEnds(logging.Handler):
    def __init__(self):
        super().__init__()
        self.by_id: collections.Counter = collections.Counter()
        self.total = 0

    def emit(self, record):
        line = json.loads(record.getMessage())
        self.by_id[line["request_id"]] += 1
        self.total += 1


async def _consume(call, cancel_after_messages: int | None) -> str:
    n = 0
    try:
        async for _ in call:
            n += 1
            if cancel_after_messages is not None and n >= cancel_after_messages:
                call.cancel()
                return "CANCELLED"
    except asyncio.CancelledError:
        return "CANCELLED"
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return "OK"


async def _one(stub, target, i: int, plan: str, rng: random.Random, prompts, max_tokens) -> str:
    req = build_request(
        rng.choice(prompts),
        max_tokens=rng.randint(1, max_tokens),
        request_id=f"soak-{i}",
        temperature=0.0,
    )
    if plan == "disconnect":
        channel = grpc.aio.insecure_channel(target)
        call = pb_grpc.PagedJaxStub(channel).Generate(req, timeout=120)
        try:
            async for _ in call:
                break
        except grpc.aio.AioRpcError as e:
            return e.code().name
        await channel.close()
        return "CANCELLED"
    call = stub.Generate(req, timeout=120)
    if plan == "before_admission":
        call.cancel()
        return "CANCELLED"
    if plan in ("queued", "before_first"):
        delay_s = rng.uniform(0, 0.02 if plan == "queued" else 0.2)
        task = asyncio.ensure_future(_consume(call, None))
        await asyncio.sleep(delay_s)
        call.cancel()
        return await task
    return await _consume(call, rng.randint(1, 3) if plan == "mid_decode" else None)


async def _drive(target, n, concurrency, cancel_fraction, seed, prompts, max_tokens):
    rng = random.Random(seed)
    plans = [
        rng.choice(CANCEL_POINTS) if rng.random() < cancel_fraction else "complete"
        for _ in range(n)
    ]
    channel = grpc.aio.insecure_channel(target)
    stub = pb_grpc.PagedJaxStub(channel)
    sem = asyncio.Semaphore(concurrency)
    codes = collections.Counter()

    async def run(i):
        async with sem:
            code = await _one(stub, target, i, plans[i], rng, prompts, max_tokens)
            codes[(plans[i], code)] += 1

    await asyncio.gather(*(run(i) for i in range(n)))
    await channel.close()
    return plans, codes


def soak(
    server, n: int, concurrency: int, cancel_fraction: float, prompts, max_tokens: int, seed=0
):
    """Runs the soak against a started PagedJaxServer; returns the report dict."""
    ends = _RequestEnds()
    logger = logging.getLogger("pagedjax.requests")
    logger.addHandler(ends)
    logger.setLevel(logging.INFO)
    start = time.monotonic()
    try:
        target = f"127.0.0.1:{server.port}"
        plans, codes = asyncio.run(
            _drive(target, n, concurrency, cancel_fraction, seed, prompts, max_tokens)
        )
        wall_s = time.monotonic() - start
        settle_end = time.monotonic() + server.config.dispatch_timeout_s + 30
        while time.monotonic() < settle_end and (
            server.loop.num_active()
            or server.loop.engine.has_unfinished()
            or sum(outcome_counts(server).values()) < calls_seen(server)
        ):
            time.sleep(0.1)
        time.sleep(0.5)  # the engine thread publishes stats every 0.1 s
    finally:
        logger.removeHandler(ends)
    stats = server.loop.engine.stats()
    ours = {f"soak-{i}" for i in range(n)}
    duplicates = [rid for rid, c in ends.by_id.items() if c > 1]
    not_cancelled_missing = [
        i for i in range(n) if plans[i] == "complete" and ends.by_id.get(f"soak-{i}", 0) != 1
    ]
    return {
        "requests": n,
        "wall_s": wall_s,
        "plans": dict(collections.Counter(plans)),
        "client_codes": {f"{p}:{c}": k for (p, c), k in sorted(codes.items())},
        "calls_seen": calls_seen(server),
        "outcomes_recorded": sum(outcome_counts(server).values()),
        "request_end_lines": ends.total,
        "request_ids_with_two_or_more_lines": len(duplicates),
        "completed_requests_without_exactly_one_line": len(not_cancelled_missing),
        "our_ids_logged": len(ours & set(ends.by_id)),
        "outcomes": {f"{o}{{{r}}}": v for (o, r), v in sorted(outcome_counts(server).items())},
        "kv_pages_used_at_end": stats.get("kv_pages_used"),
        "engine_unfinished_at_end": server.loop.engine.has_unfinished(),
    }
