"""The Mixtral family (`MixtralForCausalLM`): Llama's attention (GQA, RoPE, optional sliding
window) with a mixture-of-experts MLP in every layer (models/moe.py).

    h = rms_norm(x) -> q, k, v -> RoPE -> attention -> x += out @ wo
    h = rms_norm(x) -> x += moe_mlp(h)   (E experts, top-k, softmax over the k best logits)

Weights: `models.moe.MoeLayerWeights` (Llama's attention fields, no dense MLP) with the
router [L, D, E] and expert stacks; HF names `block_sparse_moe.gate.weight` (router) and
`block_sparse_moe.experts.{e}.w1 / w3 / w2.weight` (gate / up / down, PyTorch [out, in]).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from models import llama as llama_family
from models import moe
from models.decoder import decoder_forward
from models.errors import ModelLoadError
from models.hf_config import common_fields, rope_scaling, rope_settings, rope_theta
from models.llama import AttentionFn, Params
from models.lora import LoraInputs

Array = jax.Array
AUX_OUTPUT = moe.AUX_OUTPUT  # forward(..., real_tokens=) also returns the expert load

HF_ARCHITECTURES = ("MixtralForCausalLM",)
GGUF_ARCHITECTURES = ()  # llama.cpp writes Mixtral as "llama" with expert_count (gguf_loader)
NORMS = ("attn_norm", "mlp_norm")
HF_EXPERT_NAMES = {
    "router": "block_sparse_moe.gate.weight",
    "gate": "block_sparse_moe.experts.{e}.w1.weight",
    "up": "block_sparse_moe.experts.{e}.w3.weight",
    "down": "block_sparse_moe.experts.{e}.w2.weight",
    "stacked": "block_sparse_moe.experts.{p}_stacked.weight",
}
# llama.cpp's names (a "llama" GGUF with expert_count): router and stacked experts
GGUF_NAMES = {
    "ffn_gate_inp.weight": HF_EXPERT_NAMES["router"],
    **{
        f"ffn_{p}_exps.weight": HF_EXPERT_NAMES["stacked"].format(p=p)
        for p in ("gate", "up", "down")
    },
}


@dataclasses.dataclass(frozen=True)
class MixtralConfig(moe.MoeConfig):
    family = "mixtral"
    routing: str = "topk_softmax"


# Named shapes (the planner's presets; no weights ship with them).
PRESETS = {
    "mixtral-8x7b": MixtralConfig(
        name="mixtral-8x7b",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        ffn_size=14336,
        vocab_size=32000,
        max_seq_len=32768,
        rope_theta=1e6,
        num_experts=8,
        num_experts_per_tok=2,
    ),
}


def param_shapes(cfg: MixtralConfig) -> Params:
    base = llama_family.param_shapes(cfg)
    return dataclasses.replace(base, layers=moe.moe_shapes(cfg, base.layers, moe.MoeLayerWeights))


def forward(
    params: Params,
    cfg: MixtralConfig,
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
        h = llama_family.rms_norm(x, w.attn_norm, eps)
        q = llama_family.apply_rope(proj("wq", h), positions, inv_freq)  # [T, H, hd]
        k = llama_family.apply_rope(proj("wk", h), positions, inv_freq)  # [T, K, hd]
        v = proj("wv", h)  # [T, K, hd]
        attn, cache = attention(q, k, v, layer, cache)  # [T, H, hd]
        x = x + proj("wo", attn, 2)
        h = llama_family.rms_norm(x, w.mlp_norm, eps)
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


def config_from_hf(c: dict, path: str, directory: str, name: str | None) -> MixtralConfig:
    if c.get("attention_bias"):
        raise ModelLoadError(f"{path!r}: attention_bias=true is not supported for Mixtral")
    rope = rope_settings(c, path)
    return MixtralConfig(
        **common_fields(c, path, directory, name),
        **moe.hf_expert_fields(c, path),
        rope_theta=rope_theta(rope, path, 1e6),
        rope_scaling=rope_scaling(rope, path),
        sliding_window=c.get("sliding_window"),
    )


def hf_layer_tensors(cfg: MixtralConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    return llama_family.hf_layer_tensors(cfg)


def hf_projection_fields(cfg: MixtralConfig, layer: int) -> tuple[str, ...]:
    """The projections layer `layer` reads by Llama's names: attention only."""
    return ("wq", "wk", "wv", "wo")


def hf_layer_arrays(t, cfg: MixtralConfig, layer: int, shapes) -> dict:
    """The router and expert stacks of one layer, in our layout."""
    return moe.expert_stacks(t, f"model.layers.{layer}.", cfg, HF_EXPERT_NAMES)
