"""models.llama.layer_layout: stacked <-> per-layer weights, and one forward for both."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import from_name
from configs.engine_config import EngineConfig
from models.dense_generate import DenseKVCache, dense_attention
from models.llama import LayerWeights, forward, init_params, layer_layout


@pytest.fixture(scope="module", params=[False, True], ids=["llama", "qwen2-bias"])
def tiny(request):
    cfg = dataclasses.replace(from_name("tiny"), attention_bias=request.param)
    return cfg, init_params(cfg, jax.random.key(0), scale=0.2)


def test_round_trip_and_auto_on_cpu(tiny):
    cfg, params = tiny
    unrolled = layer_layout(params, "unrolled")
    assert isinstance(unrolled.layers, tuple) and len(unrolled.layers) == cfg.num_layers
    assert unrolled.layers[1].wq.shape == params.layers.wq.shape[1:]
    assert (unrolled.layers[0].bq is None) == (not cfg.attention_bias)
    back = layer_layout(unrolled, "scan")
    assert isinstance(back.layers, LayerWeights)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    assert layer_layout(params, "scan") is params and layer_layout(unrolled, "unrolled") is unrolled
    assert isinstance(layer_layout(params, "auto").layers, tuple)  # the tests run on CPU


def test_forward_gives_the_same_logits_on_both_layouts(tiny):
    cfg, params = tiny
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, 24), jnp.int32)
    pos = jnp.arange(24, dtype=jnp.int32)

    @jax.jit
    def logits(p):
        cache = DenseKVCache.zeros(cfg, 24)
        return forward(p, cfg, ids, pos, cache, dense_attention(cfg, pos))[0]

    np.testing.assert_allclose(
        logits(params), logits(layer_layout(params, "unrolled")), rtol=1e-5, atol=1e-5
    )


def test_bad_layer_loop_names_the_field():
    with pytest.raises(ValueError, match="layer_loop='unroll'"):
        layer_layout(init_params(from_name("tiny"), jax.random.key(0)), "unroll")
    with pytest.raises(ValueError, match="layer_loop='fast'"):
        EngineConfig(layer_loop="fast")
