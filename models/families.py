"""The model-family seam: which family module runs a config, and which family an HF
`architectures` entry or a GGUF `general.architecture` names.

    llama   models/llama.py   Llama 2/3/3.x, Mistral, Qwen2, SmolLM2
    qwen3   models/qwen3.py   Qwen3 dense (QK-norm)
    phi3    models/phi3.py    Phi-3 / 3.5 / 4-mini (fused weights, LongRoPE, partial rotary)
    gemma3  models/gemma3.py  Gemma 3 text (local/global layers, (1 + w) norms, GeGLU)
    mixtral    models/mixtral.py    Mixtral (mixture of experts, models/moe.py)
    qwen3_moe  models/qwen3_moe.py  Qwen3-MoE (QK-norm attention, mixture of experts)

A family module declares: its config class (a `ModelConfig` subclass whose class attribute
`family` names it), `LayerWeights` (Llama's, or a subclass adding fields with their logical
axes), `param_shapes(cfg)`, `forward(...)` (the contract of `models.llama.forward`),
`config_from_hf(config_dict, path, directory, name)`, `hf_layer_tensors(cfg)` (per-layer
tensors besides the seven projections), optionally `hf_getter(get, cfg)` (fused tensors
split at load), optionally `hf_layer_arrays(t, cfg, layer, shapes)` (a layer's other
weights in our layout: MoE expert stacks) with `hf_projection_fields(cfg, layer)` (which of
the seven it reads by Llama's names), `GGUF_NAMES` (llama.cpp tensor names beyond
Llama's), `NORMS` (fields to initialise to 1), `HF_ARCHITECTURES` and `GGUF_ARCHITECTURES`.
Optionally `AUX_OUTPUT`: the name of a small per-step array its `forward` also returns when
called with `real_tokens=` ([T] bool, the non-padding rows): the MoE families' "expert_tokens"
[L, E] int32. The engine reports it (`forward_with_aux`); a family without one is called
exactly as before, so its step program is unchanged.

The engine calls `forward`, `param_shapes` and `init_params` here; it never names a family.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig
from models.errors import ModelLoadError

FAMILY_MODULES = {
    "llama": "models.llama",
    "qwen3": "models.qwen3",
    "phi3": "models.phi3",
    "gemma3": "models.gemma3",
    "mixtral": "models.mixtral",
    "qwen3_moe": "models.qwen3_moe",
}
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "qwen3moe": "qwen3_moe",
}


def family_module(name: str) -> ModuleType:
    if name not in FAMILY_MODULES:
        raise ValueError(f"model family {name!r} is unknown (known: {sorted(FAMILY_MODULES)})")
    return importlib.import_module(FAMILY_MODULES[name])


def family_of(cfg: ModelConfig) -> ModuleType:
    """The module that runs `cfg` (its class attribute `family`)."""
    return family_module(type(cfg).family)


def family_for_hf(architectures: list[str], path: str) -> str:
    """The family of a config.json's `architectures`; ModelLoadError naming it otherwise."""
    for arch in architectures or []:
        if arch in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[arch]
    raise ModelLoadError(
        f"{path!r}: architectures {list(architectures or [])} not supported "
        f"(supported: {', '.join(HF_ARCHITECTURES)})"
    )


def family_for_gguf(arch: str, path: str) -> str:
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {path!r}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    return GGUF_ARCHITECTURES[arch]


def forward(params, cfg: ModelConfig, *args, **kwargs) -> tuple[jax.Array, Any]:
    """`models.llama.forward`'s contract, run by the family of `cfg`."""
    return family_of(cfg).forward(params, cfg, *args, **kwargs)


def aux_output(cfg: ModelConfig) -> str | None:
    """The name of the auxiliary step output of `cfg`'s family (None: it has none)."""
    return getattr(family_of(cfg), "AUX_OUTPUT", None)


def forward_with_aux(
    params, cfg: ModelConfig, *args, real_tokens: jax.Array | None, **kwargs
) -> tuple[jax.Array, Any, jax.Array | None]:
    """`forward` plus the family's auxiliary output (`aux_output`), or None for a family
    without one (`real_tokens` is then not read, and may be None)."""
    family = family_of(cfg)
    if aux_output(cfg) is None:
        return (*family.forward(params, cfg, *args, **kwargs), None)
    return family.forward(params, cfg, *args, real_tokens=real_tokens, **kwargs)


def param_shapes(cfg: ModelConfig):
    """The abstract params (float32 `ShapeDtypeStruct` leaves) of `cfg`'s family."""
    return family_of(cfg).param_shapes(cfg)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02):
    """Random params (tests and benchmarks); the family's x * w norms start at 1."""
    family = family_of(cfg)
    shapes = family.param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(key, len(leaves))
    out = [(scale * jax.random.normal(k, x.shape)).astype(dtype) for k, x in zip(keys, leaves)]
    params = jax.tree.unflatten(treedef, out)
    ones = {name: jnp.ones_like(getattr(params.layers, name)) for name in family.NORMS}
    final = jnp.ones_like(params.final_norm) if family.NORMS else params.final_norm
    return dataclasses.replace(
        params, layers=dataclasses.replace(params.layers, **ones), final_norm=final
    )


def family_presets() -> dict[str, ModelConfig]:
    """Named configs the family modules declare (`PRESETS`; shapes only, e.g. the MoE
    models the planner sizes), beside `configs.model_config.PRESETS`."""
    out: dict[str, ModelConfig] = {}
    for name in FAMILY_MODULES:
        out.update(getattr(family_module(name), "PRESETS", {}))
    return out


def default_chat_template(gguf_architecture: str | None) -> str | None:
    """The family's chat template for a checkpoint that ships none (None: the family has
    no default; chat requests are then refused by the tokenizer)."""
    family = GGUF_ARCHITECTURES.get(gguf_architecture or "")
    if family is None:
        return None
    return getattr(family_module(family), "CHAT_TEMPLATE", None)


def family_stop_tokens(gguf_architecture: str | None) -> tuple[str, ...]:
    """Tokens that end a generation besides the file's EOS (Gemma: <end_of_turn>)."""
    family = GGUF_ARCHITECTURES.get(gguf_architecture or "")
    if family is None:
        return ()
    return getattr(family_module(family), "STOP_TOKENS", ())
