"""The Qwen3-MoE family (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, 235B-A22B): Qwen3's attention
(per-head RMSNorm on Q and K, explicit head_dim, no bias) with a mixture-of-experts MLP
(models/moe.py: softmax over all router logits, top-k, renormalised when `norm_topk_prob`).

Layer i is sparse when i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step`
== 0; the others run a dense SwiGLU MLP of `intermediate_size` (experts are
`moe_intermediate_size` wide). Published checkpoints are all sparse (step 1, no mlp-only
layers); then the dense fields are None.
NOTE: in a mixed model every stacked field holds every layer (so the layers still scan):
a dense layer carries zero expert stacks and a sparse layer zero dense MLP weights. That
costs memory only for mixed configs.

Weights: `LayerWeights` = `models.moe.MoeLayerWeights` + q_norm, k_norm [L, hd]; HF names
`mlp.gate.weight` (router), `mlp.experts.{e}.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from models import layers, moe
from models import llama as llama_family
from models import qwen3 as qwen3_family
from models.decoder import decoder_forward
from models.errors import ModelLoadError
from models.hf_config import common_fields, rope_scaling, rope_settings, rope_theta
from models.llama import AttentionFn, Params, param_field
from models.lora import LoraInputs

Array = jax.Array
AUX_OUTPUT = moe.AUX_OUTPUT  # forward(..., real_tokens=) also returns the expert load

HF_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
GGUF_ARCHITECTURES = ("qwen3moe",)
NORMS = qwen3_family.NORMS
MLP_FIELDS = ("w_gate", "w_up", "w_down")
HF_EXPERT_NAMES = {
    "router": "mlp.gate.weight",
    "gate": "mlp.experts.{e}.gate_proj.weight",
    "up": "mlp.experts.{e}.up_proj.weight",
    "down": "mlp.experts.{e}.down_proj.weight",
    "stacked": "mlp.experts.{p}_stacked.weight",
}
# llama.cpp's names (GGUF "qwen3moe"): QK norms, router and stacked experts
GGUF_NAMES = {
    **qwen3_family.GGUF_NAMES,
    "ffn_gate_inp.weight": HF_EXPERT_NAMES["router"],
    **{
        f"ffn_{p}_exps.weight": HF_EXPERT_NAMES["stacked"].format(p=p)
        for p in ("gate", "up", "down")
    },
}


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(moe.MoeConfig):
    family = "qwen3_moe"


# Named shapes (the planner's presets; no weights ship with them).
PRESETS = {
    "qwen3-30b-a3b": Qwen3MoeConfig(
        name="qwen3-30b-a3b",
        num_layers=48,
        hidden_size=2048,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        ffn_size=6144,
        vocab_size=151936,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        num_experts=128,
        num_experts_per_tok=8,
        moe_ffn_size=768,
        norm_topk_prob=True,
    ),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights(moe.MoeLayerWeights):
    q_norm: Array = param_field("layers", "head_dim")  # [L, hd]
    k_norm: Array = param_field("layers", "head_dim")  # [L, hd]


def param_shapes(cfg: Qwen3MoeConfig) -> Params:
    base = llama_family.param_shapes(cfg)
    s = lambda *shape: jax.ShapeDtypeStruct(shape, base.embed.dtype)  # noqa: E731
    L, hd = cfg.num_layers, cfg.head_dim
    layers_ = moe.moe_shapes(cfg, base.layers, LayerWeights, q_norm=s(L, hd), k_norm=s(L, hd))
    return dataclasses.replace(base, layers=layers_)


def forward(
    params: Params,
    cfg: Qwen3MoeConfig,
    token_ids: Array,
    positions: Array,
    cache: Any,
    attention: AttentionFn,
    logits_indices: Array | None = None,
    lora: LoraInputs | None = None,
    real_tokens: Array | None = None,
) -> tuple[Array, Any] | tuple[Array, Any, Array]:
    """Same contract as `models.llama.forward`; with `real_tokens` [T] bool (the non-padding
    rows) also returns AUX_OUTPUT, the expert token counts [L, E] int32 (models/moe.py)."""
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
        out, aux = moe.mlp_block(cfg, h, w, kind, proj, real_tokens)
        return (x + out, cache, *aux)

    return decoder_forward(
        params,
        cfg,
        token_ids,
        positions,
        cache,
        body,
        logits_indices,
        lora,
        layer_kinds=cfg.layer_kinds(),
        with_aux=real_tokens is not None,
    )


def config_from_hf(c: dict, path: str, directory: str, name: str | None) -> Qwen3MoeConfig:
    if c.get("use_sliding_window"):
        raise ModelLoadError(
            f"{path!r}: use_sliding_window=true (Qwen3 per-layer windows) is not supported"
        )
    if c.get("attention_bias"):
        raise ModelLoadError(f"{path!r}: attention_bias=true is not supported for Qwen3-MoE")
    experts = moe.hf_expert_fields(c, path)
    if "moe_intermediate_size" not in c:
        raise ModelLoadError(f"{path!r}: key 'moe_intermediate_size' is missing")
    step = int(c.get("decoder_sparse_step", 1))
    if step < 1:
        raise ModelLoadError(f"{path!r}: decoder_sparse_step={step}: must be >= 1")
    mlp_only = set(c.get("mlp_only_layers") or [])
    num_layers = int(c["num_hidden_layers"])
    sparse = tuple(
        i not in mlp_only and experts["num_experts"] > 0 and (i + 1) % step == 0
        for i in range(num_layers)
    )
    if not any(sparse):
        raise ModelLoadError(
            f"{path!r}: no sparse layer (mlp_only_layers={sorted(mlp_only)}, "
            f"decoder_sparse_step={step}); load it as a dense Qwen3"
        )
    rope = rope_settings(c, path)
    return Qwen3MoeConfig(
        **common_fields(c, path, directory, name),
        **experts,
        moe_ffn_size=int(c["moe_intermediate_size"]),
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        sparse_layers=sparse,
        rope_theta=rope_theta(rope, path, None),
        rope_scaling=rope_scaling(rope, path),
    )


def hf_layer_tensors(cfg: Qwen3MoeConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    return qwen3_family.hf_layer_tensors(cfg)


def hf_projection_fields(cfg: Qwen3MoeConfig, layer: int) -> tuple[str, ...]:
    """Attention always; the dense MLP only in a dense layer."""
    attention = ("wq", "wk", "wv", "wo")
    return attention if cfg.sparse_layers[layer] else attention + MLP_FIELDS


def hf_layer_arrays(t, cfg: Qwen3MoeConfig, layer: int, shapes) -> dict:
    """A sparse layer's router and expert stacks (plus zero dense MLP weights when the model
    is mixed); a dense layer's zero expert stacks."""
    if not cfg.sparse_layers[layer]:
        return moe.zero_layer(shapes, moe.MOE_FIELDS)
    out = moe.expert_stacks(t, f"model.layers.{layer}.", cfg, HF_EXPERT_NAMES)
    if cfg.mixed:
        out.update(moe.zero_layer(shapes, MLP_FIELDS))
    return out
