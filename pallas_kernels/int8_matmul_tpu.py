"""Pallas Mosaic TPU kernel for the weight-only int8 matmul (int8_matmul.py).

Grid (row block i, column block j, K block k), k innermost and "arbitrary" (a reduction):

    x      [bm, bk] float   BlockSpec (i, k)
    q      [bk, bn] int8    BlockSpec (k, j): Pallas' pipeline DMAs 1 byte per weight into
                            VMEM; the tile is converted to float there, inside the K loop
    scale  [1, bn]  f32     BlockSpec (0, j) of scale reshaped to [1, N] (a free reshape)
    out    [bm, bn]         written at the last k step
    scratch acc [bm, bn] f32 in VMEM

Tiles follow the TPU layout: bn and bk multiples of 128 lanes (int8 packs 32 sublanes, so
bk >= 128 also satisfies its second-minor tiling), bm a multiple of 8. A dim that no such
block divides is taken whole (a block equal to the array dim is always legal; SmolLM2's
K = 576 = 4.5 x 128 gives one [bm, 576] x [576, bn] step), so weights are never padded;
only dims above MAX_WHOLE_DIM would be zero-padded (a copy per call).

NOTE: not yet run on a TPU (none was available): correctness comes from TPU interpret mode
on CPU and the Mosaic lowering check in tests/test_quant.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.int8_matmul_gpu import pad_axis_to

MAX_WHOLE_DIM = 4096


def _pick_block(dim: int, choices: tuple[int, ...]) -> int:
    """The largest choice dividing dim, else dim itself (whole), else the smallest (padded)."""
    fit = next((c for c in choices if dim % c == 0), None)
    if fit is not None:
        return fit
    return dim if dim <= MAX_WHOLE_DIM else choices[-1]


def _kernel(x_ref, q_ref, scale_ref, o_ref, acc_ref):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    w = q_ref[...].astype(jnp.float32)  # [bk, bn]: dequantized in VMEM, tile by tile
    acc_ref[...] += jnp.dot(
        x_ref[...].astype(jnp.float32), w, preferred_element_type=jnp.float32
    )  # [bm, bn]

    @pl.when(k == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = (acc_ref[...] * scale_ref[...]).astype(o_ref.dtype)


def int8_matmul_tpu(x, q, scale, *, interpret=False):
    """x [M, K] @ (q [K, N] int8 * scale [N]) -> [M, N] in x's dtype."""
    m, k = x.shape
    n = q.shape[1]
    bm = min(128, -(-m // 8) * 8)
    bk = _pick_block(k, (512, 256, 128))
    bn = _pick_block(n, (512, 256, 128))
    xp = pad_axis_to(pad_axis_to(x, 0, bm), 1, bk)  # [Mp, Kp]
    qp = pad_axis_to(pad_axis_to(q, 0, bk), 1, bn)  # [Kp, Np]
    sp = pad_axis_to(scale.astype(jnp.float32).reshape(1, n), 1, bn)  # [1, Np]
    mp, kp = xp.shape
    np_ = qp.shape[1]
    out = pl.pallas_call(
        _kernel,
        grid=(mp // bm, np_ // bn, kp // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="int8_matmul_tpu",
    )(xp, qp, sp)
    return out[:m, :n]
