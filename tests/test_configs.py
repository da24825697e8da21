import dataclasses

import pytest

from configs import PRESETS, from_name, kv_bytes_per_sequence, kv_bytes_per_token


def test_seed_worked_example_one_gib_per_8k_sequence():
    cfg = dataclasses.replace(from_name("llama-3.1-8b"), num_layers=32, num_kv_heads=8)
    assert cfg.head_dim == 128
    assert kv_bytes_per_token(cfg, "bfloat16") == 128 * 1024
    assert kv_bytes_per_sequence(cfg, 8192, "bfloat16") == 2**30


def test_page_rounding_and_int8():
    cfg = from_name("smollm2-135m")
    per_token = 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(cfg, "bfloat16") == per_token
    assert kv_bytes_per_sequence(cfg, 17, "bfloat16", page_size=16) == 32 * per_token
    # int8 stores one float32 scale per token per KV head for K and V beside the values.
    assert kv_bytes_per_token(cfg, "int8") == per_token // 2 + 2 * 30 * 3 * 4


def test_presets_are_hashable_and_derive_head_dim():
    assert len({hash(c) for c in PRESETS.values()}) == len(PRESETS)
    assert from_name("smollm2-135m").head_dim == 64
    assert from_name("qwen2.5-0.5b").attention_bias


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="num_kv_heads=4"):
        dataclasses.replace(from_name("tiny"), num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="hidden_size=65"):
        dataclasses.replace(from_name("tiny"), hidden_size=65, head_dim=0)
    with pytest.raises(KeyError, match="unknown model preset 'nope'"):
        from_name("nope")
