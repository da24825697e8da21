"""Arrival processes, workloads, trace replay and the open-loop dispatcher (no network)."""

import asyncio
import itertools
import statistics

import pytest

from serving.capacity.loadgen import arrivals, driver, trace
from serving.capacity.loadgen.arrivals import ArrivalConfig
from serving.capacity.loadgen.metrics import RequestRecord
from serving.capacity.loadgen.workloads import (
    Corpus,
    LengthDist,
    WorkloadGenerator,
    mix_to_dict,
    parse_mix,
)

LONG = 2000.0  # seconds of simulated arrivals: enough for a few-% rate tolerance


@pytest.mark.parametrize("kind", ["constant", "poisson", "gamma", "onoff", "diurnal"])
def test_mean_rate(kind):
    cfg = ArrivalConfig(kind, rate=5.0, on_s=3.0, off_s=7.0, period_s=100.0, seed=1)
    times = arrivals.schedule(cfg, LONG, 10**9)
    assert times == sorted(times) and times[0] >= 0.0 and times[-1] < LONG
    assert len(times) / LONG == pytest.approx(5.0, rel=0.06)


def test_schedule_respects_max_requests_and_is_seeded():
    cfg = ArrivalConfig("poisson", rate=100.0, seed=3)
    assert len(arrivals.schedule(cfg, 100.0, 25)) == 25
    assert arrivals.schedule(cfg, 10.0, 50) == arrivals.schedule(cfg, 10.0, 50)
    assert arrivals.schedule(ArrivalConfig("closed", concurrency=4), 10.0, 50) is None


def _cv2(times):
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.pvariance(gaps) / statistics.mean(gaps) ** 2


def test_gamma_burstiness_is_the_squared_cv_of_gaps():
    poisson = arrivals.schedule(ArrivalConfig("poisson", rate=10.0, seed=2), LONG, 10**9)
    bursty = arrivals.schedule(
        ArrivalConfig("gamma", rate=10.0, burstiness=4.0, seed=2), LONG, 10**9
    )
    assert _cv2(poisson) == pytest.approx(1.0, rel=0.1)
    assert _cv2(bursty) == pytest.approx(4.0, rel=0.15)


def test_onoff_sends_nothing_in_off_windows():
    times = arrivals.schedule(ArrivalConfig("onoff", rate=5.0, on_s=2.0, off_s=3.0), 100.0, 10**9)
    assert times and all(t % 5.0 < 2.0 for t in times)


def test_diurnal_peak_busier_than_trough():
    cfg = ArrivalConfig("diurnal", rate=10.0, period_s=100.0, amplitude=0.9, seed=4)
    times = arrivals.schedule(cfg, 1000.0, 10**9)
    trough = sum(1 for t in times if t % 100.0 < 10 or t % 100.0 > 90)
    peak = sum(1 for t in times if 40 < t % 100.0 < 60)
    assert peak > 5 * trough


def test_arrival_config_validates():
    with pytest.raises(ValueError, match="rate=0"):
        ArrivalConfig("poisson", rate=0.0)
    with pytest.raises(ValueError, match="kind='sine'"):
        ArrivalConfig("sine")


def test_joint_lengths_correlation_and_medians():
    import random

    rng = random.Random(0)
    dist = LengthDist(100, 50, 0.5, 0.5, rho=0.8, max_in=10**6, max_out=10**6)
    draws = [dist.sample(rng) for _ in range(5000)]
    ins, outs = zip(*draws)
    assert statistics.median(ins) == pytest.approx(100, rel=0.05)
    assert statistics.median(outs) == pytest.approx(50, rel=0.05)
    assert statistics.correlation(ins, outs) > 0.6
    with pytest.raises(ValueError, match="rho=2"):
        LengthDist(1, 1, rho=2)


def test_workload_generator_mix_prefixes_tenants_and_cancels():
    gen = WorkloadGenerator(
        parse_mix("short_qa:1,shared_prefix:1,multi_tenant:1"),
        length_scale=0.25,
        cancel_fraction=0.5,
        seed=7,
    )
    specs = [gen.next(float(i)) for i in range(300)]
    classes = {s.workload for s in specs}
    assert classes == {"short_qa", "shared_prefix", "multi_tenant"}
    shared = [s.prompt for s in specs if s.workload == "shared_prefix"]
    prefixes = {p.split("\n\n")[0] for p in shared}
    assert 1 < len(prefixes) <= 4  # a few token-identical system prompts, reused
    assert {(s.tenant, s.priority) for s in specs if s.workload == "multi_tenant"} == {
        ("gold", 1),
        ("silver", 0),
        ("bronze", -1),
    }
    cancels = [s for s in specs if s.cancel_after_tokens is not None]
    assert 0.35 < len(cancels) / len(specs) < 0.65
    assert all(0 <= s.cancel_after_tokens < s.max_tokens for s in cancels)
    assert len({s.request_id for s in specs}) == len(specs)
    assert mix_to_dict(gen.mix, 0.25)["short_qa"]["weight"] == pytest.approx(1 / 3)


def test_parse_mix_errors():
    with pytest.raises(ValueError, match="'chat'"):
        parse_mix("chat:1")
    with pytest.raises(ValueError, match="positive weight"):
        parse_mix("short_qa:0")


