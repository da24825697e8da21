"""The paged engine against the dense oracle loop (models.dense_generate), one prompt at a
time: greedy outputs must be identical token for token, whatever the batching, the page
pool size (preemptions), the prefill chunk, or cancellations of other requests."""

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.api_types import EngineRequest
from engine.errors import InvalidRequestError
from engine.runner import compiles
from models.dense_generate import generate_dense
from tests.conftest import FULL_SIZES_ONLY

TINY_OPTS = dict(
    page_size=8, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=32, max_model_len=256
)


def mixed_prompts(n, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    return [[1] + rng.integers(3, vocab, int(rng.integers(1, 90))).tolist() for _ in range(n)]


def dense(llm, ids, max_tokens):
    """The dense oracle's greedy tokens; `llm`: an LLM or a loaded model (the conftest's
    `tiny_model`), whose weights it reads in their loader layout."""
    model = getattr(llm, "model", llm)
    return generate_dense(
        model.params,
        model.config,
        ids,
        max_tokens,
        eos_token_ids=model.tokenizer.eos_token_ids,
    )["token_ids"]


def assert_pool_empty(llm):
    pool = llm.engine.pool
    pool.check_invariants()
    assert pool.num_used_pages == 0
    assert not llm.engine.has_unfinished()


# Both weight layouts (models/llama.py `layer_layout`): the engine's layers scanned over
# stacked weights or unrolled over per-layer weights; the dense oracle always scans.
# "unrolled" is what "auto" picks on CPU (every other test's engine); "scan" is the extra one.
@pytest.fixture(
    scope="module", params=[pytest.param("scan", marks=pytest.mark.compile), "unrolled"]
)
def tiny_llm(request):
    return LLM("tiny", num_pages=200, layer_loop=request.param, **TINY_OPTS)


# NOTE: the oracle reads the loaded tiny model, not `tiny_llm`: both layouts are the same
# weights, and a fixture that asked for `tiny_llm` would run every test that takes the
# reference (the preemption, small-chunk and prefix-cache-off engines, which build their
# own) once per layout, the second time identical to the first.
@pytest.fixture(scope="module")
def tiny_reference(tiny_model):
    prompts = mixed_prompts(32)
    return prompts, [dense(tiny_model, p, 12) for p in prompts]


def check_against_dense(llm, prompts, expected, max_tokens=12):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    for o, want in zip(outs, expected):
        assert o.token_ids == want
        assert o.finish_reason == ("stop" if want[-1] in llm.tokenizer.eos_token_ids else "length")
    assert_pool_empty(llm)
    return outs


def test_32_mixed_prompts_match_dense_loop(tiny_llm, tiny_reference):
    outs = check_against_dense(tiny_llm, *tiny_reference)
    m = outs[0].metrics
    assert m.ttft_s > 0 and m.e2e_s >= m.ttft_s and m.queue_s >= 0
    assert len(m.itl_s) == len(outs[0].token_ids) - 1


@pytest.mark.compile
def test_tiny_pool_forces_preemption_and_still_matches(tiny_reference):
    # 23 pages of 8 tokens for 8 slots; a pool of its own is a program set of its own, kept
    # small (6 shapes: padding never changes a result)
    llm = LLM("tiny", num_pages=24, max_step_shapes=6, **TINY_OPTS)
    check_against_dense(llm, *tiny_reference)
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.compile
def test_small_prefill_chunk_matches(tiny_reference):
    llm = LLM(
        "tiny",
        num_pages=200,
        max_step_shapes=6,  # its own step budget, its own programs: few of them
        **{**TINY_OPTS, "prefill_chunk_size": 5, "max_num_batched_tokens": 16},
    )
    check_against_dense(llm, *tiny_reference)


@pytest.mark.compile
def test_prefix_cache_off_matches(tiny_reference):
    llm = LLM("tiny", num_pages=200, prefix_caching=False, **TINY_OPTS)
    check_against_dense(llm, *tiny_reference)
    assert llm.stats()["prefix_cache_hit_tokens"] == 0


def test_cancellation_mid_flight_leaves_others_unharmed(tiny_llm, tiny_reference):
    prompts, expected = tiny_reference
    core = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=12)
    for i, p in enumerate(prompts[:12]):
        core.add_request(EngineRequest(f"c{i}", p, params))
    results = {f"c{i}": [] for i in range(12)}
    reasons = {}
    for step in range(200):
        if step == 3:
            for i in (1, 4, 7):
                core.abort_request(f"c{i}")
        for out in core.step():
            results[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in reasons, "two outcomes for one request"
                reasons[out.request_id] = out.finish_reason
        if not core.has_unfinished():
            break
    assert len(reasons) == 12
    for i in range(12):
        if i in (1, 4, 7):
            assert reasons[f"c{i}"] == "cancelled"
        else:
            assert results[f"c{i}"] == expected[i]
    assert_pool_empty(tiny_llm)


def test_seeded_sampling_does_not_depend_on_batch(tiny_llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=1234)
    alone = tiny_llm.generate([[1, 5, 6, 7]], params)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=8, seed=s) for s in range(5)]
    batch = tiny_llm.generate(
        [[1, 9, 9]] * 2 + [[1, 5, 6, 7]] + [[1, 3]] * 3, others[:2] + [params] + others[2:5]
    )
    assert batch[2].token_ids == alone


def test_stop_conditions_and_logprobs(tiny_llm):
    prompt = [1, 10, 11, 12]
    free = tiny_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )[0]
    stop_id = free.token_ids[3]
    k = free.token_ids.index(stop_id)  # first occurrence
    out = tiny_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop_id,), logprobs=3)
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: k + 1]
    assert len(out.logprobs) == len(out.token_ids)
    assert all(len(lp.top) == 3 and lp.logprob <= 0 for lp in out.logprobs)
    assert out.logprobs[0].top[0][0] == out.token_ids[0]  # greedy picks the top token


