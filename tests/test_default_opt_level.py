"""Exactness at XLA:CPU's defaults. The suite compiles with LLVM at -O0 and XLA:CPU's older
fusion emitters (tests/conftest.py TEST_XLA_FLAGS: faster compiles, same floats); the server
and the benchmarks run XLA's defaults. This file reruns a small exactness subset in a fresh
pytest process without those flags, so a difference they make (a fused or reordered
reduction changing a greedy pick) shows in `make test`:

    paged engine == dense loop, 32 mixed prompts, token for token (tests/test_engine.py)
    tiny random checkpoint logits == transformers (tests/test_model_parity.py)
    penalties == dense NumPy penalties, token for token (tests/test_penalty_oracle.py)
    int8 KV log-probs == dense int8 simulation (tests/test_kv_int8_oracle.py)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import FUSION_FLAG, TEST_XLA_FLAGS, without_test_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBSET = [
    "tests/test_engine.py::test_32_mixed_prompts_match_dense_loop[unrolled]",
    "tests/test_model_parity.py::test_tiny_random_checkpoint_matches_transformers[llama-unrolled]",
    "tests/test_penalty_oracle.py",
    "tests/test_kv_int8_oracle.py",
    "tests/test_default_opt_level.py::test_this_process_runs_at_the_level_it_was_asked_for",
]


def test_this_process_runs_at_the_level_it_was_asked_for():
    """In the child (PAGEDJAX_XLA_DEFAULT_OPT=1) none of the suite's flags is set; otherwise
    all of them."""
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("PAGEDJAX_XLA_DEFAULT_OPT") == "1":
        assert without_test_xla_flags(flags) == " ".join(flags.split()), flags
    else:
        wanted = set(TEST_XLA_FLAGS)
        if os.environ.get("PAGEDJAX_TEST_FUSION_EMITTERS") == "1":  # real-model processes
            wanted.discard(FUSION_FLAG)
        assert wanted <= set(flags.split()), flags


@pytest.mark.subprocess
def test_exactness_subset_at_the_default_optimisation_level():
    flags = without_test_xla_flags(os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, XLA_FLAGS=flags, PAGEDJAX_XLA_DEFAULT_OPT="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert f"{len(SUBSET)} passed" in proc.stdout, tail
