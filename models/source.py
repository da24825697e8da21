"""What `--model` / `LLM(model)` names, checked without loading anything (no JAX import), so a
wrong path or a file of the wrong type fails in milliseconds with one line a person can act
on, before a model load that takes seconds.

    check_model_source("smollm2-135m")        -> "preset"
    check_model_source("/x/model.gguf")       -> "gguf"   (first 4 bytes are b"GGUF")
    check_model_source("/x/hf_dir")           -> "hf_dir" (holds config.json)
    anything else                             -> ModelLoadError naming value and what is allowed
"""

from __future__ import annotations

import os

from models.errors import ModelLoadError

PRESETS_WITH_WEIGHTS = ("smollm2-135m", "gemma3-270m", "tiny")
GGUF_MAGIC = b"GGUF"
ALLOWED = f"a preset ({', '.join(PRESETS_WITH_WEIGHTS)}), a .gguf file or a Hugging Face directory"


def check_model_source(name_or_path: str) -> str:
    """The kind of model source ("preset", "gguf", "hf_dir"); raises ModelLoadError."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ModelLoadError(f"model={name_or_path!r}: expected {ALLOWED}")
    if name_or_path in PRESETS_WITH_WEIGHTS:
        return "preset"
    path = name_or_path
    if not os.path.exists(path):
        raise ModelLoadError(f"model={path!r}: no such file or directory (expected {ALLOWED})")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(
                f"model={path!r}: directory has no config.json (expected a Hugging Face "
                "model directory with config.json and *.safetensors)"
            )
        return "hf_dir"
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise ModelLoadError(f"model={path!r}: cannot be read ({e.strerror})") from None
    if not head.startswith(GGUF_MAGIC):
        raise ModelLoadError(
            f"model={path!r}: not a GGUF file (starts with {head[:8]!r}, a GGUF file starts "
            f"with {GGUF_MAGIC!r}); expected {ALLOWED}"
        )
    return "gguf"
