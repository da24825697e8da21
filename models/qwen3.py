"""The Qwen3 dense family (`Qwen3ForCausalLM`): Llama's layer plus a per-head RMSNorm on Q and
K before RoPE, an explicit `head_dim` (not hidden / heads) and no QKV bias.

    h = rms_norm(x) -> q [T,H,hd], k [T,K,hd] -> q_norm(q), k_norm(k) (over hd, per head)
      -> RoPE -> attention -> x += out @ wo ;  x += swiglu(rms_norm(x))

Weights: Llama's `LayerWeights` plus `q_norm`, `k_norm` [L, hd]; HF names
`self_attn.{q,k}_norm.weight`, GGUF `attn_{q,k}_norm.weight`. Its chat template (with the
`<think>` convention and `enable_thinking`) comes from the checkpoint's tokenizer_config /
GGUF metadata and is rendered as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from configs.model_config import ModelConfig
from models import layers
from models import llama as llama_family
from models.decoder import decoder_forward
from models.errors import ModelLoadError
from models.hf_config import common_fields, rope_scaling, rope_settings, rope_theta
from models.llama import AttentionFn, Params, param_field
from models.lora import LoraInputs

Array = jax.Array

HF_ARCHITECTURES = ("Qwen3ForCausalLM",)
GGUF_ARCHITECTURES = ("qwen3",)


@dataclasses.dataclass(frozen=True)
class Qwen3Config(ModelConfig):
    family = "qwen3"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights(llama_family.LayerWeights):
    q_norm: Array = param_field("layers", "head_dim")  # [L, hd]
    k_norm: Array = param_field("layers", "head_dim")  # [L, hd]


def param_shapes(cfg: ModelConfig) -> Params:
    base = llama_family.param_shapes(cfg)
    s = lambda *shape: jax.ShapeDtypeStruct(shape, base.embed.dtype)  # noqa: E731
    L, hd = cfg.num_layers, cfg.head_dim
    fields = {f.name: getattr(base.layers, f.name) for f in dataclasses.fields(base.layers)}
    layers_ = LayerWeights(**fields, q_norm=s(L, hd), k_norm=s(L, hd))
    return dataclasses.replace(base, layers=layers_)


NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm")  # init to 1 (Llama-style x * w)


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
    """Same contract as `models.llama.forward`."""
    inv_freq = llama_family.rope_inv_freq(cfg)
    eps = cfg.norm_eps

    def body(x, cache, w, layer, kind, proj):  # x [T, D]
        h = layers.rms_norm(x, w.attn_norm, eps)
        q = layers.rms_norm(proj("wq", h), w.q_norm, eps)  # [T, H, hd]
        k = layers.rms_norm(proj("wk", h), w.k_norm, eps)  # [T, K, hd]
        v = proj("wv", h)  # [T, K, hd]
        q = layers.apply_rope(q, positions, inv_freq)
        k = layers.apply_rope(k, positions, inv_freq)
        attn, cache = attention(q, k, v, layer, cache)  # [T, H, hd]
        x = x + proj("wo", attn, 2)
        h = layers.rms_norm(x, w.mlp_norm, eps)
        x = x + proj("w_down", layers.gated_mlp(proj("w_gate", h), proj("w_up", h), "silu"))
        return x, cache

    return decoder_forward(params, cfg, token_ids, positions, cache, body, logits_indices, lora)


def config_from_hf(c: dict, path: str, directory: str, name: str | None) -> Qwen3Config:
    if c.get("use_sliding_window"):
        raise ModelLoadError(
            f"{path!r}: use_sliding_window=true (Qwen3 per-layer windows) is not supported"
        )
    if c.get("attention_bias"):
        raise ModelLoadError(f"{path!r}: attention_bias=true is not supported for Qwen3")
    rope = rope_settings(c, path)
    return Qwen3Config(
        **common_fields(c, path, directory, name),
        rope_theta=rope_theta(rope, path, None),
        rope_scaling=rope_scaling(rope, path),
    )


# Per-layer tensors besides the seven projections: field -> (HF suffix, shape fn)
def hf_layer_tensors(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    D, hd = cfg.hidden_size, cfg.head_dim
    return {
        "attn_norm": ("input_layernorm.weight", (D,)),
        "mlp_norm": ("post_attention_layernorm.weight", (D,)),
        "q_norm": ("self_attn.q_norm.weight", (hd,)),
        "k_norm": ("self_attn.k_norm.weight", (hd,)),
    }


GGUF_NAMES = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
