"""benchmarks/step_profile.py: the hand-built batches are well formed and every timing
variant runs (tiny model; no timing assertions)."""

import numpy as np
import pytest

from benchmarks import step_profile


def test_make_batch_lays_out_decodes_then_prefill_chunks():
    case = step_profile.Case((20, 3), ((0, 7), (16, 5)), chunk_size=32)
    batch, shape, num_pages = step_profile.make_batch(case, page_size=4)
    assert (shape.num_decode, shape.num_prefill_tokens, shape.num_prefill_seqs) == (2, 16, 2)
    assert batch.kv_lens_d.tolist() == [20, 3] and batch.kv_lens_p.tolist() == [7, 21]
    assert batch.query_start_p.tolist() == [0, 7, 12] and batch.num_seqs_p.tolist() == [2]
    assert batch.logits_indices.tolist() == [0, 1, 2 + 6, 2 + 11]
    assert batch.positions[:2].tolist() == [19, 2]
    assert batch.positions[2:14].tolist() == [*range(7), *range(16, 21)]
    # every token's slot is on its own sequence's pages, pages never shared
    pages = batch.slot_mapping[:14] // 4
    assert len(set(pages[:2])) == 2 and not set(pages[:2]) & set(pages[2:14])
    assert num_pages == 1 + 5 + 1 + 2 + 6 and np.all(batch.slot_mapping[14:] == 0)


@pytest.mark.compile
def test_smoke_profile_runs_every_variant():
    r = step_profile.main(["--smoke", "--cases=decode8,prefill5", "--iters=1"])
    for case in ("decode8", "prefill5"):
        for v in ("step", "step_full", "no_attention", "forward_only"):
            assert r[case][f"{v}_ms"] > 0 and r[case][f"{v}_cpu_ms"] >= 0
            assert r[case][f"{v}_floor_over_cpu"] > 0
    assert r["matmul_gflop_per_cpu_s"] > 0


def test_case_flops_count_every_real_token_at_its_context():
    from configs.model_config import PRESETS

    cfg = PRESETS["tiny"]
    case = step_profile.Case((20, 3), ((0, 2), (16, 1)))
    expected = sum(cfg.flops_per_token(c) for c in (20, 3, 1, 2, 17))
    assert step_profile.case_flops(cfg, case) == expected
    assert cfg.flops_per_token(20) > cfg.flops_per_token(3)  # context counts
