"""Engine throughput benchmark (issue 4): tokens/s by concurrency, step time against the
memory and compute floors, static vs continuous batching, the Hugging Face baseline and
the host-side share of a step, all in ONE run on the same machine state.

    python -m benchmarks.engine_bench                       # SmolLM2-135M, float32
    python -m benchmarks.engine_bench --out=engine_bench.json
    python -m benchmarks.engine_bench --smoke               # tiny model, seconds (CI)

How each figure is measured:
- Peaks: a jitted f32 matrix-vector product over a 128 MB matrix (read bandwidth) and a
  2048^3 f32 matmul (FLOP/s), median of warm runs, measured in this run.
- Concurrency c: c requests (prompt `--prompt_len` tokens, `--output_len` tokens with
  ignore_eos) submitted together to one EngineCore (prefix cache off). Its step programs are
  built ahead of time (engine.runner.warmup), then the workload runs twice on the same engine and
  only the second run is timed: no compile is timed (`compiles` in the table counts step
  compilations during the timed run: should be 0), and neither is a program's first
  execution, which on XLA:CPU costs 0.3-0.7 s more per SmolLM2 prefill program (the
  prefill line prints that first run's tokens/s too).
  `tok/s` = output tokens / wall time of the run (prefill included); `decode tok/s` = decode
  tokens / summed wall time of the decode-only steps.
- Floors of a decode step (median over decode-only steps): memory = (weight bytes + the K/V
  bytes of every attended position) / measured bandwidth; compute = sum over the step's
  tokens of `ModelConfig.flops_per_token(context)` / measured matmul FLOP/s.
- Paired floors (the `paired` ratios, the headline targets): the same two peak kernels run
  once just before every timed step (`PeakProbe`, outside the run's time), and each step's
  floor uses the peaks measured next to it; the ratio is the median over steps. This
  machine's own speed drifts: the 2048^3 matmul ran at 194-445 GFLOP/s on an idle machine
  within minutes (2026-12-02), so peaks measured minutes apart from a step put +-25% on it.
- Ceiling (c > 1): the model's forward over c rows with attention stubbed out and no
  sampling (`step_profile.weights_only_fn`, each run paired with the peaks like the steps):
  the step's compute floor over its time is what the decode step would reach if attention,
  the KV write, sampling and the host cost nothing.
- Static vs continuous: one mixed-length workload; static = add a batch of N, step it to
  completion, then the next N; continuous = all requests given to an engine that runs at most
  N at once. Ratio = continuous tokens/s over static tokens/s.
- Host time: EngineCore.step wall minus its device call (dispatch, compute and the one
  device->host copy), from the engine's phase timings (synchronous engine); schedule /
  build / update timed separately.
- Hugging Face: `transformers` `generate` (greedy, float32, torch threads = CPU count) on the
  same prompts: batch 1 and a static batch of `--hf_batch` with left padding.
- Prefill: one request with a `--prefill_len` (1,024) token prompt and one output token; its
  prefill steps' wall time against the compute floor of the tokens they computed.
- llama.cpp (optional extra `peers`: `llama-cpp-python`, skipped when it does not import):
  the same GGUF with its own quantized weights, EOS suppressed by logit_bias; batch-1 decode
  and prefill tokens/s.
- Targets (issue 21), as fractions of this run's floors: batch-1 decode >= 0.8 of the memory
  floor, 64-way decode >= 0.6 of the compute floor, 1k prefill >= 0.6 of the compute floor.
- The same ratios in process CPU time (`*_cpu` keys, "CPU time" lines): the peaks' matvec and
  matmul are also timed in CPU seconds and each step's CPU time is recorded, so a floor is
  "FLOPs (bytes) at the peak's rate per CPU-second". On a shared machine the wall-clock
  peaks and the steps see different loads (ratios above 1 happen); CPU time is what other
  processes disturb least, but not nothing: the matmul's FLOP per CPU-second itself drifts
  ~15% within minutes (its spin-waits grow when a core is shared).
- Peaks are measured twice, before and after the timed concurrency runs (`peaks_before`,
  `peaks_after`), and the floors use their mean (`peaks`): one measurement at the start put
  +-10% on every ratio (benchmarks/RESULTS.md, "64-way decode, part 2").
Load average is printed with every section: other processes share this CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.step_profile import weights_only_fn
from configs.engine_config import EngineConfig
from configs.kv_memory import kv_bytes_per_token
from engine.api_types import EngineRequest
from engine.runner import compiles
from engine.sampling.params import SamplingParams


def load_avg() -> float:
    return os.getloadavg()[0]


def _median_time(fn, iters: int) -> tuple[float, float]:
    """(median wall s, median process CPU s) over `iters` warm calls."""
    fn()  # compile / warm
    walls, cpus = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


class PeakProbe:
    """The two peak kernels, built once: an f32 matrix-vector product over a `matvec_bytes`
    matrix (read bandwidth) and an f32 `matmul_n`^3 matmul (FLOP/s)."""

    def __init__(self, matvec_bytes: int = 128 << 20, matmul_n: int = 2048):
        cols = 4096
        rows = matvec_bytes // (4 * cols)
        self.matvec_bytes, self.matmul_flop = rows * cols * 4, 2 * matmul_n**3
        a = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32)  # [rows, cols]
        x = jnp.ones((cols,), jnp.float32)
        m = jax.random.normal(jax.random.key(1), (matmul_n, matmul_n), jnp.float32)
        matvec, matmul = jax.jit(lambda a, x: a @ x), jax.jit(lambda a, b: a @ b)
        self.matvec = lambda: matvec(a, x).block_until_ready()
        self.matmul = lambda: matmul(m, m).block_until_ready()
        self.matvec(), self.matmul()  # compile

    def rates(self) -> tuple[float, float, float]:
        """One run of each: (read B/s, FLOP/s, seconds spent). Paired with the engine step
        that follows it (`Instrument(probe=...)`), so both see the same machine state."""
        t0 = time.perf_counter()
        self.matvec()
        t1 = time.perf_counter()
        self.matmul()
        t2 = time.perf_counter()
        return self.matvec_bytes / (t1 - t0), self.matmul_flop / (t2 - t1), t2 - t0


def measure_peaks(matvec_bytes: int = 128 << 20, matmul_n: int = 2048, iters: int = 10) -> dict:
    """Read bandwidth of an f32 matrix-vector product and f32 matmul FLOP/s (this CPU, now)."""
    probe = PeakProbe(matvec_bytes, matmul_n)
    t_mv, cpu_mv = _median_time(probe.matvec, iters)
    t_mm, cpu_mm = _median_time(probe.matmul, max(3, iters // 2))
    return {
        "bandwidth_gb_s": probe.matvec_bytes / t_mv / 1e9,
        "matmul_gflop_s": probe.matmul_flop / t_mm / 1e9,
        "bandwidth_gb_per_cpu_s": probe.matvec_bytes / max(cpu_mv, 1e-9) / 1e9,
        "matmul_gflop_per_cpu_s": probe.matmul_flop / max(cpu_mm, 1e-9) / 1e9,
        "load": load_avg(),
    }


def bracketed_peaks(before: dict, after: dict) -> dict:
    """The peaks the floors use: the mean of two measurements that bracket the timed runs."""
    keys = ("bandwidth_gb_s", "matmul_gflop_s", "bandwidth_gb_per_cpu_s", "matmul_gflop_per_cpu_s")
    return {**{k: (before[k] + after[k]) / 2 for k in keys}, "load": after["load"]}


# ---------------------------------------------------------------- workloads


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def uniform_workload(
    n: int, prompt_len: int, output_len: int, vocab: int, seed: int = 0
) -> Workload:
    rng = np.random.default_rng(seed)
    prompts = [[1] + rng.integers(3, vocab, prompt_len - 1).tolist() for _ in range(n)]
    return Workload(prompts, [output_len] * n)


def mixed_workload(n: int, max_prompt: int, max_output: int, vocab: int, seed: int = 0) -> Workload:
    """Prompt lengths uniform in [8, max_prompt]; output lengths log-uniform in
    [4, max_output] (many short answers, a few long ones: what makes static batches wait)."""
    rng = np.random.default_rng(seed)
    plens = rng.integers(8, max_prompt + 1, n)
    olens = np.exp(rng.uniform(np.log(4), np.log(max_output), n)).astype(int)
    prompts = [[1] + rng.integers(3, vocab, int(p) - 1).tolist() for p in plens]
    return Workload(prompts, [int(o) for o in olens])


# ---------------------------------------------------------------- instrumented engine runs


@dataclasses.dataclass
class StepRecord:
    wall_s: float
    device_s: float  # dispatch + compute + device_get
    schedule_s: float
    build_s: float
    update_s: float
    num_decode: int
    num_prefill_tokens: int
    contexts: list[int]  # per token computed: its position + 1 (positions it attends)
    compiled: bool = False  # the step compiled a program (its time is left out of tok/s)
    cpu_s: float = 0.0  # process CPU time of the whole step (host + device threads)
    # the peaks measured just before this step (PeakProbe.rates), 0: not paired
    probe_b_s: float = 0.0
    probe_flop_s: float = 0.0


@dataclasses.dataclass
class RunResult:
    wall_s: float
    output_tokens: int
    steps: list[StepRecord]
    compiles: int
    first_run: RunResult | None = None  # the untimed first run after warm-up (warm_and_run)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def decode_steps(self) -> list[StepRecord]:
        """Decode-only steps that did not compile (all decode steps if every one did)."""
        dec = [s for s in self.steps if s.num_prefill_tokens == 0 and s.num_decode > 0]
        return [s for s in dec if not s.compiled] or dec


class Instrument:
    """Times the parts of EngineCore.step from the engine's own phase timings
    (`engine.timings`), and records what each step computed by wrapping the batch builder.
    The engine runs synchronously here (`make_engine`), so a step's device time is its
    dispatch + wait."""

    def __init__(self, engine, probe: PeakProbe | None = None):
        self.engine, self.probe = engine, probe
        self.probe_s = 0.0  # time spent in the probe (left out of the run's wall time)
        self.cur: dict = {}
        builder = engine.builder
        orig_build = builder.build

        def build(scheduled, *args):  # args: the builder's own (a verify step's shape fit)
            ctx = [p + 1 for s in scheduled for p in range(s.start, s.start + s.num_new_tokens)]
            self.cur["decode"] = sum(1 for s in scheduled if s.num_new_tokens == 1)
            self.cur["prefill"] = sum(s.num_new_tokens for s in scheduled if s.num_new_tokens > 1)
            self.cur["contexts"] = ctx
            return orig_build(scheduled, *args)

        builder.build = build

    def close(self) -> None:
        del self.engine.builder.build

    def step(self) -> tuple[list, StepRecord | None]:
        self.cur = {}
        probe_b_s = probe_flop_s = 0.0
        if self.probe is not None:
            probe_b_s, probe_flop_s, spent_s = self.probe.rates()
            self.probe_s += spent_s
        t = self.engine.timings
        before = dataclasses.replace(t)
        compiled_before = compiles.count()
        t0, c0 = time.perf_counter(), time.process_time()
        outs = self.engine.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        c = self.cur
        if t.num_steps == before.num_steps:
            return outs, None
        d = lambda name: getattr(t, name) - getattr(before, name)  # noqa: E731
        return outs, StepRecord(
            wall,
            d("dispatch_s") + d("wait_s"),
            d("schedule_s"),
            d("build_s"),
            d("update_s"),
            c["decode"],
            c["prefill"],
            c["contexts"],
            compiles.count() > compiled_before,
            cpu,
            probe_b_s,
            probe_flop_s,
        )


_ids = iter(range(10**9))


def _requests(workload: Workload) -> list[EngineRequest]:
    return [
        EngineRequest(
            f"bench-{next(_ids)}", p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        )
        for p, m in zip(workload.prompts, workload.max_tokens)
    ]


def run_workload(
    engine, workload: Workload, static_batch: int | None = None, probe: PeakProbe | None = None
) -> RunResult:
    """Continuous (all requests at once) or static batches of `static_batch`; with `probe`,
    the peaks are measured before every step (StepRecord.probe_*), outside the run's time."""
    reqs = _requests(workload)
    groups = (
        [reqs]
        if static_batch is None
        else [reqs[i : i + static_batch] for i in range(0, len(reqs), static_batch)]
    )
    inst = Instrument(engine, probe)
    steps, produced = [], 0
    before = compiles.count()
    t0 = time.perf_counter()
    try:
        for group in groups:
            for r in group:
                engine.add_request(r)
            while engine.has_unfinished():
                outs, rec = inst.step()
                produced += sum(len(o.new_token_ids) for o in outs)
                if rec is not None:
                    steps.append(rec)
    finally:
        inst.close()
    # NOTE: a step that compiled (a shape the warm-up missed) is counted in `compiles` and
    # its time left out, so tok/s measures the engine, not XLA's compiler.
    wall = time.perf_counter() - t0 - sum(s.wall_s for s in steps if s.compiled) - inst.probe_s
    if produced != workload.output_tokens:
        raise RuntimeError(f"produced {produced} tokens, expected {workload.output_tokens}")
    return RunResult(wall, produced, steps, compiles.count() - before)


