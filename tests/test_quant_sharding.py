"""int8 weights under a mesh (engine/parallel/sharding.py +
models/quant.quantized_shardings): greedy
tokens equal one device, and each scale is split like its weight's output axes (the
worker runs on 8 virtual CPU devices in a subprocess; see tests/quant_sharding_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.subprocess
def test_int8_weights_and_scales_shard_with_their_output_channels():
    script = os.path.join(ROOT, "tests", "quant_sharding_worker.py")
    proc = subprocess.run(
        [sys.executable, script, "int8"], capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT ") :])
    for mesh in ("model:2", "model:4", "data:2,model:2"):
        r = res[mesh]
        assert r["same"], mesh
        assert r["revision"].endswith(";quantization=int8-w-perchannel+lm_head,kv=float32")
        s = r["specs"]
        # column parallel: q split on heads/vocab, the scale on the same output axis
        assert s["wq.q"] == [None, None, "model"] and s["wq.scale"] == [None, "model"]
        assert s["lm_head.q"] == [None, "model"] and s["lm_head.scale"] == ["model"]
        # row parallel: the split axis is contracted, so the per-output scale is replicated
        assert s["wo.q"] == [None, "model"] and s["wo.scale"] == []
        assert s["w_down.q"] == [None, "model"] and s["w_down.scale"] == []
    # model:4 > 2 KV heads: wk (q and scale) repeated to 4 heads, like the float weights
    assert res["model:4"]["wk_scale_shape"] == [2, 4, 16]
    assert res["model:2"]["wk_scale_shape"] == [2, 2, 16]
