"""EngineCore: the loop that turns many concurrent requests into fixed-shape device steps.

One step, all on the caller's (single) thread:

    plan = scheduler.schedule(now)               host: who computes how many tokens
    batch, shape, rows = build_batch(plan)       host: numpy arrays, padded to buckets
    kv, counts, packed = engine_step(...)        device: one jitted call, cache donated
    packed = device_get(packed)                  the one device->host transfer
    scheduler.update_after_step(plan, tokens)    host: advance, append sampled tokens
    stop checks (EOS, stop ids/strings, max_tokens) -> finish_request -> RequestOutput deltas

The host half of a step (validation, stop checks, RequestOutput deltas, metrics) is
engine/outputs.py's OutputProcessor, shared with serving's MockEngine. The serving layer
drives the engine from its engine thread through engine/interface.py's `Engine` Protocol.
"""

from __future__ import annotations

import logging
import random
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs.engine_config import EngineConfig
from engine import compiles, sharding
from engine.api_types import EngineRequest, RequestOutput, TokenLogprob
from engine.batch import BatchShape, build_batch, pow2_bucket
from engine.kv_cache import PagedKVCache
from engine.outputs import OutputProcessor
from engine.page_pool import PagePool, model_keys_of
from engine.request import Request
from engine.sampling import (
    SampleResult,
    SamplingFlags,
    init_counts,
    reset_slot_counts,
    resolve_seed,
    sampler_flags,
    uses_penalties,
)
from engine.scheduler import Scheduler
from engine.step import NONFINITE_TOKEN, engine_step
from models.llama import cast_params, layer_layout
from models.registry import engine_model

log = logging.getLogger(__name__)
NONFINITE_ERROR = "model produced non-finite logits"

_reset_counts_jit = jax.jit(reset_slot_counts, donate_argnums=(0, 1))


