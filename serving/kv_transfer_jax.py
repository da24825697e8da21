"""K/V over `jax.experimental.transfer` (device to device, no host copy), behind the same
KVTransfer.Prefill stream as the chunked gRPC bytes (serving/kv_transfer_wire.py).

    python -m serving.server --role=prefill --kv_transport=jax ...   (and the decode workers)

    decode worker  Prefill call with metadata x-pagedjax-kv-transport: jax (its transport)
    prefill worker both sides want jax and its transfer server runs:
                     await_pull(uuid, the gathered pages: device arrays padded to the page
                     bucket, engine/kv_transfer.PendingExport), then KVChunk(header:
                     meta JSON, arrays' shapes, jax_address, jax_uuid) + KVChunk(trailer:
                     sha256 of the meta JSON); no data chunks
                   otherwise: the gRPC byte stream (host copy + sha256 of everything)
    decode worker  a header with jax_address: connect (one connection per peer, kept) and
                   pull(uuid, shapes) -> device arrays, scattered straight into its pages

So a worker with `--kv_transport=jax` talks to one without it over the gRPC stream (the
fallback), and one that cannot start a transfer server logs why and serves gRPC only.
Integrity: the K/V bytes cross JAX's transfer transport (TCP here), which the sha256 no
longer covers; the metadata still is. An offer nobody pulls (the decode side was cancelled)
is dropped by the transfer server at its deadline (`PULL_WINDOW_S`).

On this CPU build (JAX 0.10.2) the transfer server works between two processes on one host
(measured in benchmarks/RESULTS.md); on GPU/TPU the same calls move device memory over the
network without staging it in host memory.
"""

from __future__ import annotations

import datetime
import logging
import random
import threading

from configs.errors import PagedJaxError
from engine.kv_transfer import KV_FIELDS, KVMeta, KVPayload, PendingExport, payload_checksum
from serving.proto import kv_transfer_pb2 as kv_pb

log = logging.getLogger("pagedjax.serving.kv")
TRANSPORTS = ("grpc", "jax")
TRANSPORT_METADATA = "x-pagedjax-kv-transport"
PULL_WINDOW_S = 60.0  # an offer not pulled by then is dropped


class JaxPullError(PagedJaxError):
    """The pull from a peer's transfer server failed (unreachable, offer expired)."""


class JaxTransport:
    """One transfer server per worker process (`host`: the address peers reach it on)."""

    def __init__(self, host: str = "127.0.0.1"):
        import jax
        from jax.experimental import transfer

        self._jax = jax
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
        trailer = kv_pb.KVTrailer(sha256=payload_checksum(pending.meta, {}))
        return [kv_pb.KVChunk(header=header), kv_pb.KVChunk(trailer=trailer)]

    # ---- decode side ------------------------------------------------------------------------
    def pull(self, header: kv_pb.KVHeader, checksum: str) -> KVPayload:
        """The payload announced by `header` (its arrays pulled onto this device)."""
        jax = self._jax
        device = jax.devices()[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
        specs = [
            jax.ShapeDtypeStruct(tuple(a.shape), a.dtype, sharding=sharding) for a in header.arrays
        ]
        try:
            pulled = self._connection(header.jax_address).pull(header.jax_uuid, specs)
            jax.block_until_ready(pulled)
        except Exception as e:  # noqa: BLE001 - XLA runtime errors of the transfer
            raise JaxPullError(f"jax transfer pull from {header.jax_address}: {e}") from e
        arrays = {a.name: x for a, x in zip(header.arrays, pulled)}
        payload = KVPayload(KVMeta.from_json(header.meta_json), arrays, checksum, on_device=True)
        payload.verify()
        return payload

    def _connection(self, address: str):
        with self._lock:
            if address not in self._connections:
                self._connections[address] = self.server.connect(address)
            return self._connections[address]


def _arrays(gathered) -> dict:
    return {n: getattr(gathered, n) for n in KV_FIELDS if getattr(gathered, n) is not None}


def start(transport: str, host: str) -> JaxTransport | None:
    """The worker's JaxTransport for `--kv_transport=jax` (None for grpc, or when the
    transfer server cannot start here: logged, the gRPC stream serves)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"kv_transport={transport!r}: one of {TRANSPORTS}")
    if transport == "grpc":
        return None
    try:
        jt = JaxTransport(host)
    except Exception as e:  # noqa: BLE001 - e.g. a backend without transfer support
        log.warning("jax.experimental.transfer unavailable (%r): K/V over gRPC only", e)
        return None
    log.info("K/V transfer server (jax.experimental.transfer) on %s", jt.address)
    return jt
