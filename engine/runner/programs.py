"""Which compiled program a step runs: `StepProgram`, and structured output's bitmask.

Each step shape has two sampler programs at most (engine/runner/shapes.py sampler_variants):
"greedy" (argmax only) and "full" (sampling, logprobs, penalties and structured output's
token bitmask in one program), so every program a step can run is one warm-up builds.
ModelRunner.program (engine/runner/model_runner.py) picks one per step; its fields are the
arguments of `engine_step` that are jit cache keys (plus the bitmask, whose presence is).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from engine.batch.builder import BuiltStep
from engine.sampling.sampler import GREEDY_FLAGS, SamplingFlags
from engine.sched.scheduler import SchedulerOutput
from engine.structured.matcher import StructuredRequests


class StepProgram(NamedTuple):
    """A step program of a shape: the sampler flags, whether penalties apply, and the
    [Sd + Sp, ceil(V/32)] int32 token bitmask (None: the program without one)."""

    flags: SamplingFlags
    use_penalties: bool
    token_bitmask: np.ndarray | None = None


GREEDY_PROGRAM = StepProgram(GREEDY_FLAGS, False, None)


def structured_bitmask(
    structured: StructuredRequests, plan: SchedulerOutput, built: BuiltStep
) -> np.ndarray | None:
    """[Sd + Sp, ceil(V/32)] int32 allowed tokens of the sampler rows (structured output),
    or None when no sampling row of the step is constrained."""
    if not structured.active:  # the common step: no per-row pass
        return None
    rows = [
        (int(r), s.request.request_id)
        for s, r in zip(plan.scheduled, built.sampler_rows)
        if s.samples and s.request.request_id in structured
    ]
    if not rows:
        return None
    ids: list[str | None] = [None] * (built.shape.num_decode + built.shape.num_prefill_seqs)
    for r, rid in rows:
        ids[r] = rid
    return structured.bitmask(ids, len(ids))
