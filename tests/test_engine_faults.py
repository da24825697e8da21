"""Engine faults on the tiny model: non-finite logits are caught on device and fail only
their request; KV exhaustion preempts instead of crashing."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.api_types import EngineRequest

# Same options and pool size as tests/test_engine.py, so the compiled steps are shared.
OPTS = dict(
    page_size=8, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=32, max_model_len=256
)
POISON = 77  # a token id whose embedding row is made NaN


def _run(engine, requests):
    for r in requests:
        engine.add_request(r)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            acc = outs.setdefault(o.request_id, {"ids": [], "reason": None, "error": None})
            acc["ids"] += o.new_token_ids
            if o.finished:
                acc["reason"], acc["error"] = o.finish_reason, o.error
    return outs


@pytest.fixture(scope="module")
def llms():
    healthy = LLM("tiny", num_pages=200, **OPTS)
    poisoned = LLM("tiny", num_pages=200, **OPTS)
    runner = poisoned.engine.runner
    runner.params = dataclasses.replace(
        runner.params, embed=runner.params.embed.at[POISON].set(jnp.nan)
    )
    return healthy, poisoned


def test_nonfinite_logits_fail_only_their_request(llms):
    healthy, poisoned = llms
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    clean, bad = [1, 5, 9, 12, 40], [1, 5, POISON, 12]
    want = _run(healthy.engine, [EngineRequest("clean", clean, sp)])["clean"]["ids"]
    outs = _run(poisoned.engine, [EngineRequest("clean", clean, sp), EngineRequest("bad", bad, sp)])
    assert outs["bad"]["reason"] == "failed" and outs["bad"]["ids"] == []
    assert "non-finite" in outs["bad"]["error"]
    assert outs["clean"]["reason"] == "length" and outs["clean"]["ids"] == want
    assert poisoned.engine.pool.num_used_pages == 0


@pytest.mark.compile
def test_kv_exhaustion_preempts_and_every_request_finishes():
    llm = LLM("tiny", num_pages=12, **OPTS)  # 11 usable pages of 8 tokens
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, 500, 40).tolist() for _ in range(4)]  # 6+ pages each
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = _run(llm.engine, [EngineRequest(f"r{i}", p, sp) for i, p in enumerate(prompts)])
    assert {o["reason"] for o in outs.values()} == {"length"}
    assert all(len(o["ids"]) == 16 for o in outs.values())
    assert llm.engine.stats()["num_preemptions"] > 0
    assert llm.engine.pool.num_used_pages == 0
