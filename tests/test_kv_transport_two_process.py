"""`--kv_transport=jax` across two processes (issue 36 item 7): the prefill worker is
`python -m serving.server --role=prefill --kv_transport=jax` in a process of its own; the
decode worker (this test's process, `kv_transport="jax"`) pulls the device pages from it
with jax.experimental.transfer. The streamed tokens must equal one engine's greedy output,
and the decode worker must have counted jax pulls (no gRPC byte fallback).
tests/test_kv_transfer_serving.py covers the same path with both workers in one process.

NOT PASSING: on 2026-12-04 (JAX 0.10.2, XLA:CPU, load ~20) the prefill process served the
request (its log shows request_end, outcome success) and the test process then aborted
(SIGABRT, exit 134) during the pull, twice in two runs; so the test is skipped and the docs
no longer claim the two-process serving path. Remove the skip to reproduce (~5 min: the
prefill worker warms up 30 shapes first)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest
from engine.sampling.params import SamplingParams
from serving.client import GenerateClient, build_request
from serving.disagg.service import wrap_engine
from serving.frontend.admission import AdmissionConfig
from serving.proto import kv_transfer_pb2 as kv_pb
from serving.proto import kv_transfer_pb2_grpc as kv_grpc
from serving.router.cluster import free_port, wait_serving
from serving.testing import running_server

ROOT = Path(__file__).resolve().parents[1]
OPTS = dict(
    page_size=4, num_pages=64, max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=32
)
MAX_MODEL_LEN = 128
PROMPTS = ["hello world", "the quick brown fox jumps over"]


def _engine(tiny_model):
    from engine.core import EngineCore

    cfg = EngineConfig(model="tiny", max_model_len=MAX_MODEL_LEN, **OPTS)
    return wrap_engine(EngineCore(tiny_model, cfg))


def _direct(eng, prompt_ids, max_tokens):
    eng.add_request(
        EngineRequest("direct", prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    )
    ids = []
    while eng.has_unfinished():
        for out in eng.step():
            ids += out.new_token_ids
    return ids


def _decode(target, prompt, request_id, kv_source, max_tokens=8):
    res = GenerateClient(target)
    req = build_request(prompt, max_tokens=max_tokens, temperature=0.0, request_id=request_id)
    try:
        stub = kv_grpc.KVTransferStub(res.channel)
        msgs = stub.Decode(kv_pb.DecodeRequest(request=req, kv_source=kv_source), timeout=300)
        return [t for m in msgs for t in m.token_ids]
    finally:
        res.close()


@pytest.fixture
def prefill_process(tmp_path):
    port = free_port()
    log = tmp_path / "prefill.log"
    args = [
        "serving.server",
        "--model=tiny",
        "--role=prefill",
        "--kv_transport=jax",
        f"--port={port}",
        "--metrics_port=-1",
        "--nocapacity_probe",
        f"--max_model_len={MAX_MODEL_LEN}",
        *(f"--{k}={v}" for k, v in OPTS.items()),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env
        )
    try:
        try:
            wait_serving(f"127.0.0.1:{port}", 600)
        except Exception as e:
            raise AssertionError(f"prefill worker not serving: {log.read_text()[-3000:]}") from e
        yield port, proc, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.skip(
    reason="aborts the test process (SIGABRT) in the decode worker's first jax pull from the "
    "prefill process (2026-12-04, JAX 0.10.2 CPU): a reproducer, see serving/disagg/jax_transfer.py"
)
@pytest.mark.subprocess
def test_decode_worker_pulls_over_jax_transfer_from_another_process(prefill_process, tiny_model):
    port, proc, log = prefill_process
    ref = _engine(tiny_model)
    admission = AdmissionConfig(max_model_len=MAX_MODEL_LEN)
    with running_server(
        _engine(tiny_model),
        admission=admission,
        role="decode",
        capacity_probe=False,
        kv_transport="jax",
    ) as (dj, _):
        assert dj.kv_service.jax is not None, "the decode worker's transfer server did not start"
        for i, prompt in enumerate(PROMPTS):
            want = _direct(ref, ref.tokenizer.encode(prompt), 8)
            got = _decode(f"127.0.0.1:{dj.port}", prompt, f"two-{i}", f"127.0.0.1:{port}")
            assert got == want, (prompt, log.read_text()[-2000:])
        assert dj.kv_service.totals["kv_jax_pulls"] == len(PROMPTS), log.read_text()[-2000:]
        assert dj.loop.engine.counters["kv_imports"] == len(PROMPTS)
    assert proc.poll() is None, log.read_text()[-3000:]  # the prefill worker still serves