def reached_shapes(engine, workload: Workload, static_batch: int | None = None) -> list:
    """The step shapes a run of `workload` reaches, found by a host-only dry run: the device
    call is replaced by zeros (with ignore_eos and fixed max_tokens the schedule does not
    depend on the sampled tokens)."""
    shapes = []

    def fake_device(batch, shape, program):
        shapes.append(shape)
        return np.zeros((shape.num_decode + shape.num_prefill_seqs, 2 + 2 * 20), np.float32)

    engine.runner.run = fake_device
    try:
        reqs = _requests(workload)
        groups = (
            [reqs]
            if static_batch is None
            else [reqs[i : i + static_batch] for i in range(0, len(reqs), static_batch)]
        )
        for group in groups:
            for r in group:
                engine.add_request(r)
            while engine.has_unfinished():
                engine.step()
    finally:
        del engine.runner.run
    return list(dict.fromkeys(shapes))


def warm_and_run(
    engine,
    workload: Workload,
    static_batch: int | None = None,
    warm: bool = True,
    probe: PeakProbe | None = None,
) -> RunResult:
    """Compiles every shape the run reaches (engine.runner.warmup over the dry run's shapes), runs
    the workload once untimed, then times a second run.

    The untimed run is needed because an ahead-of-time built program is slower on its first
    execution: XLA:CPU sets up its library calls (the YNN dot fusions) then, 0.3-0.7 s per
    SmolLM2 prefill program on this CPU (benchmarks/RESULTS.md, 2026-12-02). That run is
    kept as `first_run`. `probe`: pair the timed run's steps with peak measurements."""
    if not warm:
        return run_workload(engine, workload, static_batch, probe)
    from engine.runner.warmup import warmup

    warmup(engine, reached_shapes(engine, workload, static_batch), sampling=("greedy",))
    first = run_workload(engine, workload, static_batch)
    res = run_workload(engine, workload, static_batch, probe)
    return dataclasses.replace(res, first_run=first)


