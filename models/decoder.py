"""The decoder scaffold every family's `forward` runs: embed -> layer loop -> final norm -> head.

A family supplies its layer body; the scaffold owns what is the same for all of them:
- the layer loop over stacked weights (`jax.lax.scan`) or a tuple of per-layer weights
  (unrolled; `models.llama.layer_layout`),
- LoRA: the body's `proj(field, h, num_in)` adds each row's adapter term when `lora` is set,
- layer kinds: a family whose layers differ statically (Gemma 3's local / global attention)
  gives `layer_kinds` (one hashable per layer); consecutive layers of one kind are scanned
  together, so each run traces one body with its kind as a Python value,
- the LM head (tied or not, int8 or float) and optional final logit soft-capping.

    body(x [T, D], cache, w (one layer's weights), layer int32, kind, proj) -> (x, cache)

A family with an auxiliary per-layer output (models/families.py `AUX_OUTPUT`: MoE expert
token counts) runs with `with_aux=True`: its body then returns (x, cache, aux) and the
scaffold stacks the layers' aux in layer order, [L, ...], beside the logits. Without it the
traced program is the plain one.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from models.layers import proj as plain_proj
from models.layers import rms_norm, soft_cap
from models.lora import LoraInputs, LoraWeights, lora_delta, lora_row_mask
from models.quant import linear

Array = jax.Array
ProjFn = Callable[[str, Array, int], Array]
LayerBody = Callable[[Array, Any, Any, Array, Hashable, ProjFn], tuple[Array, Any]]


def _proj_fn(w, lw, lora_mask) -> ProjFn:
    def proj(field: str, h: Array, num_in: int = 1) -> Array:
        y = plain_proj(h, getattr(w, field), num_in)
        if lw is not None:  # static: without LoRA the traced program is unchanged
            y = y + lora_delta(h, lw.a[field], lw.b[field], lora_mask)
        return y

    return proj


def _runs(kinds: Sequence[Hashable]) -> list[tuple[int, int, Hashable]]:
    """[(start, end, kind)] of consecutive layers of one kind."""
    out, start = [], 0
    for kind, group in itertools.groupby(kinds):
        n = len(list(group))
        out.append((start, start + n, kind))
        start += n
    return out


def decoder_forward(
    params,
    cfg,
    token_ids: Array,
    positions: Array,
    cache: Any,
    body: LayerBody,
    logits_indices: Array | None = None,
    lora: LoraInputs | None = None,
    *,
    layer_kinds: Sequence[Hashable] | None = None,
    embed_scale: float | None = None,
    norm_offset: float = 0.0,
    final_softcap: float | None = None,
    with_aux: bool = False,
) -> tuple[Array, Any] | tuple[Array, Any, Array]:
    """Returns (logits [R, V] float32, cache), with `with_aux` also the layers' aux [L, ...];
    see the module doc for `body`."""
    x = params.embed[token_ids]  # [T, D]
    if embed_scale is not None:  # Gemma: sqrt(D), rounded to the weights' dtype first
        x = x * jnp.asarray(embed_scale, x.dtype)
    kinds = tuple(layer_kinds) if layer_kinds is not None else (None,) * cfg.num_layers
    lora_weights, lora_mask = None, None
    if lora is not None:
        lora_weights = lora.weights  # stacked, or one per layer (like params.layers)
        first = lora_weights[0] if isinstance(lora_weights, tuple) else lora_weights
        lora_mask = lora_row_mask(lora.row_slots, first.num_slots, first.max_rank, x.dtype)

    def step(kind, carry, xs):
        x, cache = carry
        w, layer, lw = xs
        out = body(x, cache, w, layer, kind, _proj_fn(w, lw, lora_mask))
        return (out[:2], out[2]) if with_aux else (out, None)

    auxes = []  # with_aux: [layers of the run, ...] per run, or one per unrolled layer

    if not isinstance(params.layers, tuple):  # stacked [L, ...]: one traced body per run
        for start, end, kind in _runs(kinds):
            whole = start == 0 and end == cfg.num_layers

            def sl(a, s=start, e=end):
                return a[s:e]

            ws = params.layers if whole else jax.tree.map(sl, params.layers)
            lw = lora_weights
            if lw is not None and not whole:
                lw = jax.tree.map(sl, lw)
            xs = (ws, jnp.arange(start, end, dtype=jnp.int32), lw)
            (x, cache), aux = jax.lax.scan(functools.partial(step, kind), (x, cache), xs)
            auxes.append(aux)
    else:  # a tuple of per-layer weights: the layers unrolled, each reads its own arrays
        for i, w in enumerate(params.layers):
            lw = lora_weights
            if isinstance(lw, LoraWeights):  # NOTE: a stacked slot stack: slice (copies)
                lw = jax.tree.map(lambda a, i=i: a[i], lw)
            elif lw is not None:
                lw = lw[i]
            (x, cache), aux = step(kinds[i], (x, cache), (w, jnp.int32(i), lw))
            auxes.append(None if aux is None else aux[None])
    if logits_indices is not None:
        x = x[logits_indices]  # [R, D]
    x = rms_norm(x, params.final_norm, cfg.norm_eps, norm_offset)
    head = params.embed.T if params.lm_head is None else params.lm_head  # [D, V]
    logits = linear(x, head, "RD,DV->RV", out_dtype=jnp.float32)
    if with_aux:
        return soft_cap(logits, final_softcap), cache, jnp.concatenate(auxes)
    return soft_cap(logits, final_softcap), cache
