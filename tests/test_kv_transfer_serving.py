"""The KVTransfer gRPC service (serving/disagg/service.py) between two in-process servers
on the tiny model: Decode on a decode worker pulling from a prefill worker streams exactly
what one engine produces; roles are enforced; pages end free on both workers; a worker
whose KV layout differs is refused with FAILED_PRECONDITION; the chunked wire format
rebuilds the payload and a corrupted chunk is DATA_LOSS-worthy (KVChecksumError)."""

import socket
import time

import grpc
import numpy as np
import pytest

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest
from engine.kv_transfer.digest import device_digest
from engine.kv_transfer.transfer import KVChecksumError, KVMeta, payload_checksum
from engine.sampling.params import SamplingParams
from serving.client import GenerateClient, build_request
from serving.disagg.jax_transfer import JaxPullError
from serving.disagg.service import wrap_engine
from serving.disagg.wire import payload_chunks, receive_payload
from serving.frontend.admission import AdmissionConfig
from serving.proto import kv_transfer_pb2 as kv_pb
from serving.proto import kv_transfer_pb2_grpc as kv_grpc
from serving.testing import calls_seen, outcome_counts, running_server, wait_for

OPTS = dict(
    page_size=4,
    num_pages=64,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    prefill_chunk_size=32,
    max_model_len=128,
)
PROMPTS = ["hello world", "the quick brown fox jumps over", "a"]
ADMISSION = AdmissionConfig(max_model_len=128)


def engine(tiny_model, **over):
    from engine.core import EngineCore

    return wrap_engine(EngineCore(tiny_model, EngineConfig(model="tiny", **{**OPTS, **over})))


