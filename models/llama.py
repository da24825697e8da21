"""The Llama family (Llama 2/3/3.1, Mistral, SmolLM2, Qwen2) as pure functions over a pytree.

Data flow of one forward call over a flat batch of T tokens (any mix of sequences):

    token_ids [T] -> embed -> x [T, D]
      scan over layers (weights stacked on axis 0, the KV cache in the carry):
        h = rms_norm(x) -> q [T,H,hd], k/v [T,K,hd] -> RoPE(positions)
        (out, cache) = attention(q, k, v, layer, cache)   # dense or paged; writes K/V
        x += out @ wo ;  x += swiglu(rms_norm(x))
    final norm -> logits [T_out, V] for the rows in `logits_indices`

`attention` is the one seam between the model and the KV cache: the dense oracle passes a
contiguous cache (`models.dense_generate`), the engine passes the paged one
(`engine.runner.step`).

Layer loop (`Params.layers`, one forward for both; `layer_layout` converts):
- stacked `LayerWeights` (leaves [L, ...]): `jax.lax.scan`, one traced layer, compile time
  flat in depth. The layout of the loaders, the Orbax cache and sharding; best on TPU/GPU,
  where a layer's dynamic slice feeds the matmul without a copy.
- a tuple of per-layer `LayerWeights`: the layers unrolled in Python. XLA:CPU copies each
  scanned layer's weight slice before its dot; separate arrays are read in place (batch-1
  forward ~30% less CPU time, 4x the compile time). `layer_layout(params, "auto")` picks it
  on CPU.
Every projection is ONE 2-D matmul over a free reshape of its weight (`_proj`): the 3-D
`DNH` einsums were ~2x slower unrolled on XLA:CPU (benchmarks/RESULTS.md, perf section).
A projection may be an int8 `Int8Weight` (models/quant.py): `_proj` dispatches on the weight
type, and the LM head goes through `models.quant.linear`.
LoRA (models/lora.py): `forward(..., lora=LoraInputs(slot stack, row slots))` adds each
row's adapter term to the seven projections; `lora=None` traces the plain model unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig
from models.lora import LoraInputs, LoraWeights, lora_delta, lora_row_mask
from models.quant import Int8Weight, int8_proj, linear

Array = jax.Array


def _param(*axes: str):
    """A params field declared with its logical axes, one name per array dim. The names are
    model-side; `engine.parallel.sharding.LOGICAL_RULES` maps them to mesh axes."""
    return dataclasses.field(metadata={"axes": axes})


def param_axes(field: dataclasses.Field) -> tuple[str, ...]:
    """The logical axes a `LayerWeights` / `Params` field was declared with."""
    if "axes" not in field.metadata:
        raise TypeError(f"params field {field.name!r} declares no logical axes: use _param(...)")
    return field.metadata["axes"]


# NOTE: one declaration per param: its shape (comment) and its logical axes side by side.
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    attn_norm: Array = _param("layers", "embed")  # [L, D]
    wq: Array = _param("layers", "embed", "heads", "head_dim")  # [L, D, H, hd]
    wk: Array = _param("layers", "embed", "kv_heads", "head_dim")  # [L, D, K, hd]
    wv: Array = _param("layers", "embed", "kv_heads", "head_dim")  # [L, D, K, hd]
    bq: Array | None = _param("layers", "heads", "head_dim")  # [L, H, hd] (Qwen2) or None
    bk: Array | None = _param("layers", "kv_heads", "head_dim")  # [L, K, hd] or None
    bv: Array | None = _param("layers", "kv_heads", "head_dim")  # [L, K, hd] or None
    wo: Array = _param("layers", "heads", "head_dim", "embed")  # [L, H, hd, D]
    mlp_norm: Array = _param("layers", "embed")  # [L, D]
    w_gate: Array = _param("layers", "embed", "ffn")  # [L, D, F]
    w_up: Array = _param("layers", "embed", "ffn")  # [L, D, F]
    w_down: Array = _param("layers", "ffn", "embed")  # [L, F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    embed: Array = _param("vocab", "embed")  # [V, D]
    # stacked [L, ...] (axes declared above), or one LayerWeights per layer (`layer_layout`)
    layers: LayerWeights | tuple[LayerWeights, ...]
    final_norm: Array = _param("embed")  # [D]
    lm_head: Array | None = _param("embed", "vocab")  # [D, V], or None when tied to `embed`


def param_shapes(cfg: ModelConfig) -> Params:
    """The abstract params: each leaf a `jax.ShapeDtypeStruct` (float32)."""
    L, D, H, K, hd, F, V = (
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.ffn_size,
        cfg.vocab_size,
    )
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    bias = cfg.attention_bias
    layers = LayerWeights(
        attn_norm=s(L, D),
        wq=s(L, D, H, hd),
        wk=s(L, D, K, hd),
        wv=s(L, D, K, hd),
        bq=s(L, H, hd) if bias else None,
        bk=s(L, K, hd) if bias else None,
        bv=s(L, K, hd) if bias else None,
        wo=s(L, H, hd, D),
        mlp_norm=s(L, D),
        w_gate=s(L, D, F),
        w_up=s(L, D, F),
        w_down=s(L, F, D),
    )
    return Params(
        embed=s(V, D),
        layers=layers,
        final_norm=s(D),
        lm_head=None if cfg.tie_embeddings else s(D, V),
    )


def init_params(cfg: ModelConfig, key: Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random params (tests and benchmarks); norms start at 1."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(key, len(leaves))
    out = [(scale * jax.random.normal(k, x.shape)).astype(dtype) for k, x in zip(keys, leaves)]
    params = jax.tree.unflatten(treedef, out)
    ones = lambda a: jnp.ones_like(a)  # noqa: E731
    layers = dataclasses.replace(
        params.layers,
        attn_norm=ones(params.layers.attn_norm),
        mlp_norm=ones(params.layers.mlp_norm),
    )
    return dataclasses.replace(params, layers=layers, final_norm=ones(params.final_norm))


def cast_params(params: Params, dtype) -> Params:
    """Floating-point leaves cast to `dtype` (None: unchanged); shardings are kept. Leaves
    already in `dtype` and integer leaves (quantized weights) are returned as they are."""
    if dtype is None:
        return params
    dtype = jnp.dtype(dtype)

    def cast(x):
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return x.astype(dtype) if floating and x.dtype != dtype else x

    return jax.tree.map(cast, params)


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> Array:
    """Inverse frequencies [hd/2], with Llama-3 / linear scaling applied."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    sc = cfg.rope_scaling
    if sc is None:
        return inv_freq
    if sc.kind == "linear":
        return inv_freq / sc.factor
    # Llama 3.1: long wavelengths scaled by `factor`, short ones kept, a smooth ramp between.
    low_freq_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_freq_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * jnp.pi / inv_freq
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    smoothed = (1 - smooth) * inv_freq / sc.factor + smooth * inv_freq
    out = jnp.where(wavelen > low_freq_wavelen, inv_freq / sc.factor, inv_freq)
    is_medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return jnp.where(is_medium, smoothed, out)


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Rotary embedding, Hugging Face `rotate_half` layout. x [T, N, hd], positions [T]."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos = jnp.cos(angles)[:, None, :]  # [T, 1, hd/2]
    sin = jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [T, N, hd/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# attention(q [T,H,hd], k [T,K,hd], v [T,K,hd], layer int32, cache) -> (out [T,H,hd], cache)
AttentionFn = Callable[[Array, Array, Array, Array, Any], tuple[Array, Any]]


def _proj(x: Array, w: Array, num_in: int = 1) -> Array:
    """x [T, *in] @ w [*in, *out] -> [T, *out] as one 2-D matmul (`num_in` = len(in)): the
    reshapes of a contiguous weight (or of its scanned slice) are free."""
    if isinstance(w, Int8Weight):  # int8 weights: pallas_kernels.int8_matmul
        return int8_proj(x, w, num_in)
    t = x.shape[0]
    w2 = w.reshape(math.prod(w.shape[:num_in]), -1)
    return (x.reshape(t, -1) @ w2).reshape(t, *w.shape[num_in:])


def _layer(
    cfg: ModelConfig,
    attention: AttentionFn,
    inv_freq: Array,
    positions: Array,
    lora_mask: Array | None,
    carry,
    xs,
):
    x, cache = carry  # x [T, D]
    w, layer, lw = xs  # one layer's LayerWeights (leading L axis removed); LoraWeights or None

    def proj(field: str, h: Array, num_in: int = 1) -> Array:
        y = _proj(h, getattr(w, field), num_in)
        if lw is not None:  # static: without LoRA the traced program is unchanged
            y = y + lora_delta(h, lw.a[field], lw.b[field], lora_mask)
        return y

    h = rms_norm(x, w.attn_norm, cfg.norm_eps)
    q = proj("wq", h)  # [T, H, hd]
    k = proj("wk", h)  # [T, K, hd]
    v = proj("wv", h)  # [T, K, hd]
    if w.bq is not None:
        q, k, v = q + w.bq, k + w.bk, v + w.bv
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    attn, cache = attention(q, k, v, layer, cache)  # [T, H, hd]
    x = x + proj("wo", attn, num_in=2)  # [T, D]
    h = rms_norm(x, w.mlp_norm, cfg.norm_eps)
    gate = proj("w_gate", h)  # [T, F]
    up = proj("w_up", h)
    x = x + proj("w_down", jax.nn.silu(gate) * up)
    return (x, cache), None


LAYER_LOOPS = ("auto", "scan", "unrolled")


def layer_layout(params: Params, layer_loop: str = "auto") -> Params:
    """`params` with its layers stacked ("scan") or one `LayerWeights` per layer
    ("unrolled"); "auto": unrolled on the CPU backend, scan elsewhere. The per-layer arrays
    are copies (the stacked ones stay alive while the caller holds them)."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop={layer_loop!r} is invalid: one of {LAYER_LOOPS}")
    if layer_loop == "auto":
        layer_loop = "unrolled" if jax.default_backend() == "cpu" else "scan"
    stacked = isinstance(params.layers, LayerWeights)
    if layer_loop == "scan" and not stacked:
        layers = jax.tree.map(lambda *ws: jnp.stack(ws), *params.layers)
    elif layer_loop == "unrolled" and stacked:
        num_layers = params.layers.attn_norm.shape[0]
        layers = tuple(jax.tree.map(lambda a, i=i: a[i], params.layers) for i in range(num_layers))
    else:
        return params
    return dataclasses.replace(params, layers=layers)


def forward(
    params: Params,
    cfg: ModelConfig,
    token_ids: Array,
    positions: Array,
    cache: Any,
    attention: AttentionFn,
    logits_indices: Array | None = None,
    lora: LoraInputs | None = None,
) -> tuple[Array, Any]:
    """Runs the model over a flat token batch. Returns (logits [R, V] float32, cache).

    token_ids, positions: [T] int32. `logits_indices` [R] picks the rows whose logits are
    needed (the last token of each sequence); None computes logits for every token.
    `lora`: the adapter slot stack and each row's slot (models/lora.py); None (no LoRA
    configured) traces exactly the plain model.
    """
    x = params.embed[token_ids]  # [T, D]
    inv_freq = rope_inv_freq(cfg)
    lora_weights, lora_mask = None, None
    if lora is not None:
        lora_weights = lora.weights  # stacked, or one per layer (like params.layers)
        first = lora_weights[0] if isinstance(lora_weights, tuple) else lora_weights
        lora_mask = lora_row_mask(lora.row_slots, first.num_slots, first.max_rank, x.dtype)
    body = functools.partial(_layer, cfg, attention, inv_freq, positions, lora_mask)
    if isinstance(params.layers, LayerWeights):  # stacked [L, ...]: one traced layer body
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        xs = (params.layers, layer_ids, lora_weights)
        (x, cache), _ = jax.lax.scan(body, (x, cache), xs)
    else:  # a tuple of per-layer weights: the layers unrolled, each reads its own arrays
        for i, w in enumerate(params.layers):
            lw = lora_weights
            if isinstance(lw, LoraWeights):  # NOTE: a stacked slot stack: slice (copies)
                lw = jax.tree.map(lambda a, i=i: a[i], lw)
            elif lw is not None:
                lw = lw[i]
            (x, cache), _ = body((x, cache), (w, jnp.int32(i), lw))
    if logits_indices is not None:
        x = x[logits_indices]  # [R, D]
    x = rms_norm(x, params.final_norm, cfg.norm_eps)
    head = params.embed.T if params.lm_head is None else params.lm_head  # [D, V]
    logits = linear(x, head, "RD,DV->RV", out_dtype=jnp.float32)
    return logits, cache
