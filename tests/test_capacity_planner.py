"""The planner's worked examples from the seeds (serving/capacity/planner.py)."""

import dataclasses
import functools
import math

import pytest

from configs import kv_memory
from configs.model_config import from_name
from serving.capacity import planner

GIB = 1024**3
SEED_MODEL = dataclasses.replace(from_name("llama-3.1-8b"), name="seed")  # 32 layers, 8x128
# The seed's 80 GiB device: 16 GiB of bf16 weights, 4 GiB of workspace, 16-token pages.
seed_plan = functools.partial(
    planner.plan,
    SEED_MODEL,
    kv_dtype="bfloat16",
    device_memory_bytes=80 * GIB,
    weights_bytes=16 * GIB,
    workspace_bytes=4 * GIB,
    page_size=16,
)


def test_seed_kv_arithmetic():
    assert (SEED_MODEL.num_layers, SEED_MODEL.num_kv_heads, SEED_MODEL.head_dim) == (32, 8, 128)
    assert kv_memory.kv_bytes_per_token(SEED_MODEL, "bfloat16") == 128 * 1024
    assert kv_memory.kv_bytes_per_sequence(SEED_MODEL, 8192, "bfloat16") == GIB
    assert 20 * kv_memory.kv_bytes_per_sequence(SEED_MODEL, 8192, "bfloat16") == 20 * GIB


def test_memory_plan_pages_tokens_and_sequences_with_page_rounding():
    # 80 GiB - 16 GiB weights - 4 GiB workspace = 60 GiB of KV = 480 sequences of 1 GiB... /8
    plan = planner.memory_plan(SEED_MODEL, "bfloat16", 80 * GIB, 16 * GIB, 4 * GIB, page_size=16)
    assert plan.page_bytes == 16 * 128 * 1024
    assert plan.kv_budget_bytes == 60 * GIB
    assert plan.kv_tokens == 60 * 8192  # 60 GiB / 128 KiB
    assert plan.sequences_that_fit(8192) == 60
    # 8193 tokens need one more page than 8192: 513 pages per sequence.
    assert plan.sequences_that_fit(8193) == plan.num_pages // 513 == 59
    assert planner.pages_per_sequence(17, 16) == 2


def test_memory_plan_rejects_weights_that_do_not_leave_room():
    with pytest.raises(ValueError, match="no KV budget"):
        planner.memory_plan(SEED_MODEL, "bfloat16", 16 * GIB, 15 * GIB, 2 * GIB)


@pytest.mark.parametrize(
    "demand,goodput,reserve,expected",
    [
        (10.0, 2.0, 0.2, 6),  # 10 / 2 x 1.2 = 6 exactly, not 7
        (10.0, 3.0, 0.0, 4),
        (20.0, 4.5, 0.3, 6),  # 5.78 -> 6
        (1.0, 4.0, 0.5, 1),
    ],
)
def test_replicas_formula(demand, goodput, reserve, expected):
    assert planner.replicas_needed(demand, goodput, reserve) == expected


def test_replicas_rejects_zero_goodput():
    with pytest.raises(ValueError, match="goodput_per_replica_rps=0"):
        planner.replicas_needed(10, 0, 0.2)


def test_output_token_demand():
    assert planner.output_token_demand(20.0, 250.0) == 5000.0


def test_plan_budgets_max_tokens_more_than_expected_lengths():
    samples = [(100, 50), (300, 150)]  # totals 150, 450
    out = seed_plan(
        samples=samples,
        max_tokens=1024,
        seq_lens=[8192],
        rate_rps=10.0,
        goodput_per_replica_rps=2.0,
        reserve=0.2,
    )
    assert out["kv_bytes_per_token"] == 128 * 1024
    assert out["sequences_that_fit"] == {"8192": 60}
    assert out["lengths"]["mean_output_tokens"] == 100
    assert out["output_token_demand_tps"] == 1000.0
    assert out["replicas"] == 6
    # ceil(150/16)=10, ceil(450/16)=29 -> 19.5 pages expected; budgeted ceil(1124/16)=71,
    # ceil(1324/16)=83 -> 77 pages.
    assert out["lengths"]["mean_pages_expected"] == 19.5
    assert out["lengths"]["mean_pages_budgeted"] == 77
    assert out["concurrent_sequences_budgeted"] < out["concurrent_sequences_expected"]
    assert "max_tokens" in out["caution"]


def test_render_plan_states_replicas_and_caution():
    out = seed_plan(
        samples=[(100, 50)],
        max_tokens=1024,
        seq_lens=[8192],
        rate_rps=20.0,
        goodput_per_replica_rps=4.5,
        reserve=0.3,
    )
    text = planner.render_plan(out)
    assert "128 KiB of KV per token" in text
    assert "8192 tokens: 60" in text
    assert "replicas: 6 = ceil(20 / 4.5 x (1 + 0.3))" in text
    assert "max_tokens" in text


