"""llm-d KV-cache events (engine/sched/kv_events.py, serving/gateway/kv_events_publisher.py),
read the way llm-d's indexer reads them: a real ZMQ SUB socket (pyzmq) decoding multipart
[topic, 8-byte big-endian seq, msgpack EventBatch] from a running server.

Over 30 requests with shared prefixes from two tenants, on a pool small enough to evict:
the stored/removed events replay into exactly the prefix cache's keys at the end; sequence
numbers run 0..N-1 without a gap (the replay socket fills what the subscriber joined too
late for); each stored block's token_ids are the request's tokens at that block; the two
tenants' identical prompts get different hashes and no tenant name is ever sent; a cache
flush sends AllBlocksCleared. A full publish queue drops and counts, never blocks."""

from __future__ import annotations

import concurrent.futures

import msgpack
import pytest
import zmq

from engine.sched.kv_events import KvEventRecorder, block_hash
from engine.sched.page_pool import PagePool
from serving.client import GenerateClient
from serving.engine_host.mock_engine import MockEngine
from serving.frontend.admission import AdmissionConfig
from serving.frontend.tenants import TenantRegistry
from serving.gateway.kv_events_publisher import KvEventPublisher
from serving.testing import running_server, wait_for

PAGE = 4
TENANTS = TenantRegistry.from_dict(
    {
        "tenants": [
            {"name": "alice", "api_keys": ["key-alice"]},
            {"name": "bob", "api_keys": ["key-bob"]},
        ]
    }
)
SYSTEMS = [f"You are assistant number {i}; answer briefly and politely. " for i in range(3)]


class Subscriber:
    """What llm-d's indexer does with the stream: SUB on the topic, decode, order by seq."""

    def __init__(self, endpoint: str, topic: str):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.topic = topic
        self.batches: dict[int, tuple[bytes, list]] = {}  # seq -> (payload, decoded)

    def drain(self, timeout_ms: int = 50) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic.decode() == self.topic and len(seq) == 8
            self.batches[int.from_bytes(seq, "big")] = (payload, msgpack.unpackb(payload))

    def replay(self, endpoint: str, start_seq: int) -> dict[int, bytes]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out = {}
        while True:
            assert dealer.poll(10_000), "replay socket did not answer"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            out[int.from_bytes(seq, "big")] = payload
        dealer.close(0)
        return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def replay_into_set(events: list, cached: set[int]) -> None:
    for event in events:
        tag = event[0]
        if tag == "BlockStored":
            cached.update(event[1])
        elif tag == "BlockRemoved":
            assert set(event[1]) <= cached, "removal of a block never announced"
            cached.difference_update(event[1])
        else:
            assert event == ["AllBlocksCleared"]
            cached.clear()


def at_engine_thread(server) -> tuple[frozenset[int], int]:
    """(hashes the prefix cache holds, batches sent so far) at one moment."""

    def snapshot(engine):
        server.kv_events.flush()
        return frozenset(block_hash(k) for k in engine.pool.cached_keys), server.kv_events.next_seq

    return server.loop.run_on_engine_thread(snapshot).result(timeout=30)


def tiny_engine(tiny_model):
    from configs.engine_config import EngineConfig
    from engine.core import EngineCore

    config = EngineConfig(
        model="tiny",
        page_size=PAGE,
        num_pages=48,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefill_chunk_size=32,
        max_model_len=128,
    )
    return EngineCore(tiny_model, config)


@pytest.mark.parametrize("kind", ["mock", pytest.param("tiny", marks=pytest.mark.compile)])
def test_event_stream_replays_into_the_prefix_cache(kind, request, monkeypatch):
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    if kind == "mock":
        engine = MockEngine(step_time_s=0.002, num_pages=48, page_size=PAGE, max_num_seqs=4)
    else:
        engine = tiny_engine(request.getfixturevalue("tiny_model"))
    config = dict(
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        capacity_probe=False,  # its requests would seed the cache with other tokens
    )
    admission = AdmissionConfig(max_model_len=engine.stats()["max_model_len"])
    with running_server(
        engine, tenants=TENANTS, admission=admission, api_key="key-alice", **config
    ) as (
        server,
        alice,
    ):
        publisher = server.kv_events
        topic = f"kv@10.1.2.3@{engine.identity.name}"
        sub = Subscriber(publisher.endpoint, topic)
        bob = GenerateClient(f"127.0.0.1:{server.port}", api_key="key-bob")
        jobs = []
        for i in range(30):
            client = (alice, bob)[i % 2]
            # the same prompt from both tenants for i < 4; shared system prompts throughout
            prompt = SYSTEMS[i % 3] + f"question {i // 2 if i < 4 else i}?"
            jobs.append((client, prompt))
        try:
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(c.generate, p, max_tokens=6) for c, p in jobs]
                results = [f.result(timeout=60) for f in futures]
            assert all(r.ok for r in results), [r.details for r in results if not r.ok]
            cached, num_batches = at_engine_thread(server)
            wait_for(
                lambda: sub.drain() or num_batches - 1 in sub.batches,
                what=lambda: f"batch {num_batches - 1}; have {sorted(sub.batches)[-3:]}",
            )
            # the subscriber joined after the first batches maybe: the replay socket has them
            replayed = sub.replay(publisher.replay_endpoint, 0)
            for seq, (payload, _) in sub.batches.items():
                assert replayed[seq] == payload  # the live and the replayed bytes agree
            assert sorted(replayed) == list(range(num_batches))  # contiguous from 0
            batches = [msgpack.unpackb(replayed[s]) for s in range(num_batches)]
            check_batches(batches, cached, jobs, results, engine)

            # a flush of the cache: AllBlocksCleared, and the replayed set follows
            server.loop.run_on_engine_thread(lambda e: e.pool.clear_cache()).result(timeout=30)
            cached, end = at_engine_thread(server)
            wait_for(lambda: sub.drain() or end - 1 in sub.batches, what="the clear's batch")
            assert sub.batches[end - 1][1][1] == [["AllBlocksCleared"]] and cached == set()
            assert publisher.dropped._value.get() == 0
        finally:
            bob.close()
            sub.close()


