"""Roofline benchmark of the paged-attention kernels.

    python -m benchmarks.kernels_bench                 # sizes picked by backend
    python -m benchmarks.kernels_bench --sizes=tiny    # what CI runs on CPU
    python -m benchmarks.kernels_bench --sizes=full --dtype=bfloat16

For decode batches (one query per sequence) and mixed batches (one prefill chunk plus
decodes), it computes the bytes the attention must move (every cached K/V page of every
sequence once, plus q and the output) and the FLOPs it must do (4 * attended keys * H * hd
per query), times each implementation (median of warm runs), and prints achieved GB/s and
TFLOP/s against this device's peak measured in the same run (a large copy and a large
matmul). Implementations on the same inputs: ours (impl="auto": the Pallas kernel on GPU/TPU,
the data-bounded jnp loops of cpu_kernels.py on CPU), the XLA reference (impl="reference"), and
JAX's shipped `pallas.ops` paged attention (GPU: `ops.gpu.paged_attention`, TPU:
`ops.tpu.paged_attention`; decode only, it has no ragged mode). On CPU the Pallas kernels run
only in interpret mode and only with --interpret (slow: they measure the interpreter, not the
kernel).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

SIZES = {
    # (batches, contexts, H, K, hd, page_size, prefill chunk)
    "smoke": ((2,), (64,), 4, 2, 64, 16, 16),
    "tiny": ((1, 4), (128, 512), 4, 2, 64, 16, 32),
    "full": ((1, 8, 64, 256), (512, 4096, 32768), 32, 8, 128, 16, 512),
}
# The reference gathers every page once more and materialises float32 scores
# [S, H, max_query_len, context]: skip it beyond this many bytes of either.
MAX_REFERENCE_BYTES = 8 << 30


@dataclasses.dataclass
class Inputs:
    kind: str  # "decode" | "mixed"
    batch: int
    context: int
    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    kv_lens: jax.Array
    page_table: jax.Array
    query_start: jax.Array
    num_seqs: jax.Array
    max_query_len: int
    bytes_moved: int
    flops: int


def make_inputs(
    kind, batch, context, *, num_heads, num_kv_heads, head_dim, page_size, chunk, dtype, seed=0
) -> Inputs:
    """Every sequence holds `context` tokens; decode: one query each; mixed: sequence 0 is a
    prefill chunk of `chunk` queries ending at `context`, the others decode."""
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-context // page_size)
    num_pages = 1 + batch * pages_per_seq
    shape = (1, num_kv_heads, num_pages, page_size, head_dim)
    key = jax.random.key(seed)
    k_pages = jax.random.normal(key, shape, dtype)
    v_pages = jax.random.normal(jax.random.fold_in(key, 1), shape, dtype)
    page_table = 1 + rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq)
    q_lens = [1] * batch
    if kind == "mixed":
        q_lens[0] = min(chunk, context)
    num_tokens = sum(q_lens)
    q = jax.random.normal(jax.random.fold_in(key, 2), (num_tokens, num_heads, head_dim), dtype)
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * batch * pages_per_seq * page_size * num_kv_heads * head_dim * itemsize
    attended = sum(context - ql + i + 1 for ql in q_lens for i in range(ql))
    return Inputs(
        kind=kind,
        batch=batch,
        context=context,
        q=q,
        k_pages=k_pages,
        v_pages=v_pages,
        kv_lens=jnp.full((batch,), context, jnp.int32),
        page_table=jnp.asarray(page_table, jnp.int32),
        query_start=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        num_seqs=jnp.array([batch], jnp.int32),
        max_query_len=max(q_lens),
        bytes_moved=kv_bytes + 2 * q.size * itemsize,
        flops=4 * attended * num_heads * head_dim,
    )


def time_median_s(fn, *args, iters: int, best: bool = False) -> float:
    """Median (or best, for peaks: a ceiling) of `iters` warm runs."""
    jax.block_until_ready(fn(*args))  # compile + warm
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times) if best else statistics.median(times)


def measure_peaks(iters: int, small: bool = False) -> tuple[float, float]:
    """(bytes/s of a large copy, FLOP/s of a large matmul) on the default device."""
    on_cpu = small or jax.default_backend() == "cpu"
    n_bytes = (16 << 20) if small else (64 << 20) if on_cpu else (2 << 30)
    # Reads and writes every byte once; donated, so the output reuses the input's buffer
    # (a fresh buffer per call would time page faults on CPU, not bandwidth).
    copy = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
    x = copy(jnp.ones((n_bytes // 4,), jnp.float32))
    copy_s = []
    for _ in range(max(iters, 5)):
        t0 = time.perf_counter()
        x = jax.block_until_ready(copy(x))
        copy_s.append(time.perf_counter() - t0)
    bw = 2 * n_bytes / min(copy_s)
    n, mm_dtype = (1024, jnp.float32) if on_cpu else (8192, jnp.bfloat16)
    n = 512 if small else n
    a = jnp.ones((n, n), mm_dtype)
    matmul = jax.jit(lambda u, v: u @ v)
    flops = 2 * n**3 / time_median_s(matmul, a, a, iters=max(iters, 5), best=True)
    return bw, flops


def shipped_decode(inputs: Inputs, sm_scale: float):
    """JAX's own paged attention for the current backend, or None (no ragged mode; CPU runs
    the GPU one in interpret mode)."""
    backend = jax.default_backend()
    pages = inputs.page_table.shape[1]
    k_pages, v_pages = inputs.k_pages[0], inputs.v_pages[0]  # L = 1: a free bitcast
    q = inputs.q * sm_scale  # the shipped kernels have no scale argument
    if backend == "tpu":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

        ppcb = math.gcd(pages, 8)
        fn = jax.jit(
            lambda: paged_attention(
                q, k_pages, v_pages, inputs.kv_lens, inputs.page_table, pages_per_compute_block=ppcb
            )
        )
        return fn
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    k_splits = math.gcd(pages, 16)
    ppcb = math.gcd(pages // k_splits, 8)
    return jax.jit(
        lambda: paged_attention(
            q,
            k_pages,
            v_pages,
            inputs.page_table,
            inputs.kv_lens,
            k_splits=k_splits,
            pages_per_compute_block=ppcb,
            interpret=backend == "cpu",
        )
    )


def implementations(inputs: Inputs, sm_scale: float, interpret: bool):
    """name -> zero-argument jitted function, all on the same inputs."""
    args = (inputs.k_pages, inputs.v_pages, inputs.kv_lens, inputs.page_table)
    on_cpu = jax.default_backend() == "cpu"

    def ours(impl, interp=False):
        if inputs.kind == "decode":
            return jax.jit(
                lambda: pk.decode_paged_attention(
                    inputs.q, *args, 0, sm_scale=sm_scale, impl=impl, interpret=interp
                )
            )
        return jax.jit(
            lambda: pk.ragged_paged_attention(
                inputs.q,
                *args,
                inputs.query_start,
                inputs.num_seqs,
                0,
                sm_scale=sm_scale,
                max_query_len=inputs.max_query_len,
                impl=impl,
                interpret=interp,
            )
        )

    fns = {"ours": ours("auto")}
    score_bytes = 4 * inputs.batch * inputs.q.shape[1] * inputs.max_query_len * inputs.context
    if max(inputs.bytes_moved, score_bytes) <= MAX_REFERENCE_BYTES:
        fns["xla_reference"] = ours("reference")
    if on_cpu and interpret:
        fns["ours_gpu_interpret"] = ours("gpu", True)
    if inputs.kind == "decode" and (not on_cpu or interpret):
        fns["jax_shipped"] = shipped_decode(inputs, sm_scale)
    return fns


def run(sizes: str, dtype, iters: int, interpret: bool, kinds=("decode", "mixed")):
    batches, contexts, num_heads, num_kv_heads, head_dim, page_size, chunk = SIZES[sizes]
    peak_bw, peak_flops = measure_peaks(iters, small=sizes == "smoke")
    print(
        f"device={jax.devices()[0].device_kind} backend={jax.default_backend()} "
        f"peak copy {peak_bw / 1e9:.1f} GB/s, peak matmul {peak_flops / 1e12:.2f} TFLOP/s"
    )
    print(
        f"{'kind':6} {'batch':>5} {'ctx':>6} {'impl':20} {'ms':>9} {'GB/s':>8} {'%bw':>5} "
        f"{'TFLOP/s':>8} {'%mm':>5} {'vs ours':>8}"
    )
    rows = []
    for kind in kinds:
        for batch in batches:
            for context in contexts:
                inputs = make_inputs(
                    kind,
                    batch,
                    context,
                    num_heads=num_heads,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    page_size=page_size,
                    chunk=chunk,
                    dtype=dtype,
                )
                times = {}
                for name, fn in implementations(inputs, head_dim**-0.5, interpret).items():
                    times[name] = time_median_s(fn, iters=iters)
                for name, t in times.items():
                    row = {
                        "kind": kind,
                        "batch": batch,
                        "context": context,
                        "impl": name,
                        "time_s": t,
                        "gb_s": inputs.bytes_moved / t / 1e9,
                        "tflop_s": inputs.flops / t / 1e12,
                        "frac_bw": inputs.bytes_moved / t / peak_bw,
                        "frac_flops": inputs.flops / t / peak_flops,
                        "ratio_vs_ours": t / times["ours"],
                    }
                    rows.append(row)
                    print(
                        f"{kind:6} {batch:5d} {context:6d} {name:20} {t * 1e3:9.3f} "
                        f"{row['gb_s']:8.1f} {100 * row['frac_bw']:5.1f} "
                        f"{row['tflop_s']:8.3f} {100 * row['frac_flops']:5.1f} "
                        f"{row['ratio_vs_ours']:8.2f}"
                    )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        choices=sorted(SIZES),
        default=None,
        help="default: tiny on CPU, full on accelerators",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="default: float32 on CPU, bfloat16 on accelerators",
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--interpret",
        action="store_true",
        help="on CPU, also time the Pallas GPU kernels in interpret mode",
    )
    args = parser.parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    sizes = args.sizes or ("tiny" if on_cpu else "full")
    dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
    return run(sizes, dtype, args.iters, args.interpret)


if __name__ == "__main__":
    main()
