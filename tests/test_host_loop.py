"""The host-only loop (benchmarks/host_loop.py): EngineCore with its device step faked runs
every stop kind to completion, deterministically (its output hash is what an A/B of two
trees compares), and the steady mode reports CPU time per step. No timing assertions."""

from benchmarks import host_loop


def test_mixed_workload_finishes_and_hashes_deterministically():
    first = host_loop.main(["--mixed", "--num_seqs=4"])
    again = host_loop.main(["--mixed", "--num_seqs=4"])
    assert [r["overlap"] for r in first] == [True, False]
    for a, b in zip(first, again):
        assert a["outputs"] > 8 and a["steps"] > 4
        assert (a["outputs_sha256"], a["batches_sha256"]) == (
            b["outputs_sha256"],
            b["batches_sha256"],
        )


def test_steady_reports_cpu_per_step():
    (row,) = host_loop.main(["--num_seqs=4", "--steps=5", "--repeats=1"])
    assert row["num_seqs"] == 4 and row["cpu_ms_per_step"] > 0
    assert set(row["phases_cpu_ms"]) == set(host_loop.PHASES)
    assert row["step_cpu_ms"]["median"] > 0
    # every phase ran in the median step (a wrapped call that never ran would read 0)
    assert all(v > 0 for v in row["phases_cpu_ms"].values()), row


def test_fake_device_bans_stop_ids_before_min_tokens():
    import numpy as np

    from engine.batch.builder import BatchShape, StepBatch

    batch = StepBatch.zeros(BatchShape(8, 0, 0, 4, 1))
    t = batch.sampling
    t.key_data[:, 1] = np.arange(8)
    t.min_tokens[:] = 100  # every row still before min_tokens
    t.stop_ids[:, 0] = 2  # EOS
    for step in range(40):
        t.step[:] = step
        assert not (host_loop.fake_tokens(batch) == 2).any()
