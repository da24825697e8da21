"""Weight quantization: int8, symmetric, one float32 scale per output channel.

    LLM("smollm2-135m", quantization="int8")     weight-only: activations stay float
    LLM("smollm2-135m", quantization="w8a8")     int8 weights AND int8 activations (dynamic
                                                 per-token scales): the fast CPU path

What is quantized: the seven projection matrices of every layer (wq, wk, wv, wo, w_gate,
w_up, w_down), and the LM head only with `quantize_lm_head=True`. What stays float: the token
embedding (a gather, not a matmul), every norm, the Q/K/V biases, and by default the LM head
(with tied embeddings it IS the embedding; quantizing it adds an int8 [D, V] copy beside the
float embedding, so it saves no memory there, only bandwidth).

A quantized weight is an `Int8Weight(q, scale)` pytree in place of the float array:

    float  w      [*in, *out]            e.g. wq [L, D, H, hd], wo [L, H, hd, D]
    int8   q      [*in, *out]  int8      w ~= q * scale (broadcast over the `in` axes)
           scale  [*out]       float32   absmax over the `in` axes / 127 (1 where all zero)

so `lax.scan` over layers slices q and scale together, jit sees two leaves, the Orbax cache
stores two arrays, and the sharding rules give the scale the weight's output axes (see
`engine.parallel.sharding`). Every weight matmul of the model goes through `linear(x, w, spec)`,
which runs `jnp.einsum` for float weights and `pallas_kernels.int8_matmul` for Int8Weight.

The identity of a quantized model names its scheme (`QuantConfig.descriptor`, e.g.
"int8-w-perchannel"); models.identity folds it into the revision string.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from configs.quant_config import QuantConfig, QuantizationConfigError
from pallas_kernels.int8_matmul import INT8_MAX, int8_matmul

Array = jax.Array

# Layer weights that are quantized, with how many leading (after L) axes are contracted.
QUANTIZED_LAYER_WEIGHTS: dict[str, int] = {
    "wq": 1,
    "wk": 1,
    "wv": 1,
    "wo": 2,
    "w_gate": 1,
    "w_up": 1,
    "w_down": 1,
}


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q", "scale"],
    meta_fields=["activations"],
)
@dataclasses.dataclass
class Int8Weight:
    q: Array  # [L, *in, *out] int8 (stacked layer weights) or [*in, *out] (LM head)
    scale: Array  # [L, *out] or [*out] float32
    activations: str = "float"  # "float" (weight-only) | "int8" (W8A8)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        return int(self.q.size) + 4 * int(self.scale.size)

    def dequantize(self, num_lead_axes: int = 1) -> Array:
        """The float weight q * scale (tests and checks; the model never builds it). The contracted
        axes are the q.ndim - scale.ndim axes after `num_lead_axes` (1: stacked layers)."""
        n_in = self.q.ndim - self.scale.ndim
        lead = self.scale.shape[:num_lead_axes]
        scale = self.scale.reshape(lead + (1,) * n_in + self.scale.shape[num_lead_axes:])
        return self.q.astype(jnp.float32) * scale


# ---- quantizing ----------------------------------------------------------------------------
def quantize_rows_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Host-side per-row int8: w [out, in] float (PyTorch layout, rows = output channels)
    -> (q [out, in] int8, scale [out] float32). Used by the loaders, tensor by tensor."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


def quantize_weight(
    w: Array, num_in_axes: int, activations: str = "float", *, stacked: bool = True
) -> Int8Weight:
    """w [L, *in, *out] (stacked layers) or [*in, *out] -> Int8Weight, scale over the
    `num_in_axes` contracted axes (the layout of `models.llama.LayerWeights`)."""
    w32 = jnp.asarray(w, jnp.float32)
    lead = 1 if stacked else 0
    in_axes = tuple(range(lead, lead + num_in_axes))
    amax = jnp.max(jnp.abs(w32), axis=in_axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(w32 / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return Int8Weight(q, jnp.squeeze(scale, axis=in_axes).astype(jnp.float32), activations)


def check_quantizable(layers, qcfg: QuantConfig) -> None:
    """Refuses int8 for layer weights it does not cover: mixture-of-experts stacks."""
    if getattr(layers, "moe_gate", None) is not None:
        raise QuantizationConfigError(
            f"quantization={qcfg.scheme!r} is not supported for mixture-of-experts models "
            f"(the expert stacks moe_gate / moe_up / moe_down have no int8 path); allowed: "
            f"'none'"
        )


def quantize_params(params, qcfg: QuantConfig):
    """Float `models.llama.Params` -> the same pytree with Int8Weight leaves (see module doc).
    An already quantized or `none` config returns params unchanged."""
    if not qcfg.enabled:
        return params
    layers = params.layers
    if isinstance(layers, tuple):
        check_quantizable(layers[0], qcfg)
    else:
        check_quantizable(layers, qcfg)
    updates = {}
    for name, n_in in QUANTIZED_LAYER_WEIGHTS.items():
        w = getattr(layers, name)
        updates[name] = (
            w if isinstance(w, Int8Weight) else quantize_weight(w, n_in, qcfg.activations)
        )
    lm_head = params.lm_head
    if qcfg.quantize_lm_head and not isinstance(lm_head, Int8Weight):
        head = params.embed.T if lm_head is None else lm_head  # [D, V]
        lm_head = quantize_weight(head, 1, qcfg.activations, stacked=False)
    return dataclasses.replace(
        params, layers=dataclasses.replace(layers, **updates), lm_head=lm_head
    )


def quant_config_of(params) -> QuantConfig:
    """The QuantConfig that produced `params` (QuantConfig() for float params)."""
    wq = params.layers.wq
    if not isinstance(wq, Int8Weight):
        return QuantConfig()
    scheme = "w8a8" if wq.activations == "int8" else "int8"
    return QuantConfig(scheme, quantize_lm_head=isinstance(params.lm_head, Int8Weight))


def quantized_param_shapes(abstract, qcfg: QuantConfig):
    """The abstract (ShapeDtypeStruct) params after `quantize_params` (Orbax restores)."""
    if not qcfg.enabled:
        return abstract

    def q_abstract(w, n_in, lead):
        out_shape = tuple(w.shape[:lead]) + tuple(w.shape[lead + n_in :])
        return Int8Weight(
            jax.ShapeDtypeStruct(w.shape, jnp.int8),
            jax.ShapeDtypeStruct(out_shape, jnp.float32),
            qcfg.activations,
        )

    layers = abstract.layers
    check_quantizable(layers, qcfg)
    updates = {n: q_abstract(getattr(layers, n), k, 1) for n, k in QUANTIZED_LAYER_WEIGHTS.items()}
    lm_head = abstract.lm_head
    if qcfg.quantize_lm_head:
        v, d = abstract.embed.shape
        head = jax.ShapeDtypeStruct((d, v), jnp.float32) if lm_head is None else lm_head
        lm_head = q_abstract(head, 1, 0)
    return dataclasses.replace(
        abstract, layers=dataclasses.replace(layers, **updates), lm_head=lm_head
    )


# ---- sharding --------------------------------------------------------------------------------
def _drop_axes(sharding, rank: int, lead: int, n_in: int):
    """The weight's sharding minus its contracted axes: the scale's sharding. A scale is
    split exactly as its weight's output axes are (per-channel), and a contracted axis that
    is split (row parallelism: wo, w_down) simply leaves the scale replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    spec = tuple(sharding.spec) + (None,) * (rank - len(sharding.spec))
    out = list(spec[:lead] + spec[lead + n_in :])
    while out and out[-1] is None:  # the canonical short form, as jit returns it
        out.pop()
    return NamedSharding(sharding.mesh, PartitionSpec(*out))


