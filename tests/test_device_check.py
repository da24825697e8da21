"""benchmarks/device_check.py runs end to end on CPU (--smoke: tiny sizes, Pallas kernels in
interpret mode), so the script meant for a one-shot accelerator run is known to work."""

import json

import pytest

from benchmarks import device_check


@pytest.mark.compile
@pytest.mark.interpret
def test_device_check_smoke_writes_json_and_markdown(tmp_path):
    out = str(tmp_path / "dc")
    r = device_check.main(["--smoke", f"--out={out}"])
    saved = json.loads((tmp_path / "dc.json").read_text())
    assert saved["ok"] and r["ok"], {k: v.get("error") for k, v in r.items() if isinstance(v, dict)}
    assert saved["devices"]["backend"] == "cpu" and saved["smoke"] is True
    cases = saved["kernels"]["cases"]
    assert {c["case"] for c in cases} == {
        "ragged_mixed",
        "ragged_window",
        "ragged_int8_kv",
        "decode_only",
    }
    assert all(c["ok"] and c["interpret"] and c["max_abs_err"] < c["tolerance"] for c in cases)
    assert {"ours", "jax_shipped"} <= set(saved["decode_attention"])
    assert saved["ragged_prefill"]["tflop_s"] > 0
    gmm = saved["grouped_matmul"]
    assert gmm["impl"] == "gpu" and gmm["interpret"]  # gmm_gpu, interpreted on CPU
    assert [c["tokens"] for c in gmm["cases"]] == [3, 8]
    assert all(c["ok"] and c["max_abs_err"] < c["tolerance"] for c in gmm["cases"])
    assert all(c[f]["ms"] > 0 for c in gmm["cases"] for f in ("gpu", "ragged_dot", "dense"))
    model = saved["model"]
    assert model["recompiles_after_warmup"] == 0
    assert model["batch1"]["tokens_per_s"] > 0 and model["batch4"]["tokens_per_s"] > 0
    md = (tmp_path / "dc.md").read_text()
    assert "SMOKE" in md and "recompiles after warm-up: 0" in md and "FAIL" not in md
    assert "- grouped matmul gpu 4 experts top-2 40->48, 8 tokens:" in md
