"""EngineCore: the loop that turns many concurrent requests into fixed-shape device steps.

One step, synchronous (`EngineConfig(async_scheduling=False)`), all on the caller's thread:

    plan = scheduler.schedule(now)             host: who computes how many tokens (committed)
    built = builder.build(plan.scheduled)      host: numpy gathers from per-slot state
    packed = runner.run(batch, shape, program) device: one jitted call, state donated
    packed = device_get(packed)                the one device->host transfer (wait; with
                                               an MoE model the step's expert load rides along)
    scheduler.receive_tokens(plan, tokens)     host: append sampled tokens, cache pages
    outputs.emit: stop checks (EOS, stop ids/strings, max_tokens) -> RequestOutput deltas

The collaborators: Scheduler (engine/sched/scheduler.py), BatchBuilder
(engine/batch/builder.py), ModelRunner (engine/runner/model_runner.py: params and the
device state, the only owner of both), OutputProcessor (engine/sched/outputs.py), and with
speculative decoding the SpecDecoder (engine/spec/decode.py: propose, then the runner
verifies, then it commits).

Overlapped (the default): JAX dispatch is asynchronous, so `step()` launches step N+1 (schedule,
build, dispatch) BEFORE it waits for step N and processes N's tokens. The device runs N+1
while the host processes N and then schedules and builds N+2:

    host:   [sched+build N+1][dispatch]  [wait N][update+stop N] | [sched+build N+2][dispatch] ...
    device:          ... step N ........][........ step N+1 ...........][ step N+2 ...

Step N+1 does not need N's tokens on the host: the scheduler counts N's sampled tokens as
*pending* (engine/sched/request.py), a decode whose input is pending reads it on the device from
`last_tokens[slot]` (engine/runner/step.py), and the host learns the token one step later for
streaming, stop checks and the prefix cache. A request that stops at step N (EOS, stop
string) was already scheduled in N+1: that one token is computed, discarded and never
emitted; its pages and slot are released while processing N (the device runs N+1 before any
later step, so reusing them is safe). A request known to reach max_tokens at N is not
scheduled in N+1. Nothing falls back to the synchronous path: penalties (token counts
live on the device), seeds (keyed by output position), logprobs and stop strings (host
side, one step later), cancellation and deadlines (next schedule), preemption (the pending
token is appended to the waiting request) and the prefix cache (pages registered once their
tokens are known) all work overlapped; outputs are identical either way
(tests/test_engine_overlap.py). `step()` returns the outputs of the step it waited for, so
the caller sees each token one call later; `has_unfinished()` stays true while a step is
in flight.

Structured output (engine/structured/) runs NOT overlapped: a constrained row's token
mask needs the token sampled the step before, on the host, before the next step is
dispatched. While any constrained request is in the engine, `step()` first waits for the
step in flight and then runs synchronously (every row of the batch, free ones too: their
tokens are unchanged, only the overlap is lost); with none left it overlaps again. Such
steps pass a [rows, ceil(V/32)] int32 bitmask to the jitted step's "full" sampler program,
which every non-greedy step runs with an all-ones mask anyway (engine/runner/shapes.py), so a
constrained step needs no program of its own.

Host time per phase is summed in `self.timings` (benchmarks/host_bench.py).
The host half of a step (validation, stop checks, RequestOutput deltas, metrics) is
engine/sched/outputs.py's OutputProcessor, shared with serving's MockEngine. The serving layer
drives the engine from its engine thread through engine/interface.py's `Engine` Protocol.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import time

import jax
import numpy as np

from configs.engine_config import EngineConfig
from engine.api_types import AdapterRef, EngineRequest, RequestOutput
from engine.batch.builder import BatchBuilder, BuiltStep
from engine.errors import InvalidRequestError
from engine.lora.adapters import UnknownAdapterError
from engine.parallel import sharding
from engine.runner import compiles
from engine.runner.expert_load import ExpertLoad
from engine.runner.kv_offload import KVOffload
from engine.runner.model_runner import ModelRunner
from engine.runner.programs import StepProgram, structured_bitmask
from engine.runner.shapes import ShapeSet, sampler_variants
from engine.runner.step import NONFINITE_ERROR, NONFINITE_TOKEN
from engine.sampling.logprobs import step_logprobs
from engine.sampling.sampler import SampleResult, resolve_seed, uses_penalties
from engine.sched.outputs import OutputProcessor
from engine.sched.page_pool import PagePool, model_keys_of
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler, SchedulerOutput
from engine.spec.decode import Proposal, SpecDecoder
from engine.spec.step import spec_engine_step
from engine.structured.matcher import StructuredRequests
from models.families import aux_output
from models.registry import engine_model
from pallas_kernels import resolve_impl

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StepTimings:
    """Host seconds spent in each phase of `EngineCore.step`, summed over steps."""

    schedule_s: float = 0.0  # scheduler.schedule + finished/preempted bookkeeping
    build_s: float = 0.0  # BatchBuilder.build (new requests take their slots there)
    dispatch_s: float = 0.0  # the jitted call (returns once the step is enqueued)
    wait_s: float = 0.0  # device_get of the packed result: blocked on the device
    update_s: float = 0.0  # unpack + scheduler.update_after_step
    outputs_s: float = 0.0  # detokenize + stop checks + RequestOutput deltas
    num_steps: int = 0

    def as_dict_ms(self) -> dict:
        n = max(self.num_steps, 1)
        return {
            f"{f.name[:-2]}_ms": 1e3 * getattr(self, f.name) / n
            for f in dataclasses.fields(self)
            if f.name.endswith("_s")
        }


@dataclasses.dataclass
class _Launched:
    """A dispatched step whose results the host has not read yet."""

    plan: SchedulerOutput
    built: BuiltStep
    packed: jax.Array | None  # [Sd + Sp, 2 + 2K] on device (None: a verify step)
    # speculative decoding (engine/spec/decode.py): the verified drafts, (packed,
    # spec_packed, num_accepted) on device (ModelRunner.verify), and when it was dispatched
    proposal: Proposal | None = None
    verified: tuple | None = None
    dispatched_at: float = 0.0
    aux: jax.Array | None = None  # the step's auxiliary output (MoE expert load) on device


class EngineCore:
    """The step loop over its collaborators: Scheduler, BatchBuilder, ModelRunner,
    OutputProcessor, and the SpecDecoder when speculating (see the module docstring)."""

    def __init__(
        self,
        model,
        config: EngineConfig,
        *,
        impl: str = "auto",
        mesh=None,
        runner_cls=ModelRunner,
    ):
        """`model`: a models.registry.LoadedModel (quantized here if `config` asks for it and
        it is float; its identity then names the quantization and the KV dtype).
        `runner_cls`: the ModelRunner class (multi-host: one that announces each call)."""
        compiles.install()
        model = _with_speculation(engine_model(model, config), config)
        self.model = model
        self.config = config
        self.identity = model.identity
        self.tokenizer = model.tokenizer
        self.impl = impl
        self.mesh = None if mesh is None else sharding.engine_mesh(mesh)
        self.sched_config = sc = config.scheduler_config(model.config)
        self.pool = PagePool.from_config(sc, model_keys_of(self.identity))
        self.scheduler = Scheduler(sc, self.pool)
        # attention bounded by the real lengths (the CPU loops) makes page-table padding free
        bounded = resolve_impl(impl) == "cpu"
        self.shapes = ShapeSet.for_config(sc, config.max_step_shapes, padded_attention=not bounded)
        self.builder = BatchBuilder(
            max_num_seqs=sc.max_num_seqs,
            # the widest page table of a step shape (at least 4, even for tiny max_model_len)
            max_pages_per_seq=max(s.pages_per_seq for s in self.shapes.shapes),
            page_size=sc.page_size,
            prefill_chunk_size=sc.prefill_chunk_size,
            eos_token_ids=self.tokenizer.eos_token_ids,
            fit_shape=self.shapes.fit,
        )
        self.builder.take_slot = self._take_slot  # build() takes a new request's slot
        spec = config.speculative  # speculative decoding (engine/spec/decode.py)
        self.runner = runner_cls(
            model, config, sc, impl=impl, mesh=self.mesh,
            verify_step=None if spec is None else spec_engine_step,
        )  # fmt: skip
        self.cfg = self.runner.cfg  # as the engine runs it (a mesh may replicate KV heads)
        self.adapters = self.runner.adapters  # LoRA slots; None: max_loras=0
        self.offload = None  # the prefix cache's host tier (engine/runner/kv_offload.py)
        if config.host_kv_gib > 0:
            self.offload = KVOffload.attach(
                self.pool,
                self.runner.state.kv,
                int(config.host_kv_gib * 2**30),
                min(self.pool.pages_for_tokens(sc.max_model_len), sc.num_pages - 1),
            )
        self.outputs = OutputProcessor(
            self.scheduler,
            self.tokenizer,
            vocab_size=self.cfg.vocab_size,
            cache_sharing=config.cache_sharing,
            on_finished=self._forget,
        )
        self._seeds: dict[str, int] = {}
        self.structured = StructuredRequests(self.tokenizer, self.cfg.vocab_size)
        self._in_flight: _Launched | None = None
        self._rng = random.Random()
        self.timings = StepTimings()
        self.num_steps = 0
        self.last_step_info: dict | None = None  # the last processed step (serving trace)
        # MoE models: per-step expert load (engine/runner/expert_load.py); None otherwise
        moe = aux_output(self.cfg) == "expert_tokens"
        self.expert_load = ExpertLoad.for_config(self.cfg) if moe else None
        self.num_tokens_processed = 0
        self.num_failed_steps = 0
        self.spec = None
        if spec is not None:
            self.spec = SpecDecoder(
                spec, model=model, runner=self.runner, scheduler=self.scheduler,
                builder=self.builder, outputs=self.outputs, shapes=self.shapes,
            )  # fmt: skip

    # ---- the interface ------------------------------------------------------------------
    def add_request(self, er: EngineRequest, cache_salt: str | None = None) -> None:
        adapter = self._acquire_adapter(er)  # LoRA: its content hash keys the prefix cache
        adapter_id = None if adapter is None else adapter.content_hash
        constraint, matcher, done = er.sampling.structured, None, None
        try:
            if constraint is not None:  # compile first: a failure leaves nothing behind
                matcher = self.structured.compile(constraint)
                done = functools.partial(self.structured.accept, er.request_id)
            self.outputs.add_request(
                er, time.monotonic(), cache_salt, adapter_id=adapter_id, grammar_done=done
            )
        except BaseException:
            self._release_adapter(er.request_id)
            raise
        if matcher is not None:
            self.structured.track(er.request_id, matcher)
        self._seeds[er.request_id] = resolve_seed(er.sampling, self._rng)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def reload_model(self, model) -> None:
        """Swap in other weights of the same architecture (a new revision), between steps.
        The prefix cache is cleared and re-keyed by the new identity, so nothing computed
        with the old weights is ever hit; requests in flight keep the K/V they already
        computed, and nothing they compute is cached."""
        if model.config != self.model.config:
            raise ValueError(
                f"reload_model: config {model.config.name!r} differs from the "
                f"running {self.model.config.name!r} (same architecture only)"
            )
        if self.mesh is not None:
            raise NotImplementedError("reload_model with a mesh (params need resharding)")
        model = _with_speculation(engine_model(model, self.config), self.config)
        self.model, self.identity, self.tokenizer = model, model.identity, model.tokenizer
        self.outputs.tokenizer = model.tokenizer  # for requests added from now on
        self.structured.set_tokenizer(model.tokenizer)
        self.runner.load_params(model.params)
        self.pool.clear_cache(model_keys_of(self.identity))

    def clear_prefix_cache(self) -> None:
        """Forget every cached page (pages in use stay in use)."""
        self.pool.clear_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then process the previous one (overlapped) or this one
        (synchronous); returns the outputs of the step it processed."""
        # NOTE: structured output turns speculation off while constrained requests run
        # (drafts are not checked against the grammar matcher).
        if self.spec is not None and not self.structured.active and self.spec.should_speculate():
            return self._spec_step()
        outputs: list[RequestOutput] = []
        if not self.config.async_scheduling or self.structured.active:
            self._drain(outputs)  # constrained rows need every token on the host
            launched = self._launch(outputs)
            if launched is not None:
                self._finish_step(launched, outputs)
            return outputs
        launched = self._launch(outputs)
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            self._finish_step(previous, outputs)
        return outputs

    def _spec_step(self) -> list[RequestOutput]:
        """One synchronous speculative step (engine/spec/decode.py): the speculator
        proposes, the runner verifies, the speculator commits."""
        outputs: list[RequestOutput] = []
        self._drain(outputs)  # proposing needs every token on the host
        drafted = self.spec.propose()
        launched = self._launch(outputs, speculate=drafted > 0)
        if launched is None:
            return outputs
        if launched.proposal is None:
            self.spec.stats.plain_steps += 1
            self._finish_step(launched, outputs)
        else:
            self._finish_verify(launched, outputs)
        return outputs

    def _drain(self, outputs: list[RequestOutput]) -> None:
        """Finish the overlapped step in flight, if any."""
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            self._finish_step(previous, outputs)

    # ---- one step, in order --------------------------------------------------------------
    def _launch(self, outputs: list[RequestOutput], speculate: bool = False) -> _Launched | None:
        """Schedule, build and dispatch a step (returns None when nothing is scheduled).
        `speculate`: drafts were proposed for this step (the speculator prepares them)."""
        t0 = time.perf_counter()
        if self.offload is not None:  # host tier: saves land, hits become visible
            self.offload.before_schedule()
        plan = self.scheduler.schedule(time.monotonic())
        if self.offload is not None:  # host tier: evicted pages out, host hits in
            self.runner.update_kv(self.offload.flush)
        if speculate:
            self.spec.after_schedule()
        outputs += self.outputs.finished(plan)
        for rid in plan.preempted_request_ids:
            self.builder.release(rid)
        if plan.is_empty:
            self.timings.schedule_s += time.perf_counter() - t0
            return None
        t1 = time.perf_counter()
        built = self.builder.build(plan.scheduled, self.spec.shapes.fit if speculate else None)
        t2 = time.perf_counter()
        try:
            # NOTE: two sampler programs per shape, what warm-up builds (engine/runner/shapes.py
            # sampler_variants); flags never change a row's token.
            program = self.runner.program(built, structured_bitmask(self.structured, plan, built))
            # NOTE: no speculation while constrained requests run (step() checks), so a
            # step with a bitmask never takes the speculative path.
            proposal = self.spec.prepare(plan, built) if speculate else None
            if proposal is not None:  # speculative decoding: drafts verified in this step
                verified = self.runner.verify(
                    built.batch,
                    built.shape,
                    proposal.batch,
                    StepProgram(program.flags, built.penalties),
                    proposal.draft_probs,
                )
                return _Launched(plan, built, None, proposal, verified, t2)
            if self.spec is not None:
                self.spec.follow(built.batch, built.shape)
            packed = self.runner.run(built.batch, built.shape, program)
            self.runner.check_compiles(built.shape, program.flags)  # what the dispatch built
        except Exception as e:  # a failed step fails only the requests in it
            self._fail(plan, e, outputs)
            return None
        finally:
            t3 = time.perf_counter()
            self.timings.schedule_s += t1 - t0
            self.timings.build_s += t2 - t1
            self.timings.dispatch_s += t3 - t2
        return _Launched(plan, built, packed, aux=self.runner.last_step_aux)

    def _finish_step(self, step: _Launched, outputs: list[RequestOutput]) -> None:
        """Wait for a launched step, then fill in its tokens and emit the deltas."""
        t0 = time.perf_counter()
        try:
            packed, aux = jax.device_get((step.packed, step.aux))  # one wait for both
        except Exception as e:
            self._fail(step.plan, e, outputs)
            return
        t1 = time.perf_counter()
        result = SampleResult.unpack(np.asarray(packed))
        tokens = result.tokens[step.built.sampler_rows]  # [len(scheduled)]
        now = time.monotonic()
        if (tokens == NONFINITE_TOKEN).any():  # the per-row check only when needed
            self._fail_nonfinite(step.plan, tokens, now, outputs)
        # finished requests' tokens are left in; receive_tokens skips them
        self.num_steps += 1
        self.num_tokens_processed += step.plan.total_num_scheduled_tokens
        shape = step.built.shape  # what the step ran (the serving trace reads it)
        self.last_step_info = {
            "shape": [shape.num_decode, shape.num_prefill_tokens, shape.num_prefill_seqs,
                      shape.pages_per_seq],
            "tokens": step.plan.total_num_scheduled_tokens,
            "requests": len(step.plan.scheduled),
            "device_wait_ms": round((t1 - t0) * 1e3, 2),
            "step": self.num_steps,  # which step: a caller polling it sees a repeat as one
        }  # fmt: skip
        if aux is not None and self.expert_load is not None:
            self.last_step_info.update(self.expert_load.observe(aux))
        received, got = self.scheduler.receive_tokens(step.plan, tokens.tolist(), now)
        t2 = time.perf_counter()
        logprobs = (  # no per-row pass when no row asked for logprobs
            step_logprobs(step.plan, result, step.built.sampler_rows)
            if step.built.logprobs
            else None
        )
        outputs += self.outputs.emit(received, now, logprobs, got)
        self.timings.wait_s += t1 - t0
        self.timings.update_s += t2 - t1
        self.timings.outputs_s += time.perf_counter() - t2
        self.timings.num_steps += 1

    def _finish_verify(self, step: _Launched, outputs: list[RequestOutput]) -> None:
        """Wait for a speculative step: its plain rows as `_finish_step` takes them, then
        the speculator commits each verified run."""
        t0 = time.perf_counter()
        plan, built = step.plan, step.built
        try:
            packed, spec_packed, num_accepted = jax.device_get(step.verified)
        except Exception as e:
            self._fail(plan, e, outputs)
            return
        now = time.monotonic()
        self.spec.stats.verify_s += time.perf_counter() - step.dispatched_at
        spec_set = set(step.proposal.indices)
        plain = dataclasses.replace(
            plan, scheduled=[s for i, s in enumerate(plan.scheduled) if i not in spec_set]
        )
        plain_rows = np.asarray(
            [r for i, r in enumerate(built.sampler_rows) if i not in spec_set], np.int32
        )
        result = SampleResult.unpack(np.asarray(packed))
        tokens = result.tokens[plain_rows]
        self._fail_nonfinite(plain, tokens, now, outputs)
        sampled = {
            s.request.request_id: int(t)
            for s, t in zip(plain.scheduled, tokens)
            if s.samples and not s.request.is_finished
        }
        received = self.scheduler.update_after_step(plain, sampled, now)
        outputs += self.outputs.emit(received, now, step_logprobs(plain, result, plain_rows))
        verified = SampleResult.unpack(np.asarray(spec_packed))
        outputs += self.spec.commit(plan, step.proposal, verified, num_accepted, now)
        self.num_steps += 1
        self.num_tokens_processed += plan.total_num_scheduled_tokens
        self.timings.wait_s += time.perf_counter() - t0
        self.timings.num_steps += 1

    def _fail_nonfinite(self, plan: SchedulerOutput, tokens, now: float, outputs) -> None:
        """Requests whose logits held NaN/inf (flagged on device: NONFINITE_TOKEN) end
        "failed" instead of receiving a token."""
        for s, token in zip(plan.scheduled, tokens):
            if token != NONFINITE_TOKEN or s.request.is_finished:
                continue
            out = self.outputs.end(s.request, "failed", now, NONFINITE_ERROR)
            if out is not None:
                log.error("request %s: non-finite logits; failed", s.request.request_id)
                outputs.append(out)

    def _fail(self, plan: SchedulerOutput, e: Exception, outputs: list[RequestOutput]) -> None:
        log.exception("engine step failed", exc_info=e)
        self.num_failed_steps += 1
        outputs += self.outputs.fail(plan, e, time.monotonic())

    # ---- a request's slot in the persistent batch (engine/batch/builder.py) ---------------------
    def _take_slot(self, req: Request) -> None:
        slot, is_new = self.builder.assign(req, self._seeds[req.request_id])
        if self.adapters is not None:
            self.adapters.bind(slot, req.request_id)
        if is_new and uses_penalties([req.sampling]):
            self.runner.reset_slot(slot, req.prompt_token_ids, req.output_token_ids)

    def _forget(self, request_id: str) -> None:
        """A request left the engine (OutputProcessor's on_finished): free its seed and slot."""
        self._seeds.pop(request_id, None)
        self.structured.remove(request_id)
        self.builder.release(request_id)
        self._release_adapter(request_id)

    # ---- LoRA adapters (engine/lora/adapters.py; self.adapters is None when max_loras = 0) ---
    def load_adapter(self, name: str, path: str) -> AdapterRef:
        """Installs a PEFT LoRA adapter under `name` (between steps; safe while requests
        run). Returns its AdapterRef. Needs EngineConfig(max_loras >= 1)."""
        if self.adapters is None:
            raise InvalidRequestError("max_loras", 0, ">= 1 to load LoRA adapters")
        return self.adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        if self.adapters is None:
            raise UnknownAdapterError(name, [])
        self.adapters.unload(name)

    def _acquire_adapter(self, er: EngineRequest) -> AdapterRef | None:
        """The request's adapter (its content hash keys the prefix cache), or None."""
        if er.adapter is None:
            return None
        if self.adapters is None:
            raise UnknownAdapterError(er.adapter, [])
        return self.adapters.acquire(er.request_id, er.adapter)

    def _release_adapter(self, request_id: str) -> None:
        if self.adapters is not None:
            self.adapters.release(request_id)

    # ---- stats --------------------------------------------------------------------------------
    def stats(self) -> dict:
        pool, sc, runner = self.pool, self.sched_config, self.runner
        used = pool.num_used_pages
        page_bytes = runner.pool_kv_bytes // sc.num_pages
        return {
            **self.scheduler.stats(),
            "kv_bytes_total": runner.kv_bytes,
            "kv_bytes_used": used * page_bytes,
            "weights_bytes": runner.weights_bytes,
            "tokens_processed": self.num_tokens_processed,
            "num_steps": self.num_steps,
            "num_failed_steps": self.num_failed_steps,
            "num_step_shapes": len(self.shapes),
            "num_step_programs": sum(len(sampler_variants(s)) for s in self.shapes.shapes),
            "num_compiled_steps": compiles.count("engine_step"),  # in this process
            "warmup_s": runner.warmup_s,
            "compiles_after_warmup": runner.compiles_after_warmup(),
            **compiles.stats(),
            **{f"host_{k}": v for k, v in self.timings.as_dict_ms().items()},
            **({} if self.spec is None else self.spec.stats.as_dict()),
            **({} if self.adapters is None else self.adapters.stats()),
            **({} if self.expert_load is None else self.expert_load.stats()),
        }


def _with_speculation(model, config: EngineConfig):
    """The model with an identity naming the engine's speculative decoding (what every
    response's resolved versions report), e.g. "ngram:k=4"."""
    if config.speculative is None:
        return model
    identity = dataclasses.replace(model.identity, speculative=config.speculative.describe())
    return dataclasses.replace(model, identity=identity)
