"""KV export/import between two engines (engine/kv_transfer/transfer.py,
engine/kv_transfer/transfer_engine.py).

Oracle: prefill on engine A (max_tokens=1, K/V exported) + decode on engine B (K/V imported
into B's own pages) gives the same greedy tokens as one engine, over a mixed batch (prompts
ending mid-page and at a page boundary, shared prefixes, max_tokens 1..8). Pages are back on
both sides afterwards, mismatched identities / KV dtypes / page sizes and corrupted bytes are
refused, a cancel after import frees the pages, and a full decode engine falls back to
recomputing (same tokens). The host copy and checksum of an export are not in the engine's
step (they run on the thread that takes the export), and the warmed gather / scatter
programs cover every transfer (nothing compiles).

Both engines use one configuration (so one set of compiled step programs); B is also the
single-engine reference.
"""

import dataclasses

import numpy as np
import pytest

from configs.engine_config import EngineConfig
from engine import SamplingParams
from engine.api_types import EngineRequest
from engine.core import EngineCore
from engine.kv_transfer.transfer import (
    KVChecksumError,
    KVTransferMismatchError,
    check_compatible,
    import_request,
    prefill_sampling,
)
from engine.kv_transfer.transfer_engine import KVTransferEngine

PS = 8
OPTS = dict(
    page_size=PS,
    num_pages=24,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    prefill_chunk_size=32,
    max_model_len=48,
)
LENGTHS = [5, 8, 13, 16, 21]  # mid-page and page-boundary prompts
MAX_TOKENS = [8, 1, 6, 8, 3]


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 512, 10).tolist()
    out = [rng.integers(3, 512, n).tolist() for n in LENGTHS]
    out[4] = shared + out[4][:11]  # two prompts sharing a prefix
    out[2] = shared + out[2][:3]
    return out


def requests(suffix: str = "") -> list[EngineRequest]:
    return [
        EngineRequest(f"r{i}{suffix}", p, SamplingParams(temperature=0, max_tokens=m))
        for i, (p, m) in enumerate(zip(prompts(), MAX_TOKENS))
    ]


def run(engine, ers=()) -> dict[str, list[int]]:
    for er in ers:
        engine.add_request(er)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def prefill(a: KVTransferEngine, ers):
    for er in ers:
        a.expect_export(er.request_id)
        a.add_request(dataclasses.replace(er, sampling=prefill_sampling(er.sampling)))
    run(a)
    return {er.request_id: a.take_export(er.request_id, timeout_s=0) for er in ers}


@pytest.fixture(scope="module")
def engines(tiny_model):
    a = KVTransferEngine(EngineCore(tiny_model, EngineConfig(model="tiny", **OPTS)))
    b = KVTransferEngine(EngineCore(tiny_model, EngineConfig(model="tiny", **OPTS)))
    return a, b


def assert_idle(engine):
    engine.pool.check_invariants()
    assert engine.pool.num_used_pages == 0 and not engine.has_unfinished()


