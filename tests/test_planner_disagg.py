"""Pool sizing for prefill/decode disaggregation (serving/capacity/planner_disagg.py), checked by
hand on the Llama-3.1-8B-on-8-GPUs example of WORKSPACE.md."""

import pytest

from serving.capacity.planner_disagg import PhaseRates, disagg_plan

KV_8B = 2 * 32 * 8 * 128 * 2  # bytes per token: K and V, 32 layers, 8 KV heads, hd 128, bf16
RATES = PhaseRates(31000, 5200, 0.0123, 450e9)


def plan(**over):
    args = dict(rate_rps=40, prompt_tokens=2000, output_tokens=250, kv_budget_bytes=58 * 2**30)
    return disagg_plan(KV_8B, RATES, **{**args, **over})


def test_worked_example_llama_8b_on_8_gpus():
    p = plan()
    assert p["prefill_workers"] == 4  # 80,000 / (31,000 x 0.7) = 3.7
    assert p["decode_workers"] == 3  # 10,000 / (5,200 x 0.7) = 2.7
    assert p["devices"] == 7
    assert p["kv_bytes_per_request"] == 2000 * 131072
    assert p["transfer_s"] == pytest.approx(2000 * 131072 / 450e9)
    assert p["decode_sequences_in_flight"] == pytest.approx(40 * 250 * 0.0123)


def test_prefix_hits_shrink_prefill_not_the_transfer():
    cold, warm = plan(), plan(prefix_hit_rate=0.5)
    assert (
        warm["prefill_workers"] == 2
        and warm["kv_bytes_per_request"] == cold["kv_bytes_per_request"]
    )


def test_long_outputs_make_decode_memory_bound():
    p = plan(output_tokens=8000, prompt_tokens=30000, rate_rps=2, kv_budget_bytes=8 * 2**30)
    assert p["decode_workers_by_memory"] > p["decode_workers_by_rate"]
    assert p["decode_workers"] == p["decode_workers_by_memory"]


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="rate_rps=0"):
        plan(rate_rps=0)
    with pytest.raises(ValueError, match="prefix_hit_rate=1"):
        plan(prefix_hit_rate=1)
