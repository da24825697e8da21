"""Loaders: clear errors for bad files, the Orbax cache round trip, and the GGUF Q/K
un-permutation (the parity tests check the numbers end to end)."""

import json
import os

import numpy as np
import pytest

from configs import from_name
from models.errors import ModelLoadError
from models.loaders.gguf_loader import load_gguf, unpermute_heads
from models.loaders.hf_loader import load_hf_dir
from models.registry import load_model, smollm2_gguf_path, tiny_tokenizer


def write_tiny_hf_dir(path, *, hidden=64, bad_tensor=None):
    """A Llama checkpoint directory with random float32 safetensors, written with numpy."""
    from safetensors.numpy import save_file

    cfg = from_name("tiny")
    D, H, K, hd, F, V = 64, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_size, 512
    rng = np.random.default_rng(0)
    t = lambda *s: rng.normal(0, 0.2, s).astype(np.float32)  # noqa: E731
    tensors = {
        "model.embed_tokens.weight": t(V, D),
        "model.norm.weight": t(D),
        "lm_head.weight": t(V, D),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": t(D),
                p + "post_attention_layernorm.weight": t(D),
                p + "self_attn.q_proj.weight": t(H * hd, D),
                p + "self_attn.k_proj.weight": t(K * hd, D),
                p + "self_attn.v_proj.weight": t(K * hd, D),
                p + "self_attn.o_proj.weight": t(D, H * hd),
                p + "mlp.gate_proj.weight": t(F, D),
                p + "mlp.up_proj.weight": t(F, D),
                p + "mlp.down_proj.weight": t(D, F),
            }
        )
    if bad_tensor:
        tensors[bad_tensor] = t(3, 3)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": hidden,
                "num_hidden_layers": cfg.num_layers,
                "num_attention_heads": H,
                "num_key_value_heads": K,
                "intermediate_size": F,
                "vocab_size": V,
                "max_position_embeddings": 1024,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            f,
        )
    tiny_tokenizer().backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, f)
    return path


def test_orbax_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = write_tiny_hf_dir(str(tmp_path / "ckpt"))
    first = load_model(ckpt)
    assert "convert_s" in first.load_times_s and "orbax_save_s" in first.load_times_s
    second = load_model(ckpt)
    assert "orbax_restore_s" in second.load_times_s and "convert_s" not in second.load_times_s
    for a, b in zip(np.asarray(first.params.layers.wq), np.asarray(second.params.layers.wq)):
        np.testing.assert_array_equal(a, b)
    assert first.identity == second.identity
    assert first.identity.revision.startswith("sha256:")


def test_missing_and_misshaped_hf_checkpoints(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_hf_dir(str(tmp_path))
    bad = write_tiny_hf_dir(str(tmp_path / "bad"), bad_tensor="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(
        ModelLoadError,
        match=r"'model.layers.1.mlp.up_proj.weight' has shape "
        r"\(3, 3\), expected \(128, 64\)",
    ):
        load_hf_dir(bad)
    wrong = write_tiny_hf_dir(str(tmp_path / "wrong"), hidden=32)
    with pytest.raises(ModelLoadError, match="expected"):
        load_hf_dir(wrong)


def test_missing_truncated_and_foreign_gguf(tmp_path):
    import gguf

    with pytest.raises(ModelLoadError, match="does not exist"):
        load_gguf(str(tmp_path / "nope.gguf"))
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_gguf_path(), "rb") as src, open(truncated, "wb") as dst:
        dst.write(src.read(4096))
    with pytest.raises(ModelLoadError, match="truncated"):
        load_gguf(str(truncated))
    foreign = str(tmp_path / "foreign.gguf")
    w = gguf.GGUFWriter(foreign, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        load_gguf(foreign)


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model("no-such-model")


def test_unpermute_inverts_llama_cpp_permute():
    n_heads, hd, d = 3, 8, 5
    w = np.arange(n_heads * hd * d, dtype=np.float32).reshape(n_heads * hd, d)
    # llama.cpp's convert_hf_to_gguf permute
    permuted = w.reshape(n_heads, 2, hd // 2, d).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_heads(permuted, n_heads), w)
