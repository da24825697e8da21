"""Where the device step's time goes: timing variants of `engine.runner.step.engine_step` on
hand-built batches (no scheduler), each against the same machine's floors.

    python -m benchmarks.step_profile [--model=smollm2-135m] [--cases=decode64,...]
    python -m benchmarks.step_profile --smoke        # tiny model (tests)

Cases (page size 16, pages laid out consecutively):
    batch1     1 decode at context 100
    decode64   64 decodes at context 77 (13-token prompts, 64 tokens generated)
    prefill39  39 prompts of 13 tokens in one 512-token prefill group (Sp bucket 64)
    prefill1k  one 256-token chunk of a 1,024-token prompt at positions 768..1023
    served_prefill   two fresh 256-token chunks padded to Sp 8, P 64 (served c=16's prefill)
    served_decode16  16 decodes at context 300 padded to P 32 (served c=16's decode)

Variants, each one compiled program timed by its median over warm runs:
    step          the engine's step with the greedy sampler (what the benchmarks run)
    step_reference  the same with the reference attention (impl="reference") instead of
                  the backend's default (on CPU: the data-bounded loops of cpu_kernels.py)
    step_full     the same with the full sampler flags (top-k candidates, logprobs)
    no_attention  attention replaced by `q` (no KV write, no gathers): weights + sampling
    forward_only  no_attention without sampling: the weight matmuls, norms and LM head

`step - no_attention` is attention + KV write; `step_full - step` the full sampler's cost;
`no_attention - forward_only` the greedy sampler's. Each figure: median wall ms and median
process CPU ms (the steadier one on a shared machine), with the load average.

Compute floor in CPU time (`--floor`, on by default): a 2048^3 float32 matmul is timed in the
same process (median process CPU time), and each variant is printed as `floor/CPU`: the
case's FLOPs (`ModelConfig.flops_per_token` of every real token at its context) at that
matmul's FLOP per CPU-second, over the variant's CPU time. Wall-clock floors swing 2x with
the machine's load; this ratio is what engine_bench's "compute floor / step" would be on an
otherwise idle machine, and `forward_only`'s is the ceiling the rest of the step can reach.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from engine.batch.builder import BatchShape, StepBatch, pow2_bucket
from engine.runner import step as step_module
from engine.runner.kv_cache import PagedKVCache
from engine.runner.state import DeviceState
from engine.sampling.sampler import FULL_FLAGS, GREEDY_FLAGS, SamplingTensors
from models.llama import LAYER_LOOPS, forward, layer_layout

PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class Case:
    decode_contexts: tuple[int, ...]  # kv_len of each decode sequence
    prefill: tuple[tuple[int, int], ...]  # (start position, new tokens) of each prefill chunk
    prefill_bucket: int = 0  # Tp (0: pow2 bucket of the tokens)
    chunk_size: int = 256
    seqs_bucket: int = 0  # Sp (0: pow2 bucket of the prefill chunks)
    pages_bucket: int = 0  # P (0: pow2 bucket of the longest sequence's pages)


CASES = {
    "batch1": Case((100,), ()),
    "decode64": Case((77,) * 64, ()),
    "prefill39": Case((), ((0, 13),) * 39, prefill_bucket=512),
    "prefill1k": Case((), ((768, 256),)),
    # What the served c=16 workload ran most (benchmarks/RESULTS.md, "Served path"): two
    # 256-token chunks padded to (Sp 8, P 64), and 16 decodes at ~300 tokens padded to P 32.
    "served_prefill": Case((), ((0, 256), (0, 256)), seqs_bucket=8, pages_bucket=64),
    "served_decode16": Case((300,) * 16, (), pages_bucket=32),
}
SMOKE_CASES = {
    "batch1": Case((20,), ()),
    "decode8": Case((17,) * 8, ()),
    "prefill5": Case((), ((0, 7),) * 5, prefill_bucket=64, chunk_size=32),
}


def make_batch(case: Case, page_size: int = PAGE_SIZE) -> tuple[StepBatch, BatchShape, int]:
    """The case's batch with every sequence on its own consecutive pages (page 0 is null).
    Returns (batch, shape, pages needed)."""
    seqs = [(c - 1, 1) for c in case.decode_contexts] + list(case.prefill)
    pages_of = [-(-(start + n) // page_size) for start, n in seqs]
    first_page = np.cumsum([1, *pages_of])
    Sd = pow2_bucket(len(case.decode_contexts)) if case.decode_contexts else 0
    n_prefill = sum(n for _, n in case.prefill)
    Tp = case.prefill_bucket or (pow2_bucket(n_prefill, 16) if n_prefill else 0)
    Sp = case.seqs_bucket or (pow2_bucket(len(case.prefill)) if case.prefill else 0)
    P = case.pages_bucket or pow2_bucket(max(pages_of), 4)
    shape = BatchShape(Sd, Tp, Sp, P, min(Tp, case.chunk_size) if Tp else 1)
    T, R = Sd + Tp, Sd + Sp
    z = lambda *s: np.zeros(s, np.int32)  # noqa: E731
    token_ids, positions, slots = z(T), z(T), z(T)
    kv_lens_d, page_table_d = z(Sd), z(Sd, P)
    kv_lens_p, page_table_p, query_start = z(Sp), z(Sp, P), z(Sp + 1)
    logits_indices = z(R)
    rng = np.random.default_rng(0)
    num_d = len(case.decode_contexts)
    row = Sd  # prefill rows follow the decode bucket
    for i, ((start, n), npages) in enumerate(zip(seqs, pages_of)):
        pages = np.arange(first_page[i], first_page[i] + npages, dtype=np.int32)
        pos = np.arange(start, start + n, dtype=np.int32)
        r = i if i < num_d else row
        token_ids[r : r + n] = rng.integers(3, 1000, n)
        positions[r : r + n] = pos
        slots[r : r + n] = pages[pos // page_size] * page_size + pos % page_size
        if i < num_d:
            kv_lens_d[i], page_table_d[i, :npages] = start + n, pages
            logits_indices[i] = i
        else:
            j = i - num_d
            kv_lens_p[j], page_table_p[j, :npages] = start + n, pages
            query_start[j + 1] = query_start[j] + n
            logits_indices[Sd + j] = row + n - 1
            row += n
    if Sp:
        query_start[len(case.prefill) + 1 :] = query_start[len(case.prefill)]
    batch = StepBatch(
        token_ids,
        np.full(len(token_ids), -1, np.int32),  # token_slots: every input token on the host
        positions,
        slots,
        kv_lens_d,
        page_table_d,
        kv_lens_p,
        page_table_p,
        query_start,
        np.array([len(case.prefill)], np.int32),
        logits_indices,
        np.ones(R, bool),
        np.arange(R, dtype=np.int32),
        SamplingTensors.from_params([None] * R, [0] * R, None, R),
    )
    return batch, shape, int(first_page[-1])


def _median_s(fn, iters: int) -> tuple[float, float, float]:
    """(median wall s, median process CPU s) of warm runs, and the first call's wall s
    (compile + run). CPU time is the steadier figure on a shared machine (wall time
    includes waiting for a core)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first_s = time.perf_counter() - t0
    walls, cpus = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn())
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus), first_s


