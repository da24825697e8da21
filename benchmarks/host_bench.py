"""Host overhead benchmark (issue 20): does the host keep a fast device busy?

    python -m benchmarks.host_bench                    # 1, 64, 256 running sequences
    python -m benchmarks.host_bench --smoke            # seconds (tests/test_host_bench.py)
    python -m benchmarks.host_bench --out=host.json
    python -m benchmarks.host_bench --device_cores=1    # XLA on core 0, the host on the rest

The `tiny` model config makes a decode step about a millisecond on this CPU, the order of an
accelerator's step for a real model, so the host's share is visible. For each number of
running sequences n:
  - pure device loop: the synchronous engine's own batches of the timed window (same
    shapes, same order), run by the same jitted step back to back (step k+1 dispatched
    before step k's results are copied back): the most steps/s the device can do for this
    work (the physical limit);
  - engine, synchronous (`async_scheduling=False`, the "before") and overlapped (the
    default, "after"): n requests decoding (ignore_eos, long max_tokens), steps/s over a
    window of steady-state decode steps, and the host ms per step by phase (the engine's
    own `timings`): schedule / build / dispatch / wait / update / outputs (outputs = stop
    checks, detokenization and the RequestOutput deltas, one pass per step since host3;
    `python -m benchmarks.host_loop --profile=256` splits it by function).
Each engine runs twice untimed first (compiles; the first runs of a new engine are slower),
then `--repeats` rounds of sync / device loop / overlap interleaved, best round of each
kept. The ratio engine / device loop is measured in the same run; the load average is
printed with every row (other processes share this CPU, and on CPU the "device" is XLA's
threads on the same cores as the host).

`--device_cores=1` emulates an accelerator: XLA's CPU threads get core 0 and the host thread
the other core(s) (`dedicate_device_cores`), so the "device" no longer loses cores to the
host's Python, as a GPU or TPU would not. Both the device loop and the engines then run on
that split. Without it (the default) XLA and the host share every core, and the host's CPU
slows the very device step it overlaps with.

Projection: with overlap a step costs max(host, device) instead of host + device, so for a
device step of `--project_step_ms` (an 8B model at batch 64 on an H200: 16 GB of weights at
4.8 TB/s = ~3.3 ms) the engine would reach device / max(host, device) of the device's rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest
from engine.core import EngineCore
from engine.sampling.params import SamplingParams

PROMPT_TOKENS = 8
MODES = ("sync", "overlap")
PHASES = ("schedule", "build", "dispatch", "wait", "update", "outputs")


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def make_engine(model, n: int, steps: int, overlap: bool) -> EngineCore:
    max_len = PROMPT_TOKENS + 2 * steps + 64
    page_size = 16
    cfg = EngineConfig(
        model="tiny",
        page_size=page_size,
        num_pages=n * (-(-max_len // page_size)) + 2,
        max_num_seqs=n,
        max_num_batched_tokens=max(512, n),
        max_model_len=max_len,
        prefix_caching=False,
        async_scheduling=overlap,
    )
    return EngineCore(model, cfg)


def _run_engine(
    engine: EngineCore, n: int, steps: int, tag: str, capture: list | None = None
) -> dict:
    """n requests; returns steps/s and host ms per step over `steps` steady decode steps.
    `capture`: gets the BuiltStep of every step built in the timed window."""
    max_tokens = 2 * steps + 32
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        prompt = [1] + [3 + (i * 7 + j) % 500 for j in range(PROMPT_TOKENS - 1)]
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt, params))
    prefill_steps = -(-n * PROMPT_TOKENS // engine.sched_config.max_num_batched_tokens)
    for _ in range(prefill_steps + 3):  # every request admitted, prefilled, decoding
        engine.step()
    if capture is not None:
        orig = engine.builder.build
        engine.builder.build = lambda *args: capture.append(orig(*args)) or capture[-1]
    before = dataclasses.replace(engine.timings)
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        engine.step()
    wall_s, cpu_s = time.perf_counter() - t0, time.thread_time() - c0
    after = engine.timings
    if capture is not None:
        del engine.builder.build
    for i in range(n):
        engine.abort_request(f"{tag}-{i}")
    while engine.has_unfinished():
        engine.step()
    done = after.num_steps - before.num_steps
    ms = lambda name: 1e3 * (getattr(after, name) - getattr(before, name)) / done  # noqa: E731
    return {
        "steps_per_s": steps / wall_s,
        "wall_ms_per_step": 1e3 * wall_s / steps,
        # CPU of the engine's thread (host work + dispatch): what an accelerator leaves to
        # the host, less sensitive to the load than wall time
        "cpu_ms_per_step": 1e3 * cpu_s / steps,
        "host_ms": {
            "schedule": ms("schedule_s"),
            "build": ms("build_s"),
            "dispatch": ms("dispatch_s"),
            "wait": ms("wait_s"),
            "update": ms("update_s"),
            "outputs": ms("outputs_s"),
        },
    }


def device_loop(engine: EngineCore, steps: list) -> float:
    """Steps/s of the jitted step alone over the engine's own batches (the same shapes in
    the same order), pipelined: step k+1 dispatched before step k's results are copied."""
    from engine.runner.programs import GREEDY_PROGRAM

    def run() -> float:
        t0 = time.perf_counter()
        prev = None
        for built in steps:
            packed = engine.runner.run(built.batch, built.shape, GREEDY_PROGRAM)
            if prev is not None:
                jax.device_get(prev)
            prev = packed
        jax.device_get(prev)
        return len(steps) / (time.perf_counter() - t0)

    return run()  # every shape was run by the engine already


