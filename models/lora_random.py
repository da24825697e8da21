"""Random LoRA adapters in PEFT's file format, written with numpy (tests and benchmarks).

The files are what `peft.PeftModel.save_pretrained` writes for a Llama model: the
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight` tensors
(A [r, in], B [out, r], PyTorch layout) and an adapter_config.json with the LoraConfig fields
models/lora.py reads; tests/test_lora_peft.py checks real peft output loads the same way.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from configs.model_config import ModelConfig
from models.lora import LORA_TARGETS, target_shapes

ALL_TARGETS = tuple(LORA_TARGETS)


def write_peft_adapter(
    path,
    cfg: ModelConfig,
    *,
    targets=ALL_TARGETS,
    r: int = 4,
    alpha: float = 8,
    rslora: bool = False,
    seed: int = 0,
    scale: float = 0.1,
    **config,
) -> str:
    """A PEFT LoRA directory at `path` with random non-zero A and B (normal, std `scale`)
    for a model of `cfg`; `config` entries override adapter_config.json fields."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for module in targets:
        field = LORA_TARGETS[module][0]
        n_in, n_out = (math.prod(s) for s in target_shapes(cfg)[field])
        part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        for layer in range(cfg.num_layers):
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[key + ".lora_A.weight"] = rng.normal(0, scale, (r, n_in)).astype(np.float32)
            tensors[key + ".lora_B.weight"] = rng.normal(0, scale, (n_out, r)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    peft_config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "target_modules": list(targets),
        "bias": "none",
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        **config,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(peft_config, f)
    return str(path)
