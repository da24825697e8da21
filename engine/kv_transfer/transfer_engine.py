"""KVTransferEngine: an EngineCore that can also export a request's K/V when it ends
(prefill worker) and start a request from imported K/V (decode worker).

It implements engine/interface.py's `Engine` Protocol by delegating to the core, so the
serving layer's one engine thread drives it unchanged. Two thread-safe mailboxes connect it
to the gRPC handler threads (serving/disagg/service.py):

    prefill:  handler: expect_export(id) -> submit the request (max_tokens=1) -> wait
              engine thread, in step(): the scheduler's on_finish hook takes a reference on
                the ending request's pages (stop / length only); after core.step() returns,
                each held request's gather is dispatched (engine/kv_transfer/transfer.start_export:
                metadata + one jitted gather, no wait), its references are dropped and the
                PendingExport is published: the engine thread never waits on a
                device-to-host copy or hashes megabytes between two steps
              handler: take_export(id) -> host copy + checksum on the handler's thread
                (waits for the gather) -> stream it; or take_pending(id) -> the gathered
                device arrays (jax.experimental.transfer: no host copy at all);
                discard_export(id) in every case
    decode:   handler: receive + verify the payload -> stage(id, payload) -> submit
              engine thread, add_request(er): a staged payload is imported
                (engine/kv_transfer/transfer.import_request); its first token's delta is returned by
                the next step(); without a staged payload, a plain add_request
              handler: unstage(id) when the call ends (a payload never fed is dropped)

Pages: an exported request's pages are freed as soon as the gather is done (the payload is
host memory), so a cancelled or dead transfer leaks nothing on the prefill side; an imported
request's pages are ordinary scheduler pages, freed when it ends or is cancelled.
"""

from __future__ import annotations

import logging
import threading
import time

from engine.api_types import EngineRequest, RequestOutput
from engine.kv_transfer.transfer import (
    KVChecksumError,
    KVPayload,
    KVTransferMismatchError,
    PendingExport,
    import_request,
    start_export,
    warm_transfer_programs,
)
from engine.sched.request import Request

log = logging.getLogger(__name__)
_EXPORTABLE = ("stop", "length")