# ---------------------------------------------------------------- floors


@dataclasses.dataclass(frozen=True)
class Floors:
    weight_bytes: int
    kv_bytes_per_token: int
    bandwidth_b_s: float
    flop_s: float

    def memory_s(self, rec: StepRecord) -> float:
        """Decode steps: every sequence reads its whole cache (context = position + 1)."""
        return (
            self.weight_bytes + self.kv_bytes_per_token * sum(rec.contexts)
        ) / self.bandwidth_b_s

    def compute_s(self, cfg, rec: StepRecord) -> float:
        return sum(cfg.flops_per_token(c) for c in rec.contexts) / self.flop_s


def host_stats(steps: list[StepRecord]) -> dict:
    steps = [s for s in steps if not s.compiled] or steps
    wall = sum(s.wall_s for s in steps)
    host = sum(s.wall_s - s.device_s for s in steps)
    return {
        "host_fraction": host / wall if wall else 0.0,
        "host_ms": 1e3 * host / max(1, len(steps)),
        "schedule_ms": 1e3 * statistics.mean(s.schedule_s for s in steps),
        "build_ms": 1e3 * statistics.mean(s.build_s for s in steps),
        "update_ms": 1e3 * statistics.mean(s.update_s for s in steps),
    }


def cpu_floors(floors: Floors, peaks: dict) -> Floors:
    """The same floors with the peaks' rates per process-CPU second: its memory_s and
    compute_s are then CPU seconds, comparable with `StepRecord.cpu_s`."""
    return dataclasses.replace(
        floors,
        bandwidth_b_s=peaks["bandwidth_gb_per_cpu_s"] * 1e9,
        flop_s=peaks["matmul_gflop_per_cpu_s"] * 1e9,
    )


