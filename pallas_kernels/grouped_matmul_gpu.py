"""Pallas GPU kernel (Triton lowering) for the grouped matmul of mixture-of-experts layers
(grouped_matmul.py, impl "gpu"): rows of x sorted by group, group e's rows times w[e].

    x [M, K] (rows of group e: offsets[e] : offsets[e+1]), w [G, K, N], group_sizes [G]
    -> out [M, N],  out[r] = x[r] @ w[group of r]      (rows past sum(group_sizes): zero)

Grid (visit v, N tile n); the visits are grouped_layout.py's (group, M tile) pairs, so a
tile straddling a group boundary gets one program per group, and each program owns the
rows of ITS group in one [tm, tn] output tile:

    offsets_ref [G+1], group_ref [V] (-1: padding visit, skipped), tile_ref [V]   int32
    x_ref   [Mp, Kp]     global memory (no BlockSpec), read as [tm, tk] tiles
    w_ref   [G, Kp, Np]  global memory, read as [tk, tn] tiles of w[group]
    o_ref   [Mp, Np]     aliased onto a zero-initialised buffer: one masked [tm, tn] store

    acc[tm, tn] f32 = 0
    for k in range(Kp // tk):
        acc += x[tile, k] @ w[group, k, n]
    o[tile, n] = acc  where  offsets[group] <= row < offsets[group + 1]

The masked store writes only the group's rows, so two visits of one tile write disjoint
rows, and rows no visit owns (past the groups) keep the buffer's zeros. Work ~ (M + G x tm)
x K x N, each visit reading its group's [K, tn] weight columns once.

Triton needs power-of-two tiles of at least 16 for a dot: M is padded to tm, K to tk, N to
tn with zeros (tm, tk, tn shrink to the padded dims for small inputs).

NOTE: not yet run on a GPU (none was available): correctness comes from interpret mode on
CPU and the CUDA lowering check in tests/test_moe.py. The block sizes and launch
parameters are untuned guesses (int8_matmul_gpu.py's); benchmarks/device_check.py times the
kernel against ragged_dot when a GPU is lent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.grouped_layout import group_metadata

MIN_TILE = 16  # Triton's smallest dot operand dimension


def _tile(requested: int, dim: int, name: str) -> int:
    """`requested` (a power of two >= 16), shrunk to the dim padded to a power of two."""
    if requested < MIN_TILE or requested != pl.next_power_of_2(requested):
        raise ValueError(f"gmm_gpu: {name}={requested} must be a power of two >= {MIN_TILE}")
    return max(MIN_TILE, min(requested, pl.next_power_of_2(dim)))


def _pad_to(a: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
    """a zero-padded at the end of each axis up to a multiple of multiples[axis]."""
    widths = [(0, -d % m) for d, m in zip(a.shape, multiples)]
    return jnp.pad(a, widths) if any(w for _, w in widths) else a


def _kernel(offsets_ref, group_ref, tile_ref, x_ref, w_ref, _zeros_ref, o_ref, *, tm, tn, tk):
    # offsets [G+1], group/tile [V]; x [Mp, Kp]; w [G, Kp, Np]; o (aliased zeros) [Mp, Np]
    v, n = pl.program_id(0), pl.program_id(1)
    group = group_ref[v]

    @pl.when(group >= 0)  # padding visits (past the real count) do nothing
    def _visit():
        row0 = pl.multiple_of(tile_ref[v] * tm, tm)
        rows, cols = pl.ds(row0, tm), pl.ds(pl.multiple_of(n * tn, tn), tn)
        precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

        def body(k, acc):
            ks = pl.ds(pl.multiple_of(k * tk, tk), tk)
            x = x_ref[rows, ks]  # [tm, tk]
            w = w_ref[group, ks, cols]  # [tk, tn]
            return acc + jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, x_ref.shape[1] // tk, body, jnp.zeros((tm, tn), jnp.float32))
        row = row0 + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        mine = (row >= offsets_ref[group]) & (row < offsets_ref[group + 1])  # [tm, tn]
        plgpu.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask=mine)


def gmm_gpu(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    tm: int = 64,
    tn: int = 128,
    tk: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """The Pallas GPU grouped matmul (module doc): x [M, K], w [G, K, N], group_sizes [G]
    int32 (sum <= M) -> [M, N] in x's dtype, equal to `jax.lax.ragged_dot(x, w, group_sizes)`.
    tm, tn, tk: powers of two >= 16 (shrunk for small dims)."""
    m, kdim = x.shape
    g, _, n = w.shape
    tm, tn, tk = _tile(tm, m, "tm"), _tile(tn, n, "tn"), _tile(tk, kdim, "tk")
    xp = _pad_to(x, (tm, tk))  # [Mp, Kp]
    wp = _pad_to(w.astype(x.dtype), (1, tk, tn))  # [G, Kp, Np]
    mp, np_ = xp.shape[0], wp.shape[2]
    offsets, visit_group, visit_tile = group_metadata(group_sizes, mp, tm, mark_padding=True)
    out = pl.pallas_call(
        functools.partial(_kernel, tm=tm, tn=tn, tk=tk),
        grid=(visit_group.shape[0], np_ // tn),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        input_output_aliases={5: 0},  # the zeros: rows no visit owns stay zero
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="moe_gmm_gpu",
    )(offsets, visit_group, visit_tile, xp, wp, jnp.zeros((mp, np_), x.dtype))
    return out[:m, :n]
