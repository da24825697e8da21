"""GGUF checkpoints (llama.cpp's format), read with the `gguf` package.

Metadata becomes a `ModelConfig`; tensors are dequantized to float32 by `gguf.quants`
(Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, F16, F32 and every other type that package knows), renamed to
the Hugging Face names, and llama.cpp's Q/K row permutation (its converter interleaves the
two RoPE halves of each head) is undone, so the model uses the `rotate_half` RoPE.
"""

from __future__ import annotations

import os
import re

import jax.numpy as jnp
import numpy as np

from configs.model_config import ModelConfig, RopeScaling
from models.errors import ModelLoadError
from models.llama import Params
from models.loaders.convert import params_from_hf_tensors

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
_PERMUTED_ARCHITECTURES = ("llama", "mistral")  # qwen2's converter does not permute Q/K

_NAME_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: str):
    """Opens a GGUF file; a missing or truncated file raises ModelLoadError naming it."""
    import gguf

    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path!r} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/IndexError/... on bad bytes
        raise ModelLoadError(
            f"GGUF file {path!r}: not a readable GGUF file, truncated or corrupt "
            f"({type(e).__name__}: {e})"
        ) from e


def field(reader, key: str, default=None, *, path: str = "", required: bool = False):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ModelLoadError(f"GGUF file {path!r}: metadata key {key!r} is missing")
        return default
    return f.contents()


def config_from_gguf(reader, path: str, name: str | None = None) -> ModelConfig:
    arch = field(reader, "general.architecture", path=path, required=True)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {path!r}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    g = lambda key, default=None, required=True: field(  # noqa: E731
        reader, f"{arch}.{key}", default, path=path, required=required
    )
    num_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    vocab = g("vocab_size", None, required=False)
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = None
    if g("rope.scaling.type", None, required=False) == "linear":
        scaling = RopeScaling("linear", float(g("rope.scaling.factor")))
    tensor_names = {t.name for t in reader.tensors}
    eos = field(reader, "tokenizer.ggml.eos_token_id", 2)
    return ModelConfig(
        name=name or os.path.splitext(os.path.basename(path))[0],
        num_layers=int(g("block_count")),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(g("attention.head_count_kv", num_heads, required=False)),
        head_dim=int(g("attention.key_length", hidden // num_heads, required=False)),
        ffn_size=int(g("feed_forward_length")),
        vocab_size=int(vocab),
        max_seq_len=int(g("context_length", 4096, required=False)),
        rope_theta=float(g("rope.freq_base", 10000.0, required=False)),
        rope_scaling=scaling,
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5, required=False)),
        tie_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=(int(eos),),
    )


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows [n_heads, hd/2, 2] -> [n_heads, 2, hd/2]."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(
    path: str, dtype=jnp.float32, name: str | None = None, reader=None
) -> tuple[ModelConfig, Params, object]:
    """Returns (config, params, reader). Pass an open `reader` to avoid parsing twice."""
    import gguf.quants

    reader = reader or open_gguf(path)
    cfg = config_from_gguf(reader, path, name)
    arch = field(reader, "general.architecture")
    by_hf_name = {}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        hf = (
            f"model.layers.{m.group(1)}.{_NAME_MAP.get(m.group(2), m.group(2))}"
            if m
            else _TOP_LEVEL.get(t.name, t.name)
        )
        by_hf_name[hf] = t

    def get(hf_name: str) -> np.ndarray:
        t = by_hf_name[hf_name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(
                f"GGUF file {path!r}: tensor {t.name!r} of type {t.tensor_type.name} "
                f"could not be dequantized: {e}"
            ) from e
        w = np.asarray(w, np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))
        if arch in _PERMUTED_ARCHITECTURES:
            if hf_name.endswith("q_proj.weight"):
                w = _unpermute(w, cfg.num_heads)
            elif hf_name.endswith("k_proj.weight"):
                w = _unpermute(w, cfg.num_kv_heads)
        return w

    params = params_from_hf_tensors(get, cfg, f"GGUF file {path!r}", dtype)
    return cfg, params, reader
