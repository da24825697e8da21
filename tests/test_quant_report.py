"""The quant report (benchmarks/quant_report.py) end to end at a small size on the tiny model:
every section is written and its numbers are consistent (float32 against itself is exact,
quantized variants differ a little, the capacity arithmetic matches the cache allocation)."""

from __future__ import annotations

import json

import pytest

from benchmarks import quant_report


@pytest.mark.compile  # six engine configurations and the formulation timings
def test_quant_report_small_on_tiny(tmp_path):
    out = tmp_path / "report"
    report = quant_report.main(
        [
            "--model=tiny",
            f"--out={out}",
            "--configs=float32,int8-w,kv-int8",
            "--windows=1",
            "--window_tokens=48",
            "--max_new_tokens=4",
            "--long_context_tokens=120",
            "--speed_batch=2",
            "--prefill_tokens=32",
            "--decode_tokens=3",
            "--speed_repeats=1",
            "--kv_budget_bytes=1000000",
            "--device_bytes=20000000",
        ]
    )
    assert {"report.md", "report.json", "kl_histogram.png", "speed.png"} <= {
        p.name for p in out.iterdir()
    }
    assert json.loads((out / "report.json").read_text())["model"] == "tiny"
    q = report["quality"]
    assert q["float32"]["mean_kl_nats"] == 0 and q["float32"]["top1_agreement"] == 1
    assert 0 < q["int8-w"]["mean_kl_nats"] < 0.05 and 0 < q["kv-int8"]["mean_kl_nats"] < 0.05
    assert q["int8-w"]["tokens"] == 47
    b = report["behaviour"]
    assert set(b["float32"]["prompts"]) == {
        "english", "french", "japanese", "code", "chat_turn", "long_context"
    }  # fmt: skip
    ref = b["float32"]["prompts"]["english"]
    assert ref["identical_token_share"] == 1.0
    # The engine's logprobs of its own greedy tokens == teacher-forced dense forward.
    assert abs(ref["mean_logprob_chosen"] - ref["logprob_of_float_tokens"]) < 1e-3
    assert b["int8-w"]["revision"].endswith(";quantization=int8-w-perchannel,kv=float32")
    assert b["kv-int8"]["revision"].endswith(";quantization=none,kv=int8")
    mem = report["memory"]
    assert 0.25 < mem["int8-w"]["layer_weight_ratio_vs_float32"] < 0.27
    per_token = report["kv_bytes_per_token_allocated"]
    assert mem["kv-int8"]["kv_bytes_per_token"] == per_token["int8"]
    assert mem["float32"]["kv_bytes_per_token"] == per_token["float32"]
    assert mem["kv-int8"]["kv_tokens_ratio_vs_float32"] > 3  # tiny: head_dim 16 -> 64/20
    assert set(report["speed"]) == {"float32", "int8-w", "kv-int8"}
    assert report["speed"]["int8-w"]["batch1_tok_s_vs_float32"] > 0
    assert {f["formulation"] for f in report["formulations"]} >= {"float32", "w8a8"}
    assert "int8-w mean KL < 0.005 nats" in report["targets"]
    md = (out / "report.md").read_text()
    for section in ("## 1. Quality", "## 2. Behaviour", "## 3. Speed", "## 4. Memory", "## 5."):
        assert section in md
