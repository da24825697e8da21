"""The Phi-3 family (`Phi3ForCausalLM`: Phi-3, Phi-3.5, Phi-4-mini): Llama's layer with
fused weights, LongRoPE and partial rotary.

- Fused `qkv_proj` [(H + 2K) hd, D] and `gate_up_proj` [2F, D] are split at load into Llama's
  wq/wk/wv and w_gate/w_up (`hf_getter`), so sharding, int8 and LoRA see the usual layout.
- Partial rotary (`partial_rotary_factor`, Phi-4-mini 0.75): only the first
  rd = hd * factor dims of each head rotate.
- LongRoPE (`rope_type` "longrope"): inv_freq = 1 / (ext * theta^(2i/rd)) with ext the
  short factors for positions < original_max_position_embeddings and the long ones beyond,
  cos/sin scaled by the attention factor sqrt(1 + ln(s) / ln(orig)), s = max / orig.
  NOTE: transformers switches every position of a sequence to the long factors once the
  sequence passes the original length (recomputing the whole prompt); a paged cache keeps
  the K already written, so here the switch is per position (as vLLM does). Identical up
  to the original length.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig
from models import layers
from models import llama as llama_family
from models.decoder import decoder_forward
from models.errors import ModelLoadError
from models.hf_config import (
    check_activation,
    common_fields,
    rope_scaling,
    rope_settings,
    rope_theta,
)
from models.llama import AttentionFn, Params
from models.lora import LoraInputs

Array = jax.Array

HF_ARCHITECTURES = ("Phi3ForCausalLM",)
GGUF_ARCHITECTURES = ()  # a phi3 GGUF (LongRoPE factors as tensors) is refused by name


@dataclasses.dataclass(frozen=True)
class LongRope:
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


@dataclasses.dataclass(frozen=True)
class Phi3Config(ModelConfig):
    family = "phi3"
    partial_rotary_factor: float = 1.0
    long_rope: LongRope | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


param_shapes = llama_family.param_shapes
NORMS = ("attn_norm", "mlp_norm")


def rope_tables(cfg: Phi3Config, positions: Array) -> tuple[Array, float]:
    """(inv_freq [rd/2] or [T, rd/2], cos/sin scale)."""
    rd = cfg.rotary_dim
    if cfg.long_rope is None:
        return layers.scaled_inv_freq(cfg.rope_theta, rd, cfg.rope_scaling), 1.0
    lr = cfg.long_rope
    base = layers.default_inv_freq(cfg.rope_theta, rd)  # [rd/2]
    short = base / jnp.asarray(lr.short_factor, jnp.float32)
    long = base / jnp.asarray(lr.long_factor, jnp.float32)
    is_long = positions[:, None] >= lr.original_max_position_embeddings  # [T, 1]
    return jnp.where(is_long, long[None], short[None]), lr.attention_factor  # [T, rd/2]


def forward(
    params: Params,
    cfg: Phi3Config,
    token_ids: Array,
    positions: Array,
    cache: Any,
    attention: AttentionFn,
    logits_indices: Array | None = None,
    lora: LoraInputs | None = None,
) -> tuple[Array, Any]:
    """Same contract as `models.llama.forward`."""
    inv_freq, scale = rope_tables(cfg, positions)
    eps = cfg.norm_eps

    def body(x, cache, w, layer, kind, proj):  # x [T, D]
        h = layers.rms_norm(x, w.attn_norm, eps)
        q = layers.apply_rope(proj("wq", h), positions, inv_freq, scale)  # [T, H, hd]
        k = layers.apply_rope(proj("wk", h), positions, inv_freq, scale)  # [T, K, hd]
        v = proj("wv", h)  # [T, K, hd]
        attn, cache = attention(q, k, v, layer, cache)  # [T, H, hd]
        x = x + proj("wo", attn, 2)
        h = layers.rms_norm(x, w.mlp_norm, eps)
        x = x + proj("w_down", layers.gated_mlp(proj("w_gate", h), proj("w_up", h), "silu"))
        return x, cache

    return decoder_forward(params, cfg, token_ids, positions, cache, body, logits_indices, lora)


def config_from_hf(c: dict, path: str, directory: str, name: str | None) -> Phi3Config:
    if c.get("attention_bias"):
        raise ModelLoadError(f"{path!r}: attention_bias=true is not supported for Phi-3")
    check_activation(c, path, "hidden_act", ("silu",))
    fields = common_fields(c, path, directory, name)
    rope = rope_settings(c, path)
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if c.get("partial_rotary_factor", partial) != partial:
        raise ModelLoadError(
            f"{path!r}: partial_rotary_factor is {c['partial_rotary_factor']} but "
            f"rope_parameters says {partial}"
        )
    kind = rope["rope_type"]
    if kind == "su":  # the name early Phi-3 configs used for LongRoPE
        kind = "longrope"
    long_rope, scaling = None, None
    if kind == "longrope":
        orig = rope.get(
            "original_max_position_embeddings", c.get("original_max_position_embeddings")
        )
        if orig is None:
            raise ModelLoadError(f"{path!r}: longrope needs original_max_position_embeddings")
        factor = rope.get("factor") or fields["max_seq_len"] / orig
        attn = rope.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        rd = int(fields["head_dim"] * partial)
        for key in ("short_factor", "long_factor"):
            if len(rope[key]) != rd // 2:
                raise ModelLoadError(
                    f"{path!r}: rope {key} has {len(rope[key])} entries, expected {rd // 2}"
                )
        long_rope = LongRope(
            tuple(float(f) for f in rope["short_factor"]),
            tuple(float(f) for f in rope["long_factor"]),
            int(orig),
            float(attn),
        )
    else:
        scaling = rope_scaling(rope, path)
    return Phi3Config(
        **fields,
        rope_theta=rope_theta(rope, path, None),
        rope_scaling=scaling,
        sliding_window=c.get("sliding_window"),
        partial_rotary_factor=float(partial),
        long_rope=long_rope,
    )


def hf_layer_tensors(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    D = cfg.hidden_size
    return {
        "attn_norm": ("input_layernorm.weight", (D,)),
        "mlp_norm": ("post_attention_layernorm.weight", (D,)),
    }


def hf_getter(get, cfg: ModelConfig):
    """A getter that serves Llama's q/k/v and gate/up names from Phi-3's fused tensors."""
    H, K, hd, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_size
    qkv_rows = {"q_proj": (0, H * hd), "k_proj": (H * hd, (H + K) * hd)}
    qkv_rows["v_proj"] = ((H + K) * hd, (H + 2 * K) * hd)
    mlp_rows = {"gate_proj": (0, F), "up_proj": (F, 2 * F)}

    def split(name: str):
        prefix, _, rest = name.rpartition(".self_attn.")
        if prefix and rest.split(".")[0] in qkv_rows:
            lo, hi = qkv_rows[rest.split(".")[0]]
            return get(f"{prefix}.self_attn.qkv_proj.weight")[lo:hi]
        prefix, _, rest = name.rpartition(".mlp.")
        if prefix and rest.split(".")[0] in mlp_rows:
            lo, hi = mlp_rows[rest.split(".")[0]]
            return get(f"{prefix}.mlp.gate_up_proj.weight")[lo:hi]
        return get(name)

    return split
