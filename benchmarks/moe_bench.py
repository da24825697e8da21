"""One mixture-of-experts MLP layer against a dense MLP of the same active parameters.

    python -m benchmarks.moe_bench                  # 64 experts, top-8, D 1024, Fm 256
    python -m benchmarks.moe_bench --sizes=smoke    # what the test runs

For T tokens (a decode step of batch T) it times (min of warm runs, float32, jitted):
- dense:       down(silu(gate h) * up h) with F = k x Fm (the same active weights per token)
- moe/<impl>:  models.moe.moe_mlp with each grouped matmul (pallas_kernels.grouped_matmul:
               "cpu" = lax loops over groups, "ragged_dot" = XLA's op)
- routing:     moe_mlp with a grouped matmul that does no matmul (router, top-k, sort,
               gather, scatter, weighted sum): the routing/permutation share of the layer
and prints each time and its ratio to dense. Routing is random-weight data: the groups are
as balanced as a random router makes them.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from models import layers, moe

SIZES = {  # (D, E, k, Fm, token counts)
    "smoke": (64, 8, 2, 32, (1, 4)),
    "default": (1024, 64, 8, 256, (1, 8, 64)),
}


def _no_matmul(x, w, group_sizes):
    """A stand-in grouped matmul: the right shape, data-dependent, no FLOPs to speak of."""
    return jnp.broadcast_to(x[:, :1], (x.shape[0], w.shape[2])) * 0 + group_sizes[0]


def _time(f, *args, iters: int) -> float:
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", choices=sorted(SIZES), default="default")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    D, E, k, Fm, tokens = SIZES[args.sizes]
    keys = iter(jax.random.split(jax.random.key(0), 16))
    nrm = lambda *s: 0.05 * jax.random.normal(next(keys), s)  # noqa: E731
    router, wg, wu, wd = nrm(D, E), nrm(E, D, Fm), nrm(E, D, Fm), nrm(E, Fm, D)
    dg, du, dd = nrm(D, k * Fm), nrm(D, k * Fm), nrm(k * Fm, D)

    # NOTE: weights are arguments, not closed-over constants (XLA would fold them)
    @jax.jit
    def dense_fn(h, g, u, d):
        return layers.gated_mlp(h @ g, h @ u, "silu") @ d

    def dense(h):
        return dense_fn(h, dg, du, dd)

    def sparse(gmm):
        f = jax.jit(functools.partial(moe.moe_mlp, top_k=k, grouped_matmul=gmm))
        return lambda h: f(h, router, wg, wu, wd)

    variants = {
        "moe/cpu": sparse(moe.grouped_matmul_fn("cpu")),
        "moe/ragged_dot": sparse(moe.grouped_matmul_fn("ragged_dot")),
        "routing": sparse(_no_matmul),
    }
    rows = []
    print(f"D={D} E={E} top-{k} Fm={Fm}; dense F={k * Fm}; backend {jax.default_backend()}")
    for t in tokens:
        h = jax.random.normal(next(keys), (t, D))
        base = _time(dense, h, iters=args.iters)
        rows.append({"tokens": t, "impl": "dense", "time_s": base, "ratio_vs_dense": 1.0})
        for name, f in variants.items():
            s = _time(f, h, iters=args.iters)
            rows.append({"tokens": t, "impl": name, "time_s": s, "ratio_vs_dense": s / base})
        line = ", ".join(
            f"{r['impl']} {r['time_s'] * 1e3:.2f} ms ({r['ratio_vs_dense']:.1f}x)"
            for r in rows
            if r["tokens"] == t
        )
        print(f"T={t}: {line}")
    return rows


if __name__ == "__main__":
    main()
