"""Hugging Face checkpoint directories: config.json + single or sharded *.safetensors."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp

from configs.model_config import ModelConfig, RopeScaling
from models.errors import ModelLoadError
from models.llama import Params
from models.loaders.convert import params_from_hf_tensors

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path!r} does not exist")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path!r} is not valid JSON: {e}") from e


def config_from_hf(directory: str, name: str | None = None) -> ModelConfig:
    path = os.path.join(directory, "config.json")
    c = _read_json(path)
    archs = c.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelLoadError(
            f"{path!r}: architectures {archs} not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
    ):
        if key not in c:
            raise ModelLoadError(f"{path!r}: key {key!r} is missing")
    rs = c.get("rope_scaling") or c.get("rope_parameters")
    scaling = None
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        scaling = RopeScaling(
            "llama3",
            float(rs["factor"]),
            float(rs["low_freq_factor"]),
            float(rs["high_freq_factor"]),
            int(rs["original_max_position_embeddings"]),
        )
    elif rs and rs.get("rope_type", rs.get("type")) == "linear":
        scaling = RopeScaling("linear", float(rs["factor"]))
    theta = c.get("rope_theta") or (rs or {}).get("rope_theta") or 10000.0
    eos = c.get("eos_token_id", 2)
    is_qwen = "Qwen2ForCausalLM" in archs
    heads = c["num_attention_heads"]
    return ModelConfig(
        name=name or os.path.basename(os.path.normpath(directory)),
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        ffn_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        max_seq_len=c.get("max_position_embeddings", 4096),
        rope_theta=float(theta),
        rope_scaling=scaling,
        norm_eps=c.get("rms_norm_eps", 1e-5),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=bool(c.get("attention_bias", is_qwen)),
        sliding_window=c.get("sliding_window")
        if c.get("use_sliding_window", not is_qwen)
        else None,
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
    )


def safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{directory!r}: no *.safetensors files")
    paths = [os.path.join(directory, f) for f in files]
    for p in paths:
        if not os.path.isfile(p):
            raise ModelLoadError(f"{p!r} is listed in the index but does not exist")
    return paths


def load_hf_dir(
    directory: str, dtype=jnp.float32, name: str | None = None, quant=None
) -> tuple[ModelConfig, Params, list[str]]:
    """Returns (config, params, weight file paths). An int8 `quant` (configs.quant_config)
    quantizes each projection from its float tensor as it is read."""
    from safetensors import safe_open

    cfg = config_from_hf(directory, name)
    paths = safetensors_files(directory)
    handles, where = [], {}
    for p in paths:
        try:
            h = safe_open(p, framework="numpy")
        except Exception as e:
            raise ModelLoadError(f"{p!r} is truncated or not a safetensors file: {e}") from e
        handles.append(h)
        for key in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            where[key] = h

    def get(hf_name: str):
        if hf_name not in where:
            raise KeyError(hf_name)
        return where[hf_name].get_tensor(hf_name)

    params = params_from_hf_tensors(get, cfg, f"checkpoint {directory!r}", dtype, quant=quant)
    return cfg, params, paths
