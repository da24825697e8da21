"""Speculative decoding beside the engine loop (host side): propose, verify, commit.

`SpecDecoder` is the speculator of one EngineCore. It holds public collaborators only (the
core's ModelRunner, Scheduler, BatchBuilder and OutputProcessor); the core drives one
speculative step (EngineCore._spec_step) in this order:

    1. drain: an overlapped step still in flight is finished first (its tokens are needed)
    2. propose (`propose`): each running decode gets up to k drafts (engine/spec/ngram.py),
       capped so that the step can never emit more than max_tokens; rows with penalties do
       not speculate (their counts would change inside the step). Model proposers (layers,
       draft) propose k placeholders here and draw the real drafts on device after the
       build (`prepare`, engine/spec/layers.py, engine/spec/draft.py)
    3. schedule: a decode with drafts computes 1 + len(drafts) tokens (the scheduler gives
       it the lookahead pages; drafts are dropped rather than preempting anyone)
    4. build (`prepare`): the speculating decodes go in the prefill group with query_len
       1 + drafts, mixed with plain decodes and prefill chunks (engine/batch/builder.py);
       `SpecBatch` names their k+1 verified rows (engine/spec/step.py)
    5. verify on device (ModelRunner.verify: the exact rule, engine/spec/rule.py), one
       device->host copy
    6. commit (`commit`) each speculating request: the n accepted drafts + 1
       correction/bonus token are appended one by one with the stop checks (EOS, stop ids,
       stop strings, max_tokens: a stop inside the run truncates there); then rollback
       (Scheduler.roll_back_drafts, BatchBuilder.trim_pages):

           before: computed = start + 1 + len(drafts)   pages cover it (lookahead)
           after:  computed = start + 1 + n             K/V of rejected drafts are stale
                   page_ids cut to pages_for_tokens(num_tokens): lookahead pages freed
                   (stale K/V in a kept page sits past kv_len and is overwritten before
                   it is ever read)

       and only then the prefix cache registers full pages, so it never holds an
       unverified token (cache_full_pages counts computed tokens, which now exclude them).

Why not overlapped: proposing needs the tokens of the previous step on the host, and an
accepted run changes how many tokens the next step starts from, which the overlapped loop
(engine/core.py) fixes one step ahead. Speculation pays at small batches, where the
device step is short and the overlap saves little; at larger batches the policy below
turns speculation off and the engine runs overlapped again. So speculative steps are
synchronous, and the engine switches per step: speculate (synchronous) while at most
`disable_by_batch_size` requests run, plain overlapped steps above.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np

from configs.spec_config import SpeculativeConfig
from engine.api_types import RequestOutput, TokenLogprob
from engine.batch.builder import BatchShape, BuiltStep, StepBatch
from engine.runner.programs import StepProgram
from engine.runner.shapes import ShapeSet, spec_shapes
from engine.runner.step import NONFINITE_ERROR, NONFINITE_TOKEN
from engine.sampling.logprobs import row_logprob
from engine.sampling.sampler import (
    SampleResult,
    SamplingTensors,
    greedy_sampler_rows,
    uses_penalties,
)
from engine.spec.draft import DraftModel, fill
from engine.spec.layers import draft_layers
from engine.spec.ngram import propose_ngram
from engine.spec.step import SpecBatch
from models.lora import LoraInputs


@dataclasses.dataclass
class SpecStats:
    """Counters of one engine's speculation (in EngineCore.stats() as spec_*)."""

    k: int
    verify_steps: int = 0  # steps that verified at least one sequence
    plain_steps: int = 0  # steps run without speculation (policy off or no draft)
    verified_seqs: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # accepted + corrections/bonuses
    draft_s: float = 0.0  # host time proposing
    verify_s: float = 0.0  # device step of speculative steps (dispatch to results)
    accepted_hist: list = None  # [k+1]: verified sequences that accepted 0..k drafts
    drafted_by_position: list = None  # [k]
    accepted_by_position: list = None  # [k]

    def __post_init__(self):
        self.accepted_hist = [0] * (self.k + 1)
        self.drafted_by_position = [0] * self.k
        self.accepted_by_position = [0] * self.k

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.verified_seqs += 1
        self.drafted_tokens += num_drafts
        self.accepted_tokens += num_accepted
        self.emitted_tokens += num_accepted + 1
        self.accepted_hist[num_accepted] += 1
        for j in range(num_drafts):
            self.drafted_by_position[j] += 1
            self.accepted_by_position[j] += j < num_accepted

    def as_dict(self) -> dict:
        n = max(self.verified_seqs, 1)
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_plain_steps": self.plain_steps,
            "spec_verified_seqs": self.verified_seqs,
            "spec_drafted_tokens": self.drafted_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_acceptance_rate": self.accepted_tokens / max(self.drafted_tokens, 1),
            # tokens a verified sequence emits per verify step (1 = nothing gained)
            "spec_tokens_per_verify": self.emitted_tokens / n,
            "spec_accepted_hist": list(self.accepted_hist),
            "spec_acceptance_by_position": [
                a / max(d, 1) for a, d in zip(self.accepted_by_position, self.drafted_by_position)
            ],
            "spec_draft_ms_per_step": 1e3 * self.draft_s / max(self.verify_steps, 1),
            "spec_verify_ms_per_step": 1e3 * self.verify_s / max(self.verify_steps, 1),
        }


