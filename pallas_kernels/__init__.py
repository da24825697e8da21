"""Paged attention for pagedjax: the KV write, ragged (mixed prefill/decode) attention and
decode attention over ONE paged KV-cache layout, with a Pallas GPU kernel, a Pallas TPU
kernel and a plain-`jnp` reference behind each public function.

KV cache (the whole model's layers stacked, so the model can `lax.scan` over layers with the
cache in the carry):

    k_pages, v_pages   [L, K, num_pages, page_size, hd]   float32 / bfloat16, or int8
    k_scales, v_scales [L, K, num_pages, page_size]       float32, int8 only (absmax/127 per
                                                           token per KV head)

Page 0 is the null page: padding tokens write there, unused page-table entries point there.
Every function takes the full stacked cache and a `layer` index (int or traced int32
scalar); none copies a layer out (the reference gathers `k_pages[layer, :, page_table]` in
one gather, the kernels index the layer inside).

Step metadata (see WORKSPACE.md): q [T, H, hd], kv_lens [S], page_table [S, P],
query_start [S+1], num_seqs [1], slot_mapping [T], all int32. Sequence s owns q rows
query_start[s]:query_start[s+1], its LAST query_len tokens: query i sits at position
kv_lens[s] - query_len + i and sees cache positions <= it (and > it - sliding_window).

Dispatch: impl="auto" picks by `jax.default_backend()`: gpu -> `gpu_kernels` (Pallas,
Triton lowering), tpu -> `tpu_kernels` (Pallas Mosaic TPU, scalar-prefetched page tables),
cpu -> `cpu_kernels` (jnp in data-bounded `lax` loops). impl="reference" | "cpu" | "gpu" |
"tpu" forces one; interpret=True runs the chosen Pallas kernel in interpret mode (that is how
the tests run kernels on CPU).

Files: reference.py (jnp oracle + KV write), cpu_kernels.py (the CPU path), validation.py
(ValueErrors), layout.py (query blocks and tiles shared by the kernels), gpu_kernels.py /
gpu_decode.py / gpu_common.py, tpu_kernels.py, testing.py (NaN-filled test cases and a naive
dense attention).

Also here, beside the attention ops: the weight-only int8 matmul of quantized models
(int8_matmul.py: reference, W8A8 and dispatch; int8_matmul_gpu.py, int8_matmul_tpu.py), and
the grouped matmul of mixture-of-experts layers (grouped_matmul.py: dispatch, the XLA:CPU
`lax` loops and the Pallas TPU kernel; grouped_matmul_gpu.py: the Pallas GPU kernel;
grouped_layout.py: the (group, M tile) visit table both kernels walk).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from pallas_kernels import reference, validation

__all__ = [
    "decode_paged_attention",
    "quantize_int8",
    "ragged_paged_attention",
    "resolve_impl",
    "write_kv",
]

quantize_int8 = reference.quantize_int8
resolve_impl = validation.resolve_impl  # "auto" -> the implementation this backend runs


@jax.jit
def _write_kv_jit(k_pages, v_pages, k, v, slot_mapping, layer, k_scales, v_scales):
    return reference.write_kv_reference(
        k_pages, v_pages, k, v, slot_mapping, layer, k_scales=k_scales, v_scales=v_scales
    )


def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    layer,
    *,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
):
    """Scatter k, v [T, K, hd] to flat slots slot_mapping [T] of layer `layer`.

    Returns (k_pages, v_pages, k_scales, v_scales) (scales None unless int8). XLA does the
    scatter in place when the cache is donated or lives in a loop carry. int8 caches get
    each token/head quantized with its absmax/127 scale."""
    num_layers, num_kv_heads, _, _, head_dim = validation.check_cache(
        k_pages, v_pages, k_scales, v_scales
    )
    validation.check_layer(layer, num_layers)
    for name, x in (("k", k), ("v", v)):
        if np.ndim(x) != 3 or tuple(x.shape[1:]) != (num_kv_heads, head_dim):
            validation.raise_shape_error(name, x, f"[T, {num_kv_heads}, {head_dim}]")
    if v.shape != k.shape:
        validation.raise_shape_error("v", v, f"k's shape {tuple(k.shape)}")
    validation.check_int32("slot_mapping", slot_mapping, (k.shape[0],))
    return _write_kv_jit(k_pages, v_pages, k, v, slot_mapping, layer, k_scales, v_scales)


_STATIC = ("sm_scale", "max_query_len", "sliding_window", "soft_cap", "impl", "interpret")


def _implementation(op: str, impl: str, interpret: bool):
    """The function behind `op` ("ragged" | "decode") for `impl`; kernels get `interpret`.
    Kernel modules are imported lazily so the CPU path never loads them."""
    if impl == "reference":
        return getattr(reference, f"{op}_paged_attention_reference")
    if impl == "cpu":
        from pallas_kernels import cpu_kernels

        return getattr(cpu_kernels, f"{op}_paged_attention_cpu")
    if impl == "gpu":
        from pallas_kernels import gpu_kernels as kernels
    else:
        from pallas_kernels import tpu_kernels as kernels
    return functools.partial(getattr(kernels, f"{op}_paged_attention_{impl}"), interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _ragged_jit(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_table,
    query_start,
    num_seqs,
    layer,
    k_scales,
    v_scales,
    *,
    sm_scale,
    max_query_len,
    sliding_window,
    soft_cap,
    impl,
    interpret,
):
    args = (q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, layer)
    opts = {
        "sm_scale": sm_scale,
        "max_query_len": max_query_len,
        "sliding_window": sliding_window,
        "soft_cap": soft_cap,
        "k_scales": k_scales,
        "v_scales": v_scales,
    }
    return _implementation("ragged", impl, interpret)(*args, **opts)


@functools.partial(jax.jit, static_argnames=tuple(s for s in _STATIC if s != "max_query_len"))
def _decode_jit(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_table,
    layer,
    k_scales,
    v_scales,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    impl,
    interpret,
):
    args = (q, k_pages, v_pages, kv_lens, page_table, layer)
    opts = {
        "sm_scale": sm_scale,
        "sliding_window": sliding_window,
        "soft_cap": soft_cap,
        "k_scales": k_scales,
        "v_scales": v_scales,
    }
    return _implementation("decode", impl, interpret)(*args, **opts)


def _check_attention_inputs(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_table,
    layer,
    k_scales,
    v_scales,
    sm_scale,
    sliding_window,
    soft_cap,
    impl,
):
    num_layers, num_kv_heads, _, _, head_dim = validation.check_cache(
        k_pages, v_pages, k_scales, v_scales
    )
    validation.check_layer(layer, num_layers)
    validation.check_query("q", q, num_kv_heads, head_dim)
    validation.check_int32("kv_lens", kv_lens, (None,))
    validation.check_int32("page_table", page_table, (kv_lens.shape[0], None))
    validation.check_options(sm_scale, sliding_window, soft_cap, impl)


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    query_start: jax.Array,
    num_seqs: jax.Array,
    layer,
    *,
    sm_scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    impl: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """Attention of a flat ragged token batch q [T, H, hd] over the paged cache of `layer`.

    Returns [T, H, hd] in q's dtype; rows beyond query_start[num_seqs] are zeros.
    max_query_len (static) must bound every sequence's query_len."""
    _check_attention_inputs(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_table,
        layer,
        k_scales,
        v_scales,
        sm_scale,
        sliding_window,
        soft_cap,
        impl,
    )
    validation.check_int32("query_start", query_start, (kv_lens.shape[0] + 1,))
    validation.check_int32("num_seqs", num_seqs, (1,))
    if not isinstance(max_query_len, (int, np.integer)) or max_query_len < 1:
        raise ValueError(f"max_query_len={max_query_len!r} must be a static int >= 1")
    return _ragged_jit(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_table,
        query_start,
        num_seqs,
        layer,
        k_scales,
        v_scales,
        sm_scale=float(sm_scale),
        max_query_len=int(max_query_len),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        impl=validation.resolve_impl(impl),
        interpret=interpret,
    )


def decode_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    layer,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    impl: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """One query per sequence, q [S, H, hd], at position kv_lens[s] - 1. Returns [S, H, hd];
    sequences with kv_lens == 0 (empty slots) give zeros."""
    _check_attention_inputs(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_table,
        layer,
        k_scales,
        v_scales,
        sm_scale,
        sliding_window,
        soft_cap,
        impl,
    )
    if q.shape[0] != kv_lens.shape[0]:
        validation.raise_shape_error("q", q, f"one row per sequence: [{kv_lens.shape[0]}, H, hd]")
    return _decode_jit(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_table,
        layer,
        k_scales,
        v_scales,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        impl=validation.resolve_impl(impl),
        interpret=interpret,
    )
