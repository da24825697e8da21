"""The Gemma 3 text family (`Gemma3ForCausalLM`, GGUF `gemma3`: the 270M / 1B text models).

    x = embed(ids) * sqrt(D)            (the scale rounded to the weights' dtype, as HF does)
    per layer (kind "sliding_attention" = local, "full_attention" = global, `layer_types`):
      h = norm(x) -> q, k, v ; q = q_norm(q), k = k_norm(k)  (per head, over hd)
      RoPE with the kind's base (local: rope_local_theta, no scaling; global: rope_theta and
      rope_scaling) ; attention with the window on local layers (`sliding_window=`) and
      softmax scale query_pre_attn_scalar^-0.5 ; x += post_attn_norm(out @ wo)
      h = pre_mlp_norm(x) ; x += post_mlp_norm(down(gelu_tanh(gate h) * up h))
    final norm -> logits, soft-capped by final_logit_softcap when set.

Every RMSNorm is Gemma's (1 + w) form. Weights: Llama's `LayerWeights` (attn_norm = input
norm, mlp_norm = pre-feedforward norm) plus q_norm, k_norm [L, hd] and post_attn_norm,
post_mlp_norm [L, D]. The engine's attention computes softmax(q k / sqrt(hd)); q is scaled
by sqrt(hd / query_pre_attn_scalar) here so the kernels keep their contract.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

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
from models.llama import AttentionFn, Params, param_field
from models.lora import LoraInputs

Array = jax.Array

HF_ARCHITECTURES = ("Gemma3ForCausalLM",)
GGUF_ARCHITECTURES = ("gemma3",)
LOCAL, GLOBAL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    family = "gemma3"
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float = 256.0
    final_logit_softcap: float | None = None

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_layers={self.num_layers}"
            )
        bad = sorted(set(self.layer_types) - {LOCAL, GLOBAL})
        if bad:
            raise ValueError(f"layer_types {bad}: expected {LOCAL!r} or {GLOBAL!r}")
        if LOCAL in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has local layers but sliding_window is not set")

    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.sliding_window if t == LOCAL else None for t in self.layer_types)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights(llama_family.LayerWeights):
    q_norm: Array = param_field("layers", "head_dim")  # [L, hd]
    k_norm: Array = param_field("layers", "head_dim")  # [L, hd]
    post_attn_norm: Array = param_field("layers", "embed")  # [L, D]
    post_mlp_norm: Array = param_field("layers", "embed")  # [L, D]


def param_shapes(cfg: ModelConfig) -> Params:
    base = llama_family.param_shapes(cfg)
    s = lambda *shape: jax.ShapeDtypeStruct(shape, base.embed.dtype)  # noqa: E731
    L, D, hd = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    fields = {f.name: getattr(base.layers, f.name) for f in dataclasses.fields(base.layers)}
    layers_ = LayerWeights(
        **fields,
        q_norm=s(L, hd),
        k_norm=s(L, hd),
        post_attn_norm=s(L, D),
        post_mlp_norm=s(L, D),
    )
    return dataclasses.replace(base, layers=layers_)


NORMS = ()  # (1 + w): zeros are unit norms, which random init already is near


def forward(
    params: Params,
    cfg: Gemma3Config,
    token_ids: Array,
    positions: Array,
    cache: Any,
    attention: AttentionFn,
    logits_indices: Array | None = None,
    lora: LoraInputs | None = None,
) -> tuple[Array, Any]:
    """Same contract as `models.llama.forward`; attention gets `sliding_window=` per layer."""
    hd, eps = cfg.head_dim, cfg.norm_eps
    inv_freq = {
        LOCAL: layers.default_inv_freq(cfg.rope_local_theta, hd),
        GLOBAL: layers.scaled_inv_freq(cfg.rope_theta, hd, cfg.rope_scaling),
    }
    q_scale = math.sqrt(hd / cfg.query_pre_attn_scalar)  # kernels divide by sqrt(hd)

    def norm(h, w):
        return layers.rms_norm(h, w, eps, offset=1.0)

    def body(x, cache, w, layer, kind, proj):  # x [T, D]
        h = norm(x, w.attn_norm)
        q = norm(proj("wq", h), w.q_norm)  # [T, H, hd]
        k = norm(proj("wk", h), w.k_norm)  # [T, K, hd]
        v = proj("wv", h)  # [T, K, hd]
        q = layers.apply_rope(q, positions, inv_freq[kind]) * q_scale
        k = layers.apply_rope(k, positions, inv_freq[kind])
        window = cfg.sliding_window if kind == LOCAL else None
        attn, cache = attention(q, k, v, layer, cache, sliding_window=window)  # [T, H, hd]
        x = x + norm(proj("wo", attn, 2), w.post_attn_norm)
        h = norm(x, w.mlp_norm)
        mlp = layers.gated_mlp(proj("w_gate", h), proj("w_up", h), "gelu_tanh")  # [T, F]
        x = x + norm(proj("w_down", mlp), w.post_mlp_norm)
        return x, cache

    return decoder_forward(
        params,
        cfg,
        token_ids,
        positions,
        cache,
        body,
        logits_indices,
        lora,
        layer_kinds=cfg.layer_types,
        embed_scale=math.sqrt(cfg.hidden_size),
        norm_offset=1.0,
        final_softcap=cfg.final_logit_softcap,
    )


def layer_types_from(c: dict, path: str, num_layers: int) -> tuple[str, ...]:
    """`layer_types`, or the old `sliding_window_pattern` (every n-th layer global)."""
    types = c.get("layer_types")
    pattern = c.get("sliding_window_pattern")
    if types is None:  # transformers 5 writes a private copy beside layer_types
        pattern = pattern or c.get("_sliding_window_pattern")
    derived = None
    if pattern:
        derived = tuple(LOCAL if (i + 1) % pattern else GLOBAL for i in range(num_layers))
    if types is None and derived is None:
        raise ModelLoadError(f"{path!r}: neither layer_types nor sliding_window_pattern is set")
    if types is not None and derived is not None and tuple(types) != derived:
        raise ModelLoadError(
            f"{path!r}: layer_types {types} disagrees with sliding_window_pattern={pattern}"
        )
    return tuple(types) if types is not None else derived


def config_from_hf(c: dict, path: str, directory: str, name: str | None) -> Gemma3Config:
    if c.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{path!r}: attn_logit_softcapping is not supported for Gemma 3")
    check_activation(c, path, "hidden_activation", ("gelu_pytorch_tanh",))
    fields = common_fields(c, path, directory, name)
    fields["norm_eps"] = c.get("rms_norm_eps", 1e-6)
    fields["tie_embeddings"] = bool(c.get("tie_word_embeddings", True))
    global_rope = rope_settings(c, path, GLOBAL)
    local_rope = rope_settings(c, path, LOCAL, old_theta_key="rope_local_base_freq")
    rope_scaling(local_rope, path, allowed=("default",))
    if "query_pre_attn_scalar" not in c:
        raise ModelLoadError(f"{path!r}: key 'query_pre_attn_scalar' is missing")
    return Gemma3Config(
        **fields,
        rope_theta=rope_theta(global_rope, path, None),
        rope_scaling=rope_scaling(global_rope, path),
        sliding_window=c.get("sliding_window"),
        layer_types=layer_types_from(c, path, fields["num_layers"]),
        rope_local_theta=rope_theta(local_rope, path, None, "rope_local_base_freq"),
        query_pre_attn_scalar=float(c["query_pre_attn_scalar"]),
        final_logit_softcap=c.get("final_logit_softcapping"),
    )


def hf_layer_tensors(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    D, hd = cfg.hidden_size, cfg.head_dim
    return {
        "attn_norm": ("input_layernorm.weight", (D,)),
        "post_attn_norm": ("post_attention_layernorm.weight", (D,)),
        "mlp_norm": ("pre_feedforward_layernorm.weight", (D,)),
        "post_mlp_norm": ("post_feedforward_layernorm.weight", (D,)),
        "q_norm": ("self_attn.q_norm.weight", (hd,)),
        "k_norm": ("self_attn.k_norm.weight", (hd,)),
    }


# llama.cpp's names (blk.N.<name>) -> HF suffixes; its converter stores Gemma norms as 1 + w.
GGUF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
GGUF_NORMS_PLUS_ONE = True


# Gemma 3's chat template (google/gemma-3-*-it tokenizer_config.json): the GGUF releases
# ship none, so a GGUF without `tokenizer.chat_template` gets this one.
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
STOP_TOKENS = ("<end_of_turn>",)  # the end of a chat turn (generation_config's eos [1, 106])
