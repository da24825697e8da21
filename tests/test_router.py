"""The cache-aware router (serving/router/) and the local cluster (serving/router/cluster.py).

Policy tests are plain Python. The `subprocess` tests start real workers on the tiny model
(one prefill, one decode, one `both` replica, each pinned to a core) and the router:
router output == one engine token for token over a concurrent mixed batch, with the
resolved versions; a cancel at the router frees the pages on every worker; killing the
decode worker mid-stream ends that stream UNAVAILABLE, leaks nothing on the prefill worker,
and takes it out of routing (requests go to the replica); a worker serving another
model revision is refused.
"""

import collections
import concurrent.futures
import time

import grpc
import pytest

from serving.client import GenerateClient, build_request
from serving.proto import kv_transfer_pb2 as kv_pb
from serving.proto import kv_transfer_pb2_grpc as kv_grpc
from serving.router.policy import HashRing, RoundRobin, pick_bounded, prefix_key

# ---- policy ------------------------------------------------------------------------------------
SYSTEM = "You are a helpful assistant for the ACME corporation. Answer briefly. " * 2


def test_same_prefix_same_key_different_prefix_different_key():
    a = prefix_key(build_request(SYSTEM + "What is 2+2?"))
    b = prefix_key(build_request(SYSTEM + "Name a colour."))
    c = prefix_key(build_request("Another system prompt entirely, long enough. " * 4))
    assert a == b != c
    short = prefix_key(build_request("hi"))
    assert short != prefix_key(build_request("ho"))  # a one-block prompt: all of it
    ids = build_request(token_ids=list(range(40)))
    assert prefix_key(ids) == prefix_key(build_request(token_ids=list(range(32)) + [7] * 9))


def test_ring_moves_only_the_removed_members_keys():
    members = [f"w{i}" for i in range(3)]
    ring, smaller = HashRing(members), HashRing(members[:2])
    keys = range(0, 1 << 64, (1 << 64) // 3000)
    moved = [k for k in keys if ring.walk(k)[0] != smaller.walk(k)[0]]
    assert all(ring.walk(k)[0] == "w2" for k in moved)
    share = collections.Counter(ring.walk(k)[0] for k in keys)
    assert min(share.values()) > 600  # 64 virtual nodes: no member gets less than ~1/5


def test_bounded_load_spills_to_the_next_member_on_the_ring():
    ring = HashRing(["a", "b", "c"])
    key = 12345
    first, second = ring.walk(key)[:2]
    loads = {"a": 0, "b": 0, "c": 0}
    assert pick_bounded(ring, key, loads.get, lambda m: True) == (first, False)
    loads[first] = 5  # bound = ceil(1.25 * 6 / 3) = 3
    assert pick_bounded(ring, key, loads.get, lambda m: True) == (second, True)
    assert pick_bounded(ring, key, loads.get, lambda m: m != second)[0] not in (first, second)
    assert pick_bounded(ring, key, loads.get, lambda m: False) == (None, False)


def test_round_robin_cycles_over_usable_members():
    rr = RoundRobin()
    assert [rr.pick(["a", "b", "c"], lambda m: m != "b") for _ in range(4)] == ["a", "c"] * 2


# ---- a real cluster ----------------------------------------------------------------------------
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
    "--warmup_max_shapes=0",
    "--capacity_probe=false",
    "--log_level=warning",
    *(f"--{k}={v}" for k, v in ENGINE.items()),
]
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a b c", "tiny"]
MAX_TOKENS = [12, 5, 9, 1]


@pytest.fixture(scope="module")
def reference(tiny_model):
    from configs.engine_config import EngineConfig
    from engine.api_types import EngineRequest
    from engine.core import EngineCore
    from engine.sampling.params import SamplingParams

    core = EngineCore(tiny_model, EngineConfig(model="tiny", **ENGINE))
    for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        sp = SamplingParams(temperature=0.0, max_tokens=m)
        core.add_request(EngineRequest(f"r{i}", core.tokenizer.encode(p), sp))
    ids = collections.defaultdict(list)
    while core.has_unfinished():
        for out in core.step():
            ids[out.request_id] += out.new_token_ids
    return [ids[f"r{i}"] for i in range(len(PROMPTS))], core.identity


@pytest.fixture(scope="module")
def cluster():
    from serving.router.cluster import LocalCluster

    with LocalCluster(
        prefill=1,
        decode=1,
        replicas=1,
        worker_args=WORKER_ARGS,
        router_args=["--health_interval_s=0.2"],
        http_port=0,  # the router's OpenAI-compatible HTTP front too
    ) as c:
        yield c


def worker_stats(address: str) -> dict:
    with grpc.insecure_channel(address) as ch:
        info = kv_grpc.KVTransferStub(ch).WorkerInfo(kv_pb.WorkerInfoRequest(), timeout=5)
    return dict(info.stats)


def generate_all(address: str) -> list:
    with GenerateClient(address) as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [
            pool.submit(client.generate, p, max_tokens=m, temperature=0.0, timeout_s=300)
            for p, m in zip(PROMPTS, MAX_TOKENS)
        ]
        return [j.result() for j in jobs]


