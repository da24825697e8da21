"""`--kv_transport=jax` across processes (issue 36 item 7): a prefill worker, a decode
worker and the router, each `python -m ...` in a process of its own
(serving/router/cluster.py LocalCluster, the tiny model, no warm-up), the workers with
`--kv_transport=jax`: every prompt's K/V crosses from the prefill process to the decode
process over jax.experimental.transfer (serving/disagg/jax_transfer.py), device to device
with the device digest checked, no bytes on the gRPC stream. The streamed tokens must equal
one engine's greedy output (tests/test_router.py's reference), the decode worker must have
counted one jax pull per request (none fell back to the gRPC bytes), and both workers must
still serve afterwards. tests/test_kv_transfer_serving.py covers the same transport with
both workers in one process, its fallback and its failure paths.

Shown (2026-12-05) to catch, planted one at a time: the decode worker not asking for the
jax transport (a silent fallback to the gRPC bytes: kv_jax_pulls 0 of 4) and the pulled
K and V pages swapped after their digest check (tokens differ). Passed at load ~40
(109 s wall). The earlier form of this test, with the decode worker inside the pytest
process, aborted that process (SIGABRT) in its first pull on 2026-12-04; with every worker
a process of its own, as deployed, it does not (the cause of that abort was not found)."""

from __future__ import annotations

import grpc
import pytest

from serving.client import GenerateClient
from serving.proto import kv_transfer_pb2 as kv_pb
from serving.proto import kv_transfer_pb2_grpc as kv_grpc
from tests.test_router import MAX_TOKENS, PROMPTS, WORKER_ARGS, reference  # noqa: F401

pytestmark = pytest.mark.subprocess


def worker_stats(address: str) -> dict:
    with grpc.insecure_channel(address) as ch:
        info = kv_grpc.KVTransferStub(ch).WorkerInfo(kv_pb.WorkerInfoRequest(), timeout=30)
    return dict(info.stats)


def log_tails(cluster) -> str:
    return "\n".join(f"{w.name}: " + open(w.log_path).read()[-2000:] for w in cluster.workers)


def test_prefill_and_decode_processes_move_kv_over_jax_transfer(reference):  # noqa: F811
    from serving.router.cluster import LocalCluster

    want, identity = reference
    args = [*WORKER_ARGS, "--kv_transport=jax"]
    with LocalCluster(prefill=1, decode=1, worker_args=args) as cluster:
        prefill, decode = cluster.workers
        with GenerateClient(cluster.address) as client:
            results = [
                client.generate(p, max_tokens=m, temperature=0.0, timeout_s=300)
                for p, m in zip(PROMPTS, MAX_TOKENS)
            ]
        for res, ids in zip(results, want):
            assert res.ok, (res.code, res.details, log_tails(cluster))
            assert res.token_ids == ids, log_tails(cluster)
            assert res.versions["revision"] == identity.revision
        stats = worker_stats(decode.address)
        pulls = (stats["kv_pulls"], stats["kv_jax_pulls"])
        assert pulls == (len(PROMPTS), len(PROMPTS)), (stats, log_tails(cluster))
        assert prefill.proc.poll() is None and decode.proc.poll() is None, log_tails(cluster)
