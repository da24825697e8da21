"""int8 weights (models/quant.py, pallas_kernels/int8_matmul*.py): the kernels against their
reference (interpret mode, odd shapes), quantization error bounds, the model and the engine
with int8 params, identities and revisions, loader paths (float, Q8_0 direct, Orbax cache)
and the errors for bad options."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.engine_config import EngineConfig
from configs.quant_config import QuantConfig, QuantizationConfigError
from engine import LLM, SamplingParams
from models.dense_generate import generate_dense
from models.identity import quantized_revision
from models.llama import forward
from models.quant import (
    QUANTIZED_LAYER_WEIGHTS,
    Int8Weight,
    linear,
    quant_config_of,
    quantize_params,
    quantize_rows_np,
    quantize_weight,
)
from models.registry import load_model, quantized_model
from pallas_kernels.int8_matmul import int8_matmul

SHAPES = [(1, 64, 128), (3, 40, 24), (17, 576, 200), (65, 130, 257)]  # incl. odd, non-pow2


def _case(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    q = jnp.asarray(rng.integers(-127, 128, size=(k, n)), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-3, 1e-2, size=n), jnp.float32)
    return x, q, scale


def _dequantized_matmul(x, q, scale):
    return np.asarray(x, np.float64) @ (np.asarray(q, np.float64) * np.asarray(scale)[None, :])


# ---- kernels -------------------------------------------------------------------------------
@pytest.mark.interpret
@pytest.mark.parametrize("impl", ["gpu", "tpu"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_pallas_kernels_match_reference_in_interpret_mode(impl, m, k, n):
    x, q, scale = _case(m, k, n, seed=m + k + n)
    ref = int8_matmul(x, q, scale, impl="reference")
    out = int8_matmul(x, q, scale, impl=impl, interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ref, _dequantized_matmul(x, q, scale), rtol=1e-4, atol=1e-3)


def test_w8a8_error_is_bounded_by_activation_rounding():
    x, q, scale = _case(17, 576, 200, seed=3)
    exact = _dequantized_matmul(x, q, scale)
    out = np.asarray(int8_matmul(x, q, scale, impl="w8a8"))
    # Each activation moves by at most half its row step amax/127; the error of a dot is at
    # most that times the L1 norm of the dequantized weight column.
    step = np.abs(np.asarray(x)).max(axis=1, keepdims=True) / 127
    bound = 0.5 * step * np.abs(np.asarray(q, np.float64) * np.asarray(scale)).sum(axis=0)
    assert (np.abs(out - exact) <= bound + 1e-4).all()
    assert np.abs(out - exact).max() > 0  # really rounded (not a silent float path)


def test_int8_matmul_rejects_bad_inputs():
    x, q, scale = _case(2, 8, 4)
    with pytest.raises(ValueError, match="impl='int4'"):
        int8_matmul(x, q, scale, impl="int4")
    with pytest.raises(ValueError, match=r"q has shape \(8, 4\) dtype float32"):
        int8_matmul(x, q.astype(jnp.float32), scale)
    with pytest.raises(ValueError, match=r"scale has shape \(3,\)"):
        int8_matmul(x, q, scale[:3])


@pytest.mark.interpret
@pytest.mark.parametrize(
    "platform,impl,marker", [("cuda", "gpu", "triton"), ("tpu", "tpu", "tpu_custom_call")]
)
def test_kernels_lower_for_their_platform(platform, impl, marker):
    x, q, scale = _case(8, 576, 1536)
    f = jax.jit(lambda a, b, c: int8_matmul(a, b, c, impl=impl))
    text = f.trace(x, q, scale).lower(lowering_platforms=(platform,)).as_text()
    assert marker in text


# ---- quantizing --------------------------------------------------------------------------
def test_quantize_weight_error_within_half_a_step_per_channel():
    w = jax.random.normal(jax.random.key(0), (3, 40, 4, 8))  # [L, D, H, hd]
    qw = quantize_weight(w, 1)
    assert qw.q.dtype == jnp.int8 and qw.scale.shape == (3, 4, 8)
    err = jnp.abs(qw.dequantize() - w)
    assert bool((err <= qw.scale[:, None] / 2 + 1e-7).all())
    assert int(jnp.abs(qw.q).max()) == 127  # absmax maps to 127 in every channel
    q_np, s_np = quantize_rows_np(np.asarray(w[0].reshape(40, 32).T))
    np.testing.assert_array_equal(q_np.T.reshape(40, 4, 8), np.asarray(qw.q[0]))
    np.testing.assert_allclose(s_np.reshape(4, 8), qw.scale[0], rtol=1e-6)


def test_linear_matches_einsum_on_the_dequantized_weight():
    x = jax.random.normal(jax.random.key(1), (5, 4, 8))
    w = jax.random.normal(jax.random.key(2), (4, 8, 16))  # wo-like: two contracted axes
    qw = quantize_weight(w, 2, stacked=False)
    expected = jnp.einsum("TNH,NHD->TD", x, qw.dequantize(0))
    np.testing.assert_allclose(linear(x, qw, "TNH,NHD->TD"), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="linear spec"):
        linear(x, qw, "TNH,DNH->TD")


def test_int8_params_flow_through_jit_and_scan_and_stay_close(tiny_model):
    cfg, params = tiny_model.config, tiny_model.params
    qparams = quantize_params(params, QuantConfig("int8"))
    for name in QUANTIZED_LAYER_WEIGHTS:
        assert isinstance(getattr(qparams.layers, name), Int8Weight)
    assert qparams.embed is params.embed and qparams.lm_head is params.lm_head  # stay float
    assert quant_config_of(qparams) == QuantConfig("int8")
    ids = jnp.arange(3, 35, dtype=jnp.int32)

    def logits(p):
        from models.dense_generate import DenseKVCache, dense_attention

        cache = DenseKVCache.zeros(cfg, 64, jnp.float32)
        pos = ids - 3
        run = jax.jit(lambda p, c: forward(p, cfg, ids, pos, c, dense_attention(cfg, pos))[0])
        return run(p, cache)

    ref, out = logits(params), logits(qparams)
    p_ref, p_out = jax.nn.log_softmax(ref), jax.nn.log_softmax(out)
    kl = jnp.sum(jnp.exp(p_ref) * (p_ref - p_out), axis=-1)
    assert float(kl.mean()) < 0.02
    assert float((ref.argmax(-1) == out.argmax(-1)).mean()) >= 0.9
    assert float(jnp.abs(ref - out).max()) > 0  # really quantized


# ---- the engine ------------------------------------------------------------------------------
OPTS = {"num_pages": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 128}


@pytest.mark.compile
@pytest.mark.parametrize("scheme,kv_dtype", [("int8", "float32"), ("w8a8", "int8")])
def test_engine_greedy_equals_dense_loop_with_the_same_quantized_params(
    tiny_model, scheme, kv_dtype
):
    llm = LLM(tiny_model, quantization=scheme, kv_dtype=kv_dtype, **OPTS)
    params = llm.engine.runner.params
    layer0 = params.layers[0] if isinstance(params.layers, tuple) else params.layers  # unrolled?
    assert isinstance(layer0.w_up, Int8Weight)
    assert layer0.w_up.activations == ("int8" if scheme == "w8a8" else "float")
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    for p, o in zip(prompts, outs):
        if kv_dtype == "float32":  # the dense oracle keeps K/V in float
            assert o.token_ids == generate_dense(params, tiny_model.config, p, 10)["token_ids"]
        else:  # int8 KV: the paged engine only; it must still answer sensibly
            assert len(o.token_ids) == 10
    rev = llm.engine.identity.revision
    desc = "int8-w8a8-perchannel" if scheme == "w8a8" else "int8-w-perchannel"
    assert rev == f"{tiny_model.identity.revision};quantization={desc},kv={kv_dtype}"
    assert llm.engine.pool.model_keys[0] == rev  # prefix-cache keys change with it


def test_revisions_name_quantization_and_kv(tiny_model):
    base = tiny_model.identity.revision
    assert quantized_revision(base, "none", "float32") == base
    assert quantized_revision(base, "none", "int8") == f"{base};quantization=none,kv=int8"
    ident = tiny_model.identity.with_quantization("int8-w-perchannel", "int8")
    assert ident.revision == f"{base};quantization=int8-w-perchannel,kv=int8"
    assert ident.content_revision == base
    assert ident.with_quantization("none", "float32").revision == base
    q = quantized_model(tiny_model, "int8")
    assert q.identity.quantization == "int8-w-perchannel" and q.identity.revision != base
    assert quantized_model(q, QuantConfig("int8")) is q
    with pytest.raises(QuantizationConfigError, match="already 'int8-w-perchannel'"):
        quantized_model(q, "w8a8")


def test_bad_quantization_options_name_option_value_and_choices():
    with pytest.raises(QuantizationConfigError, match=r"quantization='int4'.*allowed.*'int8'"):
        EngineConfig(quantization="int4")
    with pytest.raises(QuantizationConfigError, match="quantize_lm_head=True needs"):
        EngineConfig(quantize_lm_head=True)
    with pytest.raises(ValueError, match=r"kv_dtype='int4'.*one of"):
        EngineConfig(kv_dtype="int4")
    with pytest.raises(QuantizationConfigError, match="quantization='fp8'"):
        load_model("tiny", quantization="fp8")
    from serving.server import build_engine

    opts = {"max_num_seqs": 2, "page_size": 16, "quantization": "int8"}
    with pytest.raises(ValueError, match="quantization='int8': the mock engine allows 'none'"):
        build_engine("mock", opts)


def test_quantized_lm_head_is_int8_and_close(tiny_model):
    q = load_model("tiny", quantization=QuantConfig("int8", quantize_lm_head=True))
    head = q.params.lm_head
    assert isinstance(head, Int8Weight) and head.q.shape == (64, 512)
    assert q.identity.quantization == "int8-w-perchannel+lm_head"
    ref = tiny_model.params.lm_head
    assert float(jnp.abs(head.dequantize(0) - ref).max()) <= float(head.scale.max()) / 2 + 1e-6


# ---- loaders ------------------------------------------------------------------------------
def test_q8_0_blocks_go_straight_to_per_channel_int8():
    import gguf

    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 96)).astype(np.float32) * rng.uniform(0.1, 3, size=(6, 3)).repeat(
        32, axis=1
    )  # blocks of very different scales in each row
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    blocks_f = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0).reshape(6, 96)
    from models.loaders.gguf_loader import q8_0_to_per_channel

    q, scale = q8_0_to_per_channel(data, 6, 96)
    assert q.dtype == np.int8 and scale.shape == (6,)
    deq = q.astype(np.float32) * scale[:, None]
    assert (np.abs(deq - blocks_f) <= scale[:, None] / 2 + 1e-6).all()
    # Same per-channel grid as quantizing the Q8_0 values from float, without building them.
    q_ref, s_ref = quantize_rows_np(blocks_f)
    np.testing.assert_allclose(scale, s_ref, rtol=1e-6)
    assert (np.abs(q.astype(int) - q_ref) <= 1).all()


def _write_tiny_gguf(path, cfg, params_hf: dict, q8_names: set):
    """A llama GGUF with the tiny config; `q8_names` (GGUF names) stored as Q8_0, the
    rest as F32 (norms) or Q4_1 (projections)."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_feed_forward_length(cfg.ffn_size)
    w.add_context_length(cfg.max_seq_len)
    w.add_vocab_size(cfg.vocab_size)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    for name, arr in params_hf.items():
        if name in q8_names:
            kind = gguf.GGMLQuantizationType.Q8_0
        elif arr.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q4_1
        else:
            kind = gguf.GGMLQuantizationType.F32
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_int8_load_paths_and_closeness(tmp_path, caplog):
    from configs.model_config import from_name
    from models.loaders.gguf_loader import load_gguf

    cfg = dataclasses.replace(from_name("tiny"), attention_bias=False, tie_embeddings=True)
    D, H, K, hd, F, V = 64, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_size, 512
    rng = np.random.default_rng(1)
    t = lambda *s: rng.normal(0, 0.2, s).astype(np.float32)  # noqa: E731
    tensors = {"token_embd.weight": t(V, D), "output_norm.weight": t(D)}
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        tensors.update(
            {
                b + "attn_norm.weight": t(D),
                b + "ffn_norm.weight": t(D),
                b + "attn_q.weight": t(H * hd, D),
                b + "attn_k.weight": t(K * hd, D),
                b + "attn_v.weight": t(K * hd, D),
                b + "attn_output.weight": t(D, H * hd),
                b + "ffn_gate.weight": t(F, D),
                b + "ffn_up.weight": t(F, D),
                b + "ffn_down.weight": t(D, F),
            }
        )
    q8 = {n for n in tensors if "attn_q" in n or "ffn_down" in n or n == "token_embd.weight"}
    path = str(tmp_path / "tiny.gguf")
    _write_tiny_gguf(path, cfg, tensors, q8)
    _, float_params, reader = load_gguf(path)
    with caplog.at_level(logging.INFO, logger="models.loaders.gguf_loader"):
        _, qp, _ = load_gguf(path, reader=reader, quant=QuantConfig("int8", quantize_lm_head=True))
    log = caplog.text
    # 2 layers x (wq, w_down) + the tied LM head from token_embd: 5 Q8_0 tensors direct.
    assert "5 tensors Q8_0 -> int8 direct" in log
    assert "10 tensors Q4_1 -> dequantized -> int8" in log
    for name in QUANTIZED_LAYER_WEIGHTS:
        w, ref = getattr(qp.layers, name), getattr(float_params.layers, name)
        assert isinstance(w, Int8Weight) and w.q.shape == ref.shape
        half_step = (
            w.scale.reshape(
                w.scale.shape[:1] + (1,) * (w.q.ndim - w.scale.ndim) + w.scale.shape[1:]
            )
            / 2
        )
        assert bool((jnp.abs(w.dequantize() - ref) <= half_step + 1e-6).all()), name
    assert isinstance(qp.lm_head, Int8Weight) and qp.lm_head.q.shape == (D, V)
    np.testing.assert_array_equal(qp.embed, float_params.embed)  # the embedding stays float


def test_orbax_cache_key_holds_the_quantization(tmp_path, monkeypatch):
    from tests.test_loaders import write_tiny_hf_dir

    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = write_tiny_hf_dir(str(tmp_path / "ckpt"))
    plain = load_model(ckpt)
    first = load_model(ckpt, quantization="int8")
    assert "convert_s" in first.load_times_s  # not the float cache entry
    second = load_model(ckpt, quantization="int8")
    assert "orbax_restore_s" in second.load_times_s
    assert isinstance(second.params.layers.wq, Int8Weight)
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        np.testing.assert_array_equal(a, b)
    assert second.identity.revision.startswith(plain.identity.revision + ";quantization=int8")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir())[1].endswith(
        "float32-int8-w-perchannel"
    )