MAX_BACKOFF_TOKENS = 32


def back_off(req, num_accepted: int) -> None:
    """Acceptance backoff: a verify step that accepted none of a request's drafts makes it
    skip drafting for its next 2, 4, 8, ... 32 output tokens (doubling per consecutive
    miss); an accepted draft resets it. Drafts that keep failing (a free-form story) then
    stop costing verify positions and, once no running request drafts, the engine runs
    plain overlapped steps again (`should_speculate`)."""
    if num_accepted:
        req.spec_misses, req.spec_resume_at = 0, 0
        return
    req.spec_misses += 1
    wait = min(2**req.spec_misses, MAX_BACKOFF_TOKENS)
    req.spec_resume_at = req.num_output_tokens + 1 + wait  # + 1: the token this step emits


@dataclasses.dataclass
class Proposal:
    """A speculative step's drafts, ready to verify: which scheduled requests speculate,
    the SpecBatch of their verified rows, and a model proposer's q [Sv, k, V] (None for
    point-mass drafts)."""

    indices: list[int]  # positions in plan.scheduled of the speculating requests
    batch: SpecBatch
    draft_probs: jax.Array | None = None


class SpecDecoder:
    """The speculator of one EngineCore (see the module docstring): `runner` (the core's
    ModelRunner) runs the model proposers and holds the target's state; `scheduler`,
    `builder`, `outputs` are the core's own, used through their public methods."""

    def __init__(
        self, config: SpeculativeConfig, *, model, runner, scheduler, builder, outputs, shapes
    ):
        """`model`: the target's LoadedModel (a draft model is checked against it);
        `shapes`: the engine's ShapeSet (verify shapes are added to it)."""
        if runner.mesh is not None and config.method != "ngram":
            # NOTE: draft_layers runs the decode kernel unsharded (WORKSPACE.md)
            raise NotImplementedError(
                f"speculative decoding method {config.method!r} with a mesh: only 'ngram'"
            )
        if runner.adapters is not None and config.method == "draft":
            # NOTE: a request's adapter fits the target's weights, not another network's
            # (ngram needs no model; layers drafts under the adapter; WORKSPACE.md)
            raise NotImplementedError(
                "speculative decoding method 'draft' with LoRA adapters (max_loras > 0): "
                "the draft model cannot run a request's adapter; use 'ngram' or 'layers'"
            )
        self.runner, self.scheduler, self.builder, self.outputs = (
            runner,
            scheduler,
            builder,
            outputs,
        )
        self.config = config
        self.k = config.num_speculative_tokens
        self.stats = SpecStats(self.k)
        sc = runner.sched_config
        self.engine_shapes = shapes.shapes
        # the engine's shapes plus verify shapes (max_query_len = k + 1; engine/runner/shapes.py)
        self.shapes = ShapeSet(shapes.shapes + spec_shapes(sc, self.k + 1), sc.page_size)
        # (request, max drafts) -> drafted token ids; tests swap in other proposers
        self.proposer = lambda req, k: propose_ngram(
            req.all_token_ids, k, config.prompt_lookup_min, config.prompt_lookup_max
        )
        if config.method == "layers":
            L, n = runner.cfg.num_layers, config.num_draft_layers
            # NOTE: n == L is allowed: the whole model drafts for itself, every draft is
            # accepted (q == p); a check of the machinery (tests), never a speed-up.
            if n > L:
                raise ValueError(
                    f"speculative.num_draft_layers={n} is invalid: must be <= the model's "
                    f"num_layers ({L}) for {runner.cfg.name!r}"
                )
        self.draft = None  # the draft model (method "draft"): engine/spec/draft.py
        if config.method == "draft":
            from models.registry import load_model

            self.draft = DraftModel(model, load_model(config.draft_model), runner)
        if config.method in ("layers", "draft"):
            # placeholders: the real drafts are drawn on device after scheduling (prepare())
            self.proposer = lambda req, k: [0] * k

    def should_speculate(self) -> bool:
        """The batch-size policy: speculate while at most disable_by_batch_size run, and
        some running request is not backing off (else plain overlapped steps)."""
        running = self.scheduler.running
        limit = self.config.disable_by_batch_size
        if not running or (limit is not None and len(running) > limit):
            return False
        return any(r.num_output_tokens >= r.spec_resume_at for r in running)

    # ---- 2-3. propose ---------------------------------------------------------------------
    def propose(self) -> int:
        """Drafts for every running decode that may speculate; returns how many got one."""
        t0, num = time.perf_counter(), 0
        for req in self.scheduler.running:
            req.spec_token_ids = []
            room = req.sampling.max_tokens - req.num_output_tokens - 1  # + 1 emitted always
            if req.num_remaining_tokens != 1 or room <= 0 or uses_penalties([req.sampling]):
                continue
            if req.num_output_tokens < req.spec_resume_at:  # backing off (see back_off)
                continue
            req.spec_token_ids = list(self.proposer(req, min(self.k, room)))[: min(self.k, room)]
            num += bool(req.spec_token_ids)
        self.stats.draft_s += time.perf_counter() - t0
        return num

    def after_schedule(self) -> None:
        """Drafts of running requests not scheduled this step are dropped (stale next step)."""
        for req in self.scheduler.running:
            req.spec_token_ids = []

    def follow(self, batch, shape: BatchShape) -> None:
        """Before a plain step: a draft model's cache follows every step (engine/spec/draft.py)."""
        if self.draft is not None:
            self.draft.fill(batch, shape, self.runner.state.last_tokens)

    # ---- 4. build -------------------------------------------------------------------------
    def prepare(self, plan, built: BuiltStep) -> Proposal | None:
        """The verify inputs of a built step (model proposers' drafts drawn on device), or
        None when no scheduled request kept its drafts."""
        spec_idx = [i for i, s in enumerate(plan.scheduled) if s.spec_token_ids]
        if not spec_idx:
            return None
        spec = self._spec_batch(plan, built, spec_idx)
        if self.config.method in ("layers", "draft"):
            return Proposal(spec_idx, *self._draft_on_device(plan, built, spec_idx, spec))
        return Proposal(spec_idx, spec)

    def _draft_on_device(self, plan, built: BuiltStep, spec_idx: list[int], spec: SpecBatch):
        """The layers / draft proposer on device (engine/spec/layers.py, engine/spec/draft.py):
        the drafts and their q stay on device and go straight into the verify step (no
        host round trip)."""
        runner, b, Sd = self.runner, built.batch, built.shape.num_decode
        Sv = spec.num_drafts.shape[0]
        first_tokens = np.zeros(Sv, np.int32)
        start = np.zeros(Sv, np.int32)
        page_table = np.zeros((Sv, b.page_table_p.shape[1]), np.int32)
        for j, i in enumerate(spec_idx):
            s = plan.scheduled[i]
            first_tokens[j] = s.request.all_token_ids[s.start]
            start[j] = s.start
            page_table[j] = b.page_table_p[int(built.sampler_rows[i]) - Sd]
        inputs = (first_tokens, start, page_table, spec.num_drafts, spec.sampling)
        if self.draft is None:  # layers: the target's first N layers over its own cache
            adapters = runner.adapters  # each sequence's slot: that of its first token row
            slots = None if adapters is None else adapters.row_slots(b, built.shape)
            drafts, q = runner.update_kv(
                functools.partial(draft_layers, runner.params), *inputs,
                cfg=runner.cfg, num_layers=self.config.num_draft_layers, k=self.k,
                impl=runner.impl, lora=self._draft_lora(slots, spec.verify_rows[:, 0]),
            )  # fmt: skip
            return dataclasses.replace(spec, drafts=drafts), q
        d = self.draft
        d.kv, drafts, q = draft_layers(
            d.params, d.kv, *inputs, cfg=d.cfg, num_layers=None, k=self.k, impl=d.impl
        )
        spec = dataclasses.replace(spec, drafts=drafts)
        d.fill(built.batch, built.shape, runner.state.last_tokens, spec)  # the whole step's K/V
        return spec, q

    def _draft_lora(self, row_slots: np.ndarray | None, rows: np.ndarray) -> LoraInputs | None:
        """The layers proposer's adapter input: the slot stack and the slot of token row
        `rows[j]` for speculating sequence j (None without adapters)."""
        adapters = self.runner.adapters
        if adapters is None:
            return None
        slots = np.zeros(len(rows), np.int32) if row_slots is None else row_slots[rows]
        return LoraInputs(adapters.run_weights, slots)

    def _spec_batch(self, plan, built: BuiltStep, spec_idx: list[int]) -> SpecBatch:
        b, k1 = built.batch, self.k + 1
        Sd = built.shape.num_decode
        Sv = built.shape.num_prefill_seqs  # >= len(spec_idx): one program per batch shape
        verify_rows = np.zeros((Sv, k1), np.int32)
        drafts = np.zeros((Sv, self.k), np.int32)
        num_drafts = np.zeros(Sv, np.int32)
        slots = np.zeros(Sv, np.int32)
        steps = np.zeros((Sv, k1), np.int32)
        for j, i in enumerate(spec_idx):
            s, row = plan.scheduled[i], int(built.sampler_rows[i])
            b.sample_mask[row] = 0  # this sequence's tokens come from the verification
            nd = len(s.spec_token_ids)
            first = Sd + int(b.query_start_p[row - Sd])  # flat row of its first token
            verify_rows[j] = first + np.minimum(np.arange(k1), nd)
            drafts[j, :nd], num_drafts[j] = s.spec_token_ids, nd
            slots[j] = built.slots[i]
            steps[j] = s.output_index + np.arange(k1)
        per_slot = self.builder.sampling
        rows = {name: np.repeat(v[slots], k1, axis=0) for name, v in per_slot.items()}
        rows["step"] = steps.reshape(-1)
        return SpecBatch(verify_rows, drafts, num_drafts, SamplingTensors(**rows))

    # ---- warm-up (engine/runner/warmup.py calls this) -----------------------------------
    def warm_shapes(self) -> list[BatchShape]:
        """The verify shapes the batch-size policy lets a step reach: Sd + Sv <=
        disable_by_batch_size (all of spec_shapes when the policy is off). A speculative
        step that also carries a prefill chunk fits an engine shape instead: that program
        is not among these (compiled on first use; counted in compiles_after_warmup)."""
        limit = self.config.disable_by_batch_size
        shapes = spec_shapes(self.runner.sched_config, self.k + 1)
        if limit is None:
            return shapes
        return [s for s in shapes if s.num_decode + s.num_prefill_seqs <= max(limit, 1)]

    def warm_programs(self, programs: list[StepProgram]) -> list:
        """Zero-argument builders, one per (verify shape, sampler program) and, for the
        layers proposer, one draft program per (Sv, P): each lowers and compiles without
        running (as ModelRunner.compile)."""
        builders = [
            functools.partial(self._compile_verify, shape, program)
            for shape in self.warm_shapes()
            for program in programs
        ]
        if self.config.method in ("layers", "draft"):
            sizes = sorted({(s.num_prefill_seqs, s.pages_per_seq) for s in self.warm_shapes()})
            builders += [functools.partial(self._compile_draft, sv, p) for sv, p in sizes]
        if self.draft is not None:  # the draft cache's fill: every engine and verify shape
            builders += [
                functools.partial(self._compile_fill, s, False) for s in self.engine_shapes
            ]
            builders += [functools.partial(self._compile_fill, s, True) for s in self.warm_shapes()]
        return builders

    def _zero_spec_batch(self, Sv: int) -> SpecBatch:
        k1 = self.k + 1
        rows = {n: np.repeat(v[:1], Sv * k1, axis=0) for n, v in greedy_sampler_rows(1).items()}
        return SpecBatch(
            np.zeros((Sv, k1), np.int32),
            np.zeros((Sv, self.k), np.int32),
            np.zeros(Sv, np.int32),
            SamplingTensors(**rows),
        )

    def _compile_verify(self, shape: BatchShape, program: StepProgram) -> None:
        Sv = shape.num_prefill_seqs
        spec, draft_probs = self._zero_spec_batch(Sv), None
        if self.config.method == "layers":  # drafts and q arrive from the draft program
            on_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            V = self.runner.cfg.vocab_size
            spec.drafts = jax.ShapeDtypeStruct((Sv, self.k), np.int32, sharding=on_device)
            draft_probs = jax.ShapeDtypeStruct((Sv, self.k, V), np.float32, sharding=on_device)
        self.runner.compile(shape, program, spec=spec, draft_probs=draft_probs)

    def _compile_draft(self, Sv: int, pages_per_seq: int) -> None:
        runner, zeros = self.runner, np.zeros(Sv, np.int32)
        params, kv, cfg = runner.params, runner.state.kv, runner.cfg
        n, lora = self.config.num_draft_layers, self._draft_lora(None, zeros)
        if self.draft is not None:
            params, kv, cfg, n = self.draft.params, self.draft.kv, self.draft.cfg, None
        extra = {} if self.draft is not None else {"lora": lora}
        draft_layers.lower(
            params, kv, zeros, zeros, np.zeros((Sv, pages_per_seq), np.int32),
            zeros, self._zero_spec_batch(Sv).sampling,
            cfg=cfg, num_layers=n, k=self.k, impl=runner.impl, **extra,
        ).compile()  # fmt: skip

    def _compile_fill(self, shape: BatchShape, with_drafts: bool) -> None:
        d, extra = self.draft, ()
        if with_drafts:  # drafts arrive from the draft program (on device)
            on_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            spec = self._zero_spec_batch(shape.num_prefill_seqs)
            drafts = jax.ShapeDtypeStruct(spec.drafts.shape, np.int32, sharding=on_device)
            extra = (spec.verify_rows, drafts, spec.num_drafts)
        fill.lower(
            d.params, d.kv, self.runner.state.last_tokens, StepBatch.zeros(shape).pack(), *extra,
            cfg=d.cfg, shape=shape, impl=d.impl,
        ).compile()  # fmt: skip

    # ---- 6. commit ----------------------------------------------------------------------------
    def commit(
        self, plan, proposal: Proposal, verified: SampleResult, num_accepted, now: float
    ) -> list[RequestOutput]:
        """Each speculating request's verified run (`verified`: the host copy of the verify
        step's spec_packed, unpacked; `num_accepted` [Sv]): appended, stop-checked and
        rolled back; returns their RequestOutput deltas."""
        outputs = []
        for j, i in enumerate(proposal.indices):
            out = self._commit(plan.scheduled[i], j, int(num_accepted[j]), verified, now)
            if out is not None:
                outputs.append(out)
        self.stats.verify_steps += 1
        return outputs

    def _commit(self, s, j: int, n: int, verified: SampleResult, now: float):
        """Append the emitted run of one speculating request (stop checks per token), then
        roll back its rejected drafts (module docstring, step 6)."""
        req = s.request
        req.num_pending_outputs -= 1
        if req.is_finished:
            return None
        if n == NONFINITE_TOKEN:
            return self.outputs.end(req, "failed", now, NONFINITE_ERROR)
        nd, k1 = len(s.spec_token_ids), self.k + 1
        rows = range(j * k1, j * k1 + n + 1)
        emitted = [int(verified.tokens[r]) for r in rows]
        req.spec_drafted_tokens += nd
        req.spec_accepted_tokens += n
        back_off(req, n)
        self.stats.record(nd, n)
        req.num_computed_tokens = s.start + 1 + n  # rejected drafts' K/V no longer count
        out = self.outputs.emit_tokens(req, emitted, now, self._logprobs(req, verified, rows))
        if not req.is_finished:
            self.scheduler.roll_back_drafts(req, time.monotonic())
            self.builder.trim_pages(req.request_id, len(req.page_ids))
        return out

    @staticmethod
    def _logprobs(req, verified: SampleResult, rows) -> list[TokenLogprob] | None:
        n = req.sampling.logprobs
        return None if n is None else [row_logprob(verified, r, n) for r in rows]
