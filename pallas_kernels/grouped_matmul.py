"""Grouped matmul for mixture-of-experts layers (models/moe.py): rows of x sorted by group,
group e's rows times w[e], in the style of megablox `gmm` (Pallas Mosaic TPU).

    x [M, K] (rows of group e: offsets[e] : offsets[e+1]), w [G, K, N], group_sizes [G]
    -> out [M, N],  out[r] = x[r] @ w[group of r]      (rows past sum(group_sizes): zero)

Kernel grid (N tile n, visit v, K tile k), k innermost:

    a visit is one (M tile, group) pair: the M tiles each group's rows touch, groups in
    order, so a tile that straddles a group boundary is visited once per group and the
    tile sequence never decreases (the output tile stays in VMEM across its visits)
    scalar-prefetched metadata:  offsets [G+1], visit_group [V], visit_tile [V]
    x    [tm, tk]  BlockSpec (visit_tile[v], k)
    w    [tk, tn]  BlockSpec (visit_group[v], k, n)   (group axis squeezed)
    out  [tm, tn]  BlockSpec (visit_tile[v], n): at the last k step the visit's rows (those
                   of its group) are stored, the tile's other rows kept (masked select)
    acc  [tm, tn]  float32 VMEM scratch

V = tiles_m + G - 1 is the static bound (each group boundary inside a tile adds a visit);
an empty group has no visit, and the visits past the real count repeat the last one (the
same values stored again). Work is proportional to the rows, not to G x M as XLA:CPU's
`ragged_dot` lowering (a dense matmul over every group with masks).

On XLA:CPU `gmm_cpu` does the same walk with `lax` loops (impl "cpu", the default there);
on GPUs `grouped_matmul_gpu.gmm_gpu` does it as a Pallas Triton kernel (impl "gpu"). The
visit table is grouped_layout.py's, shared by both kernels.

NOTE: not run on a TPU (none was available): correctness comes from TPU interpret mode on
CPU against `jax.lax.ragged_dot` and a float64 dense reference (tests/test_moe.py), and the
Mosaic lowering check there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.grouped_layout import group_metadata
from pallas_kernels.grouped_matmul_gpu import gmm_gpu

IMPLS = ("ragged_dot", "cpu", "tpu", "gpu")
CPU_TILE_ROWS = 8  # measured best of 8 / 32 / 128 at 8 - 4096 rows, 64 experts (WORKSPACE)


def _pick_block(dim: int, choices: tuple[int, ...]) -> int:
    """The largest choice dividing dim, else the whole dim (always a legal block)."""
    return next((c for c in choices if dim % c == 0), dim)


def _kernel(offsets, visit_group, visit_tile, x_ref, w_ref, o_ref, acc_ref, *, tm, tiles_k):
    v, k = pl.program_id(1), pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(
        x_ref[...].astype(jnp.float32),
        w_ref[...].astype(jnp.float32),
        preferred_element_type=jnp.float32,
    )  # [tm, tn]

    @pl.when(k == tiles_k - 1)
    def _store():
        g = visit_group[v]
        rows = visit_tile[v] * tm + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        mine = (rows >= offsets[g]) & (rows < offsets[g + 1])  # [tm, tn]
        o_ref[...] = jnp.where(mine, acc_ref[...], o_ref[...].astype(jnp.float32)).astype(
            o_ref.dtype
        )


def gmm_tpu(x, w, group_sizes, *, tm: int = 128, interpret: bool = False):
    """The Pallas TPU grouped matmul (module doc). x [M, K], w [G, K, N], group_sizes [G]."""
    m, kdim = x.shape
    g, _, n = w.shape
    tm = min(tm, -(-m // 8) * 8)
    tk = _pick_block(kdim, (512, 256, 128))
    tn = _pick_block(n, (512, 256, 128))
    mp = -(-m // tm) * tm
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    offsets, visit_group, visit_tile = group_metadata(group_sizes, mp, tm)
    tiles_k = kdim // tk
    grid = (n // tn, visit_group.shape[0], tiles_k)
    out = pl.pallas_call(
        functools.partial(_kernel, tm=tm, tiles_k=tiles_k),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=grid,
            in_specs=[
                pl.BlockSpec((tm, tk), lambda nn, v, kk, offs, vg, vt: (vt[v], kk)),
                pl.BlockSpec((None, tk, tn), lambda nn, v, kk, offs, vg, vt: (vg[v], kk, nn)),
            ],
            out_specs=pl.BlockSpec((tm, tn), lambda nn, v, kk, offs, vg, vt: (vt[v], nn)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((mp, n), x.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="moe_gmm_tpu",
    )(offsets, visit_group, visit_tile, xp, w)
    rows = jnp.arange(m)[:, None] < offsets[-1]  # rows past the groups: zero, as ragged_dot
    return jnp.where(rows, out[:m], 0).astype(x.dtype)


def gmm_cpu(x, w, group_sizes, *, tm: int = CPU_TILE_ROWS):
    """The grouped matmul as `lax` loops for XLA:CPU: over the non-empty groups (each
    expert's weight sliced once), and inside a group over its tiles of `tm` rows (masked
    where a tile runs past the group). Work ~ (M + G x tm) x K x N and each non-empty
    group's weight read once, against `ragged_dot`'s dense G x M x K x N on this backend.
    x [M, K], w [G, K, N]."""
    m, _ = x.shape
    g, _, n = w.shape
    xp = jnp.pad(x, ((0, tm), (0, 0)))  # a tile starting at a group's last row stays in range
    sizes = group_sizes.astype(jnp.int32)
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes, dtype=jnp.int32)])

    # the non-empty groups first (stable), so the loop never touches an unused weight
    active = jnp.argsort(sizes == 0, stable=True).astype(jnp.int32)  # [G]

    def group(j, out):  # out [M + tm, N] float32
        e = active[j]
        w_e = w[e]  # [K, N]
        lo, hi = offsets[e], offsets[e + 1]

        def tile(i, out):
            start = lo + i * tm
            rows = jax.lax.dynamic_slice_in_dim(xp, start, tm)  # [tm, K]
            y = jnp.dot(rows, w_e, preferred_element_type=jnp.float32)  # [tm, N]
            mine = (start + jnp.arange(tm))[:, None] < hi
            cur = jax.lax.dynamic_slice_in_dim(out, start, tm)
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y, cur), start, 0)

        return jax.lax.fori_loop(0, (hi - lo + tm - 1) // tm, tile, out)

    num_active = jnp.sum(sizes > 0)
    out = jax.lax.fori_loop(0, num_active, group, jnp.zeros((m + tm, n), jnp.float32))
    return out[:m].astype(x.dtype)  # rows past the groups were never written: zero


def resolve_impl(impl: str) -> str:
    """ "auto": the `lax` loops on XLA:CPU, `ragged_dot` elsewhere (the Pallas TPU and GPU
    kernels are not the default until each has run on its device)."""
    if impl == "auto":
        return "cpu" if jax.default_backend() == "cpu" else "ragged_dot"
    if impl not in IMPLS:
        raise ValueError(f"grouped_matmul: impl={impl!r} is unknown (known: auto, {IMPLS})")
    return impl


def grouped_matmul(x, w, group_sizes, *, impl: str = "ragged_dot", interpret: bool = False):
    """x [M, K] @ w[group] -> [M, N]; impl "ragged_dot" (XLA, every backend), "cpu" (`lax`
    loops), "tpu" (Pallas TPU), "gpu" (Pallas Triton) or "auto" (`resolve_impl`)."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"grouped_matmul: x has shape {x.shape}, w {w.shape}: expected [M, K] and [G, K, N]"
        )
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"grouped_matmul: group_sizes has shape {group_sizes.shape}, expected ({w.shape[0]},)"
        )
    impl = resolve_impl(impl)
    if impl == "ragged_dot":
        return jax.lax.ragged_dot(x, w, group_sizes)
    if impl == "cpu":
        return gmm_cpu(x, w, group_sizes)
    if impl == "gpu":
        return gmm_gpu(x, w, group_sizes, interpret=interpret)
    return gmm_tpu(x, w, group_sizes, interpret=interpret)
