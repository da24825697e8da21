"""The KV-cache event stream for llm-d's KV-cache indexer: ZMQ PUB, the wire format vLLM
emits (off unless the server runs with `--kv_events_endpoint`).

    engine thread                                   publisher thread ("kv-events")
    page pool -> KvEventRecorder.pending            |
    EngineLoop iteration end: flush()  --bounded--> queue.get -> msgpack -> PUB socket
      (take() + seq number + put_nowait; a full       [topic, seq (8 bytes, big-endian),
       queue drops the batch and counts it: the        payload]; the last `replay_batches`
       engine never waits on a subscriber)             kept for the ROUTER replay socket

Message: multipart `[topic, seq, payload]`, topic `kv@<pod-id>@<model-name>`, payload the
msgpack array `[timestamp, [events...], data_parallel_rank]` (engine/sched/kv_events.py has the
events). Sequence numbers are given at flush, one per batch, from 0: a dropped batch leaves a
gap a subscriber can see (and `pagedjax_kv_events_dropped_batches_total` counts it).

Endpoint: like vLLM, an address with `*` (or `::`, ipc://, inproc://) is bound
(`tcp://*:5557`: subscribers connect to the pod), any other is connected to
(`tcp://epp:5557`: the indexer binds and every pod connects to it).

Replay (`--kv_events_replay_endpoint`, optional): a ROUTER socket; a DEALER/REQ client sends
a start sequence number (8 bytes, big-endian) and gets `[seq, payload]` for each buffered
batch from there, then `[-1 (8 bytes, signed), b""]`, as vLLM's.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import threading
import time

import msgpack
import prometheus_client as prom
import zmq

from engine.sched import kv_events

log = logging.getLogger("pagedjax.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def default_topic(model_name: str, pod_id: str | None = None) -> str:
    """`kv@<pod-id>@<model-name>`; the pod id defaults to $POD_IP (the llm-d manifests set it
    from the downward API), else the host name."""
    pod_id = pod_id or os.environ.get("POD_IP") or socket.gethostname()
    return f"kv@{pod_id}@{model_name}"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    def __init__(
        self,
        engine,
        endpoint: str,
        topic: str,
        *,
        replay_endpoint: str | None = None,
        max_queue_batches: int = 1024,
        replay_batches: int = 10_000,
        hwm: int = 100_000,
        registry: prom.CollectorRegistry | None = None,
    ):
        self.recorders = kv_events.attach(engine)
        self.topic = topic.encode()
        self._queue: queue.Queue = queue.Queue(max_queue_batches)
        self._replay_buffer: collections.deque = collections.deque(maxlen=replay_batches)
        self.next_seq = 0  # engine thread only
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            (self._pub.bind if _binds(endpoint) else self._pub.connect)(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(f"kv_events_endpoint={endpoint!r} is invalid: {e}") from e
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        counter = lambda name, doc: prom.Counter(name, doc, registry=registry)  # noqa: E731
        self.published = counter("pagedjax_kv_events_batches", "KV event batches sent")
        self.events_sent = counter("pagedjax_kv_events", "KV events sent (in the batches sent)")
        self.dropped = counter(
            "pagedjax_kv_events_dropped_batches", "KV event batches dropped (publish queue full)"
        )
        self.dropped_events = counter(
            "pagedjax_kv_events_dropped_events", "KV events in the dropped batches"
        )
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ---- engine thread ---------------------------------------------------------------------
    def flush(self) -> None:
        """Hand the events recorded since the last flush to the publisher thread, one batch
        per data-parallel rank; never blocks."""
        for rank, recorder in enumerate(self.recorders):
            if recorder.pending:
                self._offer(recorder.take(), rank)

    def replace_engine(self, engine) -> None:
        """A reload: the old engine's cache is gone; record on the new one's pools."""
        self.flush()
        self.recorders = kv_events.attach(engine)
        self._offer([["AllBlocksCleared"]], 0)

    def _offer(self, events: list, rank: int) -> None:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events, rank))
        except queue.Full:
            self.dropped.inc()
            self.dropped_events.inc(len(events))

    # ---- publisher thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, events, rank = item
            payload = msgpack.packb([ts, events, rank])
            seq_bytes = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self.topic, seq_bytes, payload))
            except zmq.ZMQError:  # the batch is lost (a gap in seq); the stream goes on
                log.exception("kv events: sending batch %d failed", seq)
                continue
            self._replay_buffer.append((seq_bytes, seq, payload))
            self.published.inc()
            self.events_sent.inc(len(events))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq_bytes, seq, payload in list(self._replay_buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq_bytes, payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to timeout_s), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning("kv events: publish queue still full at close")
        self._thread.join(timeout_s)
        self._ctx.destroy(linger=0)
