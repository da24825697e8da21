"""Weight-only int8 matmul: `out[M, N] = (x[M, K] @ q[K, N]) * scale[N]`, a Pallas GPU kernel
and a Pallas TPU kernel beside plain-`jnp` formulations, dispatched like the attention ops.

    x      [M, K]  float32 / bfloat16 activations
    q      [K, N]  int8 weights, symmetric (-127..127), quantized per output channel
    scale  [N]     float32: column n of the float weight is q[:, n] * scale[n]
    out    [M, N]  x's dtype, accumulated in float32

Because the scale belongs to the output channel, it factors out of the K sum: the kernels
convert each int8 [bk, bn] tile to float inside the K loop, accumulate x_tile @ w_tile in
float32 and multiply by the scales once at the end. No float copy of a whole weight exists.

Formulations (`impl`):
    "reference"   x @ q.astype(x.dtype), then * scale: the oracle, and XLA's choice on CPU
    "cpu"         the same as "reference" (the attention's CPU name, accepted here too)
    "w8a8"        x quantized per row (dynamic absmax/127 scale), int8 x int8 dot with int32
                  accumulation, then * x_scale * scale. NOT weight-only: it also rounds the
                  activations, so it is its own quantization scheme (models.quant "w8a8").
    "gpu"         Pallas, Triton lowering (int8_matmul_gpu.py)
    "tpu"         Pallas, Mosaic TPU (int8_matmul_tpu.py)
    "auto"        gpu -> "gpu", tpu -> "tpu", cpu -> "cpu" (= "reference")
`interpret=True` runs a Pallas kernel in interpret mode (how the tests run them on CPU).

NOTE (CPU): XLA:CPU has no fused int8-weight float dot; it converts the int8 weight to a
float32 copy before the dot (FACTS.md), so weight-only int8 saves memory but not time on
CPU. The W8A8 int8 x int8 dot is the formulation that can be faster here; see
benchmarks/quant_report.py for the measured options.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import validation

INT8_MAX = 127.0
IMPLS = ("auto", "reference", "cpu", "w8a8", "gpu", "tpu")


def int8_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x [M, K] @ (q [K, N] int8 * scale [N]) in float32; the oracle for the kernels."""
    acc = jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32)  # [M, N]
    return (acc * scale.astype(jnp.float32)).astype(x.dtype)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-row symmetric int8: x [M, K] -> (xq [M, K] int8, x_scale [M] float32)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)  # [M]
    x_scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    xq = jnp.clip(jnp.round(x32 / x_scale[:, None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return xq, x_scale


def int8_matmul_w8a8(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """W8A8: int8 activations (per-row dynamic scales) x int8 weights, int32 accumulation."""
    xq, x_scale = quantize_rows(x)  # [M, K] int8, [M]
    acc = jax.lax.dot(xq, q, preferred_element_type=jnp.int32)  # [M, N] int32
    out = acc.astype(jnp.float32) * x_scale[:, None] * scale.astype(jnp.float32)[None, :]
    return out.astype(x.dtype)


def _implementation(impl: str, interpret: bool):
    if impl in ("reference", "cpu"):  # on CPU XLA's own dot is the fast path
        return int8_matmul_reference
    if impl == "w8a8":
        return int8_matmul_w8a8
    if impl == "gpu":
        from pallas_kernels.int8_matmul_gpu import int8_matmul_gpu as kernel
    else:
        from pallas_kernels.int8_matmul_tpu import int8_matmul_tpu as kernel
    return functools.partial(kernel, interpret=interpret)


def check_int8_matmul_inputs(x, q, scale, impl: str) -> None:
    """ValueErrors naming the argument, what it got and what is expected (trace time)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x has shape {x.shape} dtype {x.dtype}; expected a float [M, K]")
    if q.ndim != 2 or q.dtype != jnp.int8 or q.shape[0] != x.shape[1]:
        raise ValueError(
            f"q has shape {q.shape} dtype {q.dtype}; expected int8 [{x.shape[1]}, N] "
            f"(K = x.shape[1])"
        )
    if scale.shape != (q.shape[1],) or scale.dtype != jnp.float32:
        raise ValueError(
            f"scale has shape {scale.shape} dtype {scale.dtype}; expected float32 [{q.shape[1]}]"
        )


def int8_matmul(
    x: jax.Array, q: jax.Array, scale: jax.Array, *, impl: str = "auto", interpret: bool = False
) -> jax.Array:
    """(x [M, K] @ q [K, N] int8) * scale [N] -> [M, N] in x's dtype (see module doc).

    Traceable: call it inside jit (the model does, once per weight matmul)."""
    check_int8_matmul_inputs(x, q, scale, impl)
    return _implementation(validation.resolve_impl(impl), interpret)(x, q, scale)
