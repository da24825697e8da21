"""The gRPC driver: many concurrent Generate streams on one asyncio loop (grpc.aio).

    schedule (open loop) ---> dispatch_open_loop: sleep until each arrival, start a task
    workers  (closed loop) -> dispatch_closed_loop: N workers, next request when one ends
                                   |
                                   v
    run_one(stub, spec): send, read chunks (client arrival time per chunk, server stamp per
    token), cancel at the planned token, map the final message / gRPC status to an outcome
                                   |
                                   v
                          RequestRecord per request (metrics.py)

Every started request produces exactly one record, whatever happens (so outcome counts add up
to requests sent). Requests still running after the drain timeout are cancelled by the
client and recorded as timed_out with reason "client_drain".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import grpc

from serving.capacity.loadgen.metrics import RequestRecord
from serving.capacity.loadgen.workloads import RequestSpec
from serving.proto import pagedjax_pb2 as pb
from serving.proto import pagedjax_pb2_grpc as pb_grpc

PRIORITY = {-1: pb.PRIORITY_LOW, 0: pb.PRIORITY_NORMAL, 1: pb.PRIORITY_HIGH}
SUCCESS_REASONS = ("stop", "length")
# gRPC status -> (outcome, reason prefix). CANCELLED is ours only when we asked for it.
STATUS_OUTCOME = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: ("rejected", "resource_exhausted"),
    grpc.StatusCode.UNAVAILABLE: ("rejected", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: ("timed_out", "deadline_exceeded"),
    grpc.StatusCode.ABORTED: ("failed", "aborted"),
    grpc.StatusCode.INVALID_ARGUMENT: ("failed", "invalid_argument"),
    grpc.StatusCode.INTERNAL: ("failed", "internal"),
}

SendFn = Callable[[RequestSpec, float], Awaitable[RequestRecord]]


def build_request(
    spec: RequestSpec, ignore_eos: bool, temperature: float, seed: int | None
) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    return pb.GenerateRequest(
        request_id=spec.request_id,
        text=spec.prompt,
        sampling=sampling,
        max_tokens=spec.max_tokens,
        ignore_eos=ignore_eos,
        stream=True,
        priority=PRIORITY.get(max(-1, min(1, spec.priority)), pb.PRIORITY_NORMAL),
    )


def new_record(spec: RequestSpec, scheduled_s: float | None) -> RequestRecord:
    return RequestRecord(
        spec.request_id,
        spec.workload,
        spec.tenant,
        spec.priority,
        scheduled_s=scheduled_s,
        max_tokens=spec.max_tokens,
        cancel_after_tokens=spec.cancel_after_tokens,
    )


def absorb_message(rec: RequestRecord, msg: pb.GenerateResponse, now: float) -> None:
    """One streamed message: client arrival time per chunk, server stamp per token."""
    n = len(msg.token_ids)
    if n:
        rec.first_token_s = rec.first_token_s or now
        rec.chunk_times_s.append(now)
        rec.chunk_tokens.append(n)
        rec.token_times_s.extend(t * 1e-9 for t in msg.token_times_unix_ns)
        rec.num_output_tokens += n
    if msg.HasField("final"):
        _absorb_final(rec, msg.final)


def _absorb_final(rec: RequestRecord, final: pb.FinalInfo) -> None:
    rec.reason = final.finish_reason
    rec.outcome = "success" if final.finish_reason in SUCCESS_REASONS else "failed"
    rec.num_prompt_tokens = final.usage.prompt_tokens
    rec.num_cached_tokens = final.usage.cached_tokens
    rec.num_output_tokens = final.usage.completion_tokens
    rec.queue_s = final.timings.queue_s


def _absorb_status(rec: RequestRecord, err: grpc.aio.AioRpcError, cancelled_by_us: bool):
    code = err.code()
    if code == grpc.StatusCode.CANCELLED and cancelled_by_us:
        rec.outcome, rec.reason = "cancelled", "client_cancel"
        return
    outcome, prefix = STATUS_OUTCOME.get(code, ("failed", code.name.lower()))
    rec.outcome, rec.reason = outcome, f"{prefix}: {err.details() or ''}".strip()


async def run_one(
    stub: pb_grpc.PagedJaxStub,
    spec: RequestSpec,
    *,
    scheduled_s: float | None,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    seed: int | None = None,
    timeout_s: float | None = None,
    early_cancel_s: float = 0.2,
    api_keys: dict[str, str] | None = None,
) -> RequestRecord:
    """Sends one request, reads its stream to the end, returns what it observed.

    The server knows tenants by API key: `api_keys` maps the spec's tenant to the key sent as
    `x-api-key` ("*": the key of every other tenant; no key: the server's anonymous tenant).
    """
    rec = new_record(spec, scheduled_s)
    keys = api_keys or {}
    key = keys.get(spec.tenant, keys.get("*"))
    md = (("x-api-key", key),) if key else None
    rec.send_s = time.perf_counter()
    call = stub.Generate(
        build_request(spec, ignore_eos, temperature, seed), timeout=timeout_s, metadata=md
    )
    cancelled_by_us = False
    canceller = None
    early = {"fired": False}
    if spec.cancel_after_tokens == 0:  # cancel before (probably) any token arrives

        def _early_cancel():
            early["fired"] = True
            call.cancel()

        canceller = asyncio.get_running_loop().call_later(early_cancel_s, _early_cancel)
    try:
        async for msg in call:
            absorb_message(rec, msg, time.perf_counter())
            cancel_at = spec.cancel_after_tokens
            if cancel_at and rec.num_output_tokens >= cancel_at and not msg.HasField("final"):
                cancelled_by_us = True
                call.cancel()
                break
    except grpc.aio.AioRpcError as err:
        _absorb_status(rec, err, cancelled_by_us or early["fired"])
    except asyncio.CancelledError:
        # NOTE: grpc.aio raises CancelledError in the reader after call.cancel(); only a
        # cancellation of this task itself (the drain timeout) is propagated.
        if early["fired"] and not asyncio.current_task().cancelling():
            cancelled_by_us = True
        else:
            call.cancel()
            rec.outcome, rec.reason = "timed_out", "client_drain"
            rec.end_s = time.perf_counter()
            raise
    finally:
        if canceller is not None:
            canceller.cancel()
    rec.end_s = time.perf_counter()
    if cancelled_by_us:
        rec.outcome, rec.reason = "cancelled", "client_cancel"
    elif rec.outcome == "failed" and not rec.reason:
        rec.reason = "stream ended without a final message"
    if rec.outcome != "cancelled" and len(rec.token_times_s) != rec.num_output_tokens:
        rec.token_times_s = []  # partial stamps: fall back to chunk times
    return rec


async def _gather_with_drain(
    tasks: dict[asyncio.Task, RequestRecord], drain_timeout_s: float
) -> list[RequestRecord]:
    if tasks:
        await asyncio.wait(list(tasks), timeout=drain_timeout_s)
    records = []
    for task, placeholder in tasks.items():
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if task.done() and not task.cancelled() and task.exception() is None:
            records.append(task.result())
        else:
            if task.done() and not task.cancelled() and task.exception() is not None:
                placeholder.outcome = "failed"
                placeholder.reason = f"client_error: {task.exception()!r}"
            else:
                placeholder.outcome, placeholder.reason = "timed_out", "client_drain"
            placeholder.end_s = placeholder.end_s or time.perf_counter()
            records.append(placeholder)
    return records


async def dispatch_open_loop(
    specs: list[RequestSpec],
    send: SendFn,
    *,
    start_s: float,
    duration_s: float,
    drain_timeout_s: float,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], Awaitable] = asyncio.sleep,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Starts each spec at start_s + spec.arrival_s; stops starting at start_s + duration_s."""
    tasks: dict[asyncio.Task, RequestRecord] = {}
    for spec in specs:
        target = start_s + spec.arrival_s
        if spec.arrival_s >= duration_s:
            break
        delay = target - clock()
        if delay > 0:
            await sleep(delay)
        task = asyncio.ensure_future(send(spec, target))
        if on_done is not None:
            task.add_done_callback(lambda t: t.cancelled() or t.exception() or on_done(t.result()))
        placeholder = new_record(spec, target)
        placeholder.send_s = clock()
        tasks[task] = placeholder
    return await _gather_with_drain(tasks, drain_timeout_s)


async def dispatch_closed_loop(
    next_spec: Callable[[], RequestSpec],
    send: SendFn,
    *,
    concurrency: int,
    duration_s: float,
    max_requests: int,
    drain_timeout_s: float,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """`concurrency` workers; each sends its next request when the previous one ends."""
    start = time.perf_counter()
    records: list[RequestRecord] = []
    started = 0

    async def worker():
        nonlocal started
        while started < max_requests and time.perf_counter() - start < duration_s:
            started += 1
            spec = next_spec()
            spec.arrival_s = time.perf_counter() - start
            placeholder = new_record(spec, time.perf_counter())
            placeholder.send_s = placeholder.scheduled_s
            try:
                rec = await send(spec, placeholder.scheduled_s)
            except asyncio.CancelledError:
                placeholder.outcome, placeholder.reason = "timed_out", "client_drain"
                placeholder.end_s = time.perf_counter()
                records.append(placeholder)
                raise
            records.append(rec)
            if on_done is not None:
                on_done(rec)

    workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    await asyncio.wait(workers, timeout=duration_s + drain_timeout_s)
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    return records
