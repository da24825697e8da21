"""The device step of a speculative batch: the normal ragged step, plus verification of
k+1 positions for each speculating sequence (engine/spec/rule.py).

A speculating sequence s sits in the prefill group of the StepBatch (engine/batch/builder.py) as a
chunk of query_len 1 + num_drafts[s]: its last known token followed by its drafts, so the
model writes their K/V and returns logits at every one of those rows. `SpecBatch` says
where those rows are and what was drafted (Sv = speculating sequences, padded; k static):

    verify_rows [Sv, k+1] int32   flat token row of each verified position (pad: row 0)
    drafts      [Sv, k]   int32   drafted tokens (pad: 0)
    num_drafts  [Sv]      int32   drafts of each sequence (0: padding sequence)
    sampling    SamplingTensors, rows [Sv * (k+1)]: the sequence's own parameters, `step`
                = the output index the token at that position would have

    (params, state: DeviceState, batch, spec)
        -> (state, packed [Sd + Sp, 2 + 2K], spec_packed [Sv * (k+1), 2 + 2K],
            num_accepted [Sv])

engine/runner/model_runner.py's ModelRunner.verify runs it over the runner's state.

The normal rows (plain decodes and prefill chunks mixed in the same step) are sampled
exactly as engine/runner/step.py does; a speculating sequence's own normal row is masked out by
the host (sample_mask 0). Each verified position is sampled by the same `sample` a plain
step runs (its own seed and output index), and the drafts are accepted by the point-mass
rule on those draws; spec_packed holds, per verified position, the emitted token (-1 past
the correction), its target logprob and the top-K target logprobs, exactly as a plain
step reports them. With `draft_probs` (a model proposer's q), the drafts come from
device, are written into the token ids here, and the general rule accept_drafts(p, q)
decides (keys salted apart from the sampler's, engine/spec/layers.py). The caller runs
speculative steps
synchronously (engine/spec/decode.py says why), so `last_tokens` is not written for
speculating rows: every input token of the next step is known on the host.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig
from engine.batch.builder import BatchShape, PackedBatch, StepBatch
from engine.runner.state import DeviceState
from engine.runner.step import NONFINITE_TOKEN, paged_attention_fn, replicated
from engine.sampling.sampler import (
    SamplingFlags,
    SamplingTensors,
    sample,
    update_counts,
)
from engine.spec.layers import ACCEPT_SALT, RESIDUAL_SALT, row_keys
from engine.spec.rule import accept_drafts, accept_point_mass_drafts, processed_logits, target_probs
from models.families import forward
from models.llama import Params
from models.lora import LoraInputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecBatch:
    verify_rows: jax.Array  # [Sv, k+1] int32
    drafts: jax.Array  # [Sv, k] int32
    num_drafts: jax.Array  # [Sv] int32
    sampling: SamplingTensors  # rows [Sv * (k+1)]


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "shape", "flags", "use_penalties", "impl", "mesh"),
    donate_argnames=("state",),
)
def spec_engine_step(
    params: Params,
    state: DeviceState,
    batch: PackedBatch,
    spec: SpecBatch,
    *,
    cfg: ModelConfig,
    shape: BatchShape,
    flags: SamplingFlags,
    use_penalties: bool,
    impl: str = "auto",
    draft_probs: jax.Array | None = None,
    lora: LoraInputs | None = None,
    mesh=None,
):
    """See the module docstring. `mesh`: None or the engine's mesh, as engine_step takes it
    (attention per shard, logits and results replicated).
    `draft_probs` [Sv, k, V]: q of a model proposer (engine/spec/layers.py), whose drafts
    (`spec.drafts`, on device) replace the placeholder draft tokens of the batch; None: a
    point-mass proposer (ngram). `lora`: each token row's adapter (engine/lora/adapters.py),
    as engine_step takes it: a speculating sequence's verified rows run under its adapter."""
    kv_cache, counts, last_tokens = state.kv, state.counts, state.last_tokens
    batch: StepBatch = batch.unpack(shape)
    Sv, k1 = spec.verify_rows.shape
    attention = paged_attention_fn(cfg, batch, shape, impl, mesh)
    from_device = last_tokens[jnp.maximum(batch.token_slots, 0)]  # [T]
    token_ids = jnp.where(batch.token_slots >= 0, from_device, batch.token_ids)  # [T]
    if draft_probs is not None:  # the drafts never went to the host: write them in here
        live = jnp.arange(k1 - 1)[None, :] < spec.num_drafts[:, None]  # [Sv, k]
        at = jnp.where(live, spec.verify_rows[:, 1:], token_ids.shape[0])  # [Sv, k]
        token_ids = token_ids.at[at.reshape(-1)].set(spec.drafts.reshape(-1), mode="drop")
    rows = jnp.concatenate([batch.logits_indices, spec.verify_rows.reshape(-1)])
    logits, kv_cache = forward(
        params, cfg, token_ids, batch.positions, kv_cache, attention, rows, lora
    )  # [Sd + Sp + Sv * (k+1), V]
    if mesh is not None:  # sampling sees the full (all-gathered) logits on every device
        logits = jax.lax.with_sharding_constraint(logits, replicated(mesh))
    R = batch.logits_indices.shape[0]
    normal, verified = logits[:R], logits[R:]  # [Sd + Sp, V], [Sv * (k+1), V]
    # ---- the normal rows: as engine/runner/step.py ----
    if use_penalties:
        result = sample(
            normal,
            batch.sampling,
            counts[batch.slot_ids],
            state.prompt_mask[batch.slot_ids],
            flags,
        )
        counts = update_counts(counts, batch.slot_ids, result.tokens, batch.sample_mask)
    else:
        result = sample(normal, batch.sampling, flags=flags)
    finite = jnp.all(jnp.isfinite(normal), axis=-1)  # [Sd + Sp]
    write_to = jnp.where(batch.sample_mask & finite, batch.slot_ids, last_tokens.shape[0])
    last_tokens = last_tokens.at[write_to].set(result.tokens, mode="drop")
    result.tokens = jnp.where(finite, result.tokens, NONFINITE_TOKEN)
    # ---- the verified rows: each position sampled as a plain step would, then the rule
    # for point-mass drafts (engine/spec/rule.py) ----
    drawn = sample(verified, spec.sampling, flags=flags)  # rows [Sv * (k+1)]
    if draft_probs is None:
        accepted = accept_point_mass_drafts(
            drawn.tokens.reshape(Sv, k1), spec.drafts, spec.num_drafts
        )
    else:
        accepted = _accept_model_drafts(verified, spec, draft_probs)
        drawn.logprobs = _token_logprobs(verified, spec.sampling, accepted.tokens.reshape(-1))
    drawn.tokens = accepted.tokens.reshape(-1)  # -1 past the correction / bonus
    seq_finite = jnp.all(jnp.isfinite(verified).reshape(Sv, -1), axis=-1)  # [Sv]
    num_accepted = jnp.where(seq_finite, accepted.num_accepted, NONFINITE_TOKEN)
    packed, spec_packed, prompt_mask = result.pack(), drawn.pack(), state.prompt_mask
    if mesh is not None:  # replicated, as engine_step returns them
        packed, spec_packed, num_accepted, counts, prompt_mask, last_tokens = (
            jax.lax.with_sharding_constraint(
                (packed, spec_packed, num_accepted, counts, prompt_mask, last_tokens),
                replicated(mesh),
            )
        )
    state = DeviceState(kv_cache, counts, prompt_mask, last_tokens)
    return state, packed, spec_packed, num_accepted


