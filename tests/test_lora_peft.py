"""LoRA against the independent oracle: transformers + peft (torch, CPU, float32).

Real adapters made by `peft` on the transformers model (random non-zero A and B:
`init_lora_weights=False`), saved with `save_pretrained`, loaded into pagedjax: logits match
(allclose 1e-4 on a tiny random Llama; SmolLM2 from the GGUF within the base model's own
parity bound) and greedy continuations are identical, alone and in one mixed batch.
"""

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from configs import from_name
from models.dense_generate import DenseKVCache, dense_attention, generate_dense
from models.llama import forward, layer_layout
from models.lora import LoraInputs, adapter_slot_arrays, init_lora_weights, read_adapter, write_slot

pytestmark = pytest.mark.slow  # torch, transformers, peft

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ADAPTERS = {  # name -> LoraConfig fields (several target sets, ranks and scalings)
    "all-r8": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "qv-r4-rslora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "o-mlp-r2": dict(
        r=2, lora_alpha=32, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
}


def _tiny_base(path):
    """A tiny random Llama saved as safetensors (+ the tiny tokenizer, for LLM)."""
    from models.registry import tiny_tokenizer

    cfg = from_name("tiny")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer().backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, f)
    return str(path)


def _make_adapter(base_dir, out_dir, seed, **lora_config):
    """peft adapter with random non-zero A and B on a fresh copy of the base model."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **lora_config)
    model = peft.get_peft_model(base, config)
    model.save_pretrained(out_dir)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    base_dir = _tiny_base(root / "base")
    models = {
        name: _make_adapter(base_dir, str(root / name), seed, **kw)
        for seed, (name, kw) in enumerate(ADAPTERS.items())
    }
    return base_dir, root, models


def _logits(params, cfg, ids, lora):
    T = len(ids)
    positions = jnp.arange(T, dtype=jnp.int32)
    cache = DenseKVCache.zeros(cfg, T, jnp.float32)
    attention = dense_attention(cfg, positions)
    ids = jnp.asarray(ids, jnp.int32)
    return np.asarray(forward(params, cfg, ids, positions, cache, attention, lora=lora)[0])


def _one_slot(adapter, cfg, max_rank):
    """A stack of 2 slots with `adapter` in row slot 2 (the second)."""
    arrays = adapter_slot_arrays(adapter, cfg, max_rank)
    a = {f: x for f, (x, _) in arrays.items()}
    b = {f: x for f, (_, x) in arrays.items()}
    return write_slot(init_lora_weights(cfg, 2, max_rank), jnp.int32(1), a, b)


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
@pytest.mark.parametrize("name", list(ADAPTERS))
def test_logits_match_transformers_peft(tiny_setup, name, layer_loop):
    from models.loaders.hf_loader import load_hf_dir

    base_dir, root, models = tiny_setup
    cfg, params, _ = load_hf_dir(base_dir)
    adapter = read_adapter(str(root / name), cfg, max_rank=8)
    assert adapter.rank == ADAPTERS[name]["r"]
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, 24).tolist()
    ours = _logits(
        layer_layout(params, layer_loop),
        cfg,
        ids,
        LoraInputs(_one_slot(adapter, cfg, 8), jnp.full(24, 2, jnp.int32)),
    )
    with torch.no_grad():
        ref = models[name](torch.tensor([ids])).logits[0].numpy()
        with models[name].disable_adapter():
            base_ref = models[name](torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    assert np.abs(ref - base_ref).max() > 1e-2  # the adapter matters


def _hf_greedy(model, ids, n):
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def test_engine_greedy_matches_peft_alone_and_mixed(tiny_setup):
    from engine import LLM, SamplingParams

    base_dir, root, models = tiny_setup
    llm = LLM(
        base_dir,
        page_size=8,
        num_pages=32,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        max_loras=2,
        max_lora_rank=8,
    )
    names = ["all-r8", "qv-r4-rslora"]
    for n in names:
        llm.load_adapter(n, str(root / n))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    rng = np.random.default_rng(3)
    prompts = [[1] + rng.integers(3, 512, 15).tolist() for _ in range(3)]
    with torch.no_grad(), models[names[0]].disable_adapter():
        want = [_hf_greedy(models[names[0]], prompts[0], 12)]
    want += [_hf_greedy(models[n], p, 12) for n, p in zip(names, prompts[1:])]
    adapters = [None, *names]
    alone = [llm.generate([p], params, adapter=a)[0].token_ids for p, a in zip(prompts, adapters)]
    mixed = [o.token_ids for o in llm.generate(prompts, params, adapter=adapters)]
    assert alone == want
    assert mixed == want


@pytest.mark.skipif(
    os.environ.get("PAGEDJAX_FULL_SIZES") != "1",
    reason="SmolLM2-size run: make test-full-sizes (the tiny peft tests above run in make test)",
)
@pytest.mark.parametrize("layer_loop", ["unrolled"])
def test_smollm2_adapter_matches_transformers_peft(smollm2, tmp_path, layer_loop):
    folder, name = os.path.split(smollm2.source)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
    )
    model = peft.get_peft_model(base, config).eval()
    with torch.no_grad():  # PEFT's random B is large for a real model: keep the text sane
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.05)
    model.save_pretrained(tmp_path)
    cfg = smollm2.config
    adapter = read_adapter(str(tmp_path), cfg, max_rank=8)
    params = layer_layout(smollm2.params, layer_loop)
    ids = smollm2.tokenizer.encode("The capital of France is")
    lora = LoraInputs(_one_slot(adapter, cfg, 8), jnp.full(len(ids), 2, jnp.int32))
    ours = _logits(params, cfg, ids, lora)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
        with model.disable_adapter():
            base_ref = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ref - base_ref).max() > 0.1  # the adapter matters
    # the base model's own parity bound (tests/test_model_parity.py): float32 summation order
    assert np.abs(ours - ref).max() < 2e-3
    merged = _merged(params, adapter, layer_loop)
    got = generate_dense(merged, cfg, ids, 16)["token_ids"]
    assert got == _hf_greedy(model, ids, 16)


def _merged(params, adapter, layer_loop):
    """Greedy decoding through the merged weights (W + A @ B) as the engine-free check."""
    stacked = layer_layout(params, "scan")
    updates = {}
    for field in adapter.a:
        w = np.asarray(getattr(stacked.layers, field))
        a, b = adapter.a[field], adapter.b[field]
        d = np.einsum(
            "lir,lro->lio",
            a.reshape(a.shape[0], -1, a.shape[-1]),
            b.reshape(b.shape[0], b.shape[1], -1),
        )
        updates[field] = jnp.asarray(w + d.reshape(w.shape))
    layers = dataclasses.replace(stacked.layers, **updates)
    return layer_layout(dataclasses.replace(stacked, layers=layers), layer_loop)
