"""The `draft` proposer: a separate draft model with the target's tokenizer, run as pure
jitted functions over its OWN paged KV cache.

Pages. The draft cache has the target's page count and page size (and its own layers,
KV heads and head size), and is indexed by the target's page ids: a request's draft pages
are allocated, shared through the prefix cache and freed together with its target pages
by the one page pool. There is no second allocator, so nothing can leak or drift apart
(tests/test_spec_draft.py drives preemptions and cancellations and checks the pool).

Keeping the draft cache in step with the target's (the invariant: every position the
target has K/V for, the draft has too, for the same tokens):

    plain step          `fill` runs the draft model over the step's flat token batch
                        (same PackedBatch, shape and last_tokens: prefill chunks and
                        decodes), writing K/V only, before the target step runs
    speculative step    the k draft passes (engine/spec/layers.py draft_layers, all of the
                        draft's layers) write start .. start + k - 1 and draw the drafts
                        and q; then `fill` runs over the verify batch with the drafts
                        written in, which also writes the last draft's position (an all-
                        accepted run leaves no hole); then the target verifies
    rollback            as the target's: K/V past kv_len are stale, overwritten before read

So a prefix-cache hit finds both models' K/V of the same tokens in its pages. NOTE: KV
imported from another engine (engine/kv_transfer/transfer.py) fills only the target cache, and
this is not refused: such a request drafts from a draft cache with holes, which costs
acceptance but never correctness (the rule is exact for whatever q the drafts were drawn
from; the target's own K/V are complete).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig
from engine.batch.builder import BatchShape, PackedBatch, StepBatch
from engine.runner.kv_cache import PagedKVCache
from engine.runner.step import paged_attention_fn
from models.families import forward
from models.llama import Params, cast_params, layer_layout


class DraftTokenizerError(ValueError):
    """The draft model's tokenizer differs from the target's (its tokens mean other text)."""


def check_draft(target, draft) -> None:
    """Refuse a draft whose tokenizer or vocabulary differs from the target's."""
    want, got = target.identity.tokenizer_hash, draft.identity.tokenizer_hash
    if want != got:
        raise DraftTokenizerError(
            f"speculative.draft_model={draft.identity.name!r} is invalid: its tokenizer_hash "
            f"{got} differs from the target {target.identity.name!r}'s tokenizer_hash {want}"
        )
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"speculative.draft_model={draft.identity.name!r} is invalid: vocab_size "
            f"{draft.config.vocab_size} != the target's {target.config.vocab_size}"
        )


@functools.partial(jax.jit, static_argnames=("cfg", "shape", "impl"), donate_argnames=("kv_cache",))
def fill(
    params: Params,
    kv_cache: PagedKVCache,
    last_tokens: jax.Array,
    batch: PackedBatch,
    verify_rows: jax.Array | None = None,
    drafts: jax.Array | None = None,
    num_drafts: jax.Array | None = None,
    *,
    cfg: ModelConfig,
    shape: BatchShape,
    impl: str = "auto",
) -> PagedKVCache:
    """The draft model over one step's flat token batch: writes its K/V at every token of
    the batch (the target step's own slot mapping and page tables). With `drafts`
    ([Sv, k], engine/spec/step.py SpecBatch layout) the drafts replace the placeholder
    tokens at verify_rows[:, 1:] first, as the verify step does."""
    step: StepBatch = batch.unpack(shape)
    from_device = last_tokens[jnp.maximum(step.token_slots, 0)]  # [T]
    token_ids = jnp.where(step.token_slots >= 0, from_device, step.token_ids)  # [T]
    if drafts is not None:
        live = jnp.arange(drafts.shape[1])[None, :] < num_drafts[:, None]  # [Sv, k]
        at = jnp.where(live, verify_rows[:, 1:], token_ids.shape[0])  # [Sv, k]
        token_ids = token_ids.at[at.reshape(-1)].set(drafts.reshape(-1), mode="drop")
    attention = paged_attention_fn(cfg, step, shape, impl)
    one_row = jnp.zeros((1,), jnp.int32)  # K/V only: the head runs on one row
    _, kv_cache = forward(params, cfg, token_ids, step.positions, kv_cache, attention, one_row)
    return kv_cache


class DraftModel:
    """The draft model's weights, config and paged KV cache, beside the target's runner
    (engine/runner/model_runner.py: its device, page count, page size and dtypes)."""

    def __init__(self, target, draft, runner):
        """`target`, `draft`: LoadedModels (the draft checked against the target)."""
        check_draft(target, draft)
        config, sc = runner.config, runner.sched_config
        self.cfg = draft.config
        self.identity = draft.identity
        self.params = layer_layout(cast_params(draft.params, config.dtype), config.layer_loop)
        self.params = jax.device_put(self.params, runner.device)
        self.kv = PagedKVCache.zeros(
            self.cfg, sc.num_pages, sc.page_size, config.kv_dtype, sharding=runner.device
        )
        self.impl = runner.impl

    def fill(self, batch, shape: BatchShape, last_tokens: jax.Array, spec=None) -> None:
        """Dispatch `fill` for a step (before the target step: last_tokens is donated by
        it); `spec`: the speculative step's SpecBatch (drafts written in)."""
        packed = batch.pack() if isinstance(batch, StepBatch) else batch
        extra = () if spec is None else (spec.verify_rows, spec.drafts, spec.num_drafts)
        self.kv = fill(
            self.params, self.kv, last_tokens, packed, *extra,
            cfg=self.cfg, shape=shape, impl=self.impl,
        )  # fmt: skip
