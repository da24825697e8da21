"""Hugging Face tensor names and layouts -> the stacked `Params` pytree.

Every loader produces a getter `get(hf_name) -> np.ndarray` in PyTorch's [out, in] layout;
`params_from_hf_tensors` transposes, reshapes per head and stacks the layers. With int8
quantization it takes the projections as (q, scale) rows from a second getter, so a loader
can hand over int8 data it already has (GGUF Q8_0) without a float round trip.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from configs.model_config import ModelConfig
from configs.quant_config import QuantConfig
from models.errors import ModelLoadError
from models.families import family_of
from models.llama import Params
from models.quant import Int8Weight, check_quantizable, quantize_rows_np

Getter = Callable[[str], np.ndarray]
Int8Getter = Callable[[str], tuple[np.ndarray, np.ndarray]]  # -> (q [out, in], scale [out])


def _checked(
    get: Getter, name: str, shape: tuple[int, ...], source: str, optional: bool = False
) -> np.ndarray | None:
    try:
        arr = get(name)
    except KeyError:
        if optional:
            return None
        raise ModelLoadError(f"{source}: tensor {name!r} is missing") from None
    if tuple(arr.shape) != shape:
        raise ModelLoadError(
            f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, expected {shape}"
        )
    return arr


def _projections(cfg: ModelConfig) -> dict[str, tuple[str, tuple, tuple]]:
    """field -> (HF suffix, our `in` axes, our `out` axes); HF stores [prod(out), prod(in)]
    and our layout is [*in, *out]."""
    D, H, K, hd, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_size
    return {
        "wq": ("self_attn.q_proj.weight", (D,), (H, hd)),
        "wk": ("self_attn.k_proj.weight", (D,), (K, hd)),
        "wv": ("self_attn.v_proj.weight", (D,), (K, hd)),
        "wo": ("self_attn.o_proj.weight", (H, hd), (D,)),
        "w_gate": ("mlp.gate_proj.weight", (D,), (F,)),
        "w_up": ("mlp.up_proj.weight", (D,), (F,)),
        "w_down": ("mlp.down_proj.weight", (F,), (D,)),
    }


def _int8_projection(get_int8, name, in_axes, out_axes, source):
    """(q [*in, *out] int8, scale [*out] float32) from the getter's HF-layout rows."""
    rows, cols = math.prod(out_axes), math.prod(in_axes)
    try:
        q, scale = get_int8(name)
    except KeyError:
        raise ModelLoadError(f"{source}: tensor {name!r} is missing") from None
    if q.shape != (rows, cols) or scale.shape != (rows,):
        raise ModelLoadError(
            f"{source}: tensor {name!r} has shape {tuple(q.shape)}, expected {(rows, cols)}"
        )
    return q.T.reshape(*in_axes, *out_axes), scale.reshape(out_axes)


def params_from_hf_tensors(
    get: Getter,
    cfg: ModelConfig,
    source: str,
    dtype=jnp.float32,
    has: Callable[[str], bool] = lambda name: True,
    *,
    quant: QuantConfig | None = None,
    get_int8: Int8Getter | None = None,
) -> Params:
    """Builds Params from HF-named tensors. `source` names the file(s) in errors.

    With an enabled `quant`, the projections (and the LM head if it says so) become
    Int8Weight stacks built tensor by tensor from `get_int8(hf_name) -> (q [out, in] int8,
    scale [out] float32)` (default: `get` then per-row quantization), so the float model is
    never held whole; norms, biases and the embedding come from `get` as float."""
    quant = quant or QuantConfig()
    if quant.enabled and get_int8 is None:
        get_int8 = lambda name: quantize_rows_np(get(name))  # noqa: E731
    D, V = cfg.hidden_size, cfg.vocab_size
    np_dtype = np.float32

    def t(name, shape, optional=False):
        """The checked float32 tensor; with `optional`, None when the checkpoint lacks it."""
        arr = _checked(get, name, shape, source, optional)
        return None if arr is None else arr.astype(np_dtype)

    family = family_of(cfg)
    if hasattr(family, "hf_getter"):  # fused tensors (Phi-3) split at load
        get = family.hf_getter(get, cfg)
    shapes = family.param_shapes(cfg)
    layer_cls = type(shapes.layers)
    if quant.enabled and hasattr(family, "hf_layer_arrays"):
        check_quantizable(shapes.layers, quant)
    projections = _projections(cfg)
    per_layer: dict[str, list] = {f.name: [] for f in dataclasses.fields(layer_cls)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for field, (suffix, hf_shape) in family.hf_layer_tensors(cfg).items():
            shape = getattr(shapes.layers, field).shape[1:]
            per_layer[field].append(t(p + suffix, hf_shape).reshape(shape))
        # a family whose layers hold other weights (MoE experts) reads them itself
        if hasattr(family, "hf_layer_arrays"):
            for field, arr in family.hf_layer_arrays(t, cfg, i, shapes.layers).items():
                want = getattr(shapes.layers, field).shape[1:]
                if tuple(arr.shape) != tuple(want):
                    raise ModelLoadError(
                        f"{source}: layer {i} {field} has shape {tuple(arr.shape)}, "
                        f"expected {tuple(want)}"
                    )
                per_layer[field].append(arr)
        fields = projections
        if hasattr(family, "hf_projection_fields"):
            fields = {f: projections[f] for f in family.hf_projection_fields(cfg, i)}
        for field, (suffix, in_axes, out_axes) in fields.items():
            if quant.enabled:
                per_layer[field].append(
                    _int8_projection(get_int8, p + suffix, in_axes, out_axes, source)
                )
            else:
                w = t(p + suffix, (math.prod(out_axes), math.prod(in_axes)))
                per_layer[field].append(w.T.reshape(*in_axes, *out_axes))
    stacked = {}
    for k, v in per_layer.items():
        if not v:
            stacked[k] = None
        elif isinstance(v[0], tuple):  # (q, scale) pairs
            q, scale = np.stack([x[0] for x in v]), np.stack([x[1] for x in v])
            stacked[k] = Int8Weight(jnp.asarray(q), jnp.asarray(scale), quant.activations)
        else:
            stacked[k] = jnp.asarray(np.stack(v), dtype)
    embed = t("model.embed_tokens.weight", (V, D))
    return Params(
        embed=jnp.asarray(embed, dtype),
        layers=layer_cls(**stacked),
        final_norm=jnp.asarray(t("model.norm.weight", (D,)), dtype),
        lm_head=_lm_head(get, get_int8, cfg, quant, source, dtype),
    )


def _lm_head(get, get_int8, cfg: ModelConfig, quant: QuantConfig, source: str, dtype):
    """[D, V] float, an Int8Weight, or None (tied to the embedding and kept float)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    name = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    if quant.quantize_lm_head:  # tied: an int8 [D, V] copy beside the float embedding
        q, scale = _int8_projection(get_int8, name, (D,), (V,), source)
        return Int8Weight(jnp.asarray(q), jnp.asarray(scale), quant.activations)
    if cfg.tie_embeddings:
        return None
    return jnp.asarray(_checked(get, name, (V, D), source).astype(np.float32).T, dtype)
