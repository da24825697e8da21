"""Pallas GPU kernel (Triton lowering) for the weight-only int8 matmul (int8_matmul.py).

Grid (row block i, column block j); each program owns one [bm, bn] output tile and walks K:

    x_ref     [Mp, Kp] float   global memory (no BlockSpec), read as [bm, bk] tiles
    q_ref     [Kp, Np] int8    global memory, read as [bk, bn] tiles: 1 byte per weight
    scale_ref [Np]     float32 the tile's [bn] scales, read once at the end
    o_ref     [Mp, Np]         one [bm, bn] store

    acc[bm, bn] f32 = 0
    for k in range(Kp // bk):        # dequantization inside the loop: int8 tile -> float
        acc += x[i, k] @ float(q[k, j])
    o[i, j] = acc * scale[j]

Triton needs power-of-two tiles of at least 16 for a dot. The block sizes divide the real
dims where they can (SmolLM2: K 576 = 9 x 64, N 1536 = 12 x 128); otherwise the wrapper pads
with zeros (an odd-shaped weight then pays a padded copy per call: fine for tests, and the
loaders' shapes never need it). Rows (tokens) are padded to the row block.

NOTE: not yet run on a GPU (none was available): correctness comes from interpret mode on
CPU and the CUDA lowering check in tests/test_quant.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_TILE = 16


def _pick_block(dim: int, choices: tuple[int, ...]) -> int:
    """The largest choice dividing dim; else the smallest (dim is then padded)."""
    return next((c for c in choices if dim % c == 0), choices[-1])


def pad_axis_to(a: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = -a.shape[axis] % multiple
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


def _kernel(x_ref, q_ref, scale_ref, o_ref, *, bm, bn, bk, num_k_blocks):
    i, j = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(i * bm, bm), pl.ds(j * bn, bn)

    def body(k, acc):
        x = x_ref[rows, pl.ds(k * bk, bk)].astype(jnp.float32)  # [bm, bk]
        w = q_ref[pl.ds(k * bk, bk), cols].astype(jnp.float32)  # [bk, bn] dequantized tile
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, num_k_blocks, body, jnp.zeros((bm, bn), jnp.float32))
    scale = scale_ref[cols]  # [bn]
    o_ref[rows, cols] = (acc * scale[None, :]).astype(o_ref.dtype)


def int8_matmul_gpu(x, q, scale, *, interpret=False):
    """x [M, K] @ (q [K, N] int8 * scale [N]) -> [M, N] in x's dtype."""
    m, k = x.shape
    n = q.shape[1]
    bm = max(MIN_TILE, min(64, pl.next_power_of_2(m)))
    bk = _pick_block(k, (64, 32, 16))
    bn = _pick_block(n, (128, 64, 32, 16))
    xp = pad_axis_to(pad_axis_to(x, 0, bm), 1, bk)  # [Mp, Kp]
    qp = pad_axis_to(pad_axis_to(q, 0, bk), 1, bn)  # [Kp, Np]
    sp = pad_axis_to(scale.astype(jnp.float32), 0, bn)  # [Np]
    mp, kp = xp.shape
    np_ = qp.shape[1]
    kernel = functools.partial(_kernel, bm=bm, bn=bn, bk=bk, num_k_blocks=kp // bk)
    out = pl.pallas_call(
        kernel,
        grid=(mp // bm, np_ // bn),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        name="int8_matmul",
    )(xp, qp, sp)
    return out[:m, :n]
