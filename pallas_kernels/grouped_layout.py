"""The visit table of the grouped-matmul kernels (grouped_matmul.py's TPU kernel and
grouped_matmul_gpu.py): which (group, M tile) pairs a grid walks.

    rows of group e: offsets[e] : offsets[e+1]    (x sorted by group, sum(sizes) <= M)
    visits: the M tiles each group's rows touch, groups in order; a tile straddling a group
            boundary is visited once per group, an empty group has no visit

    M=24, tm=8, sizes [5, 0, 11]:   tile 0 rows 0-7    visit 0 (group 0, tile 0)
                                                       visit 1 (group 2, tile 0)
                                    tile 1 rows 8-15   visit 2 (group 2, tile 1)
                                    tile 2 rows 16-23  (no group: never visited)

V = ceil(M / tm) + G - 1 bounds the count statically (each group boundary inside a tile
adds one visit); the visits past the real count are padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_metadata(group_sizes: jax.Array, m: int, tm: int, *, mark_padding: bool = False):
    """(offsets [G+1], visit_group [V], visit_tile [V]) int32, V = ceil(m / tm) + G - 1.

    Padding visits repeat the last real one (the TPU kernel's output block index must stay
    in range and never go back), or with `mark_padding` have visit_group -1 (the GPU kernel
    skips them)."""
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes, dtype=jnp.int32)])
    starts, ends = offsets[:-1], offsets[1:]
    first_tile = starts // tm
    tiles = jnp.where(sizes > 0, (ends + tm - 1) // tm - first_tile, 0)  # [G] visits
    last = jnp.cumsum(tiles)  # visits through group e
    num_visits = last[-1]
    v_max = -(-m // tm) + g - 1
    visit = jnp.arange(v_max, dtype=jnp.int32)
    j = jnp.minimum(visit, jnp.maximum(num_visits - 1, 0))
    group = jnp.clip(jnp.searchsorted(last, j, side="right"), 0, g - 1).astype(jnp.int32)
    tile = first_tile[group] + j - (last[group] - tiles[group])
    if mark_padding:
        group = jnp.where(visit < num_visits, group, -1)
    return offsets, group, tile.astype(jnp.int32)
