"""LoRA adapters (models/lora.py, engine/lora/adapters.py).

Oracles: a numpy per-row reference for the batched delta; the model with the adapter MERGED
into its weights (W + scaling * A @ B, computed in numpy) for the forward and the engine;
each request alone for a mixed batch. The transformers + peft oracle is
tests/test_lora_peft.py (slow: torch).

Adapters here are written with numpy in PEFT's file format (the key names and the
adapter_config.json fields `peft.PeftModel.save_pretrained` writes; test_lora_peft.py checks
the real thing loads the same way).
"""

import dataclasses
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.lora.adapters import AdapterSlotsFullError, UnknownAdapterError
from models.dense_generate import DenseKVCache, dense_attention, generate_dense
from models.llama import forward, layer_layout
from models.lora import (
    LoraConfigError,
    LoraInputs,
    adapter_slot_arrays,
    init_lora_weights,
    lora_delta,
    lora_delta_gather,
    lora_row_mask,
    read_adapter,
    write_slot,
)
from models.lora_random import write_peft_adapter


def merged_params(params, adapter):
    """The base params with `adapter` merged: W + A @ B (scaling already folded into B)."""
    layers = params.layers
    updates = {}
    for field in adapter.a:
        w = np.asarray(getattr(layers, field))  # [L, *in, *out]
        a, b = adapter.a[field], adapter.b[field]  # [L, *in, r], [L, r, *out]
        delta = np.einsum(
            "lir,lro->lio",
            a.reshape(a.shape[0], -1, a.shape[-1]),
            b.reshape(b.shape[0], b.shape[1], -1),
        )
        updates[field] = jnp.asarray(w + delta.reshape(w.shape))
    return dataclasses.replace(params, layers=dataclasses.replace(layers, **updates))


