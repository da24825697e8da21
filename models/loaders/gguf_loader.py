"""GGUF checkpoints (llama.cpp's format), read with the `gguf` package.

Metadata becomes a `ModelConfig`; tensors are dequantized to float32 by `gguf.quants`
(Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, F16, F32 and every other type that package knows), renamed to
the Hugging Face names, and llama.cpp's Q/K row permutation (its converter interleaves the
two RoPE halves of each head) is undone, so the model uses the `rotate_half` RoPE.

Quantized loading (`quant=QuantConfig("int8")`): see `load_gguf` and `q8_0_to_per_channel`.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter

import jax.numpy as jnp
import numpy as np

from configs.model_config import ModelConfig, RopeScaling
from configs.quant_config import QuantConfig
from models.errors import ModelLoadError
from models.families import GGUF_ARCHITECTURES, family_for_gguf, family_of
from models.llama import Params
from models.loaders.convert import params_from_hf_tensors
from models.quant import INT8_MAX, quantize_rows_np

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)
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
    """GGUF metadata -> the config of its family; an unknown `general.architecture` fails
    here, before any tensor is read."""
    arch = field(reader, "general.architecture", path=path, required=True)
    family = family_for_gguf(arch, path)
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
    num_layers = int(g("block_count"))
    head_dim = int(g("attention.key_length", hidden // num_heads, required=False))
    common = dict(
        name=name or os.path.splitext(os.path.basename(path))[0],
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(g("attention.head_count_kv", num_heads, required=False)),
        head_dim=head_dim,
        ffn_size=int(g("feed_forward_length")),
        vocab_size=int(vocab),
        max_seq_len=int(g("context_length", 4096, required=False)),
        rope_scaling=scaling,
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5, required=False)),
        tie_embeddings="output.weight" not in tensor_names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=(int(eos),),
    )
    if family == "gemma3":
        from models.gemma3 import GLOBAL, LOCAL, Gemma3Config

        # llama.cpp's gemma3 graph fixes what the GGUF does not store: every 6th layer
        # global, local RoPE base 10000, query scale 1/sqrt(head_dim) (all sizes but 27B).
        return Gemma3Config(
            **common,
            rope_theta=float(g("rope.freq_base", required=True)),
            sliding_window=int(g("attention.sliding_window")),
            layer_types=tuple(LOCAL if (i + 1) % 6 else GLOBAL for i in range(num_layers)),
            rope_local_theta=float(g("rope.freq_base_swa", 10000.0, required=False)),
            query_pre_attn_scalar=float(head_dim),
            final_logit_softcap=g("final_logit_softcapping", None, required=False),
        )
    if family == "qwen3":
        from models.qwen3 import Qwen3Config

        return Qwen3Config(**common, rope_theta=float(g("rope.freq_base", required=True)))
    experts = g("expert_count", None, required=False)
    if family == "qwen3_moe" or experts:
        return _moe_config(family, common, g, tensor_names, path)
    return ModelConfig(
        **common,
        rope_theta=float(g("rope.freq_base", 10000.0, required=False)),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
    )


def _moe_config(family: str, common: dict, g, tensor_names: set, path: str) -> ModelConfig:
    """Qwen3-MoE ("qwen3moe") or Mixtral (a "llama" GGUF with expert_count): every layer
    sparse (llama.cpp's graphs for both). Experts must be stacked (`ffn_gate_exps`); the
    old per-expert layout (`ffn_gate.0.weight`, ...) is refused by name."""
    if "blk.0.ffn_gate_exps.weight" not in tensor_names:
        raise ModelLoadError(
            f"GGUF file {path!r}: expert tensors are not stacked (no blk.0.ffn_gate_exps); "
            f"the per-expert layout of older Mixtral files is not supported"
        )
    moe = dict(
        num_experts=int(g("expert_count")),
        num_experts_per_tok=int(g("expert_used_count")),
    )
    if family == "qwen3_moe":
        from models.qwen3_moe import Qwen3MoeConfig

        # llama.cpp normalises Qwen3-MoE's top-k weights unless the file says otherwise
        return Qwen3MoeConfig(
            **common,
            **moe,
            moe_ffn_size=int(g("expert_feed_forward_length")),
            norm_topk_prob=bool(g("expert_weights_norm", True, required=False)),
            rope_theta=float(g("rope.freq_base", required=True)),
        )
    from models.mixtral import MixtralConfig

    return MixtralConfig(
        **common, **moe, rope_theta=float(g("rope.freq_base", 1e6, required=False))
    )


def unpermute_heads(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows [n_heads, hd/2, 2] -> [n_heads, 2, hd/2]."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


Q8_0_BLOCK = 32  # weights per Q8_0 block: one float16 scale d, then 32 int8 values
Q8_0_BLOCK_BYTES = 2 + Q8_0_BLOCK


def q8_0_to_per_channel(data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's raw blocks -> (q [rows, cols] int8, scale [rows] float32), one scale
    per row (output channel) instead of one per 32-block.

    Q8_0 stores w = d_b * q (q int8, d_b float16 per 32 weights). One row's blocks have
    different d_b, so a per-channel form needs re-quantization: s = max_b |d_b| * max|q| / 127
    over the row, q' = round(q * d_b / s). The block(s) that set s keep their int8 values
    exactly; every other value moves by at most s/2 (the rounding of a per-channel grid, the
    same bound as quantizing the float weight directly). The float tensor from
    `gguf.quants.dequantize` is never built; the rescale works on one tensor at a time."""
    blocks = np.ascontiguousarray(data, np.uint8).reshape(rows, cols // Q8_0_BLOCK, -1)
    if blocks.shape[-1] != Q8_0_BLOCK_BYTES:
        raise ValueError(f"Q8_0 block of {blocks.shape[-1]} bytes, expected {Q8_0_BLOCK_BYTES}")
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # [rows, nb, 1]
    qs = blocks[..., 2:].copy().view(np.int8)  # [rows, nb, 32]
    amax = (np.abs(d[..., 0]) * np.abs(qs).max(axis=-1)).max(axis=-1)  # [rows]
    scale = np.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
    q = np.rint(qs * (d / scale[:, None, None]))  # [rows, nb, 32], |q| <= 127 by construction
    return np.clip(q, -INT8_MAX, INT8_MAX).astype(np.int8).reshape(rows, cols), scale


def load_gguf(
    path: str,
    dtype=jnp.float32,
    name: str | None = None,
    reader=None,
    quant: QuantConfig | None = None,
) -> tuple[ModelConfig, Params, object]:
    """Returns (config, params, reader). Pass an open `reader` to avoid parsing twice.

    With an int8 `quant`: Q8_0 tensors go straight to per-channel int8
    (`q8_0_to_per_channel`); every other type is dequantized and re-quantized per row; F32
    and F16 are quantized from their values. The log line says how many tensors took which
    path, by source type."""
    import gguf.quants

    reader = reader or open_gguf(path)
    cfg = config_from_gguf(reader, path, name)
    arch = field(reader, "general.architecture")
    family = family_of(cfg)
    name_map = {**_NAME_MAP, **getattr(family, "GGUF_NAMES", {})}
    norms_plus_one = getattr(family, "GGUF_NORMS_PLUS_ONE", False)
    by_hf_name = {}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        hf = (
            f"model.layers.{m.group(1)}.{name_map.get(m.group(2), m.group(2))}"
            if m
            else _TOP_LEVEL.get(t.name, t.name)
        )
        by_hf_name[hf] = t

    def unpermute(hf_name: str, w: np.ndarray) -> np.ndarray:
        if arch in _PERMUTED_ARCHITECTURES:
            if hf_name.endswith("q_proj.weight"):
                return unpermute_heads(w, cfg.num_heads)
            if hf_name.endswith("k_proj.weight"):
                return unpermute_heads(w, cfg.num_kv_heads)
        return w

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
        if norms_plus_one and hf_name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp's converter stores Gemma's (1 + w) norms as 1 + w
        return unpermute(hf_name, w)

    paths: Counter = Counter()

    def get_int8(hf_name: str) -> tuple[np.ndarray, np.ndarray]:
        t = by_hf_name[hf_name]
        rows, cols = tuple(reversed([int(d) for d in t.shape]))
        if t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
            paths[f"{t.tensor_type.name} -> dequantized -> int8"] += 1
            return quantize_rows_np(get(hf_name))  # get() has undone the Q/K permutation
        q, scale = q8_0_to_per_channel(t.data, rows, cols)
        paths["Q8_0 -> int8 direct (32-block scales -> per-channel)"] += 1
        # A row permutation commutes with per-row quantization: permute q and scale alike.
        return unpermute(hf_name, q), unpermute(hf_name, scale)

    params = params_from_hf_tensors(
        get, cfg, f"GGUF file {path!r}", dtype, quant=quant, get_int8=get_int8
    )
    if paths:
        log.info(
            "%s: %s int8 weights: %s",
            path,
            quant.descriptor,
            ", ".join(f"{n} tensors {k}" for k, n in sorted(paths.items())),
        )
    return cfg, params, reader


def tensor_types(reader) -> dict[str, int]:
    """How many tensors of each GGUF type the file holds (the report's artifact section)."""
    return dict(Counter(t.tensor_type.name for t in reader.tensors))
