"""The `layers` proposer: self-speculation from the target's first N layers plus its own
final norm and LM head (no second model).

The first N layers of the target, run over a prefix, compute exactly the target's own K/V
for those layers, so the draft needs no cache of its own: it reads and writes the target's
pages for layers < N. For Sv speculating sequences (k static, P pages per sequence):

    first_tokens [Sv]     int32  the last known token of each sequence (position `start`)
    start        [Sv]     int32  its position (= num_computed_tokens when scheduled)
    page_table   [Sv, P]  int32  the sequence's pages, covering start + num_drafts (the
                                 scheduler gave the lookahead pages before this runs)
    num_drafts   [Sv]     int32  drafts wanted (0: padding sequence)
    sampling     SamplingTensors rows [Sv * (k+1)], as SpecBatch.sampling (row j*(k+1) + i
                                 has step = the output index of draft i)

    draft pass i = 0..k-1 (a lax.scan): the token at position start + i (the last known
    token, then draft i-1) goes through layers < N as a one-token decode, writing its
    layer-< N K/V at start + i; final norm + LM head give logits; q_i = the request's
    sampling transforms applied to them (engine/spec/rule.py target_probs: temperature,
    top-k, top-p, min-p, min_tokens ban; greedy rows get a point mass); x_i ~ q_i.

    -> (kv_cache, drafts [Sv, k] int32, q [Sv, k, V] float32)

With LoRA adapters (`lora`: the engine's slot stack, row_slots [Sv] = each sequence's
adapter slot) the draft passes run under each request's adapter, its first N layers'
part (`truncated_lora`), so q is the truncated model of that request, not the base's.

Rows past a sequence's num_drafts write the null page and their q is unused. The verify
pass (engine/spec/step.py) then runs all layers over start..start + num_drafts, rewriting
those positions' K/V for every layer, so the draft's layer-< N writes are overwritten with
the same values; rejected positions are rolled back exactly as for ngram drafts
(engine/spec/decode.py). Because q is the real draft distribution (not a point mass), the
verify step applies the general rule min(1, p/q) with residual max(0, p - q)
(engine/spec/rule.py accept_drafts). Randomness: the draw of x_i, the acceptance uniform
and the residual draw use keys fold_in(fold_in(key(seed), output index), salt) with three
different salts, so they are independent of each other and of the ordinary sampler, and a
seeded request is reproducible (but, unlike ngram's coupled rule, not token-identical to
spec-off sampling; greedy is identical).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig
from engine.runner.kv_cache import PagedKVCache
from engine.sampling.sampler import SamplingTensors
from engine.sched.page_pool import NULL_PAGE
from engine.spec.rule import target_probs
from models.families import forward
from models.llama import LayerWeights, Params
from models.lora import LoraInputs
from pallas_kernels import decode_paged_attention, write_kv

DRAFT_SALT, ACCEPT_SALT, RESIDUAL_SALT = 1, 2, 3


def row_keys(tensors: SamplingTensors, salt: int) -> jax.Array:
    """[R] threefry keys fold_in(fold_in(key(seed), step), salt): one per row, independent
    across salts (and of engine.sampling.sampler's own key, which has no salt)."""
    keys = jax.random.wrap_key_data(tensors.key_data, impl="threefry2x32")  # [R]
    keys = jax.vmap(jax.random.fold_in)(keys, tensors.step)  # [R]
    return jax.vmap(lambda key: jax.random.fold_in(key, salt))(keys)  # [R]


def truncated(params: Params, cfg: ModelConfig, num_layers: int) -> tuple[Params, ModelConfig]:
    """The target's first `num_layers` layers with its own embedding, final norm and head."""
    if isinstance(params.layers, LayerWeights):  # stacked [L, ...]
        layers = jax.tree.map(lambda a: a[:num_layers], params.layers)
    else:
        layers = tuple(params.layers[:num_layers])
    per_layer = {}  # a family's per-layer config fields (Gemma 3's layer_types) are cut too
    if getattr(cfg, "layer_types", None):
        per_layer["layer_types"] = cfg.layer_types[:num_layers]
    return dataclasses.replace(params, layers=layers), dataclasses.replace(
        cfg, num_layers=num_layers, **per_layer
    )


def truncated_lora(lora: LoraInputs, num_layers: int) -> LoraInputs:
    """The adapter stack's first `num_layers` layers (stacked [L, ...] or one per layer)."""
    if isinstance(lora.weights, tuple):
        weights = tuple(lora.weights[:num_layers])
    else:
        weights = jax.tree.map(lambda a: a[:num_layers], lora.weights)
    return dataclasses.replace(lora, weights=weights)


def _decode_attention(cfg: ModelConfig, slots, kv_lens, page_table, impl: str):
    """The model's attention for one token per sequence over the paged cache."""
    sm_scale = 1.0 / math.sqrt(cfg.head_dim)

    def attention(q, k, v, layer, cache: PagedKVCache, sliding_window=cfg.sliding_window):
        kp, vp, ks, vs = write_kv(
            cache.k_pages, cache.v_pages, k, v, slots, layer,
            k_scales=cache.k_scales, v_scales=cache.v_scales,
        )  # fmt: skip
        out = decode_paged_attention(
            q, kp, vp, kv_lens, page_table, layer,
            sm_scale=sm_scale, sliding_window=sliding_window, impl=impl,
            k_scales=ks, v_scales=vs,
        )  # fmt: skip  # [Sv, H, hd]
        return out.astype(q.dtype), PagedKVCache(kp, vp, ks, vs)

    return attention


@functools.partial(
    jax.jit, static_argnames=("cfg", "num_layers", "k", "impl"), donate_argnames=("kv_cache",)
)
def draft_layers(
    params: Params,
    kv_cache: PagedKVCache,
    first_tokens: jax.Array,
    start: jax.Array,
    page_table: jax.Array,
    num_drafts: jax.Array,
    sampling: SamplingTensors,
    *,
    cfg: ModelConfig,
    num_layers: int | None,
    k: int,
    impl: str = "auto",
    lora: LoraInputs | None = None,
):
    """See the module docstring: k draft passes of the first `num_layers` layers (None:
    all of them: a separate draft model over its own cache, engine/spec/draft.py).
    `lora`: row_slots [Sv], each sequence's adapter slot (None: no adapters)."""
    Sv = first_tokens.shape[0]
    page_size = kv_cache.k_pages.shape[3]
    draft_params, draft_cfg = params, cfg
    if num_layers is not None:
        draft_params, draft_cfg = truncated(params, cfg, num_layers)
        lora = None if lora is None else truncated_lora(lora, num_layers)
    rows = jax.tree.map(lambda a: a.reshape(Sv, k + 1, *a.shape[1:])[:, :k], sampling)
    keys = row_keys(jax.tree.map(lambda a: a.reshape(Sv * k, *a.shape[2:]), rows), DRAFT_SALT)
    keys = keys.reshape(Sv, k)

    def one_pass(carry, i):
        cache, tokens = carry  # tokens [Sv]: the input token at position start + i
        pos = start + i  # [Sv]
        live = i < num_drafts  # [Sv]
        page = jnp.take_along_axis(page_table, (pos // page_size)[:, None], axis=1)[:, 0]
        slots = jnp.where(live, page * page_size + pos % page_size, NULL_PAGE * page_size)
        kv_lens = jnp.where(live, pos + 1, 1)  # [Sv]
        attention = _decode_attention(draft_cfg, slots, kv_lens, page_table, impl)
        logits, cache = forward(draft_params, draft_cfg, tokens, pos, cache, attention, None, lora)
        tensors = jax.tree.map(lambda a: a[:, i], rows)  # rows [Sv]
        q = target_probs(logits, tensors)  # [Sv, V]
        g = jax.vmap(lambda key: jax.random.gumbel(key, (q.shape[-1],)))(keys[:, i])  # [Sv, V]
        x = jnp.argmax(jnp.log(q) + g, axis=-1).astype(jnp.int32)  # [Sv] x ~ q
        return (cache, x), (x, q)

    (kv_cache, _), (drafts, q) = jax.lax.scan(
        one_pass, (kv_cache, first_tokens.astype(jnp.int32)), jnp.arange(k)
    )  # drafts [k, Sv], q [k, Sv, V]
    return kv_cache, drafts.T, jnp.swapaxes(q, 0, 1)
