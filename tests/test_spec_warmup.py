"""Speculative programs are built by warm-up: after `warmup`, speculative steps of the
layers proposer (its draft program and the verify step, greedy and sampled) and of the
draft proposer (draft program, the draft cache's fill on every shape, verify; greedy)
compile nothing (tiny model, a small config: the verify shape set is small)."""

import pytest

from engine import LLM, SamplingParams
from engine.runner import compiles
from engine.runner.warmup import warmup

pytestmark = pytest.mark.compile


SPECS = {
    "layers": {"method": "layers", "num_draft_layers": 1},
    "draft": {"method": "draft", "draft_model": "tiny"},
}
SAMPLED = SamplingParams(temperature=1.0, top_k=5, max_tokens=20, seed=3, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize(
    "method",
    [
        "layers",
        # NOTE: the draft case compiled one program after warm-up on the spec2 branch;
        # with main's sampler programs (penalties inside "full") it compiles none.
        "draft",
    ],
)
def test_nothing_compiles_after_warmup_with_speculation(method):
    sampling = ("greedy", "full") if method == "layers" else ("greedy",)
    llm = LLM(
        "tiny",
        num_pages=64,
        page_size=16,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        prefill_chunk_size=16,
        max_model_len=64,
        speculative={**SPECS[method], "num_speculative_tokens": 2, "disable_by_batch_size": 1},
    )
    spec = llm.engine.spec
    assert 0 < len(spec.warm_shapes()) < len(spec.shapes.shapes)  # the policy bounds them
    warmup(llm.engine, sampling=sampling)
    before = compiles.count()
    prompt = [1, 40, 41, 42, 43, 40, 41, 42, 43]
    for params in (GREEDY, SAMPLED) if "full" in sampling else (GREEDY,):
        llm.generate([prompt], params)  # one request at a time: the policy speculates
    s = llm.stats()
    assert s["spec_verify_steps"] > 5
    assert compiles.count() == before and s["compiles_after_warmup"] == 0
