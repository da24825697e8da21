"""Tensor/data parallelism (engine/parallel/sharding.py).

The layout rules are checked in this process (one device). Sharded generation needs 8
devices, which JAX fixes when it starts, so `tests/sharding_worker.py` runs it in a
subprocess per scenario and these tests check what it reports: greedy tokens equal to one
device, the `.sharding` of each weight and of the KV cache, per-device bytes, and no
recompilation on a second identical run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from configs.model_config import from_name
from engine.parallel import sharding
from engine.parallel.sharding import ShardingConfigError
from tests.conftest import FULL_SIZES_ONLY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- in-process: mesh strings, layout checks, rules ----------------------------------------
def test_parse_mesh_spec():
    assert sharding.parse_mesh_spec("model:4") == {"data": 1, "expert": 1, "model": 4}
    assert sharding.parse_mesh_spec("data:2,model:4") == {"data": 2, "expert": 1, "model": 4}
    assert sharding.parse_mesh_spec("tp=2") == {"data": 1, "expert": 1, "model": 2}
    assert sharding.parse_mesh_spec("data:2,ep=2") == {"data": 2, "expert": 2, "model": 1}
    for bad in ("model", "model:0", "pipe:2", "model:x"):
        with pytest.raises(ShardingConfigError, match="mesh="):
            sharding.parse_mesh_spec(bad)


def test_make_mesh_needs_enough_devices():
    with pytest.raises(ShardingConfigError, match="needs 64 devices"):
        sharding.make_mesh("data:8,model:8")


def test_smollm2_model_axis_must_divide_heads():
    cfg = from_name("smollm2-135m")  # 9 heads, 3 KV heads
    assert sharding.allowed_model_degrees(cfg, 16) == [1, 3]  # 9: ffn_size 1536 % 9 != 0
    for m in (2, 4, 8):
        with pytest.raises(ShardingConfigError, match=r"num_heads=9.*allowed.*\[1, 3\]"):
            sharding.check_model_axis(cfg, m)
    with pytest.raises(ShardingConfigError, match="ffn_size=1536"):
        sharding.check_model_axis(cfg, 9)
    assert sharding.sharded_config(cfg, 3) is cfg
    wide = dataclasses.replace(cfg, ffn_size=1512)  # 9 | 1512: KV heads replicated 3x
    assert sharding.kv_replication(wide, 9) == 3
    assert sharding.sharded_config(wide, 9).num_kv_heads == 9


def test_tiny_model_axis_limits():
    cfg = from_name("tiny")  # 4 heads, 2 KV heads
    assert sharding.allowed_model_degrees(cfg, 8) == [1, 2, 4]
    assert sharding.kv_replication(cfg, 4) == 2
    with pytest.raises(ShardingConfigError, match="num_heads=4"):
        sharding.check_model_axis(cfg, 8)


@given(K=st.integers(1, 8), q_per_kv=st.integers(1, 8), r=st.integers(1, 8))
def test_replicated_kv_heads_keep_each_query_heads_kv(K, q_per_kv, r):
    # After repeating each KV head r times (K' = K r), query head h reads KV head
    # h // (H / K'), which must be a copy of its original KV head h // (H / K).
    H = K * q_per_kv * r  # the model axis K r divides H
    for h in range(H):
        assert (h // (H // (K * r))) // r == h // (H // K)


def test_replicate_kv_heads_repeats_weights():
    import jax

    from models.llama import init_params

    cfg = from_name("tiny")
    params = init_params(cfg, jax.random.key(0))
    out = sharding.replicate_kv_heads(params, 2)
    wk, wk2 = np.asarray(params.layers.wk), np.asarray(out.layers.wk)
    assert wk2.shape[2] == 2 * wk.shape[2]
    for j in range(wk2.shape[2]):
        np.testing.assert_array_equal(wk2[:, :, j], wk[:, :, j // 2])
    bv, bv2 = np.asarray(params.layers.bv), np.asarray(out.layers.bv)
    np.testing.assert_array_equal(bv2[:, 3], bv[:, 1])
    assert out.layers.wq is params.layers.wq


def test_rules_table_specs():
    mesh = AbstractMesh((2, 4), ("data", "model"))
    spec = lambda axes, shape: sharding.logical_to_spec(axes, shape, mesh)
    assert spec(("layers", "embed", "heads", "head_dim"), (2, 64, 8, 16)) == P(None, None, "model")
    assert spec(("layers", "ffn", "embed"), (2, 128, 64)) == P(None, "model")
    assert spec(("vocab", "embed"), (512, 64)) == P("model")
    assert spec(("vocab", "embed"), (510, 64)) == P()  # vocab the axis does not divide
    assert spec(("layers", "embed"), (2, 64)) == P()  # norms replicated
    assert spec(("batch",), (6,)) == P("data")


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m", "qwen2.5-0.5b"])
def test_every_param_declares_one_known_logical_axis_per_dim(name):
    """The axes declared on the params fields (models/llama.py) match param_shapes' ranks
    and are all in the rules table; the shardings derived from them keep the tree."""
    from models.llama import param_axes, param_shapes

    shapes = param_shapes(from_name(name))
    checked = 0
    for tree in (shapes, shapes.layers):
        for field in dataclasses.fields(tree):
            x = getattr(tree, field.name)
            if x is None or dataclasses.is_dataclass(x):
                continue
            axes = param_axes(field)
            assert len(axes) == len(x.shape), (field.name, axes, x.shape)
            assert set(axes) <= set(sharding.LOGICAL_RULES), (field.name, axes)
            checked += 1
    assert checked == len(jax.tree.leaves(shapes))  # every param, biases and lm_head if any
    shardings = sharding.param_shardings(from_name(name), sharding.make_mesh("model:1"))
    assert jax.tree.structure(shardings) == jax.tree.structure(shapes)


# ---- 8 virtual CPU devices, in a subprocess -------------------------------------------------
def _worker(scenario: str, timeout_s: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    script = os.path.join(ROOT, "tests", "sharding_worker.py")
    proc = subprocess.run(
        [sys.executable, script, scenario],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def tiny_runs():
    return _worker("tiny", 900)


@pytest.mark.subprocess
@pytest.mark.parametrize("mesh", ["model:1", "model:2", "model:4", "data:2", "data:2,model:2"])
def test_tiny_greedy_matches_one_device_and_does_not_recompile(tiny_runs, mesh):
    run = tiny_runs[mesh]
    assert run["same"] and run["again_same"], (mesh, tiny_runs["ref"])
    assert run["recompiled"] == 0


@pytest.mark.subprocess
@pytest.mark.parametrize("mesh,m", [("model:2", 2), ("model:4", 4), ("data:2,model:2", 2)])
def test_tiny_weights_and_cache_carry_the_megatron_layout(tiny_runs, mesh, m):
    specs = tiny_runs[mesh]["specs"]
    assert specs["wq"] == [None, None, "model"]  # column-parallel by heads
    assert specs["wk"] == [None, None, "model"]
    assert specs["wo"] == [None, "model"]  # row-parallel
    assert specs["w_gate"] == [None, None, "model"]
    assert specs["w_down"] == [None, "model"]
    assert specs["embed"] == ["model"]  # by vocab
    assert specs["attn_norm"] == []  # replicated
    assert specs["k_pages"] == [None, "model"]  # by KV head
    assert tiny_runs[mesh]["loaded_wq_spec"] == [None, None, "model"]  # placed by the loader


@pytest.mark.subprocess
def test_tiny_kv_bytes_per_device_shrink_and_replicate(tiny_runs):
    ref = tiny_runs["ref_kv_bytes"]  # one device, 2 KV heads
    two, four = tiny_runs["model:2"], tiny_runs["model:4"]
    assert two["kv_bytes_per_device"] == [ref // 2] * 2 and two["num_kv_heads"] == 2
    # model 4 > 2 KV heads: each head twice (memory multiplier 2), one head per device
    assert four["num_kv_heads"] == 4 and four["kv_bytes_total"] == 2 * ref
    assert four["kv_bytes_per_device"] == [ref // 2] * 4
    assert max(four["weights_bytes_per_device"]) < tiny_runs["ref_weights_bytes"] / 2
    assert tiny_runs["model:1"]["kv_bytes_per_device"] == [ref]


@pytest.mark.subprocess
def test_data_replicas_use_disjoint_device_groups(tiny_runs):
    assert tiny_runs["data:2"]["replica_devices"] == [[0], [1]]
    assert tiny_runs["data:2,model:2"]["replica_devices"] == [[0, 1], [2, 3]]
    assert tiny_runs["data:2"]["kv_bytes_per_device"] == [tiny_runs["ref_kv_bytes"]]


@pytest.mark.subprocess
def test_eight_kv_heads_model_axis_8_matches_one_device():
    res = _worker("kv8", 900)
    run = res["model:8"]
    assert run["same"] and run["again_same"] and run["recompiled"] == 0
    assert run["kv_bytes_per_device"] == [res["ref_kv_bytes"] // 8] * 8
    assert run["specs"]["k_pages"] == [None, "model"] and run["num_kv_heads"] == 8


@pytest.mark.subprocess
def test_ngram_speculation_under_a_model_mesh_matches_one_device():
    """Speculative decoding (ngram) under model:2: the verify step runs attention per shard
    with replicated logits and results, like the plain step; drafts = the one-device
    continuation are all accepted and the tokens equal one device without speculation."""
    res = _worker("spec", 900)
    assert res["same"], res
    assert res["verify_steps"] > 0 and res["accepted"] == res["drafted"] > 0, res
    assert res["k_pages_spec"] == [None, "model"]


# The tiny, kv8 and gemma3 scenarios above keep the sharding oracle in `make test`; SmolLM2
# (model axis 3, Orbax restore into the shardings) is `make test-full-sizes`.
@pytest.mark.slow
@pytest.mark.subprocess
@FULL_SIZES_ONLY
def test_smollm2_model_axis_3_matches_one_device():
    pytest.importorskip("gguf")
    res = _worker("smollm2", 1200)
    run = res["model:3"]
    assert run["same"] and run["again_same"] and run["recompiled"] == 0, res["ref"]
    assert run["kv_bytes_per_device"] == [res["ref_kv_bytes"] // 3] * 3
    # LLM("smollm2-135m", mesh=...) restored the Orbax cache straight into the shardings
    # (the first load in this run converted the GGUF and saved it when no cache existed)
    assert run["loaded_wq_spec"] == [None, None, "model"]
    assert "orbax_restore_s" in run["load_times"]


@pytest.mark.subprocess
def test_gemma3_family_model_axis_2_matches_one_device():
    """A second family (models/gemma3.py: QK-norm params, local/global layers) shards by the
    logical axes its LayerWeights subclass declares and matches one device."""
    res = _worker("gemma3", 900)
    run = res["model:2"]
    assert run["same"] and run["again_same"] and run["recompiled"] == 0, res["ref"]
    assert run["kv_bytes_per_device"] == [res["ref_kv_bytes"] // 2] * 2


@pytest.fixture(scope="module")
def moe_runs():
    return _worker("moe", 900)


@pytest.mark.subprocess
def test_expert_axis_matches_one_device_and_splits_the_experts(moe_runs):
    """A tiny Qwen3-MoE (4 experts, one sparse and one dense layer): expert:2, expert:4,
    data:2,expert:2 and expert:2,model:2 give one device's greedy tokens without
    recompiling, and the same expert load (tokens per expert of the sparse layer; with
    data:2 summed over the replicas); the
    expert stacks are split on E (and on their FFN by the model axis),
    everything else replicated across the expert axis; the expert stacks' bytes shrink by
    the expert axis; an axis that does not divide the experts, or a dense model, is refused
    by name."""
    ref_bytes = moe_runs["ref_weights_bytes"]
    experts = 2 * 4 * 3 * 64 * 32 * 4  # L x E x (gate, up, down) x D x Fm x float32
    for mesh, e in [("expert:2", 2), ("expert:4", 4), ("data:2,expert:2", 2)]:
        run = moe_runs[mesh]
        assert run["same"] and run["again_same"] and run["recompiled"] == 0, mesh
        assert run["expert_tokens"] == moe_runs["ref_expert_tokens"], mesh  # data:2: summed
        assert run["grouped_matmul"] == "ragged_dot"  # one device ran the CPU loops
        assert run["specs"]["moe_gate"] == [None, "expert"]
        assert run["specs"]["moe_down"] == [None, "expert"]
        assert run["specs"]["router"] == [] and run["specs"]["wq"] == []
        assert run["weights_bytes_per_device"] == [ref_bytes - experts + experts // e] * e
        assert run["kv_bytes_per_device"] == [moe_runs["ref_kv_bytes"]] * e  # replicated
    both = moe_runs["expert:2,model:2"]
    assert both["same"] and both["recompiled"] == 0
    assert both["expert_tokens"] == moe_runs["ref_expert_tokens"]
    assert both["specs"]["moe_gate"] == [None, "expert", None, "model"]
    assert both["specs"]["moe_down"] == [None, "expert", "model"]
    assert moe_runs["data:2,expert:2"]["replica_devices"] == [[0, 1], [2, 3]]
    refused = moe_runs["refused"]
    assert "num_experts=4 must be divisible by the expert axis (3)" in refused["expert:3"]
    assert "allowed expert axis sizes: [1, 2, 4]" in refused["expert:3"]
    assert "not a mixture-of-experts model" in refused["expert:2"]
