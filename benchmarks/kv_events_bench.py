"""What llm-d KV-cache events cost the engine thread (engine/sched/kv_events.py,
serving/gateway/kv_events_publisher.py), per engine step, at 64 running sequences.

    python -m benchmarks.kv_events_bench                  # 64 sequences, 1500 steps
    python -m benchmarks.kv_events_bench --steps=200 --repeats=2   # smoke

The workload runs on the MockEngine: the real Scheduler and PagePool (where the events come
from: every page that fills is cached, evictions once the pool is full) with the device step
replaced by arithmetic. 64 requests decode at once (page_size 16: a page fills every 16
tokens of each) behind 4 shared system prompts; a finished request is replaced at once
(its prefill caches many pages). The pool's calls into the recorder are captured per step.

Timed (chunks of 20 steps, each the best of --repeats, so that the other processes on
this CPU bias it least):
  - engine thread: replaying each step's captured pool calls into a KvEventRecorder plus
    the per-iteration flush() into a live publisher (take, sequence number, put_nowait;
    its thread packs and sends to a ZMQ SUB draining it), minus the same loop without the
    recorder calls and flush: the events' cost per engine step, in microseconds;
  - publisher thread: msgpack of one step's batch (off the engine thread, but it
    shares the interpreter lock, so it is reported too);
  - the reference: the mock engine's own step (host only: scheduler, fake device, outputs)
    with events off, median; a real accelerator step adds the device time on top.
Whole-step on/off A/B at this size drowns in the CPU's noise (tried: +-200 us swings at a
load of 15 on 2 cores), hence the replay. The load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import msgpack
import zmq

from engine.api_types import EngineRequest
from engine.sampling.params import SamplingParams
from engine.sched.kv_events import KvEventRecorder
from serving.engine_host.mock_engine import MockEngine
from serving.gateway.kv_events_publisher import KvEventPublisher

PAGE = 16
CHUNK = 20  # steps timed together


def make_engine(num_seqs: int) -> MockEngine:
    return MockEngine(
        max_num_seqs=num_seqs,
        num_pages=num_seqs * 24,  # ~1.3x the working set: evictions happen
        page_size=PAGE,
        max_model_len=1024,
        max_num_batched_tokens=4096,
    )


def request(i: int) -> EngineRequest:
    system = [(7 * (i % 4) + j) % 250 + 1 for j in range(128)]  # 4 shared system prompts
    question = [(i * 31 + j) % 250 + 1 for j in range(64)]
    sp = SamplingParams(temperature=0.0, max_tokens=96 + (i % 5) * 16, ignore_eos=True)
    return EngineRequest(f"r{i}", system + question, sp)


class Capture:
    """Stands in for the recorder during the workload: the pool's calls, per step."""

    def __init__(self):
        self.steps: list[list[tuple[str, tuple]]] = [[]]

    def page_stored(self, *args) -> None:
        self.steps[-1].append(("page_stored", args))

    def page_removed(self, *args) -> None:
        self.steps[-1].append(("page_removed", args))

    def cleared(self) -> None:
        self.steps[-1].append(("cleared", ()))


def capture_workload(num_seqs: int, steps: int) -> tuple[list, float]:
    """(each step's pool calls, median step time in seconds with events off)."""
    engine = make_engine(num_seqs)
    capture = Capture()
    engine.pool.events = capture
    next_id = 0
    for _ in range(num_seqs):
        engine.add_request(request(next_id))
        next_id += 1
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - t0)
        capture.steps.append([])
        for out in outputs:
            if out.finished:
                engine.add_request(request(next_id))
                next_id += 1
    return capture.steps[:steps], statistics.median(times)


def replay_s(steps: list, publisher: KvEventPublisher | None) -> float:
    """Seconds to replay `steps` (pool calls + flush per step); None: the bare loop."""
    if publisher is None:
        t0 = time.perf_counter()
        for calls in steps:
            for _name, _args in calls:
                pass
        return time.perf_counter() - t0
    recorder = publisher.recorders[0]
    bound = {n: getattr(recorder, n) for n in ("page_stored", "page_removed", "cleared")}
    t0 = time.perf_counter()
    for calls in steps:
        for name, args in calls:
            bound[name](*args)
        publisher.flush()
    return time.perf_counter() - t0


def step_batches(steps: list) -> list:
    """The EventBatches one replay of `steps` makes (non-empty steps only)."""
    recorder = KvEventRecorder(PAGE)
    out = []
    for calls in steps:
        for name, args in calls:
            getattr(recorder, name)(*args)
        if recorder.pending:
            out.append([time.time(), recorder.take(), 0])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num_seqs", type=int, default=64)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    print(f"load average: {os.getloadavg()} ({os.cpu_count()} CPUs)")
    steps, step_s = capture_workload(args.num_seqs, args.steps)
    n = len(steps)
    engine = make_engine(args.num_seqs)
    publisher = KvEventPublisher(engine, "tcp://127.0.0.1:*", "kv@bench@mock")
    sub_ctx = zmq.Context()
    sub = sub_ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    # NOTE: timed in chunks of CHUNK steps, each the best of --repeats: a chunk takes ~1 ms,
    # short enough that most repeats run without being preempted on a loaded machine.
    on_s = off_s = 0.0
    batches = []
    for start in range(0, n, CHUNK):
        chunk = steps[start : start + CHUNK]
        off_s += min(replay_s(chunk, None) for _ in range(args.repeats))
        on_s += min(replay_s(chunk, publisher) for _ in range(args.repeats))
        while sub.poll(0):  # drain (keeps the PUB's queue short)
            batches.append(sub.recv_multipart()[2])
    while sub.poll(200):
        batches.append(sub.recv_multipart()[2])
    publisher.close()
    sub_ctx.destroy(linger=0)
    decoded = step_batches(steps)  # what one replay sends, as Python objects
    num_events = sum(len(d[1]) for d in decoded)
    num_blocks = sum(len(e[1]) for d in decoded for e in d[1] if e[0] != "AllBlocksCleared")
    num_bytes = sum(len(msgpack.packb(d)) for d in decoded)
    pack = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for d in decoded:
            msgpack.packb(d)
        pack.append(time.perf_counter() - t0)
    cost_us = 1e6 * (on_s - off_s) / n
    pack_us = 1e6 * min(pack) / n
    steps_per_s = 1 / step_s
    print(
        f"{args.num_seqs} sequences, {n} steps: {len(decoded)} batches, "
        f"{num_events / n:.2f} events and {num_blocks / n:.2f} blocks per step, "
        f"{num_bytes / n:.0f} payload bytes per step; received {len(batches)} of "
        f"{publisher.next_seq} batches sent; dropped {publisher.dropped._value.get():.0f}"
    )
    print(
        f"engine thread: {cost_us:.1f} us per step (recorder + flush; 20-step chunks, best of "
        f"{args.repeats}); publisher thread: {pack_us:.1f} us per step (msgpack; shares "
        f"the GIL); mock engine step (host only, events off): {1e6 * step_s:.0f} us median "
        f"-> events = {100 * cost_us / (1e6 * step_s):.1f}% of it; at {steps_per_s:.0f} "
        f"steps/s: {num_events / n * steps_per_s:.0f} events/s; load {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