def quantized_shardings(float_shardings, abstract, qcfg: QuantConfig):
    """Shardings for quantized params, from the float layout's (`engine.parallel.sharding`): q takes
    its float weight's sharding, scale that sharding without the contracted axes. A
    quantized LM head with tied embeddings takes the embedding's sharding, transposed."""
    if not qcfg.enabled:
        return float_shardings
    from jax.sharding import NamedSharding, PartitionSpec

    layers = float_shardings.layers
    updates = {}
    for name, n_in in QUANTIZED_LAYER_WEIGHTS.items():
        s, rank = getattr(layers, name), len(getattr(abstract.layers, name).q.shape)
        updates[name] = Int8Weight(s, _drop_axes(s, rank, 1, n_in), qcfg.activations)
    lm_head = float_shardings.lm_head
    if qcfg.quantize_lm_head:
        if lm_head is None:  # tied: [V, D] embedding spec -> [D, V]
            e = float_shardings.embed
            spec = tuple(e.spec) + (None,) * (2 - len(e.spec))
            lm_head = _drop_axes(NamedSharding(e.mesh, PartitionSpec(spec[1], spec[0])), 2, 2, 0)
        lm_head = Int8Weight(lm_head, _drop_axes(lm_head, 2, 0, 1), qcfg.activations)
    return dataclasses.replace(
        float_shardings, layers=dataclasses.replace(layers, **updates), lm_head=lm_head
    )


