"""Frozen, hashable configuration: model architectures (presets) and KV memory arithmetic."""

from configs.kv_memory import kv_bytes_per_sequence, kv_bytes_per_token
from configs.model_config import PRESETS, ModelConfig, RopeScaling, from_name

__all__ = [
    "PRESETS",
    "ModelConfig",
    "RopeScaling",
    "from_name",
    "kv_bytes_per_token",
    "kv_bytes_per_sequence",
]