def measure(model, n: int, steps: int, repeats: int) -> dict:
    """Both engines warmed (two untimed runs each: the first runs of a new engine are slower
    on this CPU), then `repeats` rounds of sync / device loop / overlap, interleaved so load
    changes hit all three alike; each figure is its best round."""
    row: dict = {"num_seqs": n, "load_before": load_avg()}
    engines = {name: make_engine(model, n, steps, name == "overlap") for name in MODES}
    for name, engine in engines.items():
        for k in range(2):
            _run_engine(engine, n, steps, f"warm{k}-{name}")
    rounds: dict = {"device": [], "sync": [], "overlap": []}
    for r in range(repeats):
        captured: list = []
        rounds["sync"].append(_run_engine(engines["sync"], n, steps, f"t{r}-sync", captured))
        rounds["device"].append(device_loop(engines["sync"], captured))
        rounds["overlap"].append(_run_engine(engines["overlap"], n, steps, f"t{r}-overlap"))
        row["shapes"] = sorted({str(dataclasses.astuple(b.shape)) for b in captured})
    dev = max(rounds["device"])
    row["device_steps_per_s"] = dev
    for name in MODES:
        best = max(rounds[name], key=lambda x: x["steps_per_s"])
        row[name] = dict(best, over_device=best["steps_per_s"] / dev)
        row[name]["rounds_steps_per_s"] = [x["steps_per_s"] for x in rounds[name]]
        row[name]["rounds_cpu_ms"] = [x["cpu_ms_per_step"] for x in rounds[name]]
    row["device_rounds_steps_per_s"] = rounds["device"]
    row["load_after"] = load_avg()
    return row


def projection(row: dict, step_ms: float) -> dict:
    """Share of a device's rate the engine would reach with this host time per step."""
    out = {}
    for name in ("sync", "overlap"):
        h = row[name]["host_ms"]
        host_ms = sum(v for k, v in h.items() if k != "wait")
        eff = step_ms / (host_ms + step_ms) if name == "sync" else step_ms / max(host_ms, step_ms)
        out[name] = {"host_ms": host_ms, "engine_over_device": eff}
    return out