def matmul_flop_per_cpu_s(n: int = 2048, iters: int = 5) -> float:
    """float32 matmul FLOP per process-CPU second of an n^3 product (this machine, now)."""
    m = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    matmul = jax.jit(lambda a, b: a @ b)
    _, cpu_s, _ = _median_s(lambda: matmul(m, m), iters)
    return 2 * n**3 / cpu_s


def case_flops(cfg, case: Case) -> float:
    """Forward FLOPs of the case's real tokens, each at its own context (engine_bench's
    compute floor counts the same)."""
    contexts = list(case.decode_contexts)
    for start, n in case.prefill:
        contexts += range(start + 1, start + n + 1)
    return sum(cfg.flops_per_token(c) for c in contexts)


def stub_attention(q, k, v, layer, cache):
    return q, cache


def weights_only_fn(model, num_tokens: int, layer_loop: str = "auto"):
    """A zero-argument call of the model's forward over `num_tokens` rows with attention
    replaced by `q` and no sampling: the weight matmuls, norms and LM head alone, i.e. what
    a step of that many tokens would cost if attention, the KV write, sampling and the host
    cost nothing (engine_bench's "ceiling"). Compiled by its first call."""
    cfg, params = model.config, layer_layout(model.params, layer_loop)
    positions = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    ids = positions % cfg.vocab_size  # [T]
    fwd = jax.jit(lambda p, t, pos: forward(p, cfg, t, pos, None, stub_attention)[0])
    return lambda: jax.block_until_ready(fwd(params, ids, positions))


