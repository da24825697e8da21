"""Local-layer page release (`EngineConfig.release_local_pages`): the sliding-window layers
of a Gemma-3-shaped model keep one ring of R pages per sequence slot (engine/runner/kv_cache.py
WindowedKVCache), the full-attention layers pool pages for the whole context.

- the ring arithmetic: every position a step writes or reads lives in a distinct ring page
  (checked by simulating chunked prefill and decode over 4,000 positions),
- the KV memory arithmetic of the planner (bytes per token with and without release),
- the refusals (prefix caching, speculative decoding, a model without a local/global split),
- a 4,000-token context through the engine: the local group holds R pages per slot whatever
  the context, the pool holds only the global layers, and the outputs equal the engine
  without release (logprobs) and transformers (greedy tokens)."""

import dataclasses
import math

import numpy as np
import pytest

from configs import kv_memory
from configs.engine_config import EngineConfig
from configs.model_config import from_name

WINDOW, PAGE, CHUNK = 32, 8, 32


def _gemma3_config(**kw):
    from models.gemma3 import GLOBAL, LOCAL, Gemma3Config

    return Gemma3Config(
        name="gemma3-shaped",
        num_layers=6,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=1,
        ffn_size=128,
        vocab_size=512,
        head_dim=256,
        sliding_window=512,
        layer_types=(LOCAL,) * 5 + (GLOBAL,),
        **kw,
    )