def wait_until(predicate, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.subprocess
def test_router_pair_equals_one_engine_and_cancel_frees_pages(cluster, reference):
    want, identity = reference
    results = generate_all(cluster.address)
    for res, ids in zip(results, want):
        assert res.ok, (res.code, res.details)
        assert res.token_ids == ids
        assert res.versions["revision"] == identity.revision
    prefill, decode = cluster.workers[0], cluster.workers[1]
    assert worker_stats(decode.address)["kv_pulls"] == len(PROMPTS)
    wait_until(lambda: worker_stats(prefill.address)["kv_exports"] == len(PROMPTS), 30, "exports")
    with GenerateClient(cluster.address) as client:  # transfer figures reach the client
        call = client.stream(build_request(PROMPTS[0], max_tokens=2, temperature=0.0))
        list(call)
        trailing = dict(call.trailing_metadata())
    assert int(trailing["x-pagedjax-kv-bytes"]) > 0
    assert float(trailing["x-pagedjax-kv-transfer-ms"]) > 0
    wait_until(  # stats refresh every 0.1 s on the worker's engine thread
        lambda: worker_stats(prefill.address)["kv_exports"] == len(PROMPTS) + 1, 30, "export"
    )
    # a cancel at the router ends the request on the decode worker: pages freed everywhere
    with GenerateClient(cluster.address) as client:
        call = client.stream(build_request("cancel me", max_tokens=100, temperature=0.0))
        next(iter(call))
        call.cancel()
    for w in cluster.workers:
        wait_until(lambda w=w: worker_stats(w.address)["kv_pages_used"] == 0, 60, "pages freed")
        assert worker_stats(w.address)["num_running"] == 0


@pytest.mark.subprocess
def test_router_http_pair_equals_one_engine_and_disconnect_frees_pages(cluster, reference):
    import openai

    from models.registry import tiny_tokenizer

    want, identity = reference
    tokenizer = tiny_tokenizer()
    client = openai.OpenAI(base_url=cluster.http_url, api_key="none", max_retries=0)
    exports = worker_stats(cluster.workers[0].address)["kv_exports"]
    for prompt, ids, max_tokens in zip(PROMPTS[:1], want, MAX_TOKENS):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        kwargs = dict(model=identity.name, prompt=prompt, max_tokens=max_tokens, temperature=0)
        full = client.completions.create(**kwargs)
        assert full.choices[0].text == text
        assert full.usage.completion_tokens == len(ids)
        assert full.model_extra["pagedjax"]["versions"]["revision"] == identity.revision
        chunks = client.completions.create(**kwargs, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    wait_until(  # every request went through the pair: one K/V export each
        lambda: worker_stats(cluster.workers[0].address)["kv_exports"] == exports + 2, 30, "kv"
    )
    stream = client.completions.create(
        model=identity.name, prompt="disconnect me", max_tokens=100, stream=True
    )
    next(iter(stream))
    stream.close()  # the client goes away mid-stream
    for w in cluster.workers:
        wait_until(lambda w=w: worker_stats(w.address)["kv_pages_used"] == 0, 60, "pages freed")
        assert worker_stats(w.address)["num_running"] == 0


@pytest.mark.subprocess
def test_killed_decode_worker_ends_its_streams_and_leaves_routing(cluster, reference):
    want, _ = reference
    prefill, decode, replica = cluster.workers
    before = worker_stats(replica.address)["tokens_processed"]
    with GenerateClient(cluster.address) as client:
        request = build_request("stream me", max_tokens=100, temperature=0.0, ignore_eos=True)
        stream = iter(client.stream(request))
        next(stream)  # the decode worker is streaming this request
        cluster.kill(decode)  # the only decode worker: no pair is left
        with pytest.raises(grpc.RpcError) as e:
            for _ in stream:
                pass
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert worker_stats(prefill.address)["kv_pages_used"] == 0  # nothing leaked there
    results = generate_all(cluster.address)  # now routed to the `both` replica
    assert [r.token_ids for r in results] == want, [(r.code, r.details) for r in results]
    wait_until(lambda: worker_stats(replica.address)["tokens_processed"] > before, 30, "replica")


@pytest.mark.subprocess
def test_router_refuses_a_worker_of_another_revision(cluster):
    from serving.router.server import Router
    from serving.testing import running_server

    with running_server() as (mock_server, _):  # MockEngine: another model, other revision
        router = Router(
            [cluster.workers[0].address, f"127.0.0.1:{mock_server.port}"], health_interval_s=0.2
        ).start()
        try:
            mock = router.pool.workers[f"127.0.0.1:{mock_server.port}"]
            assert mock.healthy and "revision=" in mock.refused
            assert not router.pool.routable("both")
        finally:
            router.stop()


@pytest.mark.subprocess
def test_router_and_kv_service_import_without_jax():
    import subprocess
    import sys

    code = (
        "import sys, serving.server, serving.router.server, serving.router.cluster,"
        " serving.disagg.wire;"
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')];"
        "assert not bad, bad[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "module, args, says",
    [
        ("serving.router.cluster", ["--prefill=1", "--decode=0"], "both zero or both >= 1"),
        ("serving.router.cluster", ["--replicas=-1"], "replicas"),
        ("serving.router.server", [], "workers"),
        ("serving.router.server", ["--workers=nohost"], "HOST:PORT"),
        ("serving.router.server", ["--workers=127.0.0.1:1", "--http_port=8000"], "--tokenizer"),
        ("serving.server", ["--model=mock", "--role=prefill"], "holds no K/V"),
    ],
)
def test_programs_refuse_bad_flags_with_one_line(module, args, says):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and says in out.stderr, out.stderr[-500:]
