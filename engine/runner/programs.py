"""EngineCore's device side: which step program a step runs, and dispatching or building it.

    flags, use_penalties, bitmask = _sampler_program(built, structured_bitmask(...))
    packed = run_step(batch, shape, flags, use_penalties, bitmask)   the jitted engine_step
    compile_step(shape, flags, use_penalties, bitmask)               the same program, built
                                                                     only (warm-up)

Each step shape has two sampler programs at most (engine/runner/shapes.py sampler_variants):
"greedy" (argmax only) and "full" (sampling, logprobs, penalties and structured output's
token bitmask in one program), so every program a step can run is one warm-up builds, and
`_check_compiles` logs the ones built after warm-up. A mixin of EngineCore (engine/core.py),
separate from the host loop because the arguments of `engine_step` (its jit cache keys)
are decided here and nowhere else; it reads the state EngineCore sets up: params, kv, the
token counts (engine/runner/penalties.py), last_tokens, cfg, impl, mesh, spec, adapters.
`run_step` and `compile_step` are the seams warm-up, benchmarks and multi-host
(engine/parallel/distributed.py LeaderEngineCore) call, fake or override.
"""

from __future__ import annotations

import logging

import numpy as np

from engine.batch.builder import BatchShape, BuiltStep, StepBatch
from engine.runner import compiles
from engine.runner.shapes import sampler_variants
from engine.runner.step import engine_step
from engine.sampling.sampler import FULL_FLAGS, GREEDY_FLAGS, SamplingFlags
from engine.sched.scheduler import SchedulerOutput
from engine.structured.matcher import StructuredRequests, bitmask_width

log = logging.getLogger("engine.core")  # NOTE: the logger these warnings always had


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


class StepPrograms:
    """EngineCore's step programs: choosing, dispatching and building them (see above)."""

    # ---- shapes (#21.3): which of a shape's two programs a step runs --------------------
    def _sampler_program(self, built: BuiltStep, bitmask: np.ndarray | None) -> tuple:
        """(flags, use_penalties, token_bitmask) of a step: "greedy" (argmax only) when the
        shape is decode-only and every row is greedy, unconstrained, without logprobs or
        penalties; else "full", which always applies penalties (neutral for rows without)
        and a token bitmask (all tokens allowed when no row is constrained), so one program
        per shape serves every other request (engine/runner/shapes.py sampler_variants)."""
        greedy_ok = "greedy" in sampler_variants(built.shape) or self.mesh is not None
        if greedy_ok and not (built.full_sampler or built.penalties or bitmask is not None):
            return GREEDY_FLAGS, False, None
        use_penalties, all_allowed = self.full_program(built.shape)
        return (
            FULL_FLAGS,
            use_penalties or built.penalties,
            all_allowed if bitmask is None else bitmask,
        )

    def full_program(self, shape: BatchShape) -> tuple[bool, np.ndarray | None]:
        """(use_penalties, token_bitmask) of the "full" program an unconstrained step runs.
        NOTE: with a mesh the sampler programs stay as they were before the shape set was
        made small (greedy on every shape, penalties and the bitmask variants of their own,
        compiled on first use, token counts allocated on first use): the sharded step's
        full sampler crashed XLA:CPU's compiler on a greedy workload (an
        optimization_barrier cast check, tests/test_multihost.py); not investigated."""
        if self.mesh is not None:
            return False, None
        return True, self.all_allowed(shape)

    def all_allowed(self, shape: BatchShape) -> np.ndarray:
        """[Sd + Sp, ceil(V/32)] int32 all ones: the full program's bitmask when no row is
        constrained (numpy, like structured output's own masks: one jit signature)."""
        rows = shape.num_decode + shape.num_prefill_seqs
        mask = self._all_allowed.get(rows)
        if mask is None:
            mask = np.full((rows, bitmask_width(self.cfg.vocab_size)), -1, np.int32)
            mask.flags.writeable = False
            self._all_allowed[rows] = mask
        return mask

    # ---- end shapes ----

    # ---- device ---------------------------------------------------------------------------
    def run_step(
        self,
        batch: StepBatch,
        shape: BatchShape,
        flags: SamplingFlags,
        use_penalties,
        token_bitmask: np.ndarray | None = None,
    ):
        """Dispatch one device step (also used by warm-up); returns the packed results on
        device without waiting for them. `token_bitmask`: structured output's allowed
        tokens per sampler row (None: the unconstrained program)."""
        # ---- speculative decoding: a draft model's cache follows every step (engine/spec/draft.py)
        if self.spec is not None and self.spec.draft is not None:
            self.spec.draft.fill(batch, shape, self._last_tokens)
        # ---- end speculative decoding
        self.kv, self._counts, self._last_tokens, packed = engine_step(
            self.params,
            self.kv,
            self._counts,
            self._prompt_mask,
            self._last_tokens,
            batch.pack() if isinstance(batch, StepBatch) else batch,
            **self._static_args(shape, flags, use_penalties),
            lora=self._lora_inputs(batch if isinstance(batch, StepBatch) else None, shape),
            # NOTE: passed only when set: an explicit None is another jit cache key than
            # the default, so warm-up's programs would not be found.
            **({} if token_bitmask is None else {"token_bitmask": token_bitmask}),
        )
        return packed

    def compile_step(
        self,
        shape: BatchShape,
        flags: SamplingFlags,
        use_penalties: bool,
        token_bitmask: np.ndarray | None = None,
    ) -> None:
        """Build the step program of `shape` (compile, or load from the persistent cache)
        without running it: `jit.lower(...).compile()` fills the cache a call then uses."""
        engine_step.lower(
            self.params,
            self.kv,
            self._counts,
            self._prompt_mask,
            self._last_tokens,
            StepBatch.zeros(shape).pack(),
            **self._static_args(shape, flags, use_penalties),
            lora=self._lora_inputs(None, shape),
            **({} if token_bitmask is None else {"token_bitmask": token_bitmask}),
        ).compile()

    def _static_args(self, shape: BatchShape, flags: SamplingFlags, use_penalties: bool) -> dict:
        return dict(
            cfg=self.cfg,
            shape=shape,
            flags=flags,
            use_penalties=use_penalties,
            impl=self.impl,
            mesh=self.mesh,
        )

    # ---- compiles after warm-up (engine/runner/compiles.py) -------------------------------
    def mark_warm(self, warmup_s: float) -> None:
        """Called by engine/runner/warmup.py: programs built from now on are counted as compiles
        after warm-up."""
        self.warmup_s = warmup_s
        self._compiles_at_warmup = compiles.count()
        self._logged_compiles = 0

    def _check_compiles(self, shape: BatchShape, flags: SamplingFlags) -> None:
        """Logs each program built after warm-up once, with the step that built it (what
        the server's pagedjax_compiles_after_warmup_total counts)."""
        if self._compiles_at_warmup is None:
            return
        after = compiles.count() - self._compiles_at_warmup
        if after > self._logged_compiles:
            log.warning(
                "%d program(s) compiled after warm-up (step shape %s, %s sampler)",
                after - self._logged_compiles,
                shape,
                "greedy" if flags.all_greedy else "full",
            )
            self._logged_compiles = after
