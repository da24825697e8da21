"""`--kv_transport=jax` across processes (issue 36 item 7): a prefill worker and a decode
worker, each `python -m serving.server` in a process of its own (the tiny model, warm-up on,
two shapes: a P/D worker whose warm-up failed once sat not-ready forever, issue 38), both
with `--kv_transport=jax`, and this test playing llm-d's routing sidecar between them (the
pairing the P/D ingress on Ray Serve makes too, serving/ray_serve/disagg.py): call 1 to the
prefill worker's HTTP API with kv_transfer_params {do_remote_decode: true}, call 2 to the
decode worker with the parameters it returned. Every prompt's K/V crosses from the prefill
process to the decode process over jax.experimental.transfer (serving/disagg/jax_transfer.py),
device to device with the device digest checked, no bytes on the gRPC stream. The completions
must equal one engine's greedy output, the decode worker must have counted one jax pull per
request (none fell back to the gRPC bytes), and both workers must still serve afterwards.
tests/test_kv_transfer_serving.py covers the same transport with both workers in one process,
its fallback and its failure paths.

Shown (2026-12-05, in its earlier form behind our router) to catch, planted one at a time: the
decode worker not asking for the jax transport (a silent fallback to the gRPC bytes:
kv_jax_pulls 0 of 4) and the pulled K and V pages swapped after their digest check (tokens
differ). The earlier form of this test, with the decode worker inside the pytest process,
aborted that process (SIGABRT) in its first pull on 2026-12-04; with every worker a process
of its own, as deployed, it does not (the cause of that abort was not found)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest

from serving.proto import kv_transfer_pb2 as kv_pb
from serving.proto import kv_transfer_pb2_grpc as kv_grpc
from serving.testing import free_port, wait_serving
from tests.served_reference import greedy_reference

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[1]
ENGINE = dict(
    page_size=4,
    num_pages=64,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    prefill_chunk_size=32,
    max_model_len=128,
)
WORKER_ARGS = [
    "--model=tiny",
    "--warmup_max_shapes=2",
    "--capacity_probe=false",
    "--log_level=warning",
    "--metrics_port=-1",
    "--host=127.0.0.1",
    "--kv_transport=jax",
    *(f"--{k}={v}" for k, v in ENGINE.items()),
]
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a b c", "tiny"]
MAX_TOKENS = [12, 5, 9, 1]
START_TIMEOUT_S = 900  # only guards against a hang: warm-up on a loaded 2-core machine


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy texts and token counts of one EngineCore."""
    return greedy_reference(tiny_model, ENGINE, PROMPTS, MAX_TOKENS)


class Worker:
    """`python -m serving.server --role=ROLE` on free ports, its log in `log_path`."""

    def __init__(self, role: str, log_dir: Path):
        self.role, self.port, self.http_port = role, free_port(), free_port()
        self.log_path = log_dir / f"{role}.log"
        args = [f"--role={role}", f"--port={self.port}", f"--http_port={self.http_port}"]
        # POD_IP: the host the prefill worker names in its kv_transfer_params
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", POD_IP="127.0.0.1")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "serving.server", *WORKER_ARGS, *args],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.url = f"http://127.0.0.1:{self.http_port}"

    def stats(self) -> dict:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            info = kv_grpc.KVTransferStub(ch).WorkerInfo(kv_pb.WorkerInfoRequest(), timeout=30)
        return dict(info.stats)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def log_tails(workers) -> str:
    return "\n".join(f"{w.role}: " + w.log_path.read_text()[-2000:] for w in workers)


def sidecar(prefill: Worker, decode: Worker, prompt: str, max_tokens: int) -> dict:
    """llm-d's two calls for one completion (serving/gateway/http_kv_transfer.py)."""
    body = {"model": "tiny", "prompt": prompt, "temperature": 0}
    first = httpx.post(
        f"{prefill.url}/v1/completions",
        json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=300,
    )
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", prefill.port)
    second = httpx.post(
        f"{decode.url}/v1/completions",
        json={**body, "max_tokens": max_tokens, "kv_transfer_params": params},
        timeout=300,
    )
    assert second.status_code == 200, second.text
    return second.json()


def test_prefill_and_decode_processes_move_kv_over_jax_transfer(reference, tmp_path):
    texts, lengths, identity = reference
    workers = [Worker("prefill", tmp_path), Worker("decode", tmp_path)]
    prefill, decode = workers
    try:
        for w in workers:  # SERVING once its warm-up (steps and K/V transfer programs) ended
            wait_serving(f"127.0.0.1:{w.port}", START_TIMEOUT_S)
        for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS)):
            reply = sidecar(prefill, decode, prompt, max_tokens)
            # NOTE: a reply that ends inside a UTF-8 character: the server's incremental
            # detokenizer holds the partial bytes back, a one-shot decode shows U+FFFD.
            text = reply["choices"][0]["text"]
            assert text == texts[i].rstrip("\ufffd"), (prompt, text, log_tails(workers))
            assert reply["usage"]["completion_tokens"] == lengths[i]
            assert reply["pagedjax"]["versions"]["revision"] == identity.revision
        stats = decode.stats()
        pulls = (stats["kv_pulls"], stats["kv_jax_pulls"])
        assert pulls == (len(PROMPTS), len(PROMPTS)), (stats, log_tails(workers))
        assert prefill.proc.poll() is None and decode.proc.poll() is None, log_tails(workers)
    finally:
        for w in workers:
            w.stop()