def check_batches(batches: list, cached: frozenset, jobs, results, engine) -> None:
    events = []
    for ts, batch_events, rank in batches:
        assert isinstance(ts, float) and rank == 0 and batch_events
        events += batch_events
    stored = [e for e in events if e[0] == "BlockStored"]
    assert stored and any(e[0] == "BlockRemoved" for e in events), "the pool must evict"
    state: set[int] = set()
    replay_into_set(events, state)
    assert state == cached and cached  # the replayed set IS the prefix cache's content

    # token_ids per stored block: the request's tokens at that block's position in its chain
    position: dict[int, int] = {}
    sequences = [
        engine.tokenizer.encode(prompt) + list(r.token_ids) for (_, prompt), r in zip(jobs, results)
    ]
    for _, hashes, parent, token_ids, block_size, lora_id, medium in stored:
        assert block_size == PAGE and lora_id is None and medium == "GPU"
        assert len(token_ids) == PAGE * len(hashes)
        start = 0 if parent is None else position[parent] + 1
        for j, h in enumerate(hashes):
            position[h] = start + j
        lo, hi = start * PAGE, (start + len(hashes)) * PAGE
        assert any(seq[lo:hi] == token_ids for seq in sequences), (start, token_ids)

    # two tenants, one prompt: different hashes for the same first block
    first = engine.tokenizer.encode(jobs[0][1])[:PAGE]
    roots = {e[1][0] for e in stored if e[2] is None and e[3][:PAGE] == first}
    assert len(roots) >= 2
    raw = b"".join(msgpack.packb(b) for b in batches)
    for secret in (b"alice", b"bob", b"tenant:", b"key-"):
        assert secret not in raw


def test_recorder_folds_a_chain_and_removals():
    pool = PagePool(16, PAGE)
    pool.events = KvEventRecorder(PAGE)
    from engine.sched.request import Request

    r = Request("a", list(range(13)))
    r.page_ids = pool.allocate(4)
    r.num_computed_tokens = 13
    pool.cache_full_pages(r)
    (event,) = pool.events.take()
    keys = pool.page_keys(r)
    assert event == [
        "BlockStored", [block_hash(k) for k in keys[:3]], None, list(range(12)), PAGE, None, "GPU"
    ]  # fmt: skip
    pool.free(r.page_ids, now_s=0.0)
    pool.allocate(15)  # evicts the three cached pages
    (removed,) = pool.events.take()
    assert removed[0] == "BlockRemoved" and sorted(removed[1]) == sorted(event[1])
    assert pool.cached_keys == frozenset()


def test_a_recorder_attached_late_announces_the_cache_first():
    from engine.sched.kv_events import attach
    from engine.sched.request import Request

    engine = MockEngine(num_pages=16, page_size=PAGE)
    r = Request("a", list(range(9)), cache_salt="tenant:alice")
    r.page_ids = engine.pool.allocate(3)
    r.num_computed_tokens = 9
    engine.pool.cache_full_pages(r)
    (recorder,) = attach(engine)
    (event,) = recorder.take()
    assert event[:4] == ["BlockStored", [block_hash(k) for k in r.page_keys], None, list(range(8))]


def test_a_full_publish_queue_drops_and_counts_never_blocks():
    engine = MockEngine()
    publisher = KvEventPublisher(engine, "tcp://127.0.0.1:*", "kv@p@mock", max_queue_batches=4)
    publisher.close()  # no thread drains the queue any more
    recorder = publisher.recorders[0]
    for _ in range(10):
        recorder.cleared()
        publisher.flush()  # returns at once even with the queue full
    assert publisher.dropped._value.get() == 10 - 4
    assert publisher.dropped_events._value.get() == 6
    assert publisher.next_seq == 10  # a dropped batch leaves a gap a subscriber sees


def test_bad_endpoint_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_events_endpoint='tcp://nohost' is invalid"):
        KvEventPublisher(MockEngine(), "tcp://nohost", "t")


def test_benchmark_smoke(capsys):
    from benchmarks import kv_events_bench

    kv_events_bench.main(["--num_seqs=8", "--steps=60", "--repeats=1"])
    out = capsys.readouterr().out
    assert "load average" in out and "us per step" in out and "dropped 0" in out


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "args,message",
    [
        (["--kv_events_endpoint=localhost:5557"], "--kv_events_endpoint=localhost:5557"),
        (["--kv_events_endpoint=tcp://*:5557", "--engine_process"], "not with --engine_process"),
        (["--distributed_env=lws", "--speculative=ngram"], "--speculative=ngram"),
        (["--distributed_env=lws", "--model=mock"], "a real model with --distributed_env"),
        (["--distributed_env=lws", "--model=tiny"], "LWS_LEADER_ADDRESS=None is invalid"),
    ],
)
def test_gateway_flag_mistakes_are_usage_errors(args, message):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "serving.server", "--metrics_port=-1", *args],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
