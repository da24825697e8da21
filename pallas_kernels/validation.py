"""Shape and dtype checks at the public functions: each failure is a ValueError naming the
argument, what it got and what was expected. Shapes are static, so this runs at trace time
and costs nothing inside jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_KV_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
IMPLS = ("auto", "reference", "cpu", "gpu", "tpu")


def raise_shape_error(name, x, expected):
    raise ValueError(
        f"{name} has shape {tuple(np.shape(x))} and dtype {jnp.result_type(x)}; expected {expected}"
    )


def check_int32(name, x, shape):
    """x must be int32 with this shape (None entries match any size)."""
    got = tuple(np.shape(x))
    if len(got) != len(shape) or any(e is not None and e != g for e, g in zip(shape, got)):
        raise_shape_error(name, x, f"shape {shape} int32")
    if jnp.result_type(x) != jnp.int32:
        raise_shape_error(name, x, f"dtype int32 (shape {shape})")


def check_layer(layer, num_layers):
    if isinstance(layer, (int, np.integer)):
        if not 0 <= int(layer) < num_layers:
            raise ValueError(
                f"layer={int(layer)} is out of range: the cache has {num_layers} layers"
            )
        return
    if np.shape(layer) != () or jnp.result_type(layer) != jnp.int32:
        raise_shape_error("layer", layer, "a Python int or an int32 scalar")


def check_cache(k_pages, v_pages, k_scales, v_scales):
    """Returns (L, K, num_pages, page_size, hd)."""
    if np.ndim(k_pages) != 5:
        raise_shape_error("k_pages", k_pages, "[L, K, num_pages, page_size, hd]")
    if np.shape(v_pages) != np.shape(k_pages) or v_pages.dtype != k_pages.dtype:
        raise_shape_error(
            "v_pages", v_pages, f"k_pages' shape {tuple(k_pages.shape)} and dtype {k_pages.dtype}"
        )
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales must be given together (int8 KV) or not at all")
    dims = tuple(k_pages.shape)
    if k_scales is None:
        if k_pages.dtype not in FLOAT_KV_DTYPES:
            raise_shape_error(
                "k_pages", k_pages, "float32/bfloat16/float16 (or int8 with k_scales)"
            )
        return dims
    if k_pages.dtype != jnp.int8:
        raise_shape_error("k_pages", k_pages, "int8 when k_scales/v_scales are given")
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        if tuple(np.shape(s)) != dims[:4] or s.dtype != jnp.float32:
            raise_shape_error(name, s, f"shape {dims[:4]} float32 ([L, K, num_pages, page_size])")
    return dims


def check_query(name, q, num_kv_heads, head_dim):
    if np.ndim(q) != 3 or q.dtype not in FLOAT_KV_DTYPES:
        raise_shape_error(name, q, "[tokens, H, hd] float32/bfloat16/float16")
    if q.shape[2] != head_dim:
        raise_shape_error(name, q, f"head dim {head_dim} (the cache's)")
    if q.shape[1] % num_kv_heads:
        raise_shape_error(name, q, f"H a multiple of the {num_kv_heads} KV heads")


def check_options(sm_scale, sliding_window, soft_cap, impl):
    if not isinstance(sm_scale, (int, float)):
        # NOTE: ValueError, not TypeError: the contract is one exception type for bad input.
        raise ValueError(f"sm_scale={sm_scale!r} must be a Python float")  # noqa: TRY004
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be None or an int >= 1")
    if soft_cap is not None and (not isinstance(soft_cap, (int, float)) or soft_cap <= 0):
        raise ValueError(f"soft_cap={soft_cap!r} must be None or a float > 0")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")


def resolve_impl(impl: str) -> str:
    """`impl="auto"` -> the kernel family for the default backend ("gpu", "tpu", or the jnp
    loops of cpu_kernels.py on CPU); any other value is returned as given."""
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    if backend == "tpu":
        return "tpu"
    return "cpu"
