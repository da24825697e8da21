"""K/V over `jax.experimental.transfer` (device to device, no host copy), behind the same
KVTransfer.Prefill stream as the chunked gRPC bytes (serving/disagg/wire.py).

    python -m serving.server --role=prefill --kv_transport=jax ...   (and the decode workers)

    decode worker  Prefill call with metadata x-pagedjax-kv-transport: jax (its transport)
    prefill worker both sides want jax and its transfer server runs:
                     await_pull(uuid, the gathered pages: device arrays padded to the page
                     bucket, engine/kv_transfer/transfer.PendingExport), then KVChunk(header:
                     meta JSON, arrays' shapes, jax_address, jax_uuid) + KVChunk(trailer:
                     device_digest of the offered arrays, sha256 of the meta JSON and the
                     digest); no data chunks
                   otherwise: the gRPC byte stream (host copy + sha256 of everything)
    decode worker  a header with jax_address: connect (one connection per peer, kept) and
                   pull(uuid, shapes) -> device arrays; sha256 checked, then the pulled
                   arrays' digest against the sent one (DATA_LOSS on a mismatch); scattered
                   straight into its pages

So a worker with `--kv_transport=jax` talks to one without it over the gRPC stream (the
fallback), and one that cannot start a transfer server logs why and serves gRPC only.
Integrity: the K/V bytes cross JAX's transfer transport (TCP here) without a host copy, so
no sha256 can cover them; instead both sides reduce the arrays ON THE DEVICE to a 64-bit
digest per array (engine/kv_transfer/digest.py: exact uint32 arithmetic, 8 bytes back per array;
not cryptographic, it catches corruption in transit). Its cost is one read of the pages
on each side; `--nokv_jax_checksum` skips it (the prefill side then sends no digest, the
decode side does not recompute it; the metadata stays checksummed). An offer nobody pulls
(the decode side was cancelled) is dropped by the transfer server at its deadline
(`PULL_WINDOW_S`).

A failed pull: `pull` on JAX 0.10.2 neither fails nor returns when the peer is gone (a dead
address, or a live peer whose offer expired or was already pulled) -- it blocks. So a TCP
connect to the peer's transfer address comes first (a dead peer: JaxPullError at once), then
the pull runs on its own daemon thread and the caller waits at most `pull_timeout_s`
(PULL_TIMEOUT_S, capped by the Decode call's deadline); then JaxPullError. The decode worker
ends either as UNAVAILABLE before it has allocated any page (the prefill worker freed its
pages at the gather). A thread blocked on a live peer cannot be cancelled: it stays parked
until the process exits, where the runtime may abort ("terminate called ..." at exit).

On this CPU build (JAX 0.10.2) the transfer calls work between processes on one host:
tests/test_kv_transport_two_process.py runs a prefill worker, a decode worker and the router
as three processes with `--kv_transport=jax` (tokens equal one engine's, every request
pulled over jax), and tests/test_kv_transfer_serving.py both workers in one process (plus
the gRPC fallback and the failure paths). A decode worker inside a pytest process aborted
(SIGABRT) in its first pull on 2026-12-04; not seen with each worker in its own process.
On GPU/TPU the same calls move device memory over the network without staging it in host
memory (not run).
"""

from __future__ import annotations

import datetime
import logging
import random
import socket
import threading

from configs.errors import PagedJaxError
from engine.kv_transfer.transfer import (
    KV_FIELDS,
    KVMeta,
    KVPayload,
    PendingExport,
    payload_checksum,
)
from serving.proto import kv_transfer_pb2 as kv_pb

log = logging.getLogger("pagedjax.serving.kv")
TRANSPORTS = ("grpc", "jax")
TRANSPORT_METADATA = "x-pagedjax-kv-transport"
PULL_WINDOW_S = 60.0  # an offer not pulled by then is dropped
PULL_TIMEOUT_S = 30.0  # a pull not done by then fails (JaxPullError -> UNAVAILABLE)


class JaxPullError(PagedJaxError):
    """The pull from a peer's transfer server failed (unreachable, offer expired)."""