class KVTransferEngine:
    def __init__(self, core):
        self.core = core
        self.replicas = [core]  # warm-up (serving/server.py engine_warmup) runs on the core
        core.scheduler.on_finish = self._on_finish
        self._lock = threading.Condition()
        self._export_ids: set[str] = set()  # handler threads add; engine thread reads
        self._exported: dict[str, PendingExport] = {}
        self._staged: dict[str, KVPayload] = {}
        self._held: dict[str, tuple[Request, list[int]]] = {}  # engine thread only
        self._early_outputs: list[RequestOutput] = []  # imports' first tokens
        self.counters = {
            "kv_exports": 0,
            "kv_export_bytes": 0,  # host payloads (take_export; not the jax transport's)
            "kv_export_s": 0.0,  # handler threads: host copy + checksum
            "kv_export_engine_s": 0.0,  # engine thread: metadata + dispatching the gather
            "kv_imports": 0,
            "kv_import_bytes": 0,
            "kv_import_s": 0.0,
            "kv_import_fallbacks": 0,
        }

    # ---- the Engine Protocol ---------------------------------------------------------------
    @property
    def identity(self):
        return self.core.identity

    @property
    def tokenizer(self):
        return self.core.tokenizer

    def __getattr__(self, name):  # config, model, pool, reload_model, runner, warm-up ...
        return getattr(self.core, name)

    def add_request(self, er: EngineRequest, cache_salt: str | None = None) -> None:
        with self._lock:
            payload = self._staged.pop(er.request_id, None)
        if payload is None:
            self.core.add_request(er, cache_salt)
            return
        t0 = time.perf_counter()
        try:
            outs = import_request(self.core, er, payload, cache_salt)
        except (KVTransferMismatchError, KVChecksumError) as e:
            # checked on the handler thread already; this engine changed since (a reload)
            log.warning("request %s: K/V not imported (%s); recomputing", er.request_id, e)
            outs = []
            self.core.add_request(er, cache_salt)
        if not outs:  # no room: queued as a plain request (recomputes its prompt)
            self.counters["kv_import_fallbacks"] += 1
            return
        self.counters["kv_imports"] += 1
        self.counters["kv_import_bytes"] += payload.num_bytes
        self.counters["kv_import_s"] += time.perf_counter() - t0
        self._early_outputs += outs

    def abort_request(self, request_id: str) -> None:
        self.core.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._early_outputs) or self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs, self._early_outputs = self._early_outputs, []
        outputs += self.core.step()
        if self._held:
            self._export_held(outputs)
        return outputs

    def stats(self) -> dict:
        return {**self.core.stats(), **self.counters}

    # ---- prefill side -------------------------------------------------------------------------
    def expect_export(self, request_id: str) -> None:
        """Export `request_id`'s K/V when it ends (call before submitting it)."""
        with self._lock:
            self._export_ids.add(request_id)

    def take_export(self, request_id: str, timeout_s: float) -> KVPayload | None:
        """The payload of an exported request (None: none within `timeout_s`): its host
        copy and checksum run here, on the caller's thread."""
        pending = self.take_pending(request_id, timeout_s)
        if pending is None:
            return None
        t0 = time.perf_counter()
        payload = pending.finish()
        with self._lock:
            self.counters["kv_export_bytes"] += payload.num_bytes
            self.counters["kv_export_s"] += time.perf_counter() - t0
        return payload

    def take_pending(self, request_id: str, timeout_s: float) -> PendingExport | None:
        """The exported request's metadata and gathered device arrays (no host copy)."""
        with self._lock:
            self._lock.wait_for(lambda: request_id in self._exported, timeout_s)
            return self._exported.pop(request_id, None)

    def discard_export(self, request_id: str) -> None:
        with self._lock:
            self._export_ids.discard(request_id)
            self._exported.pop(request_id, None)

    def _on_finish(self, request: Request, reason: str) -> None:
        """Scheduler hook (engine thread), before the pages are freed: keep them."""
        rid = request.request_id
        with self._lock:
            wanted = rid in self._export_ids
        if not wanted or reason not in _EXPORTABLE or request.num_output_tokens != 1:
            return
        num_pages = self.core.pool.pages_for_tokens(request.num_prompt_tokens)
        pages = request.page_ids[:num_pages]
        self.core.pool.acquire(pages)
        self._held[rid] = (request, pages)

    def _export_held(self, outputs: list[RequestOutput]) -> None:
        logprobs = {o.request_id: o.logprobs[0] for o in outputs if o.logprobs}
        for rid, (request, pages) in list(self._held.items()):
            t0 = time.perf_counter()
            try:
                pending = start_export(self.core, request, pages, logprobs.get(rid))
            finally:  # safe before the gather ran: see start_export
                self.core.pool.free(pages, time.monotonic())
                del self._held[rid]
            self.counters["kv_exports"] += 1
            self.counters["kv_export_engine_s"] += time.perf_counter() - t0
            with self._lock:
                if rid in self._export_ids:
                    self._export_ids.discard(rid)
                    self._exported[rid] = pending
                    self._lock.notify_all()

    def warm_transfer(self, role: str, on_device: bool = False) -> int:
        """Engine thread, at start-up: compile the gather (role prefill) and scatter (role
        decode; `on_device`: of pulled device arrays too) programs of every page-count
        bucket. Returns the programs run."""
        return warm_transfer_programs(
            self.core, gather=role == "prefill", scatter=role == "decode", on_device=on_device
        )

    # ---- decode side --------------------------------------------------------------------------
    def stage(self, request_id: str, payload: KVPayload) -> None:
        """Import `payload` when the request `request_id` is added (call before submitting)."""
        with self._lock:
            self._staged[request_id] = payload

    def unstage(self, request_id: str) -> None:
        with self._lock:
            self._staged.pop(request_id, None)