def repeat_heads(w, repeats: int, axis: int):
    """jnp.repeat along a weight's head axis (KV-head replication in
    engine.parallel.sharding); for an
    Int8Weight the scale repeats along the same output axis (one contracted axis fewer)."""
    if w is None:
        return None
    if isinstance(w, Int8Weight):
        n_in = w.q.ndim - w.scale.ndim
        return Int8Weight(
            jnp.repeat(w.q, repeats, axis=axis),
            jnp.repeat(w.scale, repeats, axis=axis - n_in),
            w.activations,
        )
    return jnp.repeat(w, repeats, axis=axis)


# ---- the one matmul seam of the model --------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _parse_spec(spec: str) -> tuple[int, str]:
    """'TD,DNH->TNH' -> (number of contracted axes, spec). The weight's contracted axes must
    lead and the x's contracted axes trail, in the same order; the output is x's batch axes
    then the weight's output axes (true of every matmul in models/llama.py)."""
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    contracted = "".join(c for c in ws if c in xs and c not in out)
    n = len(contracted)
    ok = n > 0 and ws[:n] == contracted and xs[-n:] == contracted and out == xs[:-n] + ws[n:]
    if not ok:
        raise ValueError(
            f"linear spec {spec!r}: an int8 weight needs the form 'B..C..,C..O..->B..O..' "
            f"(contracted axes C leading the weight, trailing x)"
        )
    return n, spec


def linear(x: Array, w, spec: str, out_dtype=None) -> Array:
    """`einsum(spec, x, w)` for a float weight; the int8 matmul for an Int8Weight.

    x [*batch, *in], w [*in, *out] (float) or Int8Weight -> [*batch, *out] in `out_dtype`
    (default x's dtype), accumulated in float32 either way."""
    if not isinstance(w, Int8Weight):
        out = jnp.einsum(spec, x, w, preferred_element_type=out_dtype)
        return out if out_dtype is None else out.astype(out_dtype)
    n_in, _ = _parse_spec(spec)
    batch_shape, in_shape = x.shape[:-n_in], x.shape[-n_in:]
    out_shape = w.q.shape[n_in:]
    k, n = math.prod(in_shape), math.prod(out_shape)
    impl = "w8a8" if w.activations == "int8" else "auto"
    x2 = x.reshape(-1, k)
    if out_dtype is not None:
        x2 = x2.astype(out_dtype)
    y = int8_matmul(x2, w.q.reshape(k, n), w.scale.reshape(n), impl=impl)  # [M, N]
    return y.reshape(*batch_shape, *out_shape)


def int8_proj(x: Array, w: Int8Weight, num_in: int = 1) -> Array:
    """x [T, *in] @ Int8Weight [*in, *out] -> [T, *out] (models.llama._proj's int8 case):
    one 2-D int8 matmul over free reshapes of q and scale."""
    t = x.shape[0]
    k = math.prod(w.q.shape[:num_in])
    out_shape = w.q.shape[num_in:]
    impl = "w8a8" if w.activations == "int8" else "auto"
    y = int8_matmul(x.reshape(t, k), w.q.reshape(k, -1), w.scale.reshape(-1), impl=impl)
    return y.reshape(t, *out_shape)


# ---- accounting ----------------------------------------------------------------------------
def layer_weight_bytes(layers) -> dict[str, int]:
    """Bytes of the quantizable layer weights as stored (int8 + scales, or float)."""
    out = {}
    for name in QUANTIZED_LAYER_WEIGHTS:
        w = getattr(layers, name)
        out[name] = (
            w.nbytes if isinstance(w, Int8Weight) else int(w.size) * jnp.dtype(w.dtype).itemsize
        )
    return out


def param_bytes(params) -> int:
    """Every byte of a params pytree (int8, scales and float leaves)."""
    return sum(int(a.size) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(params))
