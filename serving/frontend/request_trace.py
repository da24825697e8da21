"""Per-request timeline (`--trace_requests=FILE`, issue 39): where each request's time goes.

Off by default. When on, the server appends Chrome trace events (the JSON array format that
Perfetto's UI and chrome://tracing open; the closing bracket may be missing, which both
accept, so the file is readable while the server runs and after a crash) to FILE:

    pid 1 "engine"    one complete event per engine.step() call on the engine thread, with
                      the step it processed: its padded shape (Sd, Tp, Sp, P), the tokens
                      it computed, its requests, and the thread's time in the call
    pid 2 "requests"  one track per request (tid = its arrival number), its phases as
                      complete events: parse (HTTP body + schema), admit (tokenize + chat
                      template + admission), queue (waiting queue -> engine), prefill
                      (engine -> first token), decode (first -> last token), deliver (last
                      token -> the outcome was recorded: for HTTP, the last byte handed to
                      the socket); args: tokens, steps it was in, outcome

A request's engine steps are the "engine" events under its prefill and decode spans (the
viewer lines them up by time); `steps` in its args counts them. Each event is one
`json.dumps` and a locked write of a few hundred bytes: cheap next to a step, but not free,
so it stays off unless asked for.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time

_US = 1e6


class RequestTrace:
    """Appends trace events to `path` (see the module docstring). Thread-safe."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        # line-buffered: readable while the server runs; closed by close()
        self._file = open(path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._file.write("[\n")
        self._ids = itertools.count(1)
        self._marks: dict[str, dict[str, float]] = {}  # HTTP request id -> phase ends
        self._steps = 0
        self._meta(1, "engine")
        self._meta(2, "requests")

    # ---- writers -------------------------------------------------------------------------------
    def _write(self, event: dict) -> None:
        line = json.dumps(event, separators=(",", ":")) + ",\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)

    def _meta(self, pid: int, name: str) -> None:
        self._write({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}})

    def _span(self, pid: int, tid: int, name: str, start_s: float, end_s: float, args=None):
        event = {
            "ph": "X",
            "pid": pid,
            "tid": tid,
            "name": name,
            "ts": round(start_s * _US, 1),
            "dur": round(max(0.0, end_s - start_s) * _US, 1),
        }
        if args:
            event["args"] = args
        self._write(event)

    # ---- hooks ---------------------------------------------------------------------------------
    def mark(self, http_request_id: str, phase: str, t_s: float | None = None) -> None:
        """The end of a phase that happened before the engine request existed (HTTP)."""
        if len(self._marks) > 65536:  # refused calls leave marks nobody settles: bound them
            self._marks.clear()
        self._marks.setdefault(http_request_id, {})[phase] = (
            time.monotonic() if t_s is None else t_s
        )

    def step(self, start_s: float, end_s: float, info: dict | None, num_outputs: int) -> None:
        """One engine.step() call; `info`: the processed step's shape and sizes, if known."""
        self._steps += 1
        args = {"outputs": num_outputs, **(info or {})}
        self._span(1, 1, "step", start_s, end_s, args)

    def request(self, r, outcome: str, end_s: float) -> None:
        """A settled request (serving/frontend/request_state.py ActiveRequest): its phases."""
        tid = next(self._ids)
        marks = self._marks.pop(r.request_id.rsplit("-", 1)[0], None) or {}
        t = r.arrival_s
        phases = []
        for name in ("parse", "admit"):
            if name in marks:
                phases.append((name, t, marks[name]))
                t = marks[name]
        if r.added_s is not None:
            phases.append(("queue", t, r.added_s))
            t = r.added_s
        times = r.token_times_s
        if times:
            phases.append(("prefill", t, times[0]))
            if len(times) > 1:
                phases.append(("decode", times[0], times[-1]))
            t = times[-1]
        phases.append(("deliver" if times else "end", t, end_s))
        steps = sum(1 for _ in times)
        args = {
            "request_id": r.request_id,
            "outcome": outcome,
            "prompt_tokens": r.num_prompt_tokens or len(r.engine_request.prompt_token_ids),
            "cached_tokens": r.num_cached_tokens,
            "output_tokens": len(times),
            "steps_with_a_token": steps,
        }
        self._write({"ph": "M", "pid": 2, "tid": tid, "name": "thread_name",
                     "args": {"name": r.request_id}})  # fmt: skip
        for name, start, end in phases:
            self._span(2, tid, name, start, end, args if name == phases[-1][0] else None)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
