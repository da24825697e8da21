"""Orbax cache of converted params: convert a checkpoint once, restore it on later starts.

The cache key is the weights' content revision plus the dtype, so a changed file never
restores stale params. Location: $PAGEDJAX_CACHE_DIR (default ~/.cache/pagedjax/orbax).
"""

from __future__ import annotations

import os

import jax

from models.llama import Params


def cache_dir() -> str:
    return os.environ.get(
        "PAGEDJAX_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pagedjax", "orbax")
    )


def checkpoint_path(revision: str, dtype_name: str) -> str:
    return os.path.join(cache_dir(), f"{revision[:32]}-{dtype_name}")


def save_params(path: str, params: Params) -> None:
    import orbax.checkpoint as ocp

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(path), params, force=True)


def restore_params(path: str, abstract: Params, shardings=None) -> Params:
    """Restores into the structure of `abstract` (ShapeDtypeStructs). `shardings`, a pytree
    of `jax.sharding.Sharding` matching it, places each shard straight on its devices."""
    import orbax.checkpoint as ocp

    if shardings is not None:
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
        )
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.abspath(path), abstract)
