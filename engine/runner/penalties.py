"""EngineCore's token counts for repetition/presence/frequency penalties, on the device.

    _counts       [max_num_seqs, V] int32  each slot's output token counts
    _prompt_mask  [max_num_seqs, V] bool   each slot's prompt tokens (repetition penalty)

Both are arguments of every step program (the "full" sampler always applies penalties,
neutral for rows without: one signature per shape), so they exist from the start; with a
mesh they are [1, 1] placeholders until warm-up or the first request with penalties
(engine/runner/programs.py full_program says why). A request taking a slot gets its row
rewritten by one jitted reset whose token lists are padded to max_model_len, so nothing
compiles per prompt length; warm-up builds that program too (engine/runner/warmup.py).

A mixin of EngineCore (engine/core.py), separate because it is the one piece of per-slot
sampling state that lives on the device rather than in BatchBuilder's numpy rows; it reads
sched_config, cfg and `_place` (device placement) from EngineCore. engine/parallel/distributed.py's
LeaderEngineCore overrides `_reset_penalty_row` to replay it on the other processes.
"""

from __future__ import annotations

import jax
import numpy as np

from engine.sampling.sampler import init_counts, reset_slot_counts
from engine.sched.request import Request

reset_counts_jit = jax.jit(reset_slot_counts, donate_argnums=(0, 1))


class PenaltyState:
    """The [max_num_seqs, V] token counts and prompt mask of the penalty sampler."""

    def init_penalty_state(self) -> None:
        """Allocate the [max_num_seqs, V] token counts (on first use, or at warm-up)."""
        if not self._penalties_ready:
            counts, mask = init_counts(self.sched_config.max_num_seqs, self.cfg.vocab_size)
            self._counts, self._prompt_mask = self._place(counts), self._place(mask)
            self._penalties_ready = True

    def _reset_penalty_row(self, slot: int, req: Request) -> None:
        """Counts of a request taking a slot. Token lists are padded to max_model_len, so
        one program serves every request (nothing compiles per prompt length)."""
        self.init_penalty_state()
        width = self.sched_config.max_model_len
        prompt = np.zeros(width, np.int32)
        prompt[: req.num_prompt_tokens] = req.prompt_token_ids
        outs = np.zeros(width, np.int32)
        outs[: req.num_output_tokens] = req.output_token_ids
        self._counts, self._prompt_mask = reset_counts_jit(
            self._counts,
            self._prompt_mask,
            np.int32(slot),
            prompt,
            np.int32(req.num_prompt_tokens),
            outs,
            np.int32(req.num_output_tokens),
        )
