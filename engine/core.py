"""EngineCore: the loop that turns many concurrent requests into fixed-shape device steps.

One step, synchronous (`EngineConfig(async_scheduling=False)`), all on the caller's thread:

    plan = scheduler.schedule(now)             host: who computes how many tokens (committed)
    built = builder.build(plan.scheduled)      host: numpy gathers from per-slot state
    kv, ..., packed = engine_step(...)         device: one jitted call, state donated
    packed = device_get(packed)                the one device->host transfer (wait)
    scheduler.update_after_step(plan, tokens)  host: append sampled tokens, cache pages
    stop checks (EOS, stop ids/strings, max_tokens) -> finish_request -> RequestOutput deltas

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
import jax.numpy as jnp
import numpy as np

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest, RequestOutput
from engine.batch.builder import BatchBuilder, BuiltStep
from engine.lora.core_adapters import EngineAdapters
from engine.parallel import sharding
from engine.runner import compiles
from engine.runner.kv_cache import PagedKVCache, WindowedKVCache
from engine.runner.kv_offload import KVOffload
from engine.runner.penalties import PenaltyState
from engine.runner.programs import StepPrograms, structured_bitmask
from engine.runner.shapes import ShapeSet, sampler_variants
from engine.runner.step import NONFINITE_TOKEN
from engine.sampling.logprobs import step_logprobs
from engine.sampling.sampler import FULL_FLAGS, SampleResult, resolve_seed, uses_penalties
from engine.sched.outputs import OutputProcessor
from engine.sched.page_pool import PagePool, model_keys_of
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler, SchedulerOutput
from engine.spec.decode import SpecDecoder
from engine.structured.matcher import StructuredRequests
from models.llama import cast_params, layer_layout
from models.registry import engine_model
from pallas_kernels import resolve_impl

log = logging.getLogger(__name__)
NONFINITE_ERROR = "model produced non-finite logits"


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
    packed: jax.Array  # [Sd + Sp, 2 + 2K] on device
    # speculative decoding (engine/spec/decode.py): (packed, spec_packed, num_accepted) on
    # device, the plan indices of the verified requests, and when it was dispatched
    spec_results: tuple | None = None
    spec_batch: list | None = None
    dispatched_at: float = 0.0


class EngineCore(StepPrograms, PenaltyState, EngineAdapters):
    """The step loop. Mixins: the step programs it dispatches (engine/runner/programs.py),
    the penalty token counts (engine/runner/penalties.py), LoRA (engine/lora/core_adapters.py)."""

    def __init__(self, model, config: EngineConfig, *, impl: str = "auto", mesh=None):
        """`model`: a models.registry.LoadedModel (quantized here if `config` asks for it and
        it is float; its identity then names the quantization and the KV dtype)."""
        compiles.install()
        model = _with_speculation(engine_model(model, config), config)
        self.model = model
        self.config = config
        self.cfg = model.config
        self.identity = model.identity
        self.tokenizer = model.tokenizer
        self.impl = impl
        self.mesh = None if mesh is None else sharding.engine_mesh(mesh)
        self.sched_config = sc = config.scheduler_config(self.cfg)
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
        self.params, kv_sharding = cast_params(model.params, config.dtype), None
        if self.mesh is not None:  # Megatron layout; cfg.num_kv_heads may grow (replication)
            self.cfg, self.params = sharding.shard_params(self.params, self.cfg, self.mesh)
            kv_sharding = sharding.kv_sharding(self.mesh, self.cfg)
        else:  # NOTE: committed, like loaded params: an uncommitted cache is another jit cache
            # key, so the first warm-up shape would compile again on first use.
            kv_sharding = next(iter(jax.tree.leaves(self.params)[0].devices()))
            self.params = layer_layout(self.params, config.layer_loop)
        ring = config.local_ring_pages(self.cfg)  # release_local_pages: K/V per layer group
        if ring is not None and self.mesh is not None:
            raise NotImplementedError("release_local_pages with a mesh (model sharding)")
        if ring is None:
            self.kv = PagedKVCache.zeros(
                self.cfg, sc.num_pages, sc.page_size, config.kv_dtype, sharding=kv_sharding
            )
        else:
            self.kv = WindowedKVCache.zeros(
                self.cfg,
                sc.num_pages,
                sc.page_size,
                sc.max_num_seqs,
                ring,
                config.kv_dtype,
                sharding=kv_sharding,
            )
        self.offload = None  # the prefix cache's host tier (engine/runner/kv_offload.py)
        if config.host_kv_gib > 0:
            self.offload = KVOffload.attach(
                self.pool,
                self.kv,
                int(config.host_kv_gib * 2**30),
                min(self.pool.pages_for_tokens(sc.max_model_len), sc.num_pages - 1),
            )
        # With a mesh: replicated, as the step returns them (the KV spec would not fit).
        self._place = (
            (lambda x: jax.device_put(x, kv_sharding))
            if self.mesh is None
            else (lambda x: sharding.replicate(x, self.mesh))
        )
        self._last_tokens = self._place(jnp.zeros((sc.max_num_seqs,), jnp.int32))
        # ---- shapes (#21.3): the token counts exist from the start (the "full" sampler
        # program always applies penalties), so every step program has one signature.
        self._penalties_ready = False
        self._counts = self._prompt_mask = self._place(jnp.zeros((1, 1), jnp.int32))
        if self.mesh is None:  # NOTE: see full_program for the mesh case
            self.init_penalty_state()
        self._all_allowed: dict[int, np.ndarray] = {}  # rows -> all-ones token bitmask
        # ---- end shapes ----
        self.adapters = self._adapter_manager(model, kv_sharding)  # LoRA; None: max_loras=0
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
        self.num_tokens_processed = 0
        self.num_failed_steps = 0
        self.warmup_s: float | None = None
        self._compiles_at_warmup: int | None = None
        self._logged_compiles = 0
        spec = config.speculative  # speculative decoding (engine/spec/decode.py)
        self.spec = None if spec is None else SpecDecoder(self, spec)

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
        self.params = layer_layout(
            cast_params(model.params, self.config.dtype), self.config.layer_loop
        )
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
            return self.spec.step()  # synchronous speculative step (engine/spec/decode.py)
        outputs: list[RequestOutput] = []
        if not self.config.async_scheduling or self.structured.active:
            if self._in_flight is not None:  # constrained rows need every token on the host
                previous, self._in_flight = self._in_flight, None
                self._finish_step(previous, outputs)
            launched = self._launch(outputs)
            if launched is not None:
                self._finish_step(launched, outputs)
            return outputs
        launched = self._launch(outputs)
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            self._finish_step(previous, outputs)
        return outputs

    # ---- one step, in order --------------------------------------------------------------
    def _launch(self, outputs: list[RequestOutput], spec=None) -> _Launched | None:
        """Schedule, build and dispatch a step (returns None when nothing is scheduled).
        `spec`: the SpecDecoder when drafts were proposed for this step."""
        t0 = time.perf_counter()
        if self.offload is not None:  # host tier: saves land, hits become visible
            self.offload.before_schedule()
        plan = self.scheduler.schedule(time.monotonic())
        if self.offload is not None:  # host tier: evicted pages out, host hits in
            self.kv = self.offload.flush(self.kv)
        if spec is not None:
            spec.after_schedule(plan)
        outputs += self.outputs.finished(plan)
        for rid in plan.preempted_request_ids:
            self.builder.release(rid)
        if plan.is_empty:
            self.timings.schedule_s += time.perf_counter() - t0
            return None
        t1 = time.perf_counter()
        built = self.builder.build(plan.scheduled, None if spec is None else spec.shapes.fit)
        t2 = time.perf_counter()
        try:
            # NOTE: two sampler programs per shape, what warm-up builds (engine/runner/shapes.py
            # sampler_variants); flags never change a row's token.
            flags, use_penalties, bitmask = self._sampler_program(
                built, structured_bitmask(self.structured, plan, built)
            )
            # NOTE: no speculation while constrained requests run (step() checks), so a
            # step with a bitmask never takes the speculative path.
            spec_run = None if spec is None else spec.run(plan, built, flags is FULL_FLAGS)
            if spec_run is not None:  # speculative decoding: drafts verified in this step
                return _Launched(plan, built, None, spec_run[:3], spec_run[3], t2)
            packed = self.run_step(built.batch, built.shape, flags, use_penalties, bitmask)
            self._check_compiles(built.shape, flags)  # the dispatch built it, if anything
        except Exception as e:  # a failed step fails only the requests in it
            self._fail(plan, e, outputs)
            return None
        finally:
            t3 = time.perf_counter()
            self.timings.schedule_s += t1 - t0
            self.timings.build_s += t2 - t1
            self.timings.dispatch_s += t3 - t2
        return _Launched(plan, built, packed)

    def _finish_step(self, step: _Launched, outputs: list[RequestOutput]) -> None:
        """Wait for a launched step, then fill in its tokens and emit the deltas."""
        t0 = time.perf_counter()
        try:
            packed = np.asarray(jax.device_get(step.packed))
        except Exception as e:
            self._fail(step.plan, e, outputs)
            return
        t1 = time.perf_counter()
        result = SampleResult.unpack(packed)
        tokens = result.tokens[step.built.sampler_rows]  # [len(scheduled)]
        now = time.monotonic()
        if (tokens == NONFINITE_TOKEN).any():  # hostspeed: the per-row check only when needed
            self._fail_nonfinite(step.plan, tokens, now, outputs)
        # host2 (#20): finished requests' tokens are left in; receive_tokens skips them
        self.num_steps += 1
        self.num_tokens_processed += step.plan.total_num_scheduled_tokens
        shape = step.built.shape  # what the step ran (the serving trace reads it)
        self.last_step_info = {
            "shape": [shape.num_decode, shape.num_prefill_tokens, shape.num_prefill_seqs,
                      shape.pages_per_seq],
            "tokens": step.plan.total_num_scheduled_tokens,
            "requests": len(step.plan.scheduled),
            "device_wait_ms": round((t1 - t0) * 1e3, 2),
        }  # fmt: skip
        received, got = self.scheduler.receive_tokens(step.plan, tokens.tolist(), now)
        t2 = time.perf_counter()
        logprobs = (  # hostspeed: no per-row pass when no row asked for logprobs
            step_logprobs(step.plan, result, step.built.sampler_rows)
            if step.built.logprobs
            else None
        )
        outputs += self.outputs.emit(received, now, logprobs, got)
        self.timings.wait_s += t1 - t0
        self.timings.update_s += t2 - t1
        self.timings.outputs_s += time.perf_counter() - t2
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
            self._reset_penalty_row(slot, req)

    def _forget(self, request_id: str) -> None:
        """A request left the engine (OutputProcessor's on_finished): free its seed and slot."""
        self._seeds.pop(request_id, None)
        self.structured.remove(request_id)
        self.builder.release(request_id)
        self._release_adapter(request_id)

    # ---- stats --------------------------------------------------------------------------------
    def stats(self) -> dict:
        pool, sc = self.pool, self.sched_config
        used = pool.num_used_pages
        pool_kv = self.kv.full if isinstance(self.kv, WindowedKVCache) else self.kv
        page_bytes = pool_kv.num_bytes // sc.num_pages
        weights_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params))
        return {
            **self.scheduler.stats(),
            "kv_bytes_total": self.kv.num_bytes,
            "kv_bytes_used": used * page_bytes,
            "weights_bytes": weights_bytes,
            "tokens_processed": self.num_tokens_processed,
            "num_steps": self.num_steps,
            "num_failed_steps": self.num_failed_steps,
            "num_step_shapes": len(self.shapes),
            "num_step_programs": sum(len(sampler_variants(s)) for s in self.shapes.shapes),
            "num_compiled_steps": compiles.count("engine_step"),  # in this process
            "warmup_s": self.warmup_s,
            "compiles_after_warmup": (
                None
                if self._compiles_at_warmup is None
                else compiles.count() - self._compiles_at_warmup
            ),
            **compiles.stats(),
            **{f"host_{k}": v for k, v in self.timings.as_dict_ms().items()},
            **({} if self.spec is None else self.spec.stats.as_dict()),
            **({} if self.adapters is None else self.adapters.stats()),
        }


def _with_speculation(model, config: EngineConfig):
    """The model with an identity naming the engine's speculative decoding (what every
    response's resolved versions report), e.g. "ngram:k=4"."""
    if config.speculative is None:
        return model
    identity = dataclasses.replace(model.identity, speculative=config.speculative.describe())
    return dataclasses.replace(model, identity=identity)
