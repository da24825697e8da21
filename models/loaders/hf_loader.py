"""Hugging Face checkpoint directories: config.json + single or sharded *.safetensors."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp

from configs.model_config import ModelConfig
from models.errors import ModelLoadError
from models.families import HF_ARCHITECTURES, family_for_hf, family_module
from models.llama import Params
from models.loaders.convert import params_from_hf_tensors

SUPPORTED_ARCHITECTURES = tuple(HF_ARCHITECTURES)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path!r} does not exist")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path!r} is not valid JSON: {e}") from e


def config_from_hf(directory: str, name: str | None = None) -> ModelConfig:
    """config.json -> the config of its family (models/families.py); an unknown
    architecture fails here, before any weight is read."""
    path = os.path.join(directory, "config.json")
    c = _read_json(path)
    family = family_module(family_for_hf(c.get("architectures") or [], path))
    return family.config_from_hf(c, path, directory, name)


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
