"""A KV payload (engine/kv_transfer/transfer.py) as a chunked gRPC stream, and back.

    KVChunk(header: meta JSON, [name, dtype, shape] per array, total bytes, prefill_s)
    KVChunk(data: <= chunk_bytes)  ...  the arrays' bytes, concatenated in header order
    KVChunk(trailer: sha256)            over the meta JSON and the arrays (KVPayload.checksum)

The receiver rebuilds the arrays, refuses a stream whose sizes disagree with its header
(KVWireError) and checks the sha256 (engine.kv_transfer.transfer.KVChecksumError). A header with
`jax_address` is followed by the trailer alone: the arrays are pulled with
jax.experimental.transfer (serving/disagg/jax_transfer.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator

import numpy as np

from configs.errors import PagedJaxError
from engine.kv_transfer.transfer import KV_FIELDS, KVMeta, KVPayload
from serving.proto import kv_transfer_pb2 as kv_pb

DEFAULT_CHUNK_BYTES = 1 << 20  # well under gRPC's default 4 MiB message limit


class KVWireError(PagedJaxError):
    """The chunk stream is malformed (order, sizes)."""


@dataclasses.dataclass(frozen=True)
class TransferStats:
    num_bytes: int
    transfer_s: float  # header received -> trailer received (the bytes on the wire)
    prefill_s: float  # the prefill worker's arrival -> export (from the header)

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else float("inf")


def payload_chunks(
    payload: KVPayload, prefill_s: float, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[kv_pb.KVChunk]:
    names = [n for n in KV_FIELDS if n in payload.arrays]
    header = kv_pb.KVHeader(
        meta_json=payload.meta.to_json(),
        arrays=[
            kv_pb.KVArray(name=n, dtype=payload.arrays[n].dtype.name, shape=payload.arrays[n].shape)
            for n in names
        ],
        total_bytes=payload.num_bytes,
        prefill_s=prefill_s,
    )
    yield kv_pb.KVChunk(header=header)
    for n in names:
        data = memoryview(np.ascontiguousarray(payload.arrays[n])).cast("B")
        for start in range(0, len(data), chunk_bytes):
            yield kv_pb.KVChunk(data=bytes(data[start : start + chunk_bytes]))
    yield kv_pb.KVChunk(trailer=kv_pb.KVTrailer(sha256=payload.checksum))


def receive_payload(
    chunks: Iterable[kv_pb.KVChunk], jax_transport=None, pull_timeout_s: float | None = None
) -> tuple[KVPayload, TransferStats]:
    """Rebuild a payload from its chunks (or pull it: `jax_transport`, a JaxTransport, within
    `pull_timeout_s`) and verify its checksum."""
    it = iter(chunks)
    first = next(it, None)
    if first is None or first.WhichOneof("part") != "header":
        raise KVWireError("KV stream: the first chunk must be the header")
    t0 = time.perf_counter()
    header = first.header
    if header.jax_address:
        return _pull_payload(header, next(it, None), jax_transport, t0, pull_timeout_s)
    buf = bytearray()
    trailer = None
    for chunk in it:
        part = chunk.WhichOneof("part")
        if part != "data":
            if part == "trailer":
                trailer = chunk.trailer
                break
            raise KVWireError(f"KV stream: unexpected {part} chunk after the header")
        buf += chunk.data
        if len(buf) > header.total_bytes:
            raise KVWireError(f"KV stream: more than the announced {header.total_bytes} bytes")
    transfer_s = time.perf_counter() - t0
    if trailer is None:
        raise KVWireError("KV stream ended without its trailer")
    if len(buf) != header.total_bytes:
        raise KVWireError(f"KV stream: {len(buf)} bytes, header announced {header.total_bytes}")
    arrays, offset = {}, 0
    for a in header.arrays:
        size = int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        arrays[a.name] = np.frombuffer(buf, a.dtype, int(np.prod(a.shape)), offset).reshape(
            tuple(a.shape)
        )
        offset += size
    if offset != len(buf):
        raise KVWireError(f"KV stream: arrays take {offset} bytes of {len(buf)}")
    payload = KVPayload(KVMeta.from_json(header.meta_json), arrays, trailer.sha256)
    payload.verify()
    return payload, TransferStats(len(buf), transfer_s, header.prefill_s)


def _pull_payload(header, trailer_chunk, jax_transport, t0: float, timeout_s: float | None):
    if jax_transport is None:
        raise KVWireError("KV stream: the sender offers jax transfer, this worker has none")
    if trailer_chunk is None or trailer_chunk.WhichOneof("part") != "trailer":
        raise KVWireError("KV stream: a jax transfer header must be followed by the trailer")
    payload = jax_transport.pull(header, trailer_chunk.trailer, timeout_s)
    stats = TransferStats(header.total_bytes, time.perf_counter() - t0, header.prefill_s)
    return payload, stats