def test_penalties_change_greedy_output(tiny_llm):
    prompt = [1, 10, 11, 12]
    plain = tiny_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )[0].token_ids
    pen = tiny_llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=2.0),
    )[0].token_ids
    assert len(set(pen)) >= len(set(plain))
    assert_pool_empty(tiny_llm)


def test_bad_requests_name_the_field(tiny_llm):
    core = tiny_llm.engine
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        core.add_request(EngineRequest("b1", [1, 999999], SamplingParams()))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        core.add_request(EngineRequest("b2", [1] * 250, SamplingParams(max_tokens=100)))
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        core.add_request(EngineRequest("b3", [], SamplingParams()))
    assert not core.has_unfinished()


def test_completion_output_carries_the_prompt_token_ids(tiny_llm):
    prompts = [[1, 5, 6, 7], "hi", [{"role": "user", "content": "hi"}]]
    outs = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2))
    assert [o.prompt_token_ids for o in outs] == [tiny_llm.encode_prompt(p) for p in prompts]
    assert outs[0].prompt_token_ids == [1, 5, 6, 7] and len(outs[2].prompt_token_ids) > 3


@pytest.mark.compile
def test_dtype_option_casts_the_params_and_the_engine_runs():
    import jax
    import jax.numpy as jnp

    from configs.engine_config import EngineConfig
    from engine.core import EngineCore
    from models.registry import load_model

    small = dict(TINY_OPTS, num_pages=32, max_num_seqs=2)
    llm = LLM("tiny", dtype="bfloat16", **small)
    assert {x.dtype for x in jax.tree.leaves(llm.engine.runner.params)} == {jnp.dtype(jnp.bfloat16)}
    out = llm.generate([[1, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))[0]
    assert len(out.token_ids) == 6 and all(0 <= t < 512 for t in out.token_ids)
    assert llm.stats()["weights_bytes"] * 2 == sum(
        x.size * 4 for x in jax.tree.leaves(load_model("tiny").params)
    )
    # An already loaded float32 model is cast by the engine (the LLM(model=LoadedModel) path).
    f32 = load_model("tiny")
    core = EngineCore(f32, EngineConfig(model="tiny", dtype="bfloat16", num_pages=32))
    assert {x.dtype for x in jax.tree.leaves(core.runner.params)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(f32.params)} == {jnp.dtype(jnp.float32)}
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int4")


def test_compile_counter_counts_each_new_program():
    import jax
    import jax.numpy as jnp

    compiles.install()

    @jax.jit
    def compile_counter_probe(x):
        return x * 2

    counts = []
    for x in (jnp.ones(3), jnp.ones(3), jnp.ones(4), jnp.ones(4)):
        compile_counter_probe(x)
        counts.append(compiles.count("jit(compile_counter_probe)"))
    assert counts == [1, 1, 2, 2]


@pytest.mark.compile
def test_no_recompilation_after_warmup():
    from engine.runner.warmup import reachable_shapes, warmup

    # A small config keeps the reachable set small (8 shapes) so the test compiles them all.
    llm = LLM(
        "tiny",
        num_pages=64,
        page_size=16,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        prefill_chunk_size=16,
        max_model_len=64,
    )
    assert len(reachable_shapes(llm.engine.sched_config)) == 8
    assert len(llm.engine.shapes) == 8  # small enough: the shape set is every reachable shape
    before = compiles.count()
    warmup(llm.engine, sampling=("greedy",))
    compiled = compiles.count()
    assert compiled > before  # the counter sees compiles (so the check below can fail)
    rng = np.random.default_rng(1)
    prompts = [[1] + rng.integers(3, 512, int(rng.integers(1, 40))).tolist() for _ in range(12)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert llm.stats()["num_steps"] > 60
    assert compiles.count() == compiled and llm.stats()["compiles_after_warmup"] == 0


def test_stats_report_memory(tiny_llm):
    s = tiny_llm.stats()
    for key in (
        "weights_bytes",
        "kv_bytes_total",
        "kv_bytes_used",
        "kv_pages_used",
        "kv_pages_free",
        "num_running",
        "num_waiting",
        "num_preemptions",
        "allocation_failures",
        "tokens_processed",
    ):
        assert key in s
    assert s["kv_bytes_total"] == 2 * 2 * 2 * 200 * 8 * 16 * 4  # K+V, L, K heads, pages...


@pytest.mark.slow  # the tiny engine above checks both layouts; SmolLM2 scan in full sizes
@pytest.mark.parametrize("layer_loop", ["unrolled", pytest.param("scan", marks=FULL_SIZES_ONLY)])
def test_smollm2_paged_matches_dense(smollm2, layer_loop):
    llm = LLM(
        smollm2,
        layer_loop=layer_loop,
        num_pages=256,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        prefill_chunk_size=64,
        max_model_len=512,
    )
    questions = [
        "What is the capital of France?",
        "Name three colors.",
        "Write a haiku about the sea.",
        "What is 2 + 2?",
        "Who wrote Hamlet?",
        "Explain gravity in one sentence.",
    ]
    prompts = [[{"role": "user", "content": q}] for q in questions]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    for p, o in zip(prompts, outs):
        assert o.token_ids == dense(llm, llm.encode_prompt(p), 24)[: len(o.token_ids)]
    assert "Paris" in outs[0].text
    assert_pool_empty(llm)
