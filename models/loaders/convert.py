"""Hugging Face tensor names and layouts -> the stacked `Params` pytree.

Every loader produces a getter `get(hf_name) -> np.ndarray` in PyTorch's [out, in] layout;
`params_from_hf_tensors` transposes, reshapes per head and stacks the layers.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from configs.model_config import ModelConfig
from models.errors import ModelLoadError
from models.llama import LayerWeights, Params

Getter = Callable[[str], np.ndarray]


def _checked(get: Getter, name: str, shape: tuple[int, ...], source: str) -> np.ndarray:
    try:
        arr = get(name)
    except KeyError:
        raise ModelLoadError(f"{source}: tensor {name!r} is missing") from None
    if tuple(arr.shape) != shape:
        raise ModelLoadError(
            f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, expected {shape}"
        )
    return arr


def params_from_hf_tensors(
    get: Getter,
    cfg: ModelConfig,
    source: str,
    dtype=jnp.float32,
    has: Callable[[str], bool] = lambda name: True,
) -> Params:
    """Builds Params from HF-named tensors. `source` names the file(s) in errors."""
    D, H, K, hd, F, V = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.ffn_size,
        cfg.vocab_size,
    )
    np_dtype = np.float32

    def t(name, shape):
        return _checked(get, name, shape, source).astype(np_dtype)

    per_layer: dict[str, list[np.ndarray]] = {k: [] for k in LayerWeights.__dataclass_fields__}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        per_layer["attn_norm"].append(t(p + "input_layernorm.weight", (D,)))
        per_layer["wq"].append(t(p + "self_attn.q_proj.weight", (H * hd, D)).T.reshape(D, H, hd))
        per_layer["wk"].append(t(p + "self_attn.k_proj.weight", (K * hd, D)).T.reshape(D, K, hd))
        per_layer["wv"].append(t(p + "self_attn.v_proj.weight", (K * hd, D)).T.reshape(D, K, hd))
        if cfg.attention_bias:
            per_layer["bq"].append(t(p + "self_attn.q_proj.bias", (H * hd,)).reshape(H, hd))
            per_layer["bk"].append(t(p + "self_attn.k_proj.bias", (K * hd,)).reshape(K, hd))
            per_layer["bv"].append(t(p + "self_attn.v_proj.bias", (K * hd,)).reshape(K, hd))
        per_layer["wo"].append(t(p + "self_attn.o_proj.weight", (D, H * hd)).T.reshape(H, hd, D))
        per_layer["mlp_norm"].append(t(p + "post_attention_layernorm.weight", (D,)))
        per_layer["w_gate"].append(t(p + "mlp.gate_proj.weight", (F, D)).T)
        per_layer["w_up"].append(t(p + "mlp.up_proj.weight", (F, D)).T)
        per_layer["w_down"].append(t(p + "mlp.down_proj.weight", (D, F)).T)
    stacked = {k: (jnp.asarray(np.stack(v), dtype) if v else None) for k, v in per_layer.items()}
    embed = t("model.embed_tokens.weight", (V, D))
    lm_head = None
    if not cfg.tie_embeddings:
        lm_head = jnp.asarray(t("lm_head.weight", (V, D)).T, dtype)
    return Params(
        embed=jnp.asarray(embed, dtype),
        layers=LayerWeights(**stacked),
        final_norm=jnp.asarray(t("model.norm.weight", (D,)), dtype),
        lm_head=lm_head,
    )
