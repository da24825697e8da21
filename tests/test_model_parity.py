"""Logit parity with Hugging Face `transformers` (torch, CPU, float32): the independent
reference. SmolLM2 from the same GGUF, and tiny random Llama / Qwen2 configs saved as
safetensors and loaded through our Hugging Face loader."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import from_name
from models.dense_generate import DenseKVCache, dense_attention, generate_dense
from models.llama import forward, layer_layout
from tests.conftest import FULL_SIZES_ONLY

pytestmark = pytest.mark.slow  # transformers and torch, every test

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a dragon who",
    "Translate to German: I like apples. ->",
]
# float32 on both sides; differences come from summation order only.
SMOLLM2_MAX_ABS_LOGIT_DIFF = 2e-3


@functools.partial(jax.jit, static_argnames=("cfg",))
def all_logits(params, cfg, token_ids):
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    cache = DenseKVCache.zeros(cfg, token_ids.shape[0], params.embed.dtype)
    logits, _ = forward(params, cfg, token_ids, positions, cache, dense_attention(cfg, positions))
    return logits


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    folder, name = os.path.split(smollm2.source)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    return model.eval()


LAYER_LOOPS = pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])


@pytest.mark.slow
@LAYER_LOOPS
def test_smollm2_logits_match_transformers(smollm2, hf_smollm2, layer_loop):
    params = layer_layout(smollm2.params, layer_loop)
    worst = 0.0
    encoded = [smollm2.tokenizer.encode(prompt) for prompt in PROMPTS]
    # One program for every prompt: each is padded to the longest; attention is causal, so
    # the tokens after a prompt do not change its positions' logits.
    width = max(len(ids) for ids in encoded)
    for ids in encoded:
        padded = jnp.array(ids + [0] * (width - len(ids)), jnp.int32)
        ours = np.asarray(all_logits(params, smollm2.config, padded))[: len(ids)]
        with torch.no_grad():
            ref = hf_smollm2(torch.tensor([ids])).logits[0].numpy()
        assert ours.shape == ref.shape
        worst = max(worst, float(np.abs(ours - ref).max()))
    print(f"SmolLM2 max abs logit diff vs transformers: {worst:.2e}")
    assert worst < SMOLLM2_MAX_ABS_LOGIT_DIFF


@pytest.mark.slow  # logits above check both layouts; 32 greedy tokens: scan in full sizes
@pytest.mark.parametrize("layer_loop", ["unrolled", pytest.param("scan", marks=FULL_SIZES_ONLY)])
def test_smollm2_greedy_32_tokens_match_transformers(smollm2, hf_smollm2, layer_loop):
    params = layer_layout(smollm2.params, layer_loop)
    tok = smollm2.tokenizer
    for prompt in PROMPTS[:2] + ["What is the capital of France?"]:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}])
        ids = tok.encode(text, add_special_tokens=False)
        ours = generate_dense(params, smollm2.config, ids, 32)["token_ids"]
        with torch.no_grad():
            # An explicit attention mask: the chat prompt contains <|im_end|>, which is also
            # the pad id, and transformers would otherwise mask those tokens out.
            x = torch.tensor([ids])
            ref = hf_smollm2.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )[0, len(ids) :].tolist()
        assert ours == ref, (prompt, tok.decode(ours), tok.decode(ref))


# `make test` keeps "Paris" on SmolLM2 through the paged engine, whose tokens equal this dense
# loop's (tests/test_engine.py), and the greedy tokens above against transformers.
@FULL_SIZES_ONLY
def test_dense_generate_answers_paris(smollm2):
    tok = smollm2.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = generate_dense(
        smollm2.params,
        smollm2.config,
        tok.encode(text, add_special_tokens=False),
        32,
        eos_token_ids=tok.eos_token_ids,
    )
    assert "Paris" in tok.decode(out["token_ids"])
    assert out["finish_reason"] == "stop"


def _tiny_hf_checkpoint(tmp_path, qwen: bool):
    cfg = dataclasses.replace(from_name("tiny"), attention_bias=qwen, tie_embeddings=qwen)
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    if qwen:
        hf_cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.LlamaConfig(**common, attention_bias=False)
        model = transformers.LlamaForCausalLM(hf_cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model.eval()


@LAYER_LOOPS
@pytest.mark.parametrize("qwen", [False, True], ids=["llama", "qwen2-bias-tied"])
def test_tiny_random_checkpoint_matches_transformers(tmp_path, qwen, layer_loop):
    from models.loaders.hf_loader import load_hf_dir

    ref_model = _tiny_hf_checkpoint(tmp_path, qwen)
    cfg, params, files = load_hf_dir(str(tmp_path))
    params = layer_layout(params, layer_loop)
    assert cfg.attention_bias == qwen and cfg.num_kv_heads == 2 and cfg.num_heads == 4
    ids = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 40))
    ours = np.asarray(all_logits(params, cfg, jnp.array(ids, jnp.int32)))
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
