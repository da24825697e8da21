"""LoRA slot stacks under a mesh (8 virtual CPU devices, in a subprocess: see
tests/lora_sharding_worker.py): same greedy tokens as one device for a batch mixing the
base model and two adapters, each adapter matrix split like the weight it adapts, and no
compile from a second run or an adapter swap."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    script = os.path.join(ROOT, "tests", "lora_sharding_worker.py")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, script, str(tmp_path_factory.mktemp("adapters"))],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


MESHES = ["model:2", "model:4", "data:2,model:2"]


@pytest.mark.subprocess
@pytest.mark.parametrize("mesh", MESHES)
def test_mixed_adapters_match_one_device_without_recompiling(runs, mesh):
    single, run = runs["single"], runs[mesh]
    assert single["out"][1] != single["out"][0]  # the adapter changes the continuation
    assert run["out"] == single["out"]
    assert run["again_same"] and run["swapped"] == single["swapped"]
    assert run["swapped"][2] != run["out"][2]  # the swap took effect
    assert run["recompiled"] == 0


@pytest.mark.subprocess
@pytest.mark.parametrize("mesh", MESHES)
def test_adapter_weights_split_like_their_base_weights(runs, mesh):
    s = runs[mesh]["specs"]
    # column parallel (wq, w_gate): A replicated, B split on the output axis with the weight
    assert s["lora_a_wq"] == [] and s["lora_b_wq"] == [None, None, None, "model"]
    assert s["wq"] == [None, None, "model"]
    assert s["lora_b_w_gate"] == [None, None, None, "model"]
    # row parallel (wo, w_down): A split on the input axis with the weight, B replicated
    assert s["lora_a_wo"] == [None, "model"] and s["lora_a_w_down"] == [None, "model"]
    assert s["w_down"] == [None, "model"]


@pytest.mark.subprocess
def test_replicated_kv_heads_repeat_the_adapters_kv_columns(runs):
    # tiny has 2 KV heads: model:4 runs 4 (each repeated twice), so does B of wk/wv
    assert runs["single"]["lora_b_wk_shape"][3] == 2
    assert runs["model:4"]["lora_b_wk_shape"][3] == 4