# ---- reading adapters ------------------------------------------------------------------------
def test_read_adapter_layout_and_scaling(tmp_path, tiny_model):
    cfg = tiny_model.config
    path = write_peft_adapter(tmp_path / "a", cfg, targets=("q_proj", "o_proj"), r=4, alpha=8)
    ad = read_adapter(path, cfg, max_rank=8)
    assert ad.targets == ("wo", "wq") and ad.rank == 4 and ad.scaling == 2.0
    assert ad.a["wq"].shape == (cfg.num_layers, cfg.hidden_size, 4)
    assert ad.b["wq"].shape == (cfg.num_layers, 4, cfg.num_heads, cfg.head_dim)
    assert ad.a["wo"].shape == (cfg.num_layers, cfg.num_heads, cfg.head_dim, 4)
    from safetensors.numpy import load_file

    t = load_file(os.path.join(path, "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.q_proj"
    np.testing.assert_array_equal(ad.a["wq"][1], t[key + ".lora_A.weight"].T)
    np.testing.assert_allclose(
        ad.b["wq"][1].reshape(4, -1), 2.0 * t[key + ".lora_B.weight"].T, rtol=1e-6
    )
    rs = read_adapter(write_peft_adapter(tmp_path / "rs", cfg, r=4, alpha=8, rslora=True), cfg, 8)
    assert rs.scaling == 8 / math.sqrt(4)  # PEFT's rank-stabilized scaling
    assert rs.content_hash != ad.content_hash and rs.content_hash.startswith("sha256:")


@pytest.mark.parametrize(
    "kwargs, field, needle",
    [
        (dict(r=32), "r", "max_lora_rank=16"),
        (
            dict(targets=("q_proj",), target_modules=["q_proj", "embed_tokens"]),
            "target_modules",
            "supported",
        ),
        (dict(use_dora=True), "use_dora", "only False"),
        (dict(rank_pattern={"q_proj": 8}), "rank_pattern", "only None"),
        (
            dict(targets=("q_proj",), target_modules=["q_proj", "k_proj"]),
            "target_modules",
            "no tensors",
        ),
    ],
)
def test_bad_adapter_configs_name_the_field(tmp_path, tiny_model, kwargs, field, needle):
    path = write_peft_adapter(tmp_path / "a", tiny_model.config, **kwargs)
    with pytest.raises(LoraConfigError) as e:
        read_adapter(path, tiny_model.config, max_rank=16)
    assert e.value.field == field and needle in str(e.value)


def test_adapter_for_another_base_model_is_rejected(tmp_path, tiny_model):
    other = dataclasses.replace(tiny_model.config, ffn_size=96)
    path = write_peft_adapter(tmp_path / "a", other, targets=("down_proj",))
    with pytest.raises(LoraConfigError, match=r"down_proj\.lora_A\.weight shape.*\(4, 128\)"):
        read_adapter(path, tiny_model.config, max_rank=16)
    deeper = dataclasses.replace(tiny_model.config, num_layers=3)
    path = write_peft_adapter(tmp_path / "b", deeper, targets=("q_proj",))
    with pytest.raises(LoraConfigError, match="layer 2 >= num_layers=2"):
        read_adapter(path, tiny_model.config, max_rank=16)
    with pytest.raises(FileNotFoundError, match="adapter_config.json is missing"):
        read_adapter(str(tmp_path / "nowhere"), tiny_model.config, max_rank=16)


# ---- the batched delta -------------------------------------------------------------------------
def test_lora_delta_matches_per_row_reference():
    rng = np.random.default_rng(0)
    T, N, R, in_shape, out_shape = 7, 3, 4, (3, 4), (5,)
    x = rng.normal(size=(T, *in_shape)).astype(np.float32)
    a = rng.normal(size=(*in_shape, N, R)).astype(np.float32)
    b = rng.normal(size=(N, R, *out_shape)).astype(np.float32)
    rows = np.array([0, 1, 2, 3, 0, 3, 1], np.int32)  # 0 = base, s = stored slot s - 1
    want = np.zeros((T, *out_shape), np.float32)
    for t, s in enumerate(rows):
        if s:
            want[t] = x[t].reshape(-1) @ a.reshape(-1, N, R)[:, s - 1] @ b[s - 1]
    mask = lora_row_mask(jnp.asarray(rows), N, R, jnp.float32)
    np.testing.assert_allclose(lora_delta(x, a, b, mask), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        lora_delta_gather(x, a, b, jnp.asarray(rows)), want, rtol=1e-5, atol=1e-5
    )


def _dense_logits(params, cfg, ids, lora=None):
    T = len(ids)
    positions = jnp.arange(T, dtype=jnp.int32)
    cache = DenseKVCache.zeros(cfg, T, jnp.float32)
    attention = dense_attention(cfg, positions)
    logits, _ = forward(
        params, cfg, jnp.asarray(ids, jnp.int32), positions, cache, attention, lora=lora
    )
    return np.asarray(logits)


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_forward_with_adapter_equals_merged_weights(tmp_path, tiny_model, layer_loop):
    cfg, params = tiny_model.config, tiny_model.params
    ad = read_adapter(write_peft_adapter(tmp_path / "a", cfg, r=3, alpha=6, scale=0.3), cfg, 4)
    stack = init_lora_weights(cfg, max_loras=2, max_rank=4)
    arrays = adapter_slot_arrays(ad, cfg, 4)
    stack = write_slot(
        stack,
        jnp.int32(1),
        {f: a for f, (a, _) in arrays.items()},
        {f: b for f, (_, b) in arrays.items()},
    )  # row slot id 2
    ids = np.random.default_rng(1).integers(3, cfg.vocab_size, 12)
    run = layer_layout(params, layer_loop)
    plain = _dense_logits(run, cfg, ids)
    as_base = _dense_logits(run, cfg, ids, LoraInputs(stack, jnp.zeros(12, jnp.int32)))
    np.testing.assert_array_equal(as_base, plain)  # slot 0 adds exact zeros
    with_adapter = _dense_logits(run, cfg, ids, LoraInputs(stack, jnp.full(12, 2, jnp.int32)))
    merged = _dense_logits(layer_layout(merged_params(params, ad), layer_loop), cfg, ids)
    np.testing.assert_allclose(with_adapter, merged, atol=1e-4, rtol=1e-4)
    assert np.abs(with_adapter - plain).max() > 1e-2  # the adapter does change the logits


# ---- the engine ---------------------------------------------------------------------------------
OPTS = dict(
    page_size=8,
    num_pages=24,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    prefill_chunk_size=32,
    max_model_len=64,
    max_loras=2,
    max_lora_rank=8,
)
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = [[1] + np.random.default_rng(i).integers(3, 512, 20).tolist() for i in range(3)]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("adapters")
    cfg = tiny_model.config
    return {
        "a1": write_peft_adapter(root / "a1", cfg, r=4, alpha=16, scale=0.3, seed=1),
        "a2": write_peft_adapter(
            root / "a2",
            cfg,
            targets=("q_proj", "v_proj", "down_proj"),
            r=8,
            alpha=8,
            rslora=True,
            scale=0.3,
            seed=2,
        ),
        "a1_v2": write_peft_adapter(root / "a1_v2", cfg, r=4, alpha=16, scale=0.3, seed=3),
    }


@pytest.fixture(scope="module")
def llm(tiny_model, adapter_dirs):
    llm = LLM(tiny_model, **OPTS)
    llm.load_adapter("a1", adapter_dirs["a1"])
    llm.load_adapter("a2", adapter_dirs["a2"])
    return llm


def _oracle(tiny_model, adapter_dir, prompt):
    params = tiny_model.params
    if adapter_dir is not None:
        params = merged_params(params, read_adapter(adapter_dir, tiny_model.config, 8))
    return generate_dense(params, tiny_model.config, prompt, GREEDY.max_tokens)["token_ids"]


@pytest.mark.compile
def test_engine_matches_merged_dense_oracle_and_mixed_batch_equals_alone(
    llm, tiny_model, adapter_dirs
):
    names = [None, "a1", "a2"]
    alone = [llm.generate([p], GREEDY, adapter=n)[0] for p, n in zip(PROMPTS, names)]
    for out, name, prompt in zip(alone, names, PROMPTS):
        want = _oracle(tiny_model, adapter_dirs.get(name), prompt)
        assert out.token_ids == want, name
        assert (out.adapter is None) == (name is None)
    # one batch: base, a1, a2 and a1 again on the base's prompt, all in the same steps
    mixed = llm.generate(PROMPTS + [PROMPTS[0]], GREEDY, adapter=names + ["a1"])
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    assert mixed[3].token_ids == _oracle(tiny_model, adapter_dirs["a1"], PROMPTS[0])
    assert mixed[3].token_ids != alone[0].token_ids  # the adapter changes the continuation
    assert mixed[1].adapter.content_hash == llm.adapters()["a1"].content_hash


@pytest.mark.compile
def test_prefix_cache_never_crosses_adapters(llm, tiny_model, adapter_dirs):
    prompt = [1] + np.random.default_rng(9).integers(3, 512, 30).tolist()  # 3 full pages
    llm.engine.clear_prefix_cache()

    def cached(name):
        return llm.generate([prompt], GREEDY, adapter=name)[0].metrics.cached_tokens

    assert cached("a1") == 0
    assert cached("a1") == 24  # same adapter: its pages hit
    assert cached("a2") == 0  # another adapter: no page shared
    assert cached(None) == 0  # the base model: none either
    assert cached(None) == 24
    first = llm.generate([prompt], GREEDY, adapter="a1")[0]
    llm.load_adapter("a1", adapter_dirs["a1_v2"])  # same name, new content
    try:
        again = llm.generate([prompt], GREEDY, adapter="a1")[0]
        assert again.metrics.cached_tokens == 0  # new content never hits old pages
        assert again.adapter.content_hash != first.adapter.content_hash
        assert again.token_ids == _oracle(tiny_model, adapter_dirs["a1_v2"], prompt)
    finally:
        llm.load_adapter("a1", adapter_dirs["a1"])


@pytest.mark.compile
def test_loading_and_swapping_adapters_compiles_nothing(llm, adapter_dirs):
    from engine.runner import compiles

    llm.generate(PROMPTS, GREEDY, adapter=["a1", "a2", None])  # shapes of this workload
    before = compiles.count("engine_step")
    llm.unload_adapter("a2")
    llm.load_adapter("a2", adapter_dirs["a1_v2"])
    llm.generate(PROMPTS, GREEDY, adapter=["a2", "a1", None])
    llm.load_adapter("a2", adapter_dirs["a2"])
    assert compiles.count("engine_step") == before


@pytest.mark.compile
def test_adapter_errors(llm, tiny_model, adapter_dirs):
    with pytest.raises(UnknownAdapterError, match="adapter='nope' is invalid: not loaded"):
        llm.generate(PROMPTS[:1], GREEDY, adapter="nope")
    with pytest.raises(UnknownAdapterError):
        llm.unload_adapter("nope")
    with pytest.raises(AdapterSlotsFullError, match="max_loras=2"):
        llm.load_adapter("a3", adapter_dirs["a1_v2"])
    with pytest.raises(LoraConfigError, match="max_lora_rank=8"):
        big = write_peft_adapter(
            os.path.dirname(adapter_dirs["a1"]) + "/big", tiny_model.config, r=16
        )
        llm.load_adapter("big", big)
    assert set(llm.adapters()) == {"a1", "a2"}  # failed loads changed nothing


def _spec_prompts():
    rng = np.random.default_rng(4)
    return [[1] + rng.integers(3, 512, 6).tolist() * 3 for _ in range(3)]


def _spec_engine(tiny_model, adapter_dirs, spec):
    on = LLM(tiny_model, speculative=dict(spec, disable_by_batch_size=None), **OPTS)
    for name in ("a1", "a2"):
        on.load_adapter(name, adapter_dirs[name])
    return on


@pytest.mark.compile
def test_ngram_speculation_verifies_each_request_under_its_adapter(llm, tiny_model, adapter_dirs):
    """Speculative decoding beside adapters: drafts = each request's own continuation under
    its adapter (speculation off), so they are accepted only if the verify step runs that
    request's rows under the same adapter; base, a1 and a2 requests share the steps."""
    prompts, names = _spec_prompts(), [None, "a1", "a2"]
    want = [o.token_ids for o in llm.generate(prompts, GREEDY, adapter=names)]
    on = _spec_engine(tiny_model, adapter_dirs, dict(num_speculative_tokens=3))
    future = {tuple(p): p + w for p, w in zip(prompts, want)}
    on.engine.spec.proposer = lambda req, k: future[tuple(req.prompt_token_ids)][
        req.num_known_tokens : req.num_known_tokens + k
    ]
    assert [o.token_ids for o in on.generate(prompts, GREEDY, adapter=names)] == want
    stats = on.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"] > 0, stats


@pytest.mark.compile
def test_layers_speculation_drafts_under_each_request_adapter(llm, tiny_model, adapter_dirs):
    """The layers proposer with every layer (N = L) drafts with the request's own model, so
    q == p and every draft is accepted only if the draft passes run under the request's
    adapter too (a base-model draft would miss where the adapter changes the argmax). A
    separate draft model cannot run the target's adapters: refused."""
    prompts, names = _spec_prompts(), [None, "a1", "a2"]
    want = [o.token_ids for o in llm.generate(prompts, GREEDY, adapter=names)]
    L = tiny_model.config.num_layers
    spec = dict(method="layers", num_draft_layers=L, num_speculative_tokens=3)
    on = _spec_engine(tiny_model, adapter_dirs, spec)
    assert [o.token_ids for o in on.generate(prompts, GREEDY, adapter=names)] == want
    stats = on.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"] > 0, stats
    with pytest.raises(NotImplementedError, match="LoRA"):
        LLM(tiny_model, speculative=dict(method="draft", draft_model="tiny"), **OPTS)


def test_engine_without_lora_has_no_adapter_state(tiny_model):
    from configs.engine_config import EngineConfig
    from engine.core import EngineCore

    core = EngineCore(tiny_model, EngineConfig(model="tiny", num_pages=8, max_num_seqs=2))
    assert core.adapters is None and core.runner.adapters is None
    from engine.api_types import EngineRequest

    with pytest.raises(UnknownAdapterError, match="no adapter is loaded"):
        core.add_request(EngineRequest("r", [1, 2, 3], GREEDY, adapter="a1"))
    assert not core.has_unfinished()
    with pytest.raises(ValueError, match="max_loras=-1 is invalid"):
        EngineConfig(max_loras=-1)


@pytest.mark.compile
def test_lora_bench_smoke(tmp_path):
    from benchmarks import lora_bench

    res = lora_bench.main(["--smoke", f"--json={tmp_path / 'bench.json'}"])
    assert set(res["cases"]) == {"base", "lora-0", "lora-1", "lora-4"}
    for row in res["cases"].values():
        assert row["output_tokens"] == 4 * 4 and row["output_tok_s"] > 0
    assert json.loads((tmp_path / "bench.json").read_text())["concurrency"] == 4