def cpu_ratios(cfg, cpu: Floors, steps: list[StepRecord]) -> dict:
    """Memory and compute floors over the steps' median process CPU time (1.0 = at it)."""
    step_cpu_s = statistics.median(s.cpu_s for s in steps)
    return {
        "step_cpu_ms": 1e3 * step_cpu_s,
        "memory_floor_over_step_cpu": statistics.median(cpu.memory_s(s) for s in steps)
        / step_cpu_s,
        "compute_floor_over_step_cpu": statistics.median(cpu.compute_s(cfg, s) for s in steps)
        / step_cpu_s,
    }


def weights_only(model, num_tokens: int, probe: PeakProbe, iters: int = 10) -> list[tuple]:
    """(wall s, CPU s, the matmul FLOP/s measured just before) of `iters` warm runs of the
    forward over `num_tokens` rows without attention or sampling (the ceiling)."""
    fn = weights_only_fn(model, num_tokens)
    fn()  # compile
    runs = []
    for _ in range(iters):
        flop_s = probe.rates()[1]
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        runs.append((time.perf_counter() - t0, time.process_time() - c0, flop_s))
    return runs


def floors_at_probe(floors: Floors, step: StepRecord) -> Floors:
    """`floors` at the peaks measured just before `step` (StepRecord.probe_*)."""
    return dataclasses.replace(floors, bandwidth_b_s=step.probe_b_s, flop_s=step.probe_flop_s)


def paired_ratios(cfg, floors: Floors, steps: list[StepRecord]) -> dict:
    """Each step's floors at the peaks measured just before it (StepRecord.probe_*), over
    its wall time; the medians. The machine's own speed drifts (the 2048^3 matmul ran at
    194-445 GFLOP/s on an idle machine within minutes, 2026-12-02), so a floor measured
    next to each step is the steadier reference."""
    paired = [s for s in steps if s.probe_flop_s]
    if not paired:
        return {}
    at = functools.partial(floors_at_probe, floors)
    return {
        "memory_floor_over_step_paired": statistics.median(
            at(s).memory_s(s) / s.wall_s for s in paired
        ),
        "compute_floor_over_step_paired": statistics.median(
            at(s).compute_s(cfg, s) / s.wall_s for s in paired
        ),
        "paired_bandwidth_gb_s": statistics.median(s.probe_b_s for s in paired) / 1e9,
        "paired_matmul_gflop_s": statistics.median(s.probe_flop_s for s in paired) / 1e9,
    }


def ceiling_ratios(cfg, steps: list[StepRecord], runs: list[tuple]) -> dict:
    """The median decode step's FLOPs at each ceiling run's paired FLOP/s, over its time."""
    flops = statistics.median(sum(cfg.flops_per_token(c) for c in s.contexts) for s in steps)
    return {
        "weights_only_ms": 1e3 * statistics.median(r[0] for r in runs),
        "weights_only_cpu_ms": 1e3 * statistics.median(r[1] for r in runs),
        "compute_floor_over_weights_only": statistics.median(flops / f / t for t, _, f in runs),
    }


