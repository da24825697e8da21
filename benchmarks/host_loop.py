"""The engine's host half alone (issue 20): EngineCore with its device step faked.

    python -m benchmarks.host_loop                       # steady 64/256-seq CPU ms per step
    python -m benchmarks.host_loop --mixed --hash        # output hash of a mixed workload
    python -m benchmarks.host_loop --profile=256         # cProfile of the steady loop

The real `EngineCore` (scheduler, BatchBuilder, OutputProcessor, stop checks, detokenizer)
runs with its runner's `run` replaced by a numpy function of the built batch: each sampling row's
token is a hash of its request's seed (`key_data`) and output index (`step`), EOS and stop
ids are banned before `min_tokens` as on the device, and the result is packed as the
device packs it. So the host code of a step runs exactly as in the engine, without XLA
competing for the cores: the CPU time per step it measures is what an accelerator would
leave to the host.

  - steady: n requests decoding (ignore_eos, long outputs), CPU ms of this thread per step
    (`time.thread_time`), and the median per step of each phase's thread CPU (`steady`);
  - mixed (`--mixed`): 2n requests of every kind (stop strings with include_stop, stop ids,
    min_tokens, short max_tokens, logprobs, multi-byte UTF-8 split across tokens, aborts)
    through a max_num_seqs=n engine, overlapped and synchronous; `--hash` prints a sha256
    of every RequestOutput (times left out) and of every packed device batch, so two trees
    can be compared for identical outputs.
Figures depend on the load: print `os.getloadavg()` with them (done here). The medians
per step of thread CPU are the figures to compare under load: the totals include steps
stalled by other processes (cache and core contention).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import pstats
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest
from engine.core import EngineCore
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import MAX_LOGPROBS

PROMPT_TOKENS = 8
# Tiny tokenizer: id = 3 + byte. ASCII letters and spaces, the two bytes of "é" and the
# three of "€" (split across tokens: the detokenizer holds them back), EOS (2).
_ASCII = [3 + b for b in b"abcdefghij klmnop qrstuvwxyz."]
_TOKENS = np.array(_ASCII * 3 + [3 + 0xC3, 3 + 0xA9, 3 + 0xE2, 3 + 0x82, 3 + 0xAC, 2], np.int32)


def fake_tokens(batch) -> np.ndarray:
    """[R] token of every sampler row: a hash of (seed, output index), stop ids banned
    before min_tokens (the next table entry is taken instead, as a device ban would)."""
    t = batch.sampling
    key = t.key_data[:, 1].astype(np.int64) + 7 * t.key_data[:, 0].astype(np.int64)
    h = (key * 1_000_003 + t.step.astype(np.int64) * 7_919) % 2_147_483_647
    idx = (h ^ (h >> 7)) % len(_TOKENS)
    tokens = _TOKENS[idx]
    for _ in range(len(_TOKENS)):
        banned = (t.step < t.min_tokens) & (tokens[:, None] == t.stop_ids).any(axis=1)
        if not banned.any():
            break
        idx = np.where(banned, (idx + 1) % len(_TOKENS), idx)
        tokens = _TOKENS[idx]
    return tokens


def fake_packed(batch) -> np.ndarray:
    """[R, 2 + 2K] float32, as engine/sampling/sampler.py SampleResult.pack lays it out."""
    tokens = fake_tokens(batch)
    R, K = len(tokens), MAX_LOGPROBS
    packed = np.zeros((R, 2 + 2 * K), np.float32)
    ids = packed.view(np.int32)
    ids[:, 0] = tokens
    packed[:, 1] = -0.5 - (tokens % 7) / 8
    ids[:, 2 : 2 + K] = (tokens[:, None] + np.arange(K)) % 259
    packed[:, 2 + K :] = -np.arange(1, K + 1, dtype=np.float32) / 4
    return packed


def make_engine(model, n: int, overlap: bool, max_model_len: int = 512) -> EngineCore:
    cfg = EngineConfig(
        model="tiny",
        page_size=16,
        num_pages=n * (-(-max_model_len // 16)) + 2,
        max_num_seqs=n,
        max_num_batched_tokens=max(512, n),
        max_model_len=max_model_len,
        prefix_caching=False,
        async_scheduling=overlap,
    )
    engine = EngineCore(model, cfg)
    engine.batch_digest = hashlib.sha256()

    def fake_run(batch, shape, program):
        packed = batch.pack()
        engine.batch_digest.update(repr(shape).encode())
        engine.batch_digest.update(packed.ints.tobytes())
        engine.batch_digest.update(packed.floats.tobytes())
        return fake_packed(batch)

    def fake_run_fast(batch, shape, program):
        batch.pack()
        return fake_packed(batch)

    engine.runner.run = fake_run
    engine.runner.run_fast = fake_run_fast
    return engine


def _prompt(i: int) -> list[int]:
    return [1] + [3 + 97 + (i * 7 + j) % 26 for j in range(PROMPT_TOKENS - 1)]


def _decoding_engine(model, n: int, steps: int):
    """An overlapped engine on the fake device with n greedy requests past their prefill,
    each with room for 2 * steps more tokens."""
    engine = make_engine(model, n, overlap=True)
    engine.runner.run = engine.runner.run_fast
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 64, ignore_eos=True)
    for i in range(n):
        engine.add_request(EngineRequest(f"r{i}", _prompt(i), params))
    for _ in range(-(-n * PROMPT_TOKENS // 512) + 3):  # the prefill chunks, then decodes
        engine.step()
    return engine


# the host phases of a step, and the calls whose thread CPU each one is (see steady)
PHASES = ("schedule", "build", "dispatch", "update", "outputs")


def _cpu_timed(obj, name: str, phase: str, acc: dict) -> None:
    """Wrap obj.name so that its thread CPU (ns) is added to acc[phase]."""
    f = getattr(obj, name)

    def timed(*args, **kwargs):
        c0 = time.thread_time_ns()
        try:
            return f(*args, **kwargs)
        finally:
            acc[phase] = acc.get(phase, 0) + time.thread_time_ns() - c0

    setattr(obj, name, timed)


def steady(model, n: int, steps: int) -> dict:
    """CPU ms of this thread per steady decode step (overlapped engine, n requests), and
    per phase: schedule (Scheduler.schedule), build (BatchBuilder.build, new requests'
    slots included), dispatch (ModelRunner.run: StepBatch.pack and the fake device), update
    (Scheduler.receive_tokens), outputs (OutputProcessor.emit: stop checks, detokenize,
    RequestOutput deltas); each the median over steps of its thread CPU in one step, so a
    step stalled by another process does not count (the figures under load stay close to
    the quiet ones). `step_cpu_ms`: the median and 10th percentile of whole steps."""
    engine = _decoding_engine(model, n, steps)
    acc: dict = {}
    _cpu_timed(engine.scheduler, "schedule", "schedule", acc)
    _cpu_timed(engine.builder, "build", "build", acc)
    _cpu_timed(engine.runner, "run", "dispatch", acc)
    _cpu_timed(engine.scheduler, "receive_tokens", "update", acc)
    _cpu_timed(engine.outputs, "emit", "outputs", acc)
    per_step: dict = {p: [] for p in (*PHASES, "step")}
    c0, w0 = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        acc.clear()
        s0 = time.thread_time_ns()
        engine.step()
        acc["step"] = time.thread_time_ns() - s0
        for p, values in per_step.items():
            values.append(acc.get(p, 0))
    cpu_s, wall_s = time.thread_time() - c0, time.perf_counter() - w0
    ms = {p: sorted(v) for p, v in per_step.items()}
    return {
        "num_seqs": n,
        "cpu_ms_per_step": round(1e3 * cpu_s / steps, 4),
        "wall_ms_per_step": round(1e3 * wall_s / steps, 4),
        "step_cpu_ms": {
            "median": round(ms["step"][steps // 2] / 1e6, 4),
            "p10": round(ms["step"][steps // 10] / 1e6, 4),
        },
        "phases_cpu_ms": {p: round(ms[p][steps // 2] / 1e6, 4) for p in PHASES},
        "load": [round(x, 2) for x in os.getloadavg()],
    }


def _mixed_params(i: int) -> SamplingParams:
    """Every stop kind the host handles, cycling over i."""
    kind = i % 8
    base = dict(temperature=0.0, max_tokens=20 + (i * 13) % 90, seed=i)
    if kind == 1:
        base.update(stop=["ab", "k l"], include_stop_str_in_output=bool(i % 3))
    elif kind == 2:
        base.update(stop_token_ids=[3 + ord("q")], min_tokens=5)
    elif kind == 3:
        base.update(ignore_eos=True, max_tokens=7)
    elif kind == 4:
        base.update(logprobs=2, stop=["é"])
    elif kind == 5:
        base.update(min_tokens=12, stop=["xyz", "€"])
    elif kind == 6:
        base.update(temperature=0.8, top_p=0.9)
    elif kind == 7:
        base.update(skip_special_tokens=False, ignore_eos=True, stop=["."])
    return SamplingParams(**base)


def mixed(model, n: int, overlap: bool) -> dict:
    """2n requests through an engine of n slots (arrivals over time, every 11th aborted);
    sha256 of every RequestOutput and of every device batch."""
    engine = make_engine(model, n, overlap=overlap)
    digest, pending, step, num_outputs = hashlib.sha256(), list(range(2 * n)), 0, 0
    while pending or engine.has_unfinished():
        for i in pending[: max(1, n // 4)]:
            engine.add_request(EngineRequest(f"m{i}", _prompt(i)[: 2 + i % 7], _mixed_params(i)))
        pending = pending[max(1, n // 4) :]
        for out in engine.step():
            digest.update(_output_key(out).encode())
            num_outputs += 1
        step += 1
        if step % 5 == 0:
            engine.abort_request(f"m{(step * 11) % (2 * n)}")
        assert step < 10_000, "the mixed workload did not finish"
    return {
        "num_seqs": n,
        "overlap": overlap,
        "steps": step,
        "outputs": num_outputs,
        "outputs_sha256": digest.hexdigest()[:16],
        "batches_sha256": engine.batch_digest.hexdigest()[:16],
    }


def _output_key(out) -> str:
    lp = None
    if out.logprobs:
        lp = [(x.token_id, round(x.logprob, 4), x.top) for x in out.logprobs]
    m = out.metrics
    return repr(
        (
            out.request_id,
            list(out.new_token_ids),
            out.new_text,
            len(out.token_times_s),
            out.finished,
            out.finish_reason,
            out.num_prompt_tokens,
            out.num_cached_tokens,
            out.num_output_tokens,
            lp,
            out.error,
            None if m is None else (m.cached_tokens, m.num_preemptions, len(m.itl_s or ())),
        )
    )


def profile(model, n: int, steps: int, top: int = 35) -> str:
    engine = _decoding_engine(model, n, steps)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num_seqs", default="64,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="steady: best of")
    ap.add_argument("--mixed", action="store_true")
    ap.add_argument("--hash", action="store_true", help="with --mixed: print the hashes")
    ap.add_argument("--profile", type=int, default=0, help="cProfile n sequences")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from models.registry import load_model

    model = load_model("tiny")
    if args.profile:
        print(profile(model, args.profile, args.steps))
        return []
    rows = []
    for n in (int(x) for x in args.num_seqs.split(",")):
        if args.mixed:
            for overlap in (True, False):
                rows.append(mixed(model, n, overlap))
                print(json.dumps(rows[-1]), flush=True)
            continue
        else:
            runs = [steady(model, n, args.steps) for _ in range(args.repeats)]
            rows.append(min(runs, key=lambda r: r["step_cpu_ms"]["median"]))
            rows[-1]["rounds_cpu_ms"] = [r["cpu_ms_per_step"] for r in runs]
            rows[-1]["rounds_step_cpu_median_ms"] = [r["step_cpu_ms"]["median"] for r in runs]
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
