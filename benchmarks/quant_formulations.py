"""Which int8 matmul formulation is fastest under XLA on this machine (the quant report's
"formulations" table): SmolLM2's FFN-up shape, 30 stacked layers in a `lax.scan` as the
model runs them, at 1 and 64 tokens, each against float32 in the same run.

    float32           x @ w                                  the baseline
    w8 convert        x @ q.astype(f32) * scale              weight-only (models/quant "int8")
    w8 mixed dot      dot_general(x, q, preferred f32) * s   weight-only, int8 operand as is
    w8 dequant-first  x @ (q.astype(f32) * scale)            weight-only, scale before the dot
    w8a8              int8(x) @ q -> int32, * sx * s         models/quant "w8a8"

    python -m benchmarks.quant_formulations          # prints a table (min of N runs)
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.int8_matmul import int8_matmul_w8a8


def _mixed_dot(x, q, s):
    acc = jax.lax.dot_general(
        x, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )  # [M, N]; XLA decides how to convert the int8 operand
    return acc * s


FORMULATIONS = {
    "float32": lambda x, w: x @ w,
    "w8 convert": lambda x, w: (x @ w[0].astype(jnp.float32)) * w[1],
    "w8 mixed dot": lambda x, w: _mixed_dot(x, w[0], w[1]),
    "w8 dequant-first": lambda x, w: x @ (w[0].astype(jnp.float32) * w[1]),
    "w8a8": lambda x, w: int8_matmul_w8a8(x, w[0], w[1]),
}


def _stacked_fn(matmul):
    """30 layers of x -> x + tanh(matmul(x, w_l)) @ proj under lax.scan (keeps x [M, D])."""

    def run(x, weights, proj):
        def body(h, w):
            return h + jnp.tanh(matmul(h, w)) @ proj, None

        return jax.lax.scan(body, x, weights)[0]

    return jax.jit(run)


def measure(
    tokens=(1, 64), layers: int = 30, d: int = 576, f: int = 1536, repeats: int = 10
) -> list[dict]:
    """Min wall time per call of each formulation; rows also carry the ratio to float32."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, (layers, d, f)).astype(np.float32)
    amax = np.abs(w).max(axis=1, keepdims=True)
    scale = (amax / 127).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    proj = jnp.asarray(rng.normal(0, 0.02, (f, d)), jnp.float32)
    weights = {
        "float32": jnp.asarray(w),
        **{k: (jnp.asarray(q), jnp.asarray(scale[:, 0])) for k in FORMULATIONS if k != "float32"},
    }
    rows = []
    for m in tokens:
        x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
        times = {}
        for name, mm in FORMULATIONS.items():
            fn = _stacked_fn(mm)
            fn(x, weights[name], proj).block_until_ready()
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(x, weights[name], proj).block_until_ready()
                best = min(best, time.perf_counter() - t0)
            times[name] = best
        for name, t in times.items():
            rows.append(
                {
                    "tokens": m,
                    "formulation": name,
                    "ms": round(t * 1e3, 2),
                    "vs_float32": round(t / times["float32"], 2),
                    "loadavg_1m": round(os.getloadavg()[0], 1),
                }
            )
    return rows


def main() -> None:
    for r in measure():
        print(
            f"{r['tokens']:>3} tokens  {r['formulation']:<17} {r['ms']:>8.2f} ms  "
            f"x{r['vs_float32']:.2f} vs float32  (load {r['loadavg_1m']})"
        )


if __name__ == "__main__":
    main()