def _accept_model_drafts(verified: jax.Array, spec: SpecBatch, q: jax.Array):
    """The general rule (engine/spec/rule.py accept_drafts) with the draft's q [Sv, k, V]
    and the target's p at the verified rows, both after the request's transforms."""
    Sv, k1 = spec.verify_rows.shape
    p = target_probs(verified, spec.sampling).reshape(Sv, k1, -1)  # [Sv, k+1, V]
    greedy = spec.sampling.temperature.reshape(Sv, k1)[:, 0] <= 0  # [Sv]
    accept_keys = row_keys(spec.sampling, ACCEPT_SALT).reshape(Sv, k1)
    residual_keys = row_keys(spec.sampling, RESIDUAL_SALT).reshape(Sv, k1)
    return accept_drafts(p, q, spec.drafts, spec.num_drafts, greedy, accept_keys, residual_keys)


def _token_logprobs(logits: jax.Array, tensors: SamplingTensors, tokens: jax.Array):
    """[R] log-probability of tokens [R] under log_softmax(processed logits), as the
    sampler reports it (-1 tokens: any value, never read)."""
    lg = processed_logits(logits, tensors)  # [R, V]
    lse = jax.nn.logsumexp(lg, axis=-1)  # [R]
    chosen = jnp.take_along_axis(lg, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
    return chosen - lse