def test_prefill_on_a_decode_on_b_equals_one_engine(engines):
    a, b = engines
    want = run(b, requests("-ref"))
    payloads = prefill(a, requests())
    assert_idle(a)  # exported pages were freed once copied out
    for rid, p in payloads.items():
        assert p is not None, rid
        assert p.meta.kv_len == len(prompts()[int(rid[1])])
        assert p.arrays["k_pages"].shape[2] == -(-p.meta.kv_len // PS)
        b.stage(rid, p)
    b.pool.clear_cache()  # no help from the reference run's cached pages
    got = run(b, requests())
    assert {k: got[k] for k in sorted(got)} == {k[:-4]: v for k, v in sorted(want.items())}
    assert b.counters["kv_imports"] == len(LENGTHS) and b.counters["kv_import_fallbacks"] == 0
    assert_idle(b)


def test_full_decode_engine_falls_back_to_recompute(engines):
    a, b = engines

    def four_tokens(suffix):  # every request stays running after its import
        return [
            dataclasses.replace(er, sampling=SamplingParams(temperature=0, max_tokens=4))
            for er in requests(suffix)
        ]

    want = run(b, four_tokens("-ref"))
    payloads = prefill(a, four_tokens("-fb"))
    for rid, p in payloads.items():
        b.stage(rid, p)
    before = b.counters["kv_import_fallbacks"]
    got = run(b, four_tokens("-fb"))  # added at once: only max_num_seqs=4 slots
    assert b.counters["kv_import_fallbacks"] - before == len(LENGTHS) - OPTS["max_num_seqs"]
    assert {k[:-3]: v for k, v in got.items()} == {k[:-4]: v for k, v in want.items()}
    assert_idle(b)


def test_cancel_after_import_frees_pages(engines):
    a, b = engines
    er = dataclasses.replace(requests("-c")[0], sampling=SamplingParams(max_tokens=30))
    b.stage(er.request_id, prefill(a, [er])[er.request_id])
    b.add_request(er)
    assert b.pool.num_used_pages > 0
    b.step()
    b.abort_request(er.request_id)
    run(b)
    assert_idle(b)


def test_cancelled_prefill_exports_nothing_and_frees_pages(engines):
    a, _ = engines
    er = requests("-x")[2]
    a.expect_export(er.request_id)
    a.add_request(dataclasses.replace(er, sampling=prefill_sampling(er.sampling)))
    a.step()  # scheduled: its pages are taken
    a.abort_request(er.request_id)
    run(a)
    assert a.take_export(er.request_id, timeout_s=0) is None
    a.discard_export(er.request_id)
    assert_idle(a)


def test_mismatches_and_corruption_are_refused(engines):
    a, b = engines
    er = requests("-m")[3]
    payload = prefill(a, [er])[er.request_id]
    check_compatible(payload.meta, b.core)
    meta = payload.meta
    bad_model = {**meta.model, "revision": "sha256:other"}
    for field, changed in [
        ("model.revision", dataclasses.replace(meta, model=bad_model)),
        ("kv_dtype", dataclasses.replace(meta, kv_dtype="int8")),
        ("page_size", dataclasses.replace(meta, page_size=16)),
        ("num_kv_heads", dataclasses.replace(meta, num_kv_heads=1)),
    ]:
        with pytest.raises(KVTransferMismatchError, match=field):
            import_request(b.core, er, dataclasses.replace(payload, meta=changed))
    corrupt = {k: v.copy() for k, v in payload.arrays.items()}
    corrupt["v_pages"].flat[7] += 1.0
    with pytest.raises(KVChecksumError):
        import_request(b.core, er, dataclasses.replace(payload, arrays=corrupt))
    assert_idle(b)


@pytest.mark.compile
def test_int8_kv_transfer_carries_scales(tiny_model):
    cfg = EngineConfig(model="tiny", kv_dtype="int8", **OPTS)
    a = KVTransferEngine(EngineCore(tiny_model, cfg))
    b = KVTransferEngine(EngineCore(tiny_model, cfg))
    ers = requests("-q")[:3]
    want = run(b, [dataclasses.replace(er, request_id=er.request_id + "x") for er in ers])
    b.pool.clear_cache()
    payloads = prefill(a, ers)
    assert set(payloads["r0-q"].arrays) == {"k_pages", "v_pages", "k_scales", "v_scales"}
    for rid, p in payloads.items():
        b.stage(rid, p)
    assert run(b, ers) == {k[:-1]: v for k, v in want.items()}
    assert_idle(a)
    assert_idle(b)


def test_export_host_copy_is_not_in_the_engine_step(engines, monkeypatch):
    from engine.kv_transfer import transfer as kv_transfer

    a, _ = engines
    copies = []
    finish = kv_transfer.PendingExport.finish

    def recording_finish(self):
        copies.append(self.meta.request_id)
        return finish(self)

    monkeypatch.setattr(kv_transfer.PendingExport, "finish", recording_finish)
    ers = requests("-t")[:2]
    for er in ers:
        a.expect_export(er.request_id)
        a.add_request(dataclasses.replace(er, sampling=prefill_sampling(er.sampling)))
    engine_s = a.counters["kv_export_engine_s"]
    run(a)  # the engine steps: gathers dispatched, no host copy
    assert copies == [] and a.counters["kv_export_engine_s"] > engine_s
    assert_idle(a)  # pages already free
    payloads = [a.take_export(er.request_id, timeout_s=0) for er in ers]
    assert copies == [er.request_id for er in ers]  # on the taker's thread
    assert all(p.num_bytes > 0 for p in payloads)
    payloads[0].verify()


def test_warmed_transfer_programs_cover_every_transfer(tiny_model):
    from engine.kv_transfer.transfer import device_fns, transfer_buckets

    cfg = EngineConfig(model="tiny", **OPTS)
    a = KVTransferEngine(EngineCore(tiny_model, cfg))
    b = KVTransferEngine(EngineCore(tiny_model, cfg))
    gather, scatter = device_fns()
    assert transfer_buckets(a.core) == [1, 2, 4, 8]  # max_model_len 48 = 6 pages of 8
    assert a.warm_transfer("prefill") == b.warm_transfer("decode") == 4
    compiled = gather._cache_size(), scatter._cache_size()
    ers = requests("-w")
    for rid, p in prefill(a, ers).items():
        b.stage(rid, p)
    run(b, ers)
    assert b.counters["kv_imports"] == len(ers)
    assert (gather._cache_size(), scatter._cache_size()) == compiled  # nothing compiled
    assert_idle(a)
    assert_idle(b)


@pytest.mark.subprocess
def test_transfer_between_tensor_parallel_engines():
    """mesh model:2 on 2 virtual CPU devices (tests/kv_transfer_mesh_worker.py): prefill on
    A + decode on B == one engine, B's cache sharding kept, nothing compiled for imports."""
    import json
    import os
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(__file__), "kv_transfer_mesh_worker.py")
    out = subprocess.run(
        [sys.executable, worker], capture_output=True, text=True, timeout=900, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {
        "same": True,
        "imports": 3,
        "sharding_kept": True,
        "num_devices": 2,
        "compiles": 0,
        "pages_used": [0, 0],
    }, got
