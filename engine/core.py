"""EngineCore: the loop that turns many concurrent requests into fixed-shape device steps.

One step, all on the caller's (single) thread:

    plan = scheduler.schedule(now)               host: who computes how many tokens
    batch, shape, rows = build_batch(plan)       host: numpy arrays, padded to buckets
    kv, counts, packed = engine_step(...)        device: one jitted call, cache donated
    packed = device_get(packed)                  the one device->host transfer
    scheduler.update_after_step(plan, tokens)    host: advance, append sampled tokens
    stop checks (EOS, stop ids/strings, max_tokens) -> finish_request -> RequestOutput deltas

The serving layer drives it from its engine thread through the interface in WORKSPACE.md
(`add_request`, `abort_request`, `step`, `has_unfinished`, `stats`, `identity`,
`tokenizer`).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs.engine_config import EngineConfig
from engine import sharding
from engine.api_types import EngineRequest, RequestMetrics, RequestOutput, TokenLogprob
from engine.batch import BatchShape, build_batch, pow2_bucket
from engine.errors import InvalidRequestError
from engine.kv_cache import PagedKVCache
from engine.page_pool import PagePool, cache_salt_for
from engine.request import Request
from engine.sampling import (
    SampleResult,
    SamplingFlags,
    init_counts,
    reset_slot_counts,
    resolve_seed,
    uses_penalties,
)
from engine.scheduler import Scheduler
from engine.step import NONFINITE_TOKEN, engine_step
from engine.stop_checker import StopChecker
from models.llama import layer_layout

log = logging.getLogger(__name__)

_GREEDY_FLAGS = SamplingFlags(filters=False, all_greedy=True, top_logprobs=False)
_FULL_FLAGS = SamplingFlags()
_reset_counts_jit = jax.jit(reset_slot_counts, donate_argnums=(0, 1))


@dataclasses.dataclass
class _RequestState:
    stop: StopChecker
    seed: int
    sent_tokens: int = 0  # output tokens already reported


def request_metrics(req: Request) -> RequestMetrics:
    t = req.token_times_s
    m = RequestMetrics(
        cached_tokens=max(req.num_cached_tokens, 0), num_preemptions=req.num_preemptions
    )
    if req.first_scheduled_s is not None:
        m.queue_s = req.first_scheduled_s - req.arrival_s
    if t:
        m.ttft_s = t[0] - req.arrival_s
        m.itl_s = [b - a for a, b in zip(t, t[1:])]
        m.tpot_s = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None
    if req.finish_s is not None:
        m.e2e_s = req.finish_s - req.arrival_s
    return m


class EngineCore:
    def __init__(self, model, config: EngineConfig, *, impl: str = "auto", mesh=None):
        """`model`: a models.registry.LoadedModel."""
        self.model = model
        self.config = config
        self.cfg = model.config
        self.identity = model.identity
        self.tokenizer = model.tokenizer
        self.impl = impl
        self.mesh = None if mesh is None else sharding.engine_mesh(mesh)
        self.sched_config = config.scheduler_config(self.cfg)
        keys = (
            self.identity.revision,
            self.identity.tokenizer_hash,
            self.identity.chat_template_hash,
        )
        self.pool = PagePool.from_config(self.sched_config, model_keys=keys)
        self.scheduler = Scheduler(self.sched_config, self.pool)
        self.params, kv_sharding = model.params, None
        if self.mesh is not None:  # Megatron layout; cfg.num_kv_heads may grow (replication)
            self.cfg, self.params = sharding.shard_params(model.params, self.cfg, self.mesh)
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
        self._states: dict[str, _RequestState] = {}
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(self.sched_config.max_num_seqs - 1, -1, -1))
        self._rng = random.Random()
        self.num_steps = 0
        self.num_tokens_processed = 0
        self.num_failed_steps = 0
        self.warmup_s: float | None = None

    # ---- the interface ------------------------------------------------------------------
    def add_request(self, er: EngineRequest, cache_salt: str | None = None) -> None:
        if not er.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids", [], "must hold at least one token")
        bad = [t for t in er.prompt_token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise InvalidRequestError(
                "prompt_token_ids", bad[0], f"token ids must be in [0, {self.cfg.vocab_size})"
            )
        if er.request_id in self._states:
            raise InvalidRequestError("request_id", er.request_id, "already running")
        now = time.monotonic()
        salt = (
            cache_salt
            if cache_salt is not None
            else cache_salt_for(er.tenant, self.config.cache_sharing)
        )
        req = Request.from_engine_request(er, now_s=now, cache_salt=salt)
        self.scheduler.add_request(req)
        detok = self.tokenizer.new_detokenizer(er.prompt_token_ids, er.sampling.skip_special_tokens)
        self._states[er.request_id] = _RequestState(
            StopChecker(er.sampling, self.tokenizer.eos_token_ids, detok),
            resolve_seed(er.sampling, self._rng),
        )

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
        self.model, self.identity, self.tokenizer = model, model.identity, model.tokenizer
        self.params = model.params
        self.pool.clear_cache(
            (self.identity.revision, self.identity.tokenizer_hash, self.identity.chat_template_hash)
        )

    def clear_prefix_cache(self) -> None:
        """Forget every cached page (pages in use stay in use)."""
        self.pool.clear_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule(time.monotonic())
        outputs = [self._finished_output(r, []) for r in plan.finished_requests]
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
            seed_of={r: st.seed for r, st in self._states.items()},
            eos_token_ids=self.tokenizer.eos_token_ids,
        )
        params_list = [s.request.sampling for s in plan.scheduled]
        try:
            packed = self._run_device(batch, shape, params_list)
        except Exception as e:  # a failed step fails only the requests in it
            log.exception("engine step failed")
            self.num_failed_steps += 1
            now = time.monotonic()
            for s in plan.scheduled:
                if self.scheduler.finish_request(s.request.request_id, "failed", now):
                    outputs.append(self._finished_output(s.request, [], error=repr(e)))
            return outputs
        result = SampleResult.unpack(packed)
        now = time.monotonic()
        outputs += self._fail_nonfinite(rows, result, now)
        sampled = {
            row.request_id: int(result.tokens[row.sampler_row])
            for row in rows
            if row.samples and result.tokens[row.sampler_row] != NONFINITE_TOKEN
        }
        row_of = {row.request_id: row.sampler_row for row in rows}
        self.num_steps += 1
        self.num_tokens_processed += plan.total_num_scheduled_tokens
        for req in self.scheduler.update_after_step(plan, sampled, now):
            outputs.append(self._on_token(req, result, row_of[req.request_id], now))
        return outputs

    def _fail_nonfinite(self, rows, result, now: float) -> list[RequestOutput]:
        """Requests whose logits held NaN/inf this step (flagged on device) end "failed"."""
        outputs = []
        for row in rows:
            if result.tokens[row.sampler_row] != NONFINITE_TOKEN:
                continue
            req = self.scheduler.get_request(row.request_id)
            if req is not None and self.scheduler.finish_request(row.request_id, "failed", now):
                log.error("request %s: non-finite logits; failed", row.request_id)
                outputs.append(
                    self._finished_output(req, [], error="model produced non-finite logits")
                )
        return outputs

    # ---- device ---------------------------------------------------------------------------
    def _run_device(self, batch, shape: BatchShape, params_list) -> np.ndarray:
        greedy = all(p.greedy and not p.logprobs for p in params_list)
        before = engine_step._cache_size()
        packed = self.run_step(
            batch, shape, _GREEDY_FLAGS if greedy else _FULL_FLAGS, uses_penalties(params_list)
        )
        if self.warmup_s is not None and engine_step._cache_size() > before:
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
        p = req.sampling
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
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

    # ---- outputs ----------------------------------------------------------------------------
    def _on_token(self, req: Request, result: SampleResult, row: int, now: float) -> RequestOutput:
        st = self._states[req.request_id]
        token = req.output_token_ids[-1]
        text, reason = st.stop.add_token(token)
        logprobs = None
        n = req.sampling.logprobs
        if n is not None:
            top = [
                (int(i), float(lp))
                for i, lp in zip(result.top_ids[row][:n], result.top_logprobs[row][:n])
            ]
            logprobs = [TokenLogprob(token, float(result.logprobs[row]), top)]
        if reason is not None:
            self.scheduler.finish_request(req.request_id, reason, now)
            return self._finished_output(req, [token], text=text, logprobs=logprobs)
        return self._delta(req, [token], text, logprobs)

    def _delta(
        self,
        req: Request,
        tokens: list[int],
        text: str,
        logprobs=None,
        finished: bool = False,
        error: str | None = None,
    ) -> RequestOutput:
        st = self._states.get(req.request_id)
        if st is not None:
            st.sent_tokens += len(tokens)
        k = len(tokens)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            new_text=text,
            token_times_s=req.token_times_s[len(req.token_times_s) - k :] if k else [],
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens,
            logprobs=logprobs,
            metrics=request_metrics(req) if finished else None,
            error=error,
        )

    def _finished_output(
        self,
        req: Request,
        tokens: list[int],
        text: str = "",
        logprobs=None,
        error: str | None = None,
    ) -> RequestOutput:
        st = self._states.pop(req.request_id, None)
        if st is not None:
            text += st.stop.flush() if req.finish_reason in ("stop", "length") else ""
        self._release_slot(req.request_id)
        out = self._delta(req, tokens, text, logprobs, finished=True, error=error)
        return out

    # ---- stats --------------------------------------------------------------------------------
    def stats(self) -> dict:
        pool, sc = self.pool, self.sched_config
        used = pool.num_used_pages
        page_bytes = self.kv.num_bytes // sc.num_pages
        weights_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params))
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_pages_total": sc.num_pages - 1,
            "kv_pages_used": used,
            "kv_pages_free": pool.num_free_pages,
            "kv_pages_cached": pool.num_cached_pages,
            "kv_usage": used / max(1, sc.num_pages - 1),
            "page_size": sc.page_size,
            "kv_capacity_tokens": (sc.num_pages - 1) * sc.page_size,
            "kv_bytes_total": self.kv.num_bytes,
            "kv_bytes_used": used * page_bytes,
            "weights_bytes": weights_bytes,
            "max_model_len": sc.max_model_len,
            "max_num_seqs": sc.max_num_seqs,
            "num_preemptions": self.scheduler.num_preemptions,
            "allocation_failures": pool.stats.allocation_failures,
            "prefix_cache_queries_tokens": pool.stats.queried_tokens,
            "prefix_cache_hit_tokens": pool.stats.hit_tokens,
            "prefix_cache_hit_rate": pool.stats.hit_rate,
            "prefix_cache_evictions": pool.stats.evictions,
            "prefix_cache_expirations": pool.stats.expirations,
            "prefix_cache_prefill_tokens_saved": pool.stats.hit_tokens,
            "prefix_cache_cached_pages": pool.num_cached_pages,
            "prefix_cache_enabled": pool.enable_prefix_caching,
            "tokens_processed": self.num_tokens_processed,
            "num_steps": self.num_steps,
            "num_failed_steps": self.num_failed_steps,
            "num_compiled_steps": engine_step._cache_size(),
            "warmup_s": self.warmup_s,
        }