def test_local_page_release_in_the_plan():
    """A Gemma 3 270M-shaped model (18 layers, 15 local with window 512, one KV head of 256):
    the plan states KV per token at 32k with and without local page release; a model
    without local layers gets no such entry."""
    from models.gemma3 import GLOBAL, LOCAL, Gemma3Config

    cfg = Gemma3Config(
        name="gemma3-270m-shaped",
        num_layers=18,
        hidden_size=640,
        num_heads=4,
        num_kv_heads=1,
        ffn_size=2048,
        vocab_size=262144,
        head_dim=256,
        sliding_window=512,
        layer_types=((LOCAL,) * 5 + (GLOBAL,)) * 3,
    )
    out = planner.plan(
        cfg,
        kv_dtype="bfloat16",
        device_memory_bytes=16 * GIB,
        weights_bytes=GIB,
        workspace_bytes=GIB,
        page_size=16,
        samples=[(100, 50)],
        max_tokens=1024,
        seq_lens=[1024],
        prefill_chunk=256,
    )
    release = out["local_page_release"]
    assert release["ring_pages_per_slot"] == 49  # ceil((512 + 256 + 14) / 16)
    at_32k = release["kv_bytes_per_token"]["32768"]
    assert at_32k["without"] == 18 * 1024  # 18 layers x 2 x 256 x 2 bytes
    assert at_32k["with"] == pytest.approx((3 * 32768 + 15 * 49 * 16) * 1024 / 32768)
    assert "32768 tokens 18.0 -> 3.4 KiB" in planner.render_plan(out)
    assert "local_page_release" not in seed_plan(samples=[(100, 50)], max_tokens=8, seq_lens=[8])


def test_moe_active_vs_total_and_expert_parallel_weights():
    """Qwen3-30B-A3B's shape: 30.5B parameters, 3.3B active (8 of 128 experts); with the
    experts over 8 devices each holds 1/8 of the expert stacks and all of the rest; the
    all-to-all per token is 2 x k x D x bytes x 7/8 per sparse layer. A dense model gets no
    MoE entry, and a degree that does not divide the experts is refused."""
    from models.families import family_presets

    cfg = family_presets()["qwen3-30b-a3b"]
    assert round(cfg.num_params / 1e9, 1) == 30.5
    assert 3.3e9 < cfg.num_active_params < 3.4e9  # Qwen: "3.3B activated"
    m1 = planner.moe_plan(cfg, "bfloat16", 1)
    m8 = planner.moe_plan(cfg, "bfloat16", 8)
    experts = 48 * 128 * 3 * 2048 * 768 * 2
    assert m1["expert_weights_gib"] * GIB == experts
    rest = cfg.num_params * 2 - experts
    assert math.isclose(m8["weights_per_device_gib"] * GIB, rest + experts / 8)
    assert m1["all_to_all_bytes_per_token"] == 0
    assert m8["all_to_all_bytes_per_token"] == 48 * 2 * 8 * 2048 * 2 * 7 / 8
    out = planner.plan(
        cfg,
        kv_dtype="bfloat16",
        device_memory_bytes=141 * GIB,
        weights_bytes=planner.default_weights_bytes(cfg, "bfloat16", 8),
        workspace_bytes=GIB,
        page_size=16,
        samples=[(100, 50)],
        max_tokens=1024,
        seq_lens=[1024],
        expert_parallel=8,
    )
    assert "3.35B active per token (11.0%; 8 of 128 experts)" in planner.render_plan(out)
    assert planner.moe_plan(SEED_MODEL, "bfloat16", 1) is None
    with pytest.raises(ValueError, match="expert_parallel=3: must divide num_experts=128"):
        planner.moe_plan(cfg, "bfloat16", 3)


def test_host_tier_plan_tokens_sessions_and_hit_rates():
    """The seed's device (30,720 pages of 2 MiB) with 64 running 150-token sequences (10 pages
    each) caches 30,080 pages; a 100 GiB host tier holds 51,200. 1,000 sessions of 2,000
    own tokens behind a 1,000-token prefix (63 pages) are 125,063 pages: the device alone
    hits 30,080 / 125,063 of the sessions' context, with the host tier 51,200 / 125,063."""
    from serving.capacity.planner_host import PrefixWorkload

    out = seed_plan(
        samples=[(100, 50)],
        max_tokens=1024,
        seq_lens=[8192],
        max_num_seqs=64,
        host_kv_bytes=100 * GIB,
        prefix=PrefixWorkload(shared_prefix_tokens=1000, sessions=1000, session_tokens=2000),
        host_bytes_per_s=20 * GIB,
        prefill_tokens_per_s=10_000,
    )
    h = out["host_tier"]
    assert (h["host_pages"], h["host_tokens"]) == (51_200, 51_200 * 16)
    assert h["device_cache_tokens"] == (30_720 - 64 * 10) * 16
    assert h["working_set_tokens"] == 125_063 * 16
    assert h["hit_rate"]["device"] == pytest.approx(30_080 / 125_063)
    assert h["hit_rate"]["device_and_host"] == pytest.approx(51_200 / 125_063)
    assert h["sessions_that_fit"] == {"device": 240, "device_and_host": 409}
    assert h["shared_prefix_cached"]
    # 128 KiB per token at 20 GiB/s: 6.1 ms per 1k tokens vs 100 ms recomputed
    assert h["reload_s_per_1k_tokens"] == pytest.approx(1000 * 128 / (20 * 1024**2))
    assert h["reload_speedup"] == pytest.approx(0.1 / (1000 * 128 / (20 * 1024**2)))
    text = planner.render_plan(out)
    assert "host KV tier: 100.00 GiB = 51200 pages" in text
    assert "hit rate of returning sessions' context 24% -> 41%" in text
    # a working set that fits the host tier hits fully; no host tier and no sessions: no entry
    small = PrefixWorkload(shared_prefix_tokens=0, sessions=100, session_tokens=2000)
    out = seed_plan(samples=[(100, 50)], max_tokens=8, seq_lens=[8], host_kv_bytes=GIB * 100,
                    prefix=small)  # fmt: skip
    assert out["host_tier"]["hit_rate"]["device_and_host"] == 1.0
    assert "host_tier" not in seed_plan(samples=[(100, 50)], max_tokens=8, seq_lens=[8])
    with pytest.raises(ValueError, match="sessions=-1 is invalid"):
        PrefixWorkload(sessions=-1)