class JaxTransport:
    """One transfer server per worker process (`host`: the address peers reach it on)."""

    def __init__(self, host: str = "127.0.0.1", checksum: bool = True):
        """`checksum`: digest the offered pages / verify the pulled ones
        (engine/kv_transfer/digest.py)."""
        import jax
        from jax.experimental import transfer

        self._jax, self.checksum = jax, checksum
        self.pull_timeout_s = PULL_TIMEOUT_S
        client = jax.devices()[0].client
        bind = f"{host}:0" if ":" not in host else f"[{host}]:0"
        self.server = transfer.start_transfer_server(client, bind, [bind])
        self.address = self.server.address()
        self._connections: dict[str, object] = {}
        self._lock = threading.Lock()

    # ---- prefill side ---------------------------------------------------------------------
    def offer(self, pending: PendingExport, prefill_s: float) -> list[kv_pb.KVChunk]:
        """Make the gathered pages pullable; the chunks that tell the receiver how."""
        arrays = _arrays(pending.gathered)
        uuid = random.getrandbits(63)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=PULL_WINDOW_S)
        self.server.await_pull(uuid, [arrays[n] for n in arrays], timeout=deadline)
        header = kv_pb.KVHeader(
            meta_json=pending.meta.to_json(),
            arrays=[
                kv_pb.KVArray(name=n, dtype=a.dtype.name, shape=a.shape) for n, a in arrays.items()
            ],
            total_bytes=sum(a.nbytes for a in arrays.values()),
            prefill_s=prefill_s,
            jax_address=self.address,
            jax_uuid=uuid,
        )
        digest = ""
        if self.checksum:
            from engine.kv_transfer.digest import device_digest

            digest = device_digest(arrays)  # waits for the gather (on the device)
        trailer = kv_pb.KVTrailer(
            sha256=payload_checksum(pending.meta, {}, digest), device_digest=digest
        )
        return [kv_pb.KVChunk(header=header), kv_pb.KVChunk(trailer=trailer)]

    # ---- decode side ------------------------------------------------------------------------
    def pull(
        self, header: kv_pb.KVHeader, trailer: kv_pb.KVTrailer, timeout_s: float | None = None
    ) -> KVPayload:
        """The payload announced by `header` (its arrays pulled onto this device), checked
        against `trailer` (KVChecksumError); JaxPullError after min(timeout_s,
        pull_timeout_s) seconds."""
        jax = self._jax
        device = jax.devices()[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
        specs = [
            jax.ShapeDtypeStruct(tuple(a.shape), a.dtype, sharding=sharding) for a in header.arrays
        ]
        wait_s = min(self.pull_timeout_s, timeout_s or self.pull_timeout_s)
        pulled = self._pull_within(header.jax_address, header.jax_uuid, specs, wait_s)
        arrays = {a.name: x for a, x in zip(header.arrays, pulled)}
        payload = KVPayload(
            KVMeta.from_json(header.meta_json),
            arrays,
            trailer.sha256,
            on_device=True,
            device_digest=trailer.device_digest,
        )
        payload.verify()
        if self.checksum and payload.device_digest:
            payload.verify_device_digest()
        return payload

    def _pull_within(self, address: str, uuid: int, specs: list, wait_s: float) -> list:
        """The pulled arrays, or JaxPullError (unreachable, failed, or not done within
        `wait_s`)."""
        host, port = address.rsplit(":", 1)
        try:  # a dead peer fails here at once, leaving no blocked pull behind
            socket.create_connection((host.strip("[]"), int(port)), min(wait_s, 5.0)).close()
        except OSError as e:
            raise JaxPullError(f"jax transfer pull from {address}: unreachable ({e})") from e
        box: dict = {}

        def run() -> None:
            try:
                box["arrays"] = self._jax.block_until_ready(
                    self._connection(address).pull(uuid, specs)
                )
            except Exception as e:  # noqa: BLE001 - XLA runtime errors of the transfer
                box["error"] = e

        thread = threading.Thread(target=run, name=f"kv-pull-{uuid}", daemon=True)
        thread.start()
        thread.join(wait_s)
        if thread.is_alive() or "error" in box:
            with self._lock:
                self._connections.pop(address, None)  # a restarted peer gets a new one
        if thread.is_alive():
            raise JaxPullError(f"jax transfer pull from {address}: nothing within {wait_s:.1f}s")
        if "error" in box:
            raise JaxPullError(f"jax transfer pull from {address}: {box['error']}")
        return box["arrays"]

    def _connection(self, address: str):
        """One connection per peer, made outside the lock (a dead peer may block it)."""
        with self._lock:
            conn = self._connections.get(address)
        if conn is None:
            conn = self.server.connect(address)
            with self._lock:
                conn = self._connections.setdefault(address, conn)
        return conn


def _arrays(gathered) -> dict:
    return {n: getattr(gathered, n) for n in KV_FIELDS if getattr(gathered, n) is not None}


def start(transport: str, host: str, checksum: bool = True) -> JaxTransport | None:
    """The worker's JaxTransport for `--kv_transport=jax` (None for grpc, or when the
    transfer server cannot start here: logged, the gRPC stream serves)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"kv_transport={transport!r}: one of {TRANSPORTS}")
    if transport == "grpc":
        return None
    try:
        jt = JaxTransport(host, checksum)
    except Exception as e:  # noqa: BLE001 - e.g. a backend without transfer support
        log.warning("jax.experimental.transfer unavailable (%r): K/V over gRPC only", e)
        return None
    log.info("K/V transfer server (jax.experimental.transfer) on %s", jt.address)
    return jt
