"""Reading a Hugging Face `config.json` dict: the fields every family shares, and RoPE in both
dialects.

Published Hub checkpoints write RoPE as `rope_theta` + `rope_scaling` (Gemma 3 adds
`rope_local_base_freq`, `sliding_window_pattern`); configs written by transformers 5 put it
under `rope_parameters` (per layer type for Gemma 3, beside `layer_types`). `rope_settings`
reads either; a field present under both names with different values is an error (a wrong
RoPE base still produces fluent-looking text), and a field under neither name is an error
unless the family passes its documented default.
"""

from __future__ import annotations

import os
from typing import Any

from configs.model_config import RopeScaling
from models.errors import ModelLoadError

REQUIRED = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


def require(c: dict, path: str, *keys: str) -> None:
    for key in keys:
        if key not in c:
            raise ModelLoadError(f"{path!r}: key {key!r} is missing")


def rope_settings(
    c: dict, path: str, layer_type: str | None = None, *, old_theta_key: str = "rope_theta"
) -> dict[str, Any]:
    """The RoPE dict ({"rope_theta", "rope_type", ...}) for `layer_type` (None: the model's
    one RoPE), merged from `rope_parameters` and the old `old_theta_key` / `rope_scaling`."""
    new = c.get("rope_parameters")
    if isinstance(new, dict) and layer_type is not None and layer_type in new:
        new = new[layer_type]
    elif isinstance(new, dict) and any(isinstance(v, dict) for v in new.values()):
        raise ModelLoadError(
            f"{path!r}: rope_parameters has per-layer-type entries {sorted(new)} but no "
            f"{layer_type!r} entry"
        )
    new = dict(new or {})
    old = dict(c.get("rope_scaling") or {}) if layer_type != "sliding_attention" else {}
    if old_theta_key in c and c[old_theta_key] is not None:
        old["rope_theta"] = c[old_theta_key]
    if "type" in old and "rope_type" not in old:
        old["rope_type"] = old["type"]
    if "type" in new and "rope_type" not in new:
        new["rope_type"] = new["type"]
    merged = dict(old)
    for key, value in new.items():
        if key in old and old[key] != value and key not in ("type",):
            raise ModelLoadError(
                f"{path!r}: RoPE {key} is {old[key]!r} under the old names but {value!r} "
                f"under rope_parameters" + (f"[{layer_type!r}]" if layer_type else "")
            )
        merged[key] = value
    merged.setdefault("rope_type", "default")
    return merged


def rope_theta(rope: dict, path: str, default: float | None, what: str = "rope_theta") -> float:
    """The base; `default` only when neither dialect has it (None: required)."""
    if rope.get("rope_theta") is not None:
        return float(rope["rope_theta"])
    if default is None:
        raise ModelLoadError(
            f"{path!r}: {what} is missing (neither rope_theta nor rope_parameters)"
        )
    return float(default)


def rope_scaling(
    rope: dict, path: str, allowed=("default", "llama3", "linear")
) -> RopeScaling | None:
    """The `RopeScaling` of a RoPE dict ("default": None); other kinds are refused by name."""
    kind = rope["rope_type"]
    if kind not in allowed:
        raise ModelLoadError(
            f"{path!r}: rope_type {kind!r} is not supported for this family "
            f"(supported: {', '.join(allowed)})"
        )
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    if kind == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    return None


def common_fields(c: dict, path: str, directory: str, name: str | None) -> dict[str, Any]:
    """ModelConfig fields every family reads the same way (no RoPE, no bias, no window)."""
    require(c, path, *REQUIRED)
    heads = c["num_attention_heads"]
    eos = c.get("eos_token_id", 2)
    return dict(
        name=name or os.path.basename(os.path.normpath(directory)),
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        ffn_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        max_seq_len=c.get("max_position_embeddings", 4096),
        norm_eps=c.get("rms_norm_eps", 1e-5),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
    )


def check_activation(c: dict, path: str, key: str, allowed: tuple[str, ...]) -> str:
    act = c.get(key)
    if act is None:
        raise ModelLoadError(f"{path!r}: key {key!r} is missing")
    if act not in allowed:
        raise ModelLoadError(f"{path!r}: {key}={act!r} is not supported (supported: {allowed})")
    return act
