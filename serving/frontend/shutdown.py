"""Graceful shutdown: drain what was admitted, refuse what is new, leave no call unrecorded.

    SIGTERM (or SIGINT) -> drain(server, drain_timeout_s), on a thread of its own:
      1. health NOT_SERVING; new Generate calls get UNAVAILABLE + retry-after-ms
         (rejected{draining}); Tokenize / ServerInfo / ListModels keep working
      2. admitted requests (queued and running) go on until they finish or drain_timeout_s
      3. whatever is left then is cancelled: outcome cancelled{shutdown}, stream closed with
         CANCELLED "server shutting down", engine abort (pages freed)
      4. the gRPC server stops once the handlers have sent their last message (grace_s)
    and the process exits 0.
    SIGHUP -> build the engine again (new revision on disk) and PagedJaxServer.reload to it.

Every call keeps exactly one outcome: the ledger's once-only settlement decides between a
request finishing and the shutdown cancelling it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import grpc

from serving.frontend.request_state import Terminal

log = logging.getLogger("pagedjax.serving")


def drain(server, drain_timeout_s: float, grace_s: float = 1.0) -> int:
    """Drain and stop `server` (a PagedJaxServer); returns how many requests were cut off."""
    server.begin_drain()
    end = time.monotonic() + drain_timeout_s
    while server.loop.num_active() and time.monotonic() < end:
        time.sleep(0.02)
    cut = cancel_remaining(server)
    if cut:
        log.warning("drain timeout %.1fs passed: cancelled %d request(s)", drain_timeout_s, cut)
    deadline = time.monotonic() + grace_s
    while server.loop.num_active() and time.monotonic() < deadline:
        time.sleep(0.02)
    server.stop(grace_s)
    return cut


def cancel_remaining(server) -> int:
    cut = 0
    for r in server.loop.active_requests():
        details = "server shutting down (drain timeout passed)"
        if server.ledger.settle(r, "cancelled", "shutdown", grpc.StatusCode.CANCELLED, details):
            cut += 1
            r.stream.close(Terminal(grpc.StatusCode.CANCELLED, details))
            server.loop.abort(r.request_id)
    return cut


def install_signal_handlers(server, drain_timeout_s: float, build_engine=None) -> threading.Event:
    """SIGTERM and SIGINT start a drain on a thread of their own; the returned event is set
    once the server has stopped (main waits on it, then exits 0). With `build_engine`, SIGHUP
    builds a fresh engine (the model files' current revision) beside the running one and
    swaps to it (PagedJaxServer.reload)."""
    stopped = threading.Event()
    if build_engine is not None:

        def reload():
            try:
                server.reload(build_engine())
            except Exception:
                log.exception("reload failed; still serving the loaded engine")

        signal.signal(
            signal.SIGHUP,
            lambda signum, frame: threading.Thread(target=reload, name="reload").start(),
        )
    started = threading.Lock()

    def on_signal(signum, frame):
        if not started.acquire(blocking=False):
            return  # already draining
        log.info("signal %d: draining for up to %.1fs", signum, drain_timeout_s)

        def run():
            try:
                drain(server, drain_timeout_s)
            finally:
                stopped.set()

        threading.Thread(target=run, name="drain", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stopped