def profile_case(
    model, case: Case, iters: int, variants: list[str], layer_loop: str, flop_per_cpu_s=None
) -> dict:
    """Times each variant; with `flop_per_cpu_s`, also its fraction of the compute floor."""
    cfg, params = model.config, layer_layout(model.params, layer_loop)
    floor_cpu_s = case_flops(cfg, case) / flop_per_cpu_s if flop_per_cpu_s else None
    batch, shape, num_pages = make_batch(case)
    kv = PagedKVCache.zeros(cfg, num_pages + 1, PAGE_SIZE)
    state = DeviceState.without_penalties(kv, shape.num_decode + shape.num_prefill_seqs)
    out = {"shape": dataclasses.asdict(shape)}

    def run_step(flags, impl="auto"):
        def go():
            nonlocal state
            state, packed, _ = step_module.engine_step(
                params,
                state,
                batch,
                cfg=cfg,
                shape=shape,
                flags=flags,
                use_penalties=False,
                impl=impl,
            )
            return packed

        return go

    fwd = jax.jit(
        lambda p, b: forward(
            p, cfg, b.token_ids, b.positions, None, stub_attention, b.logits_indices
        )[0]
    )
    runners = {
        "step": run_step(GREEDY_FLAGS),
        "step_full": run_step(FULL_FLAGS),
        "step_reference": run_step(GREEDY_FLAGS, "reference"),
        "forward_only": lambda: fwd(params, batch),
    }
    for name in variants:
        if name == "no_attention":
            original = step_module.paged_attention_fn
            step_module.paged_attention_fn = lambda *a, **k: stub_attention
            try:
                step_module.engine_step.clear_cache()
                t, cpu, first = _median_s(run_step(GREEDY_FLAGS), iters)
            finally:
                step_module.paged_attention_fn = original
                step_module.engine_step.clear_cache()
        else:
            t, cpu, first = _median_s(runners[name], iters)
        out[name + "_ms"], out[name + "_cpu_ms"] = 1e3 * t, 1e3 * cpu
        out[name + "_first_call_s"] = first
        ratio = ""
        if floor_cpu_s:
            out[name + "_floor_over_cpu"] = floor_cpu_s / cpu
            ratio = f", floor/CPU {floor_cpu_s / cpu:.2f}"
        print(
            f"    {name}: {1e3 * t:.1f} ms wall, {1e3 * cpu:.1f} ms CPU{ratio}, first call "
            f"{first:.1f} s (load {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--cases", default=None, help="comma list (default: all)")
    p.add_argument("--variants", default="step,step_full,no_attention,forward_only")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--layer_loop", default="auto", choices=LAYER_LOOPS)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--no_floor", action="store_true", help="skip the 2048^3 matmul floor")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.iters = "tiny", 2
    return args


def main(argv=None) -> dict:
    from models.registry import load_model

    args = parse_args(sys.argv[1:] if argv is None else argv)
    model = load_model(args.model)
    cases = SMOKE_CASES if args.smoke else CASES
    names = args.cases.split(",") if args.cases else list(cases)
    results = {}
    flop_per_cpu_s = None
    if not args.no_floor:
        flop_per_cpu_s = matmul_flop_per_cpu_s(256 if args.smoke else 2048)
        results["matmul_gflop_per_cpu_s"] = flop_per_cpu_s / 1e9
        print(f"  matmul floor: {flop_per_cpu_s / 1e9:.0f} GFLOP per CPU-second", flush=True)
    for name in names:
        print(f"  {name}:", flush=True)
        results[name] = profile_case(
            model,
            cases[name],
            args.iters,
            args.variants.split(","),
            args.layer_loop,
            flop_per_cpu_s,
        )
    return results


if __name__ == "__main__":
    main()