def direct(eng, prompt_ids, max_tokens):
    eng.add_request(
        EngineRequest("direct", prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    )
    ids = []
    while eng.has_unfinished():
        for out in eng.step():
            ids += out.new_token_ids
    return ids


def decode_call(target, prompt, request_id, kv_source, max_tokens=10):
    res = GenerateClient(target)  # reuse its response parsing
    req = build_request(prompt, max_tokens=max_tokens, temperature=0.0, request_id=request_id)
    stub = kv_grpc.KVTransferStub(res.channel)
    out = []
    try:
        for msg in stub.Decode(kv_pb.DecodeRequest(request=req, kv_source=kv_source), timeout=60):
            out.append(msg)
    finally:
        res.close()
    return out


@pytest.fixture(scope="module")
def workers(tiny_model):
    p, d = engine(tiny_model), engine(tiny_model)
    with (
        running_server(p, admission=ADMISSION, role="prefill", capacity_probe=False) as (ps, _),
        running_server(d, admission=ADMISSION, role="decode", capacity_probe=False) as (ds, _),
    ):
        yield ps, ds


def test_decode_pulls_from_prefill_and_equals_one_engine(workers, tiny_model):
    ps, ds = workers
    ref = engine(tiny_model)
    for i, prompt in enumerate(PROMPTS):
        want = direct(ref, ref.tokenizer.encode(prompt), 10)
        msgs = decode_call(f"127.0.0.1:{ds.port}", prompt, f"d{i}", f"127.0.0.1:{ps.port}")
        got = [t for m in msgs for t in m.token_ids]
        assert got == want, prompt
        final = msgs[-1].final
        assert final.finish_reason == "length" and final.versions.revision == ref.identity.revision
    assert ds.loop.engine.counters["kv_imports"] == len(PROMPTS)
    assert ps.loop.engine.counters["kv_exports"] == len(PROMPTS)
    for s in (ps, ds):
        wait_for(lambda s=s: s.loop.last_stats.get("kv_pages_used") == 0, what="pages freed")
        s.loop.engine.pool.check_invariants()
        assert sum(outcome_counts(s).values()) == calls_seen(s) == len(PROMPTS)
    info = kv_grpc.KVTransferStub(grpc.insecure_channel(f"127.0.0.1:{ds.port}")).WorkerInfo(
        kv_pb.WorkerInfoRequest()
    )
    assert info.role == "decode" and info.page_size == 4 and info.stats["kv_pulls"] == 3


def test_roles_are_enforced(workers):
    ps, ds = workers
    with pytest.raises(grpc.RpcError) as e:
        decode_call(f"127.0.0.1:{ps.port}", "hi", "x1", f"127.0.0.1:{ps.port}")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "role is 'prefill'" in e.value.details()


def test_mismatched_page_size_is_refused(workers, tiny_model):
    ps, _ = workers
    with running_server(
        engine(tiny_model, page_size=8), admission=ADMISSION, capacity_probe=False
    ) as (other, _):
        with pytest.raises(grpc.RpcError) as e:
            decode_call(f"127.0.0.1:{other.port}", "hi", "x2", f"127.0.0.1:{ps.port}")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "page_size=4" in e.value.details()
        assert other.loop.engine.pool.num_used_pages == 0


def test_wire_round_trip_and_corruption(workers):
    ps, _ = workers
    stub = kv_grpc.KVTransferStub(grpc.insecure_channel(f"127.0.0.1:{ps.port}"))
    chunks = list(stub.Prefill(build_request("hello there", request_id="w1", max_tokens=5)))
    payload, stats = receive_payload(chunks)
    assert stats.num_bytes == payload.num_bytes > 0 and stats.prefill_s > 0
    again = list(payload_chunks(payload, 0.0, chunk_bytes=1000))
    assert len(again) > 3  # header, several data chunks, trailer
    p2, _ = receive_payload(again)
    assert all(np.array_equal(p2.arrays[k], payload.arrays[k]) for k in payload.arrays)
    data = bytearray(again[1].data)
    data[5] ^= 0xFF
    again[1] = kv_pb.KVChunk(data=bytes(data))
    with pytest.raises(KVChecksumError):
        receive_payload(again)


def test_jax_transfer_transport_and_fallback_to_grpc(workers, tiny_model):
    """--kv_transport=jax: a jax-enabled decode worker pulls device to device from a
    jax-enabled prefill worker (no data chunks on the gRPC stream), and falls back to the
    gRPC bytes with the grpc-only prefill worker of the `workers` fixture."""
    ps_grpc, _ = workers
    ref = engine(tiny_model)
    with (
        running_server(
            engine(tiny_model),
            admission=ADMISSION,
            role="prefill",
            capacity_probe=False,
            kv_transport="jax",
        ) as (pj, _),
        running_server(
            engine(tiny_model),
            admission=ADMISSION,
            role="decode",
            capacity_probe=False,
            kv_transport="jax",
        ) as (dj, _),
    ):
        assert pj.kv_service.jax is not None and dj.kv_service.jax is not None
        stub = kv_grpc.KVTransferStub(grpc.insecure_channel(f"127.0.0.1:{pj.port}"))
        offer = list(
            stub.Prefill(
                build_request("hello", request_id="j0", max_tokens=5),
                metadata=(("x-pagedjax-kv-transport", "jax"),),
            )
        )
        assert [c.WhichOneof("part") for c in offer] == ["header", "trailer"]
        assert offer[0].header.jax_address == pj.kv_service.jax.address
        header, trailer = offer[0].header, offer[1].trailer
        assert trailer.device_digest.startswith("k_pages:")  # the pages' device digest
        payload = dj.kv_service.jax.pull(header, trailer)
        assert payload.on_device and payload.meta.request_id == "j0"
        assert device_digest(payload.arrays) == trailer.device_digest
        # pages that differ from the ones digested at export are refused (DATA_LOSS)
        other = fresh_offer(stub, "j0b")[0].header
        bad = kv_pb.KVTrailer(device_digest="k_pages:0000000000000000")
        bad.sha256 = payload_checksum(KVMeta.from_json(other.meta_json), {}, bad.device_digest)
        with pytest.raises(KVChecksumError, match="device digest"):
            dj.kv_service.jax.pull(other, bad)
        pulls = 0
        for source, rid in ((pj, "j1"), (ps_grpc, "j2")):  # jax, then the gRPC fallback
            for prompt in PROMPTS[:2]:
                want = direct(ref, ref.tokenizer.encode(prompt), 10)
                msgs = decode_call(
                    f"127.0.0.1:{dj.port}", prompt, rid + prompt, f"127.0.0.1:{source.port}"
                )
                assert [t for m in msgs for t in m.token_ids] == want, (source, prompt)
                pulls += 1
        assert dj.loop.engine.counters["kv_imports"] == pulls
        assert dj.kv_service.totals["kv_jax_pulls"] == 2  # the two from the jax worker
        # a pull from a peer that is gone (JAX 0.10.2's pull blocks): UNAVAILABLE at once
        pj.kv_service.jax.address, live = f"127.0.0.1:{free_port()}", pj.kv_service.jax.address
        dj.kv_service.jax.pull_timeout_s = 1.0
        with pytest.raises(grpc.RpcError) as e:
            decode_call(f"127.0.0.1:{dj.port}", "hello", "jgone", f"127.0.0.1:{pj.port}")
        pj.kv_service.jax.address = live
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "unreachable" in e.value.details()
        assert dj.loop.engine.counters["kv_imports"] == pulls  # nothing imported
        # a live peer whose pull does not return (an expired offer): JaxPullError in time
        jt = dj.kv_service.jax
        jt._connections[live] = Stalled()
        with pytest.raises(JaxPullError, match="nothing within 0.5s"):
            jt.pull(header, trailer, timeout_s=0.5)
        assert live not in jt._connections  # the next pull connects afresh
        for s in (pj, dj, ps_grpc):
            wait_for(lambda s=s: s.loop.last_stats.get("kv_pages_used") == 0, what="pages")


class Stalled:
    """A transfer connection whose pull takes 2 s (JAX's blocks for good on a lost offer)."""

    def pull(self, uuid, specs):
        time.sleep(2.0)
        return []


def fresh_offer(stub, request_id: str) -> list:
    return list(
        stub.Prefill(
            build_request("hello", request_id=request_id, max_tokens=5),
            metadata=(("x-pagedjax-kv-transport", "jax"),),
        )
    )


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