class EngineCore:
    def __init__(self, model, config: EngineConfig, *, impl: str = "auto", mesh=None):
        """`model`: a models.registry.LoadedModel (quantized here if `config` asks for it and
        it is float; its identity then names the quantization and the KV dtype)."""
        compiles.install()
        model = engine_model(model, config)
        self.model = model
        self.config = config
        self.cfg = model.config
        self.identity = model.identity
        self.tokenizer = model.tokenizer
        self.impl = impl
        self.mesh = None if mesh is None else sharding.engine_mesh(mesh)
        self.sched_config = config.scheduler_config(self.cfg)
        self.pool = PagePool.from_config(self.sched_config, model_keys_of(self.identity))
        self.scheduler = Scheduler(self.sched_config, self.pool)
        self.params, kv_sharding = cast_params(model.params, config.dtype), None
        if self.mesh is not None:  # Megatron layout; cfg.num_kv_heads may grow (replication)
            self.cfg, self.params = sharding.shard_params(self.params, self.cfg, self.mesh)
            kv_sharding = sharding.kv_sharding(self.mesh, self.cfg)
        else:  # NOTE: committed, like loaded params: an uncommitted cache is another jit cache
            # key, so the first warm-up shape would compile again on first use.
            kv_sharding = next(iter(jax.tree.leaves(self.params)[0].devices()))
            self.params = layer_layout(self.params, config.layer_loop)
        self.kv = PagedKVCache.zeros(
            self.cfg,
            self.sched_config.num_pages,
            self.sched_config.page_size,
            config.kv_dtype,
            sharding=kv_sharding,
        )
        zeros = jnp.zeros((1, 1), jnp.int32)
        # With a mesh: replicated, as the step returns it (the KV spec would not fit (1, 1)).
        self._counts = self._prompt_mask = (
            jax.device_put(zeros, kv_sharding)
            if self.mesh is None
            else sharding.replicate(zeros, self.mesh)
        )
        self._penalties_ready = False
        self.outputs = OutputProcessor(
            self.scheduler,
            self.tokenizer,
            vocab_size=self.cfg.vocab_size,
            cache_sharing=config.cache_sharing,
            on_finished=self._forget,
        )
        self._seeds: dict[str, int] = {}
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(self.sched_config.max_num_seqs - 1, -1, -1))
        self._rng = random.Random()
        self.num_steps = 0
        self.num_tokens_processed = 0
        self.num_failed_steps = 0
        self.warmup_s: float | None = None

    # ---- the interface ------------------------------------------------------------------
    def add_request(self, er: EngineRequest, cache_salt: str | None = None) -> None:
        self.outputs.add_request(er, time.monotonic(), cache_salt)
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
        model = engine_model(model, self.config)
        self.model, self.identity, self.tokenizer = model, model.identity, model.tokenizer
        self.outputs.tokenizer = model.tokenizer  # for requests added from now on
        self.params = layer_layout(
            cast_params(model.params, self.config.dtype), self.config.layer_loop
        )
        self.pool.clear_cache(model_keys_of(self.identity))

    def clear_prefix_cache(self) -> None:
        """Forget every cached page (pages in use stay in use)."""
        self.pool.clear_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule(time.monotonic())
        outputs = self.outputs.finished(plan)
        for rid in plan.preempted_request_ids:
            self._release_slot(rid)
        if plan.is_empty:
            return outputs
        for s in plan.scheduled:
            self._ensure_slot(s.request)
        batch, shape, rows = build_batch(
            plan.scheduled,
            self.sched_config.page_size,
            max_prefill_tokens=self.sched_config.max_num_batched_tokens,
            prefill_chunk_size=self.sched_config.prefill_chunk_size,
            max_pages_per_seq=self.sched_config.max_pages_per_seq,
            slot_of=self._slot_of,
            seed_of=self._seeds,
            eos_token_ids=self.tokenizer.eos_token_ids,
        )
        params_list = [s.request.sampling for s in plan.scheduled]
        try:
            packed = self._run_device(batch, shape, params_list)
        except Exception as e:  # a failed step fails only the requests in it
            log.exception("engine step failed")
            self.num_failed_steps += 1
            return outputs + self.outputs.fail(plan, e, time.monotonic())
        result = SampleResult.unpack(packed)
        now = time.monotonic()
        outputs += self._fail_nonfinite(rows, result, now)
        sampled = {
            row.request_id: int(result.tokens[row.sampler_row])
            for row in rows
            if row.samples and result.tokens[row.sampler_row] != NONFINITE_TOKEN
        }
        self.num_steps += 1
        self.num_tokens_processed += plan.total_num_scheduled_tokens
        logprobs = self._logprobs(plan, result, rows)
        return outputs + self.outputs.commit(plan, sampled, now, logprobs)

    def _fail_nonfinite(self, rows, result, now: float) -> list[RequestOutput]:
        """Requests whose logits held NaN/inf this step (flagged on device) end "failed"."""
        outputs = []
        for row in rows:
            if result.tokens[row.sampler_row] != NONFINITE_TOKEN:
                continue
            req = self.scheduler.get_request(row.request_id)
            out = None if req is None else self.outputs.end(req, "failed", now, NONFINITE_ERROR)
            if out is not None:
                log.error("request %s: non-finite logits; failed", row.request_id)
                outputs.append(out)
        return outputs

    # ---- device ---------------------------------------------------------------------------
    def _run_device(self, batch, shape: BatchShape, params_list) -> np.ndarray:
        before = compiles.count()
        packed = self.run_step(
            batch, shape, sampler_flags(params_list), uses_penalties(params_list)
        )
        if self.warmup_s is not None and compiles.count() > before:
            log.warning("step compiled a shape after warm-up: %s", shape)
        return np.asarray(jax.device_get(packed))

    def run_step(self, batch, shape: BatchShape, flags: SamplingFlags, use_penalties: bool):
        """One device step (also used by warm-up); returns the packed results on device."""
        self.kv, self._counts, packed = engine_step(
            self.params,
            self.kv,
            self._counts,
            self._prompt_mask,
            batch,
            cfg=self.cfg,
            shape=shape,
            flags=flags,
            use_penalties=use_penalties,
            impl=self.impl,
            mesh=self.mesh,
        )
        return packed

    def _ensure_slot(self, req: Request) -> None:
        rid = req.request_id
        if rid in self._slot_of:
            return
        slot = self._free_slots.pop()
        self._slot_of[rid] = slot
        if uses_penalties([req.sampling]):
            self._reset_penalty_row(slot, req)

    def _reset_penalty_row(self, slot: int, req: Request) -> None:
        if not self._penalties_ready:
            self._counts, self._prompt_mask = init_counts(
                self.sched_config.max_num_seqs, self.cfg.vocab_size
            )
            self._penalties_ready = True
        prompt = np.zeros(pow2_bucket(req.num_prompt_tokens, 16), np.int32)
        prompt[: req.num_prompt_tokens] = req.prompt_token_ids
        outs = np.zeros(pow2_bucket(max(req.num_output_tokens, 1), 16), np.int32)
        outs[: req.num_output_tokens] = req.output_token_ids
        self._counts, self._prompt_mask = _reset_counts_jit(
            self._counts,
            self._prompt_mask,
            slot,
            prompt,
            req.num_prompt_tokens,
            outs,
            req.num_output_tokens,
        )

    def _release_slot(self, request_id: str) -> None:
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _forget(self, request_id: str) -> None:
        """A request left the engine (OutputProcessor's on_finished)."""
        self._seeds.pop(request_id, None)
        self._release_slot(request_id)

    @staticmethod
    def _logprobs(plan, result: SampleResult, rows) -> dict[str, TokenLogprob]:
        """The sampled tokens' logprobs, for the requests that asked for them."""
        wanted = {s.request.request_id: s.request.sampling.logprobs for s in plan.scheduled}
        out = {}
        for row in rows:
            n = wanted.get(row.request_id)
            if n is None or not row.samples:
                continue
            r = row.sampler_row
            top = [
                (int(i), float(lp))
                for i, lp in zip(result.top_ids[r][:n], result.top_logprobs[r][:n])
            ]
            out[row.request_id] = TokenLogprob(
                int(result.tokens[r]), float(result.logprobs[r]), top
            )
        return out

    # ---- stats --------------------------------------------------------------------------------
    def stats(self) -> dict:
        used, sc = self.pool.num_used_pages, self.sched_config
        return {
            **self.scheduler.stats(),
            "kv_bytes_total": self.kv.num_bytes,
            "kv_bytes_used": used * (self.kv.num_bytes // sc.num_pages),
            "weights_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params)),
            "tokens_processed": self.num_tokens_processed,
            "num_steps": self.num_steps,
            "num_failed_steps": self.num_failed_steps,
            "num_compiled_steps": compiles.count("jit(engine_step)"),
            "warmup_s": self.warmup_s,
        }
