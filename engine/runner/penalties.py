"""The per-slot token counts of repetition/presence/frequency penalties, on the device.

    counts       [max_num_seqs, V] int32  each slot's output token counts
    prompt_mask  [max_num_seqs, V] bool   each slot's prompt tokens (repetition penalty)

Both are fields of the runner's DeviceState (engine/runner/state.py) and arguments of every
step program (the "full" sampler always applies penalties, neutral for rows without: one
signature per shape), so they exist from the start; with a mesh they are [1, 1]
placeholders until warm-up or the first request with penalties (ModelRunner.full_program
says why). A request taking a slot gets its rows rewritten by one jitted reset whose token
lists are padded to max_model_len, so nothing compiles per prompt length; warm-up builds
that program too (engine/runner/warmup.py).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from engine.runner.state import DeviceState
from engine.sampling.sampler import init_counts, reset_slot_counts

reset_counts_jit = jax.jit(reset_slot_counts, donate_argnums=(0, 1))


def with_penalties(state: DeviceState, num_slots: int, vocab_size: int, place) -> DeviceState:
    """`state` with zeroed [num_slots, V] counts and prompt mask, placed by `place`."""
    counts, mask = init_counts(num_slots, vocab_size)
    return dataclasses.replace(state, counts=place(counts), prompt_mask=place(mask))


def reset_slot(
    state: DeviceState, slot: int, prompt_token_ids, output_token_ids, width: int
) -> DeviceState:
    """`state` with the rows of `slot` rewritten for a request holding these tokens. Token
    lists are padded to `width` (max_model_len), so one program serves every request."""
    prompt = np.zeros(width, np.int32)
    prompt[: len(prompt_token_ids)] = prompt_token_ids
    outs = np.zeros(width, np.int32)
    outs[: len(output_token_ids)] = output_token_ids
    counts, mask = reset_counts_jit(
        state.counts,
        state.prompt_mask,
        np.int32(slot),
        prompt,
        np.int32(len(prompt_token_ids)),
        outs,
        np.int32(len(output_token_ids)),
    )
    return dataclasses.replace(state, counts=counts, prompt_mask=mask)