def concurrency_row(
    cfg,
    floors: Floors,
    c: int,
    res: RunResult,
    cpu: Floors | None = None,
    ceiling: list[tuple] | None = None,
) -> dict:
    """`ceiling`: `weights_only` runs over c rows; the compute floor over them is the ratio
    the step would reach if everything but the weight matmuls, norms and LM head cost
    nothing (paired with its own peak measurements, like the steps)."""
    dec = res.decode_steps()
    step_s = statistics.median(s.wall_s for s in dec)
    mem_s = statistics.median(floors.memory_s(s) for s in dec)
    comp_s = statistics.median(floors.compute_s(cfg, s) for s in dec)
    dec_tokens = sum(s.num_decode for s in dec)
    return {
        "concurrency": c,
        "tokens_per_s": res.tokens_per_s,
        "decode_tokens_per_s": dec_tokens / sum(s.wall_s for s in dec),
        "step_ms": 1e3 * step_s,
        "memory_floor_ms": 1e3 * mem_s,
        "compute_floor_ms": 1e3 * comp_s,
        "step_over_memory_floor": step_s / mem_s,
        "step_over_compute_floor": step_s / comp_s,
        "steps": len(res.steps),
        "compiles": res.compiles,
        "wall_s": res.wall_s,
        **host_stats(res.steps),
        **(cpu_ratios(cfg, cpu, dec) if cpu else {}),
        **paired_ratios(cfg, floors, dec),
        **(ceiling_ratios(cfg, dec, ceiling) if ceiling else {}),
        "load": load_avg(),
    }


# ---------------------------------------------------------------- Hugging Face baseline


def hf_model(model_source: str):
    """The same GGUF loaded by transformers (dequantized to float32)."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    folder, name = os.path.split(model_source)
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()


def hf_generate(model, workload: Workload, batch: int) -> dict:
    """transformers `generate` on the first `batch` prompts (left padded), greedy, exactly
    max_tokens new tokens each."""
    import torch

    prompts = workload.prompts[:batch]
    new = workload.max_tokens[0]
    width = max(len(p) for p in prompts)
    ids = torch.zeros((batch, width), dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1

    def gen(n):
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    gen(2)  # warm
    t0 = time.perf_counter()
    out = gen(new)
    wall = time.perf_counter() - t0
    produced = (out.shape[1] - width) * batch
    return {"batch": batch, "tokens_per_s": produced / wall, "wall_s": wall, "load": load_avg()}


# ---------------------------------------------------------------- prefill and llama.cpp


def prefill_steps(res: RunResult) -> list[StepRecord]:
    return [s for s in res.steps if s.num_prefill_tokens and not s.compiled] or res.steps


def prefill_row(
    model,
    floors: Floors,
    prompt_len: int,
    warm: bool = True,
    cpu: Floors | None = None,
    probe: PeakProbe | None = None,
) -> dict:
    """One request of `prompt_len` tokens and one output token: the prefill steps (chunks of
    `prefill_chunk_size`) against the compute floor of the tokens they computed."""
    cfg = model.config
    engine = make_engine(model, 1, prompt_len + 16, prompt_len + 32)
    w = uniform_workload(1, prompt_len, 1, cfg.vocab_size, seed=prompt_len)
    res = warm_and_run(engine, w, warm=warm, probe=probe)
    steps = prefill_steps(res)
    wall_s = sum(s.wall_s for s in steps)
    floor_s = sum(floors.compute_s(cfg, s) for s in steps)
    return {
        "prompt_len": prompt_len,
        "steps": len(steps),
        "wall_s": wall_s,
        "tokens_per_s": prompt_len / wall_s,
        # the same prefill on its programs' first execution (see warm_and_run)
        "first_run_tokens_per_s": prompt_len / sum(s.wall_s for s in prefill_steps(res.first_run))
        if res.first_run
        else None,
        "compute_floor_s": floor_s,
        "compute_floor_over_step": floor_s / wall_s,
        **(
            {
                "cpu_s": sum(s.cpu_s for s in steps),
                "compute_floor_over_step_cpu": sum(cpu.compute_s(cfg, s) for s in steps)
                / max(sum(s.cpu_s for s in steps), 1e-9),
            }
            if cpu
            else {}
        ),
        **(
            {
                "compute_floor_over_step_paired": sum(
                    floors_at_probe(floors, s).compute_s(cfg, s) for s in steps
                )
                / wall_s
            }
            if all(s.probe_flop_s for s in steps)
            else {}
        ),
        "compiles": res.compiles,
        "load": load_avg(),
    }


def llama_cpp_peer(gguf_path: str, prompt: list[int], new_tokens: int, eos_ids) -> dict | None:
    """llama.cpp (`llama-cpp-python`, optional extra `peers`) on the same GGUF (its own
    quantized weights, all CPU threads): batch-1 decode and prefill tokens/s. EOS is
    suppressed with logit_bias so it generates exactly `new_tokens`. None if not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(
        model_path=gguf_path,
        n_ctx=len(prompt) + new_tokens + 8,
        n_batch=512,
        n_threads=os.cpu_count(),
        verbose=False,
    )
    bias = {int(e): -1e9 for e in eos_ids}

    def complete(n: int) -> float:
        llm.reset()
        t0 = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=n, temperature=0.0, logit_bias=bias)
        wall = time.perf_counter() - t0
        if out["usage"]["completion_tokens"] != n:
            raise RuntimeError(f"llama.cpp produced {out['usage']['completion_tokens']} != {n}")
        return wall

    complete(2)  # warm
    first_s = complete(1)  # prefill + one token
    full_s = complete(new_tokens)
    return {
        "prompt_len": len(prompt),
        "prefill_tokens_per_s": len(prompt) / first_s,
        "decode_tokens_per_s": (new_tokens - 1) / (full_s - first_s),
        "load": load_avg(),
    }


# ---------------------------------------------------------------- main