def test_corpus_prompt_is_real_text_of_roughly_the_target_length():
    import random

    text = Corpus().text(130, random.Random(0))
    assert len(text.split()) == 100  # 130 tokens / 1.3 tokens per word
    assert all(w.strip(".,;:'\"!?-").isascii() for w in text.split())


def test_trace_roundtrip_and_replay_spec_times(tmp_path):
    path = tmp_path / "t.jsonl"
    entries = [
        trace.TraceEntry(0.5, 20, 8, "acme", 1, "chat"),
        trace.TraceEntry(0.0, 0, 4, prompt="hello there"),
        trace.TraceEntry(1.25, 10, 2, cancel_after_tokens=1),
    ]
    trace.save_trace(path, entries)
    loaded = trace.load_trace(path)
    assert [e.arrival_s for e in loaded] == [0.0, 0.5, 1.25]
    specs = trace.specs_from_trace(loaded, speedup=2.0)
    assert [s.arrival_s for s in specs] == [0.0, 0.25, 0.625]
    assert specs[0].prompt == "hello there" and specs[1].tenant == "acme"
    assert specs[1].max_tokens == 8 and specs[2].cancel_after_tokens == 1


def test_trace_names_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 3}\n{"arrival_s": -1, "prompt_tokens": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        trace.load_trace(path)


class FakeClock:
    """A clock that advances only when the dispatcher sleeps."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    async def sleep(self, dt):
        await asyncio.sleep(0)  # let started requests run at the current time first
        self.now += dt


def test_open_loop_dispatch_replays_trace_arrival_times(tmp_path):
    entries = [trace.TraceEntry(t, 5, 2) for t in (0.0, 0.1, 0.1, 0.35, 2.0, 9.0)]
    specs = trace.specs_from_trace(entries)
    clock = FakeClock()
    sent = []

    async def send(spec, scheduled_s):
        sent.append(clock())
        return RequestRecord(
            spec.request_id,
            send_s=clock(),
            scheduled_s=scheduled_s,
            end_s=clock(),
            outcome="success",
        )

    records = asyncio.run(
        driver.dispatch_open_loop(
            specs,
            send,
            start_s=clock(),
            duration_s=5.0,
            drain_timeout_s=1.0,
            clock=clock,
            sleep=clock.sleep,
        )
    )
    # The arrival at 9.0 s is past duration_s: never sent.
    assert [t - 100.0 for t in sent] == pytest.approx([0.0, 0.1, 0.1, 0.35, 2.0])
    assert len(records) == 5
    assert all(r.send_s - r.scheduled_s == pytest.approx(0.0) for r in records)


def test_open_loop_records_every_request_even_when_send_fails_or_hangs():
    specs = trace.specs_from_trace(
        [trace.TraceEntry(0.0, 5, 2), trace.TraceEntry(0.0, 5, 2), trace.TraceEntry(0.0, 5, 2)]
    )

    async def send(spec, scheduled_s):
        if spec.request_id.endswith("1"):
            raise RuntimeError("boom")
        if spec.request_id.endswith("2"):
            await asyncio.sleep(3600)
        return RequestRecord(spec.request_id, end_s=0.0, outcome="success")

    records = asyncio.run(
        driver.dispatch_open_loop(specs, send, start_s=0.0, duration_s=1.0, drain_timeout_s=0.05)
    )
    assert sorted(r.outcome for r in records) == ["failed", "success", "timed_out"]
    assert any("boom" in r.reason for r in records)


def test_build_request_maps_spec_fields():
    from serving.capacity.loadgen.workloads import RequestSpec
    from serving.proto import pagedjax_pb2 as pb

    spec = RequestSpec("id-1", "short_qa", "Four score", 3, 17, "gold", 1)
    req = driver.build_request(spec, ignore_eos=True, temperature=0.0, seed=5)
    assert (req.request_id, req.text, req.max_tokens) == ("id-1", "Four score", 17)
    assert req.ignore_eos and req.stream and req.sampling.seed == 5
    assert req.priority == pb.PRIORITY_HIGH
    spec.priority = -7  # clamped to LOW
    assert driver.build_request(spec, True, 0.0, None).priority == pb.PRIORITY_LOW


def test_absorb_messages_keeps_token_stamps_apart_from_chunks():
    from serving.capacity.loadgen import metrics as m
    from serving.proto import pagedjax_pb2 as pb

    rec = RequestRecord("r", send_s=10.0)
    ns = [5_000_000_000 + 20_000_000 * i for i in range(4)]  # server clock, 20 ms apart
    driver.absorb_message(
        rec, pb.GenerateResponse(token_ids=[1, 2, 3], token_times_unix_ns=ns[:3]), 10.8
    )
    final = pb.FinalInfo(
        finish_reason="length",
        usage=pb.Usage(prompt_tokens=7, completion_tokens=4),
        timings=pb.Timings(queue_s=0.05),
    )
    driver.absorb_message(
        rec, pb.GenerateResponse(token_ids=[4], token_times_unix_ns=ns[3:], final=final), 10.9
    )
    assert rec.outcome == "success" and rec.num_output_tokens == 4 and rec.queue_s == 0.05
    assert m.ttft(rec) == pytest.approx(0.8)
    assert m.itl(rec) == pytest.approx([0.02] * 3)  # token level, from the server's stamps
    assert m.chunk_itl(rec) == pytest.approx([0.1])  # what the client's stream showed
    assert m.tpot(rec) == pytest.approx(0.02)