@pytest.mark.parametrize("window,page_size,chunk", [(32, 8, 16), (33, 8, 1), (512, 16, 256)])
def test_ring_pages_cover_every_position_a_step_touches(window, page_size, chunk):
    """Simulate one sequence (chunks of <= `chunk`, then decodes) in the slot-3 ring: after
    each step's writes, every position its queries may see is still in its ring page."""
    from engine.runner.kv_cache import ring_page_table

    ring = kv_memory.ring_pages(window, page_size, chunk)
    if chunk == 1:
        assert ring <= math.ceil(window / page_size) + 1
    table = np.asarray(ring_page_table(np.array([3], np.int32), 4000 // page_size + 1, ring))[0]
    holder: dict[int, int] = {}  # ring page -> logical page written there last
    rng = np.random.default_rng(window)
    start = 0
    while start < 4000:
        n = min(int(rng.integers(1, chunk + 1)), 4000 - start) if start < 3000 else 1
        for pos in range(start, start + n):
            holder[int(table[pos // page_size])] = pos // page_size
        first_visible = max(0, start - window + 1)
        for logical in range(first_visible // page_size, (start + n - 1) // page_size + 1):
            assert holder[int(table[logical])] == logical, (start, n, logical)
        start += n
    assert set(holder) == set(range(1 + 3 * ring, 1 + 4 * ring))  # slot 3's pages only


def test_ring_pages_formula():
    assert kv_memory.ring_pages(32, 8, 1) == 5 == math.ceil(32 / 8) + 1
    assert kv_memory.ring_pages(32, 8, 16) == 7  # + the chunk written before it attends
    assert kv_memory.ring_pages(512, 16, 256) == 49
    with pytest.raises(ValueError, match="max_query_len=0"):
        kv_memory.ring_pages(32, 8, 0)


def test_kv_bytes_per_token_with_release():
    """Gemma 3 270M's shape (18 layers, 15 local with window 512, 1 KV head of 256):
    32k tokens cost 3/18 of the layers' bytes plus 15 rings, not 18 layers' worth."""
    from models.gemma3 import GLOBAL, LOCAL

    types = ((LOCAL,) * 5 + (GLOBAL,)) * 3
    cfg = dataclasses.replace(_gemma3_config(), num_layers=18, layer_types=types)
    per_layer = 2 * 1 * 256 * 2  # K and V, 1 head, hd 256, bfloat16
    n = 32768
    plain = kv_memory.kv_bytes_per_token_in_context(cfg, n, "bfloat16")
    assert plain == 18 * per_layer
    released = kv_memory.kv_bytes_per_token_in_context(
        cfg, n, "bfloat16", release_local_pages=True, page_size=16, max_query_len=256
    )
    ring_tokens = kv_memory.ring_pages(512, 16, 256) * 16
    assert released == pytest.approx((3 * n + 15 * ring_tokens) * per_layer / n)
    assert released < plain / 4
    # a short context holds no more than its own pages either way
    short = kv_memory.kv_bytes_per_token_in_context(cfg, 100, "bfloat16", release_local_pages=True)
    assert short == kv_memory.kv_bytes_per_token_in_context(cfg, 100, "bfloat16")


def test_pool_pages_count_global_layers_only():
    cfg = _gemma3_config()
    plain = EngineConfig(kv_cache_bytes=2**30, prefix_caching=False)
    released = EngineConfig(kv_cache_bytes=2**30, prefix_caching=False, release_local_pages=True)
    per_page = kv_memory.kv_bytes_per_token_per_layer(cfg, "float32") * 16
    assert plain.num_pages_for(cfg) == 2**30 // (6 * per_page)
    R = released.local_ring_pages(cfg)
    rings = 5 * per_page * (1 + 64 * R)
    assert released.num_pages_for(cfg) == (2**30 - rings) // per_page


def test_refusals_name_the_fields():
    with pytest.raises(ValueError, match="prefix_caching=True"):
        EngineConfig(release_local_pages=True)
    with pytest.raises(ValueError, match="speculative="):
        EngineConfig(release_local_pages=True, prefix_caching=False, speculative="ngram:k=2")
    config = EngineConfig(release_local_pages=True, prefix_caching=False)
    with pytest.raises(ValueError, match="'smollm2-135m'.*Gemma 3"):
        config.local_ring_pages(from_name("smollm2-135m"))
    assert config.local_ring_pages(_gemma3_config()) == kv_memory.ring_pages(512, 16, 256)


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory):
    """A tiny random Gemma 3 (transformers' own config class) with window 32."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from models.registry import tiny_tokenizer

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        num_hidden_layers=4,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
        final_logit_softcapping=5.0,
    )
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.config._attn_implementation = "eager"
    folder = tmp_path_factory.mktemp("gemma3_window")
    model.save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer().backend.save(str(folder / "tokenizer.json"))
    return model.eval(), str(folder)


@pytest.mark.slow
@pytest.mark.compile
def test_4000_token_context_holds_a_window_of_local_pages(gemma3_folder):
    import torch

    from engine import LLM, SamplingParams
    from engine.runner.kv_cache import PagedKVCache, WindowedKVCache

    ref_model, folder = gemma3_folder
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, 4000).tolist(), rng.integers(3, 512, 45).tolist()]
    # the short request decodes while the long one prefills, until the pool (a little larger
    # than the long request) runs out: the short one is preempted and recomputed later
    max_tokens = (8, 150)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in max_tokens
    ]
    num_pages = math.ceil(4008 / PAGE) + 1 + 12
    results = {}
    for release in (False, True):
        llm = LLM(
            folder,
            page_size=PAGE,
            max_num_seqs=2,
            max_num_batched_tokens=2 * CHUNK,
            prefill_chunk_size=CHUNK,
            max_model_len=4096,
            num_pages=num_pages,
            prefix_caching=False,
            max_step_shapes=4,
            release_local_pages=release,
        )
        core = llm.engine
        results[release] = llm.generate(prompts, params)
        if not release:
            assert isinstance(core.runner.state.kv, PagedKVCache)
            continue
        kv = core.runner.state.kv
        assert isinstance(kv, WindowedKVCache)
        R = kv_memory.ring_pages(WINDOW, PAGE, CHUNK)
        assert kv.ring_pages == R <= math.ceil(WINDOW / PAGE) + 1 + math.ceil((CHUNK - 1) / PAGE)
        # the local group: R pages per slot (+ its null page), whatever the context length
        assert kv.num_local_pages == 1 + 2 * R
        assert kv.local.k_pages.shape[0] == 3 and kv.full.k_pages.shape[0] == 1
        # the pool's pages hold the one global layer only, and all came back
        assert kv.full.k_pages.shape[2] == num_pages
        assert core.pool.num_used_pages == 0
        assert core.scheduler.num_preemptions >= 1
    for plain, released in zip(results[False], results[True]):
        assert released.token_ids == plain.token_ids
        np.testing.assert_allclose(
            [t.logprob for t in released.logprobs],
            [t.logprob for t in plain.logprobs],
            atol=1e-5,
        )
    for prompt, out, n in zip(prompts, results[True], max_tokens):
        with torch.no_grad():
            x = torch.tensor([prompt])
            ref = ref_model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out.token_ids == ref, len(prompt)