def format_table(r: dict) -> str:
    lines = [
        "| seqs | device loop steps/s | sync steps/s | overlap steps/s | sync/device | "
        "overlap/device | load |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['num_seqs']} | {row['device_steps_per_s']:.0f} | "
            f"{row['sync']['steps_per_s']:.0f} | {row['overlap']['steps_per_s']:.0f} | "
            f"{row['sync']['over_device']:.2f} | {row['overlap']['over_device']:.2f} | "
            f"{row['load_before'][0]} -> {row['load_after'][0]} |"
        )
    lines += ["", "host ms per step (" + " / ".join(PHASES) + "; engine thread CPU):"]
    for row in r["rows"]:
        for name in ("sync", "overlap"):
            h = row[name]["host_ms"]
            parts = " / ".join(f"{h[p]:.3f}" for p in PHASES)
            cpu = row[name]["cpu_ms_per_step"]
            lines.append(f"  {row['num_seqs']:>4} {name:>7}: {parts}; cpu {cpu:.3f}")
    lines += ["", f"projection for a {r['project_step_ms']} ms device step:"]
    for row in r["rows"]:
        p = row["projection"]
        lines.append(
            f"  {row['num_seqs']:>4}: host {p['overlap']['host_ms']:.2f} ms -> sync "
            f"{p['sync']['engine_over_device']:.2f}, overlap "
            f"{p['overlap']['engine_over_device']:.2f} of the device's rate"
        )
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    ap.add_argument("--num_seqs", default="1,64,256")
    ap.add_argument("--steps", type=int, default=100, help="timed steady-state steps")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (best kept)")
    ap.add_argument("--project_step_ms", type=float, default=3.3)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument(
        "--device_cores",
        type=int,
        default=0,
        help="accelerator emulation: XLA's threads on the first N cores, the host on the rest "
        "(0: off, XLA and the host share every core)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.num_seqs, args.steps, args.repeats = "1,4", 6, 1
    return args


def dedicate_device_cores(num_cores: int) -> dict:
    """Give XLA's CPU runtime the first `num_cores` cores and this (the host) thread the rest,
    so the "device" no longer competes with the host for cores, as an accelerator would not.
    XLA sizes its thread pool from the affinity mask when the CPU client starts, and its
    threads keep the mask they were created with; so pin this thread, start the client and
    run one program (its threads start), then move this thread to the other cores. Must run
    before anything touches a JAX backend (raises otherwise: the pool would be sized already)."""
    all_cores = sorted(os.sched_getaffinity(0))
    if not 0 < num_cores < len(all_cores):
        raise ValueError(f"--device_cores={num_cores}: must be 1..{len(all_cores) - 1} here")
    if jax._src.xla_bridge.backends_are_initialized():
        raise RuntimeError("dedicate_device_cores: a JAX backend already started")
    device, host = set(all_cores[:num_cores]), set(all_cores[num_cores:])
    os.sched_setaffinity(0, device)
    jax.block_until_ready(jax.jit(lambda x: x + 1)(jax.numpy.zeros(8)))
    os.sched_setaffinity(0, host)
    return {"device_cores": sorted(device), "host_cores": sorted(host)}


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cores = dedicate_device_cores(args.device_cores) if args.device_cores else None
    from models.registry import load_model

    model = load_model("tiny")
    rows = []
    for n in (int(x) for x in args.num_seqs.split(",")):
        row = measure(model, n, args.steps, args.repeats)
        row["projection"] = projection(row, args.project_step_ms)
        rows.append(row)
        print(f"[{n} seqs] {json.dumps(row)}", file=sys.stderr, flush=True)
    result = {
        "rows": rows,
        "project_step_ms": args.project_step_ms,
        "jax": jax.__version__,
        "cores": cores or "shared (XLA and the host on every core)",
    }
    print(f"cores: {result['cores']}")
    print(format_table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
