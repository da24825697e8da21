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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig
from models import layers
from models.decoder import decoder_forward
from models.lora import LoraInputs

Array = jax.Array


def param_field(*axes: str):
    """A params field declared with its logical axes, one name per array dim. The names are
    model-side; `engine.parallel.sharding.LOGICAL_RULES` maps them to mesh axes."""
    return dataclasses.field(metadata={"axes": axes})


def param_axes(field: dataclasses.Field) -> tuple[str, ...]:
    """The logical axes a `LayerWeights` / `Params` field was declared with."""
    if "axes" not in field.metadata:
        raise TypeError(
            f"params field {field.name!r} declares no logical axes: use param_field(...)"
        )
    return field.metadata["axes"]


# NOTE: one declaration per param: its shape (comment) and its logical axes side by side.
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    attn_norm: Array = param_field("layers", "embed")  # [L, D]
    wq: Array = param_field("layers", "embed", "heads", "head_dim")  # [L, D, H, hd]
    wk: Array = param_field("layers", "embed", "kv_heads", "head_dim")  # [L, D, K, hd]
    wv: Array = param_field("layers", "embed", "kv_heads", "head_dim")  # [L, D, K, hd]
    bq: Array | None = param_field("layers", "heads", "head_dim")  # [L, H, hd] (Qwen2) or None
    bk: Array | None = param_field("layers", "kv_heads", "head_dim")  # [L, K, hd] or None
    bv: Array | None = param_field("layers", "kv_heads", "head_dim")  # [L, K, hd] or None
    wo: Array = param_field("layers", "heads", "head_dim", "embed")  # [L, H, hd, D]
    mlp_norm: Array = param_field("layers", "embed")  # [L, D]
    w_gate: Array = param_field("layers", "embed", "ffn")  # [L, D, F]
    w_up: Array = param_field("layers", "embed", "ffn")  # [L, D, F]
    w_down: Array = param_field("layers", "ffn", "embed")  # [L, F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    embed: Array = param_field("vocab", "embed")  # [V, D]
    # stacked [L, ...] (axes declared above), or one LayerWeights per layer (`layer_layout`)
    layers: LayerWeights | tuple[LayerWeights, ...]
    final_norm: Array = param_field("embed")  # [D]
    lm_head: Array | None = param_field("embed", "vocab")  # [D, V], or None when tied to `embed`


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


# Building blocks live in models/layers.py (shared by every family); kept here by name.
rms_norm = layers.rms_norm
apply_rope = layers.apply_rope
_proj = layers.proj


def rope_inv_freq(cfg: ModelConfig) -> Array:
    """Inverse frequencies [hd/2], with Llama-3 / linear scaling applied."""
    return layers.scaled_inv_freq(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling)


# attention(q [T,H,hd], k [T,K,hd], v [T,K,hd], layer int32, cache) -> (out [T,H,hd], cache)
# Families with per-layer windows (Gemma 3) also pass `sliding_window=` (int or None).
AttentionFn = Callable[..., tuple[Array, Any]]


def llama_layer(cfg: ModelConfig, attention: AttentionFn, inv_freq: Array, positions: Array):
    """The Llama layer body for `models.decoder.decoder_forward`."""

    def body(x, cache, w, layer, kind, proj):  # x [T, D]
        h = rms_norm(x, w.attn_norm, cfg.norm_eps)
        q = proj("wq", h)  # [T, H, hd]
        k = proj("wk", h)  # [T, K, hd]
        v = proj("wv", h)  # [T, K, hd]
        if w.bq is not None:
            q, k, v = q + w.bq, k + w.bk, v + w.bv
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        attn, cache = attention(q, k, v, layer, cache)  # [T, H, hd]
        x = x + proj("wo", attn, 2)  # [T, D]
        h = rms_norm(x, w.mlp_norm, cfg.norm_eps)
        x = x + proj("w_down", layers.gated_mlp(proj("w_gate", h), proj("w_up", h), "silu"))
        return x, cache

    return body


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
    body = llama_layer(cfg, attention, rope_inv_freq(cfg), positions)
    return decoder_forward(params, cfg, token_ids, positions, cache, body, logits_indices, lora)


# ---- the family's declarations (models/families.py) ---------------------------------------
HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
NORMS = ("attn_norm", "mlp_norm")  # x * w norms: init to 1


def config_from_hf(c: dict, path: str, directory: str, name: str | None) -> ModelConfig:
    """Llama / Mistral / Qwen2 config.json (either RoPE dialect) -> ModelConfig."""
    from models.hf_config import common_fields, rope_scaling, rope_settings, rope_theta

    is_qwen = "Qwen2ForCausalLM" in (c.get("architectures") or [])
    rope = rope_settings(c, path)
    return ModelConfig(
        **common_fields(c, path, directory, name),
        rope_theta=rope_theta(rope, path, 10000.0),
        rope_scaling=rope_scaling(rope, path),
        attention_bias=bool(c.get("attention_bias", is_qwen)),
        sliding_window=c.get("sliding_window")
        if c.get("use_sliding_window", not is_qwen)
        else None,
    )


def hf_layer_tensors(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Per-layer tensors besides the seven projections: field -> (HF suffix, HF shape)."""
    D, H, K, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out = {
        "attn_norm": ("input_layernorm.weight", (D,)),
        "mlp_norm": ("post_attention_layernorm.weight", (D,)),
    }
    if cfg.attention_bias:
        out["bq"] = ("self_attn.q_proj.bias", (H * hd,))
        out["bk"] = ("self_attn.k_proj.bias", (K * hd,))
        out["bv"] = ("self_attn.v_proj.bias", (K * hd,))
    return out
