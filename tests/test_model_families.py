"""Each model family against Hugging Face `transformers` (torch, CPU, float32, eager
attention) on tiny random checkpoints made with transformers' own config classes and saved
as safetensors: next-token logits within 1e-4 over a prompt longer than the sliding window
(both of Gemma 3's layer kinds), and 24 greedy tokens identical through the paged engine
(chunked prefill, a batch of mixed lengths) and transformers' `generate`."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from engine import LLM, SamplingParams
from models.dense_generate import DenseKVCache, dense_attention
from models.families import forward
from models.llama import layer_layout

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
WINDOW = 16  # Gemma 3's local window: shorter than the prompts


def _qwen3():
    cfg = transformers.Qwen3Config(
        **COMMON, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True, rope_theta=1e4
    )
    return transformers.Qwen3ForCausalLM(cfg)


def _phi3():
    # Phi-4-mini's shape of RoPE: LongRoPE factors and partial rotary (rd = 12 of hd = 16).
    common = {**COMMON, "max_position_embeddings": 4096}
    cfg = transformers.Phi3Config(
        **common,
        num_hidden_layers=2,
        original_max_position_embeddings=1024,
        partial_rotary_factor=0.75,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.5],
            "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
        },
        tie_word_embeddings=False,
    )
    return transformers.Phi3ForCausalLM(cfg)


def _gemma3():
    cfg = transformers.Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=4,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        },
        final_logit_softcapping=5.0,
    )
    return transformers.Gemma3ForCausalLM(cfg)


FAMILIES = {"qwen3": _qwen3, "phi3": _phi3, "gemma3": _gemma3}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(family, HF model, folder) with random weights (std 0.2: peaked logits, no ties)."""
    from models.registry import tiny_tokenizer

    torch.manual_seed(0)
    model = FAMILIES[request.param]()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.config._attn_implementation = "eager"
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer().backend.save(str(folder / "tokenizer.json"))
    return request.param, model.eval(), str(folder)


def _all_logits(params, cfg, ids):
    positions = jnp.arange(len(ids), dtype=jnp.int32)
    cache = DenseKVCache.zeros(cfg, len(ids), params.embed.dtype)
    attention = dense_attention(cfg, positions)
    logits, _ = forward(params, cfg, jnp.array(ids, jnp.int32), positions, cache, attention)
    return np.asarray(logits)


@pytest.mark.slow  # transformers and torch (as tests/test_model_parity.py)
@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_logits_match_transformers(checkpoint, layer_loop):
    from models.loaders.hf_loader import load_hf_dir

    family, ref_model, folder = checkpoint
    cfg, params, _ = load_hf_dir(folder)
    assert type(cfg).family == family
    ids = np.random.default_rng(0).integers(3, VOCAB, 3 * WINDOW + 5).tolist()
    ours = _all_logits(layer_layout(params, layer_loop), cfg, ids)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.compile
def test_engine_greedy_matches_transformers(checkpoint):
    """24 greedy tokens per prompt through the engine (pages of 8, prefill chunks of 16,
    mixed lengths batched together) equal transformers' generate."""
    family, ref_model, folder = checkpoint
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 3 * WINDOW + 3, 21, 40)]
    llm = LLM(
        folder,
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        prefill_chunk_size=16,
        max_model_len=128,
        num_pages=64,
    )
    assert type(llm.model.config).family == family
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            x = torch.tensor([prompt])
            ref = ref_model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out.token_ids == ref, (family, len(prompt))


def test_hf_config_dialects_agree(tmp_path):
    """Gemma 3's old names (rope_theta, rope_local_base_freq, sliding_window_pattern) and
    transformers 5's (rope_parameters per layer type, layer_types) give one config; a base
    present under both names with different values is refused."""
    import json

    from models.errors import ModelLoadError
    from models.loaders.hf_loader import config_from_hf

    base = dict(
        architectures=["Gemma3ForCausalLM"],
        num_hidden_layers=12,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        vocab_size=VOCAB,
        sliding_window=512,
        query_pre_attn_scalar=32,
        hidden_activation="gelu_pytorch_tanh",
    )
    old = dict(
        base,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=6,
    )
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    new = dict(
        base,
        layer_types=kinds * 2,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    )
    cfgs = []
    for i, c in enumerate((old, new)):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c))
        cfgs.append(config_from_hf(str(d), "g"))
    assert cfgs[0] == cfgs[1]
    assert cfgs[0].rope_local_theta == 1e4 and cfgs[0].rope_theta == 1e6
    assert cfgs[0].layer_types == tuple(kinds * 2)
    assert math.isclose(cfgs[0].rope_scaling.factor, 8.0)
    clash = dict(new, rope_theta=1e5)
    (tmp_path / "config.json").write_text(json.dumps(clash))
    with pytest.raises(ModelLoadError, match="rope_theta is 100000.0 under the old names"):
        config_from_hf(str(tmp_path))


def test_unknown_architecture_is_refused_by_name(tmp_path):
    import json

    from models.errors import ModelLoadError
    from models.loaders.hf_loader import config_from_hf

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match=r"MambaForCausalLM.*Qwen3ForCausalLM"):
        config_from_hf(str(tmp_path))


@pytest.mark.slow
def test_int8_weights_and_lora_run_every_family(checkpoint):
    """int8 weights (models/quant.py) stay close to float, and a LoRA slot (the decoder's
    `proj` adds it) equals the same adapter merged into the weights, for every family."""
    import dataclasses

    import jax

    from configs.quant_config import QuantConfig
    from models.lora import LoraInputs, LoraWeights, target_shapes
    from models.quant import quantize_params

    _, _, folder = checkpoint
    from models.loaders.hf_loader import load_hf_dir

    cfg, params, _ = load_hf_dir(folder)
    ids = np.random.default_rng(2).integers(3, VOCAB, 2 * WINDOW).tolist()
    ref = _all_logits(params, cfg, ids)
    q8 = _all_logits(quantize_params(params, QuantConfig("int8")), cfg, ids)
    assert np.abs(q8 - ref).max() < 0.03 * np.abs(ref).max()
    assert (q8.argmax(-1) == ref.argmax(-1)).mean() > 0.9

    L, R = cfg.num_layers, 2
    keys = iter(jax.random.split(jax.random.key(3), 32))
    a, b, merged = {}, {}, {}
    for field, (in_shape, out_shape) in target_shapes(cfg).items():
        a[field] = 0.3 * jax.random.normal(next(keys), (L, *in_shape, 1, R))
        b[field] = 0.3 * jax.random.normal(next(keys), (L, 1, R, *out_shape))
        delta = jnp.einsum(
            "l...r,lrz->l...z", a[field][..., 0, :], b[field][:, 0].reshape(L, R, -1)
        )
        w = getattr(params.layers, field)
        merged[field] = w + delta.reshape(w.shape)
    lora = LoraInputs(LoraWeights(a, b), jnp.ones(len(ids), jnp.int32))
    positions = jnp.arange(len(ids), dtype=jnp.int32)
    cache = DenseKVCache.zeros(cfg, len(ids), params.embed.dtype)
    with_lora, _ = forward(
        params,
        cfg,
        jnp.array(ids, jnp.int32),
        positions,
        cache,
        dense_attention(cfg, positions),
        lora=lora,
    )
    merged_params = dataclasses.replace(params, layers=dataclasses.replace(params.layers, **merged))
    np.testing.assert_allclose(
        np.asarray(with_lora), _all_logits(merged_params, cfg, ids), atol=2e-3, rtol=2e-3
    )