def make_engine(model, max_num_seqs: int, max_model_len: int, num_tokens: int):
    from engine.core import EngineCore

    page_size = 16
    cfg = EngineConfig(
        model=model.config.name,
        page_size=page_size,
        num_pages=num_tokens // page_size + max_num_seqs + 2,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=512,
        max_model_len=max_model_len,
        prefix_caching=False,
        # NOTE: synchronous, so each step's device time is measured on its own (host work
        # is far below the device step here; benchmarks/host_bench.py measures the overlap).
        async_scheduling=False,
    )
    return EngineCore(model, cfg)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--smoke", action="store_true", help="tiny model, small sizes (CI)")
    p.add_argument("--concurrency", default="1,8,32,64,128")
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--output_len", type=int, default=32)
    p.add_argument("--mixed_requests", type=int, default=64)
    p.add_argument("--mixed_max_prompt", type=int, default=128)
    p.add_argument("--mixed_max_output", type=int, default=128)
    p.add_argument("--static_batch", type=int, default=32)
    p.add_argument("--hf_batch", type=int, default=32)
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--prefill_len", type=int, default=1024, help="the prefill target's prompt")
    p.add_argument("--skip_llama_cpp", action="store_true")
    p.add_argument("--skip_mixed", action="store_true")
    p.add_argument("--no_warm", action="store_true", help="time compiles too (smoke)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.concurrency, args.prompt_len, args.output_len = "tiny", "1,2", 12, 4
        args.mixed_requests, args.mixed_max_prompt, args.mixed_max_output = 4, 14, 8
        args.static_batch, args.skip_hf, args.no_warm = 2, True, True
        args.prefill_len, args.skip_llama_cpp = 40, True
    return args


def run(args) -> dict:
    from models.registry import load_model

    model = load_model(args.model)
    cfg = model.config
    conc = [int(c) for c in args.concurrency.split(",")]
    peak_sizes = {"matvec_bytes": 4 << 20, "matmul_n": 256, "iters": 2} if args.smoke else {}
    peaks_before = measure_peaks(**peak_sizes)
    probe = PeakProbe(**{k: v for k, v in peak_sizes.items() if k != "iters"})
    print(
        f"peaks: {peaks_before['bandwidth_gb_s']:.1f} GB/s matrix-vector read, "
        f"{peaks_before['matmul_gflop_s']:.0f} GFLOP/s f32 matmul (load "
        f"{peaks_before['load']:.1f})",
        flush=True,
    )
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    max_len = args.prompt_len + max(args.output_len, args.mixed_max_output) + args.mixed_max_prompt
    engine = make_engine(
        model,
        max(conc + [args.static_batch]),
        max_len,
        max(conc) * (args.prompt_len + args.output_len + 16),
    )
    runs = []
    for c in conc:
        w = uniform_workload(c, args.prompt_len, args.output_len, cfg.vocab_size, seed=c)
        res = warm_and_run(engine, w, warm=not args.no_warm, probe=probe)
        runs.append((c, res, load_avg()))
        step_ms = 1e3 * statistics.median(s.wall_s for s in res.decode_steps())
        print(
            f"  concurrency {c}: {res.tokens_per_s:.1f} tok/s, step {step_ms:.1f} ms "
            f"(load {runs[-1][2]:.1f})",
            flush=True,
        )
    ceilings = {c: weights_only(model, c, probe) for c in conc if c > 1}
    peaks_after = measure_peaks(**peak_sizes)
    peaks = bracketed_peaks(peaks_before, peaks_after)
    floors = Floors(
        weight_bytes,
        kv_bytes_per_token(cfg, "float32"),
        peaks["bandwidth_gb_s"] * 1e9,
        peaks["matmul_gflop_s"] * 1e9,
    )
    results = {
        "model": cfg.name,
        "peaks": peaks,
        "peaks_before": peaks_before,
        "peaks_after": peaks_after,
        "weight_bytes": weight_bytes,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "concurrency": [  # each row with the load at the end of its own run
            {
                **concurrency_row(cfg, floors, c, res, cpu_floors(floors, peaks), ceilings.get(c)),
                "load": load,
            }
            for c, res, load in runs
        ],
    }
    results["prefill"] = prefill_row(
        model,
        floors,
        args.prefill_len,
        warm=not args.no_warm,
        cpu=cpu_floors(floors, peaks),
        probe=probe,
    )
    print(
        f"  prefill {args.prefill_len} tokens: {results['prefill']['tokens_per_s']:.0f} tok/s "
        f"(load {results['prefill']['load']:.1f})",
        flush=True,
    )
    if not args.skip_llama_cpp and model.source.endswith(".gguf"):
        prompt = uniform_workload(1, args.prefill_len, 1, cfg.vocab_size, seed=1).prompts[0]
        peer = llama_cpp_peer(model.source, prompt, 64, cfg.eos_token_ids)
        if peer is not None:
            results["llama_cpp"] = peer
    if not args.skip_mixed:
        results["static_vs_continuous"] = static_vs_continuous(model, args, max_len)
    if not args.skip_hf:
        w = uniform_workload(
            max(args.hf_batch, 1),
            args.prompt_len,
            args.output_len,
            cfg.vocab_size,
            seed=args.hf_batch,
        )
        hf = hf_model(model.source)
        results["hf"] = [hf_generate(hf, w, b) for b in (1, args.hf_batch)]
    results["targets"] = targets(results)
    return results


def static_vs_continuous(model, args, max_len: int) -> dict:
    cfg = model.config
    n = args.static_batch
    w = mixed_workload(
        args.mixed_requests, args.mixed_max_prompt, args.mixed_max_output, cfg.vocab_size, seed=7
    )
    engine = make_engine(model, n, max_len, n * max_len)
    cont = warm_and_run(engine, w, warm=not args.no_warm)
    static = warm_and_run(engine, w, static_batch=n, warm=not args.no_warm)
    out = {
        "requests": args.mixed_requests,
        "batch": n,
        "output_tokens": w.output_tokens,
        "continuous_tokens_per_s": cont.tokens_per_s,
        "static_tokens_per_s": static.tokens_per_s,
        "continuous_over_static": cont.tokens_per_s / static.tokens_per_s,
        "continuous_steps": len(cont.steps),
        "static_steps": len(static.steps),
        "compiles": cont.compiles + static.compiles,
        "continuous_host_fraction": host_stats(cont.steps)["host_fraction"],
        "load": load_avg(),
    }
    print(
        f"  mixed: continuous {out['continuous_tokens_per_s']:.1f} tok/s, static "
        f"{out['static_tokens_per_s']:.1f} tok/s (load {out['load']:.1f})",
        flush=True,
    )
    return out


def targets(r: dict) -> dict:
    by_c = {row["concurrency"]: row for row in r["concurrency"]}
    t = {}
    if 1 in by_c:
        t["batch1_step_over_memory_floor<=1.5"] = by_c[1]["step_over_memory_floor"]
    if 1 in by_c and 64 in by_c:
        t["c64_over_c1>=8"] = by_c[64]["tokens_per_s"] / by_c[1]["tokens_per_s"]
        t["c64_tokens_per_s~700"] = by_c[64]["tokens_per_s"]
    if 64 in by_c and r.get("hf"):
        t["c64_over_hf_batch1>=10"] = by_c[64]["tokens_per_s"] / r["hf"][0]["tokens_per_s"]
        t["c64_over_hf_static>=10"] = by_c[64]["tokens_per_s"] / r["hf"][-1]["tokens_per_s"]
    if "static_vs_continuous" in r:
        t["continuous_over_static>=2"] = r["static_vs_continuous"]["continuous_over_static"]
    t["max_host_fraction<0.05"] = max(row["host_fraction"] for row in r["concurrency"])
    # issue 21: fractions of this run's floors (1.0 = at the floor); paired first
    if 1 in by_c and "memory_floor_over_step_paired" in by_c[1]:
        t["batch1_memory_floor/step>=0.8 (paired)"] = by_c[1]["memory_floor_over_step_paired"]
    if 64 in by_c and "compute_floor_over_step_paired" in by_c[64]:
        t["c64_compute_floor/step>=0.6 (paired)"] = by_c[64]["compute_floor_over_step_paired"]
    if "compute_floor_over_step_paired" in r.get("prefill", {}):
        t["prefill_compute_floor/step>=0.6 (paired)"] = r["prefill"][
            "compute_floor_over_step_paired"
        ]
    if 1 in by_c:
        t["batch1_memory_floor/step>=0.8"] = 1 / by_c[1]["step_over_memory_floor"]
    if 64 in by_c:
        t["c64_compute_floor/step>=0.6"] = 1 / by_c[64]["step_over_compute_floor"]
    if "prefill" in r:
        t["prefill_compute_floor/step>=0.6"] = r["prefill"]["compute_floor_over_step"]
    # the same three in process CPU time (see the module docstring)
    if 1 in by_c and "memory_floor_over_step_cpu" in by_c[1]:
        t["batch1_memory_floor/step>=0.8 (CPU time)"] = by_c[1]["memory_floor_over_step_cpu"]
    if 64 in by_c and "compute_floor_over_step_cpu" in by_c[64]:
        t["c64_compute_floor/step>=0.6 (CPU time)"] = by_c[64]["compute_floor_over_step_cpu"]
    if 64 in by_c and "compute_floor_over_weights_only" in by_c[64]:  # not a target: its ceiling
        t["c64 ceiling: compute_floor/weights-only forward"] = by_c[64][
            "compute_floor_over_weights_only"
        ]
    if "compute_floor_over_step_cpu" in r.get("prefill", {}):
        t["prefill_compute_floor/step>=0.6 (CPU time)"] = r["prefill"][
            "compute_floor_over_step_cpu"
        ]
    if "llama_cpp" in r and 64 in by_c:
        t["c64_decode_over_llama_cpp_batch1"] = (
            by_c[64]["decode_tokens_per_s"] / r["llama_cpp"]["decode_tokens_per_s"]
        )
    return t


TABLE_HEADER = (
    "| conc | tok/s | decode tok/s | step ms | mem floor ms | x mem | compute floor ms "
    "| x compute | host % | sched/build/update ms | compiles | load |"
)


def format_table(r: dict) -> str:
    peaks = r["peaks"]
    title = (
        f"engine benchmark: {r['model']} float32, prompt {r['prompt_len']} + output "
        f"{r['output_len']} tokens per request"
    )
    peak_line = (
        f"peaks: {peaks['bandwidth_gb_s']:.1f} GB/s read, {peaks['matmul_gflop_s']:.0f} "
        f"GFLOP/s f32 matmul (load {peaks['load']:.1f}); per CPU-second "
        f"{peaks['bandwidth_gb_per_cpu_s']:.1f} GB, {peaks['matmul_gflop_per_cpu_s']:.0f} GFLOP; "
        f"weights {r['weight_bytes'] / 1e6:.0f} MB"
    )
    if "peaks_before" in r:
        b, a = r["peaks_before"], r["peaks_after"]
        peak_line += (
            f" (mean of before / after the concurrency runs: {b['matmul_gflop_per_cpu_s']:.0f} / "
            f"{a['matmul_gflop_per_cpu_s']:.0f} GFLOP per CPU-second, load {b['load']:.1f} / "
            f"{a['load']:.1f})"
        )
    lines = [title, peak_line, "", TABLE_HEADER, "|---:" * 9 + "|---|---:|---:|"]
    for x in r["concurrency"]:
        parts = (
            x["concurrency"],
            f"{x['tokens_per_s']:.1f}",
            f"{x['decode_tokens_per_s']:.1f}",
            f"{x['step_ms']:.1f}",
            f"{x['memory_floor_ms']:.1f}",
            f"{x['step_over_memory_floor']:.2f}",
            f"{x['compute_floor_ms']:.1f}",
            f"{x['step_over_compute_floor']:.2f}",
            f"{100 * x['host_fraction']:.2f}",
            f"{x['schedule_ms']:.2f}/{x['build_ms']:.2f}/{x['update_ms']:.2f}",
            x["compiles"],
            f"{x['load']:.1f}",
        )
        lines.append("| " + " | ".join(str(v) for v in parts) + " |")
    for x in r["concurrency"]:
        if "step_cpu_ms" in x:
            lines.append(
                f"CPU time, c={x['concurrency']}: step {x['step_cpu_ms']:.1f} ms CPU, memory "
                f"floor/step {x['memory_floor_over_step_cpu']:.2f}, compute floor/step "
                f"{x['compute_floor_over_step_cpu']:.2f}"
            )
        if "compute_floor_over_step_paired" in x:
            lines.append(
                f"paired floors, c={x['concurrency']}: peaks before each step (median "
                f"{x['paired_bandwidth_gb_s']:.1f} GB/s, "
                f"{x['paired_matmul_gflop_s']:.0f} GFLOP/s): "
                f"memory floor/step {x['memory_floor_over_step_paired']:.2f}, compute floor/step "
                f"{x['compute_floor_over_step_paired']:.2f}"
            )
        if "weights_only_ms" in x:
            lines.append(
                f"ceiling, c={x['concurrency']}: the forward over {x['concurrency']} rows without "
                f"attention or sampling takes {x['weights_only_ms']:.1f} ms "
                f"({x['weights_only_cpu_ms']:.1f} ms CPU) = "
                f"{x['compute_floor_over_weights_only']:.2f} of the compute floor (paired)"
            )
    if "static_vs_continuous" in r:
        s = r["static_vs_continuous"]
        lines += [
            "",
            (
                f"mixed workload ({s['requests']} requests, {s['output_tokens']} output tokens, "
                f"batch {s['batch']}): continuous {s['continuous_tokens_per_s']:.1f} tok/s, "
                f"static {s['static_tokens_per_s']:.1f} tok/s, ratio "
                f"{s['continuous_over_static']:.2f} (load {s['load']:.1f})"
            ),
        ]
    for h in r.get("hf", []):
        lines.append(
            f"transformers generate batch {h['batch']}: {h['tokens_per_s']:.1f} tok/s "
            f"(load {h['load']:.1f})"
        )
    if "prefill" in r:
        x = r["prefill"]
        lines.append(
            f"prefill {x['prompt_len']} tokens: {x['tokens_per_s']:.0f} tok/s in {x['steps']} "
            f"steps, {x['compute_floor_over_step']:.2f} of the compute floor (load {x['load']:.1f})"
        )
        if "compute_floor_over_step_paired" in x:
            lines.append(
                f"  paired floors: {x['compute_floor_over_step_paired']:.2f} of the compute floor"
            )
        if x.get("first_run_tokens_per_s"):
            lines.append(
                f"  the same prefill on its programs' first execution after warm-up: "
                f"{x['first_run_tokens_per_s']:.0f} tok/s"
            )
        if "compute_floor_over_step_cpu" in x:
            lines.append(
                f"CPU time, prefill: {1e3 * x['cpu_s']:.0f} ms CPU, compute floor/step "
                f"{x['compute_floor_over_step_cpu']:.2f}"
            )
    if "llama_cpp" in r:
        x = r["llama_cpp"]
        lines.append(
            f"llama.cpp (llama-cpp-python, GGUF as shipped): batch 1 decode "
            f"{x['decode_tokens_per_s']:.1f} tok/s, prefill {x['prefill_tokens_per_s']:.0f} tok/s "
            f"(load {x['load']:.1f})"
        )
    lines += ["", "targets (measured value):"]
    lines += [f"  {k}: {v:.3g}" for k, v in r["targets"].items()]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    results = run(args)
    print(format_table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
