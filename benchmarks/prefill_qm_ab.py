"""What a prefill step's static `max_query_len` (Qm) costs (issue 21.1): the same batch of
short prompts at the Qm the engine's shapes give it today (min(Tp, prefill_chunk_size),
engine/batch/builder.py `query_len_bound`) and at a small Qm, timed alternately in one process.

    python -m benchmarks.prefill_qm_ab [--cases=13x40,32x16] [--iters=8] [--stub]
    python -m benchmarks.prefill_qm_ab --smoke       # tiny model, two iterations

Qm enters the ragged attention only as a bound (pallas_kernels/layout.py): the batch is cut
into min(cdiv(T, BQ) + S, S * cdiv(Qm, BQ)) query blocks of BQ rows (BQ = pow2(T / S), at
least 16, at most pow2(Qm)), so a smaller Qm removes blocks only when every sequence fits
in one block. Each case prints both programs' BQ, block count and median process CPU /
wall ms, and with `--stub` the same step with attention stubbed out (attention + KV write's
share of the step: the most any Qm could save). Figures: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from benchmarks.step_profile import PAGE_SIZE, Case, make_batch, stub_attention
from engine.runner import step as step_module
from engine.runner.kv_cache import PagedKVCache
from engine.runner.state import DeviceState
from engine.sampling.sampler import GREEDY_FLAGS
from models.llama import layer_layout
from pallas_kernels import layout
from pallas_kernels.reference import ragged_block_q

# name: (prefill chunks as (start, tokens), Tp, (chunk size of today's Qm, small Qm))
CASES = {
    "13x40": (((0, 40),) * 12 + ((0, 32),), 512, (256, 64)),  # 32 x 40 under a 512 budget
    "32x16": (((0, 16),) * 32, 512, (256, 16)),
    "39x13": (((0, 13),) * 39, 512, (256, 16)),
    "32x40": (((0, 40),) * 32, 2048, (256, 64)),  # a 2,048-token budget
}
SMOKE_CASES = {"5x7": (((0, 7),) * 5, 64, (32, 8))}


def _runner(params, cfg, case: Case):
    """A zero-argument function running one step of `case`, and the step's shape."""
    batch, shape, num_pages = make_batch(case)
    kv = PagedKVCache.zeros(cfg, num_pages + 1, PAGE_SIZE)
    state = [DeviceState.without_penalties(kv, shape.num_prefill_seqs)]  # penalties unused

    def run():
        state[0], packed, _ = step_module.engine_step(
            params, state[0], batch, cfg=cfg, shape=shape, flags=GREEDY_FLAGS,
            use_penalties=False,
        )  # fmt: skip
        return packed

    return run, shape


def _cpu_wall_ms(fn) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    return 1e3 * (time.process_time() - c0), 1e3 * (time.perf_counter() - t0)


def ab_case(params, cfg, prefill, tp: int, chunks, iters: int) -> dict[int, dict]:
    """{Qm: {blocks, block_q, cpu_ms, wall_ms (medians)}}, the programs timed alternately."""
    runs, out = {}, {}
    for chunk in chunks:
        run, shape = _runner(params, cfg, Case((), prefill, prefill_bucket=tp, chunk_size=chunk))
        T, S, Qm = shape.num_prefill_tokens, shape.num_prefill_seqs, shape.max_query_len
        bq = ragged_block_q(T, S, Qm)
        blocks = layout.num_query_blocks(T, S, Qm, bq)
        print(f"    Qm={Qm}: {shape}, BQ {bq}, {blocks} blocks ({blocks * bq} rows)", flush=True)
        jax.block_until_ready(run())  # compile
        runs[Qm], out[Qm] = (run, []), {"blocks": blocks, "block_q": bq}
    for _ in range(iters):
        for run, times in runs.values():
            times.append(_cpu_wall_ms(run))
    for qm, (_, times) in runs.items():
        out[qm]["cpu_ms"], out[qm]["wall_ms"] = (statistics.median(t) for t in zip(*times))
    return out


def stub_share(params, cfg, prefill, tp: int, chunk: int, iters: int) -> float:
    """1 - CPU(step with attention stubbed) / CPU(step), the two measured back to back."""
    case = Case((), prefill, prefill_bucket=tp, chunk_size=chunk)
    original = step_module.paged_attention_fn
    cpu = {}
    try:
        for name, fn in (("stub", lambda *a, **k: stub_attention), ("step", original)):
            step_module.paged_attention_fn = fn
            step_module.engine_step.clear_cache()  # the attention is bound at trace time
            run, _ = _runner(params, cfg, case)
            jax.block_until_ready(run())  # compile
            cpu[name] = statistics.median(_cpu_wall_ms(run)[0] for _ in range(iters))
    finally:
        step_module.paged_attention_fn = original
        step_module.engine_step.clear_cache()
    return 1 - cpu["stub"] / cpu["step"]


def main(argv=None) -> dict:
    from models.registry import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=None, help="comma list (default: all)")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--stub", action="store_true", help="also time the step without attention")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    cases = SMOKE_CASES if args.smoke else CASES
    model = load_model("tiny" if args.smoke else "smollm2-135m")
    cfg, params = model.config, layer_layout(model.params, "scan")
    iters = 2 if args.smoke else args.iters
    results = {}
    for name in args.cases.split(",") if args.cases else cases:
        prefill, tp, chunks = cases[name]
        print(f"  {name}:", flush=True)
        results[name] = r = ab_case(params, cfg, prefill, tp, chunks, iters)
        base_cpu = next(iter(r.values()))["cpu_ms"]
        for qm, m in r.items():
            print(
                f"    Qm={qm}: {m['cpu_ms']:.1f} ms CPU ({m['cpu_ms'] / base_cpu:.3f}), "
                f"{m['wall_ms']:.1f} ms wall (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
        if args.stub:
            r["attention_share"] = stub_share(params, cfg, prefill, tp, chunks[0], iters)
            print(f"    attention + KV write: {r['attention_share']:.1%} of the step", flush=True)
    return results


if __name__ == "__main__":
    main()
