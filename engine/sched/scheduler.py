"""The continuous-batching scheduler (host side, plain Python; vLLM v1 / nano-vllm style).

Each step the engine calls, from its one thread:

    out = scheduler.schedule(now_s)          # the plan: who computes how many tokens
    ... device step over out.scheduled ...   # writes K/V of the new tokens, samples
    got = scheduler.update_after_step(out, {request_id: sampled token}, now_s)

`schedule` commits the plan at once: each scheduled request's `num_computed_tokens` advances
and a sampling one gets a pending output (engine/sched/request.py). So the next `schedule` may run
before `update_after_step` of this plan (the engine overlaps them: it schedules step N+1
while step N runs on the device), and `update_after_step` only fills in the tokens.
    for req in got:                          # requests that received a token this step
        if <engine's stop check: EOS, stop ids/strings, max_tokens>:
            scheduler.finish_request(req.request_id, "stop" | "length", now_s)

and between steps `add_request(req)` and `abort_request(request_id)`.

What `schedule(now_s)` does, in order:
  1. Expire old prefix-cache pages; end aborted requests ("cancelled") and those past their
     deadline ("timed_out"), freeing their pages at once (`out.finished_requests`).
  2. Running requests: decodes (1 token left to compute) first, then partially prefilled
     ones (a chunk of at most prefill_chunk_size), most important first, while the token
     budget lasts. A request whose known + pending outputs reach max_tokens is skipped (it
     ends when the host reads its last token). When the pool has no page for one of them,
     preempt by recompute the least important unscheduled running request (lowest
     effective priority, then latest arrival; possibly the request itself): its pages are
     freed, num_computed_tokens goes back to 0, its outputs are kept and recomputed later,
     and it returns to the waiting queue ahead of requests of equal effective priority.
  3. If nobody was preempted: admit waiting requests in order of effective priority while
     the token budget, the slot limit (max_num_seqs running) and the pool allow. A
     request's cached prefix (engine.sched.page_pool; device pages, then pages the host
     tier copies back) is attached first, so only the rest is computed. Admission stops
     at the first request that does not fit (no overtaking, so a long prompt cannot be
     starved by short ones).

Effective priority = priority + priority_aging_per_s * (now_s - arrival_s): a request that
waits long enough overtakes any fresh one, so low priority cannot starve. NOTE: the order
this defines does not depend on now_s (the difference between two requests' effective
priorities is constant), so the waiting queue is kept sorted by the static key
priority - rate * arrival_s instead of being re-sorted every step.

Invariants (tests/test_scheduler.py checks them on random workloads): the scheduled tokens of
a step never exceed max_num_batched_tokens; at most max_num_seqs requests run; a page has
one owner unless shared through the prefix cache's reference counts; every request ends with
exactly one finish reason; when all requests have ended every page is free again.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Callable

from configs.engine_config import SchedulerConfig
from engine.api_types import FinishReason
from engine.errors import DuplicateRequestError, InvalidRequestError
from engine.sched.host_tier import host_tier_stats
from engine.sched.page_pool import PagePool
from engine.sched.request import Request, RequestStatus


@dataclasses.dataclass(slots=True)  # slots: hundreds are built per step (host time, #20)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step: all_token_ids[start : start + num_new]
    start: int  # = request.num_computed_tokens when scheduled (position of the first one)
    samples: bool  # start + num_new_tokens == num_tokens: a token is sampled from the last
    output_index: int = 0  # when sampling: index of the output token this step samples
    # Speculative decoding: drafts computed after the last known token (num_new_tokens =
    # 1 + len(spec_token_ids)); the step verifies them and emits 1..len + 1 tokens.
    spec_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan. The device step reads each request's page_ids and token ids."""

    scheduled: list[ScheduledRequest]  # batch order: running requests, then admissions
    total_num_scheduled_tokens: int  # sum of num_new_tokens <= max_num_batched_tokens
    preempted_request_ids: list[str]  # sent back to waiting this step (pages freed)
    finished_requests: list[Request]  # ended inside schedule(): "cancelled" or "timed_out"
    num_running: int  # after this schedule
    num_waiting: int

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request.request_id: s.num_new_tokens for s in self.scheduled}

    @property
    def sampling_request_ids(self) -> list[str]:
        return [s.request.request_id for s in self.scheduled if s.samples]

    @property
    def aborted_request_ids(self) -> list[str]:
        return [r.request_id for r in self.finished_requests if r.finish_reason == "cancelled"]

    @property
    def timed_out_request_ids(self) -> list[str]:
        return [r.request_id for r in self.finished_requests if r.finish_reason == "timed_out"]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, page_pool: PagePool):
        if page_pool.page_size != config.page_size or page_pool.num_pages != config.num_pages:
            raise ValueError(
                f"page pool ({page_pool.num_pages} pages of "
                f"{page_pool.page_size}) does not match the config "
                f"({config.num_pages} pages of {config.page_size})"
            )
        self.config = config
        self.pool = page_pool
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: list[Request] = []  # admission order (_waiting_key), kept sorted
        self.running: list[Request] = []
        # `running` by rank, or None after `running` changed (_running_in_order)
        self._ranked: list[Request] | None = None
        self._pending_aborts: list[Request] = []  # objects, not ids: an id may be reused
        self._with_deadline: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_finished: collections.Counter[str] = collections.Counter()
        # KV transfer (engine/kv_transfer/transfer.py): called with a request about to end and its
        # reason, BEFORE its pages are freed, so a prefill worker can keep them to export.
        self.on_finish: Callable[[Request, FinishReason], None] | None = None

    # ---- requests in and out -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises DuplicateRequestError or InvalidRequestError."""
        if request.request_id in self.requests:
            raise DuplicateRequestError(request.request_id)
        max_len = request.num_prompt_tokens + request.sampling.max_tokens
        if max_len > self.config.max_model_len:
            raise InvalidRequestError(
                "prompt_token_ids + max_tokens",
                max_len,
                f"<= max_model_len ({self.config.max_model_len})",
            )
        # NOTE: a request that could not fit in the pool alone would preempt itself forever.
        if self.pool.pages_for_tokens(max_len) > self.pool.num_pages - 1:
            raise InvalidRequestError(
                "prompt_token_ids + max_tokens",
                max_len,
                f"<= {(self.pool.num_pages - 1) * self.pool.page_size}"
                " tokens (the whole KV page pool)",
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if request.deadline_s is not None:
            self._with_deadline[request.request_id] = request
        self._enqueue(request)

    def abort_request(self, request_id: str) -> None:
        """Cancel at the next schedule() (unknown or finished ids are ignored)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._pending_aborts.append(request)

    def finish_request(self, request_id: str, reason: FinishReason, now_s: float) -> bool:
        """End a request now (the engine's stop checks, a failed step) and free its pages.
        Returns False if it had already ended: the first reason stands."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, reason, now_s)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self, now_s: float) -> SchedulerOutput:
        self.pool.expire(now_s)
        finished = self._end_aborted_and_late(now_s)
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        for_priority = self._preempt_for_priority(now_s) if self.config.priority_preemption else []
        budget = self._schedule_running(now_s, budget, scheduled, preempted)
        if not preempted:
            self._admit_waiting(now_s, budget, scheduled)
        preempted += for_priority
        total = sum([s.num_new_tokens for s in scheduled])  # a list: cheaper than a generator
        assert total <= self.config.max_num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        return SchedulerOutput(
            scheduled, total, preempted, finished, len(self.running), len(self.waiting)
        )

    def update_after_step(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int], now_s: float
    ) -> list[Request]:
        """Fill in a finished device step (schedule() already advanced the computed tokens):
        append the sampled tokens, register newly full pages in the prefix cache. Returns
        the requests that received a token, for the engine's stop checks. A request
        preempted since this plan (waiting again) still receives its token: it was sampled
        from its whole context before the preemption."""
        finished = RequestStatus.FINISHED
        tokens = [
            sampled_token_ids[s.request.request_id]
            if s.samples and s.request.status is not finished
            else 0
            for s in output.scheduled
        ]
        return self.receive_tokens(output, tokens, now_s)[0]

    def receive_tokens(
        self, output: SchedulerOutput, tokens: list[int], now_s: float
    ) -> tuple[list[Request], list[int]]:
        """`update_after_step` with the tokens as a list aligned with `output.scheduled`
        (the value of a row that does not sample is ignored): the engine's form, without a
        dict per step (host time, #20). Returns the requests that received a token and
        their tokens."""
        received, got = [], []
        # host time (#20): properties read once per row; no prefix-cache call when off
        caching = self.pool.enable_prefix_caching
        running, finished = RequestStatus.RUNNING, RequestStatus.FINISHED
        for s, token in zip(output.scheduled, tokens):
            request = s.request
            if s.samples:
                request.num_pending_outputs -= 1
            status = request.status
            if status is finished:  # ended between schedule() and now (finish_request)
                continue
            if caching and status is running:
                self.pool.cache_full_pages(request)
            if s.samples:
                assert len(request.output_token_ids) == s.output_index, request.request_id
                request.append_output_token(token, now_s)
                received.append(request)
                got.append(token)
        return received, got

    def roll_back_drafts(self, request: Request, now_s: float) -> None:
        """After a speculative step appended a request's accepted run (its computed count
        already excludes the rejected drafts): free the lookahead pages past what its
        tokens need, then register its full pages in the prefix cache, which so never
        holds an unverified token. Stale K/V in a kept page sits past kv_len and is
        overwritten before it is read."""
        keep = self.pool.pages_for_tokens(request.num_tokens)
        extra = request.page_ids[keep:]
        if extra:
            self.pool.free(extra, now_s)
            del request.page_ids[keep:]
        self.pool.cache_full_pages(request)

    def _schedule_running(
        self, now_s: float, budget: int, scheduled: list[ScheduledRequest], preempted: list[str]
    ) -> int:
        # Decodes first, then the most important; victims come from the not yet scheduled.
        order = self._running_in_order()
        page_size = self.pool.page_size
        append = scheduled.append
        i = 0  # order[i:] are not scheduled yet (a list and an index: no deque per step)
        while i < len(order) and budget > 0:
            request = order[i]
            i += 1
            start, pending = request.num_computed_tokens, request.num_pending_outputs
            num_outputs = len(request.output_token_ids)
            if (  # host time (#20): a plain decode with room in its pages, inlined
                len(request.prompt_token_ids) + num_outputs + pending - start == 1
                and start < len(request.page_ids) * page_size
                and not request.spec_token_ids
                and request.first_scheduled_s is not None
            ):  # = _scheduled(request, 1, now_s) with _grow_pages True at no cost
                request.num_computed_tokens = start + 1
                request.num_pending_outputs = pending + 1
                append(ScheduledRequest(request, 1, start, True, num_outputs + pending))
                budget -= 1
                continue
            num_new = min(request.num_remaining_tokens, self.config.prefill_chunk_size, budget)
            if request.spec_token_ids:  # host time (#20): the call only with drafts
                num_new += self._spec_tokens_fitting(request, num_new, budget)
            while not self._grow_pages(request, num_new):
                if request.spec_token_ids:  # drafts never preempt anyone: drop them
                    num_new -= len(request.spec_token_ids)
                    request.spec_token_ids = []
                    continue
                victim = max([request, *order[i:]], key=self._rank)
                self._preempt(victim, now_s)
                preempted.append(victim.request_id)
                if victim is request:
                    break
                del order[order.index(victim, i)]
            else:
                append(self._scheduled(request, num_new, now_s))
                budget -= num_new
        return budget

    def _running_in_order(self) -> list[Request]:
        """The running requests with outputs left to schedule, decodes (one token left to
        compute) first, each group by rank (_rank: effective priority, then arrival), ties
        in running order: `sorted` by (not a decode, *_rank) as one stable sort would give.
        Host time (#20): the rank order is kept between steps (`_ranked`, rebuilt only
        when `running` changes), so a step only splits it into decodes and the rest."""
        ranked = self._ranked
        if ranked is None:
            rate = self.config.priority_aging_per_s
            ranked = self._ranked = sorted(
                self.running, key=lambda r: (rate * r.arrival_s - r.priority, r.arrival_s)
            )
        decodes, others = [], []
        for r in ranked:
            num_outputs = len(r.output_token_ids) + r.num_pending_outputs
            if num_outputs >= r.sampling.max_tokens:  # r.max_outputs_reached, inlined
                continue
            if len(r.prompt_token_ids) + num_outputs - r.num_computed_tokens > 1:
                others.append(r)
            else:
                decodes.append(r)
        decodes += others
        return decodes

    def _preempt_for_priority(self, now_s: float) -> list[str]:
        """Slots full and a waiting request of a higher priority class than the lowest
        running one: preempt that one (recompute), so the higher one is admitted this step.
        Classes, not effective priorities: aging alone never preempts (no thrash)."""
        preempted: list[str] = []
        while self.waiting and len(self.running) >= self.config.max_num_seqs:
            head = self.waiting[0]
            victim = max(self.running, key=self._rank)
            if head.priority <= victim.priority or head.num_pending_outputs:
                break
            self._preempt(victim, now_s)
            preempted.append(victim.request_id)
        return preempted

    def _admit_waiting(self, now_s: float, budget: int, scheduled: list[ScheduledRequest]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending_outputs:  # preempted with a token in flight: next step
                break
            hit = self.pool.find_prefix(request)  # device pages, then the host tier's
            cached_pages, num_cached = hit.device_pages, len(hit.pages) * self.pool.page_size
            num_new = min(request.num_tokens - num_cached, self.config.prefill_chunk_size, budget)
            num_pages = self.pool.pages_for_tokens(num_cached + num_new) - len(cached_pages)
            if not self.pool.can_allocate(num_pages, reserving=cached_pages):
                self.pool.stats.allocation_failures += 1
                break
            self.pool.acquire(cached_pages)
            fresh = self.pool.allocate(num_pages)
            request.page_ids = self.pool.attach_prefix(request, hit, fresh, now_s)
            request.num_computed_tokens = num_cached
            request.num_registered_pages = len(hit.pages)
            if self.pool.enable_prefix_caching:
                self.pool.record_lookup(request.num_tokens, num_cached)
            if request.num_cached_tokens < 0:  # first admission: what metrics report
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.waiting.pop(0)
            self.running.append(request)
            self._ranked = None
            scheduled.append(self._scheduled(request, num_new, now_s))
            budget -= num_new

    def _scheduled(self, request: Request, num_new: int, now_s: float) -> ScheduledRequest:
        """Commit the request's share of the plan: its computed tokens advance now, and a
        sampling step adds a pending output (filled in by update_after_step)."""
        if request.first_scheduled_s is None:
            request.first_scheduled_s = now_s
        start = request.num_computed_tokens
        drafts = ()
        if request.spec_token_ids:  # host time (#20): no new list per request per step
            drafts, request.spec_token_ids = tuple(request.spec_token_ids), []
        num_outputs = len(request.output_token_ids)
        samples = start + num_new == request.num_tokens + len(drafts)
        output_index = num_outputs + request.num_pending_outputs
        request.num_computed_tokens += num_new
        request.num_pending_outputs += samples
        return ScheduledRequest(
            request, num_new, start, samples, output_index if samples else 0, drafts
        )

    def _spec_tokens_fitting(self, request: Request, num_new: int, budget: int) -> int:
        """How many of the request's drafts this step computes: all of them after its one
        remaining token when they fit the chunk and the budget, else none (dropped)."""
        n = len(request.spec_token_ids)
        if n and not (
            request.num_remaining_tokens == num_new == 1
            and 1 + n <= min(self.config.prefill_chunk_size, budget)
        ):
            request.spec_token_ids, n = [], 0
        return n

    def _rank(self, request: Request) -> tuple[float, float]:
        """Sort key, most important first: effective priority, then earliest arrival."""
        aged = request.priority - self.config.priority_aging_per_s * request.arrival_s
        return (-aged, request.arrival_s)

    def _waiting_key(self, request: Request) -> tuple[float, bool, float]:
        # Preempted requests go ahead of others of equal effective priority.
        return (self._rank(request)[0], request.num_preemptions == 0, request.arrival_s)

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._waiting_key)

    def _grow_pages(self, request: Request, num_new: int) -> bool:
        """Make the page table cover num_computed + num_new tokens; False if no room."""
        num_tokens = request.num_computed_tokens + num_new
        if num_tokens <= len(request.page_ids) * self.pool.page_size:  # host time (#20)
            return True
        num_pages = self.pool.pages_for_tokens(num_tokens) - len(request.page_ids)
        if num_pages <= 0:
            return True
        pages = self.pool.allocate(num_pages)
        if pages is None:
            return False
        request.page_ids.extend(pages)
        return True

    def _preempt(self, request: Request, now_s: float) -> None:
        self.running.remove(request)
        self._ranked = None
        request.spec_token_ids = []
        self._release(request, now_s)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)

    def _release(self, request: Request, now_s: float) -> None:
        self.pool.free(request.page_ids, now_s)
        request.page_ids = []
        request.num_computed_tokens = 0
        request.num_registered_pages = 0

    def _end_aborted_and_late(self, now_s: float) -> list[Request]:
        finished = []
        for request in self._pending_aborts:
            if not request.is_finished:  # else it ended first (finish_request, twice aborted)
                self._finish(request, "cancelled", now_s)
                finished.append(request)
        self._pending_aborts.clear()
        for request in list(self._with_deadline.values()):
            if now_s >= request.deadline_s:
                self._finish(request, "timed_out", now_s)
                finished.append(request)
        return finished

    def _finish(self, request: Request, reason: FinishReason, now_s: float) -> None:
        if self.on_finish is not None:
            self.on_finish(request, reason)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._ranked = None
        else:
            self.waiting.remove(request)
        if request.page_ids:
            self.pool.free(request.page_ids, now_s)
            request.page_ids = []
        request.num_computed_tokens = 0  # its pages are gone
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_s = now_s
        del self.requests[request.request_id]
        self._with_deadline.pop(request.request_id, None)
        self.num_finished[reason] += 1

    # ---- KV transfer (engine/kv_transfer/transfer.py) -----------------------------------
    def adopt(
        self, request_id: str, page_ids: list[int], num_computed_tokens: int, now_s: float
    ) -> Request:
        """Run a just-added WAITING request at once with K/V another engine computed, already
        written into `page_ids` (allocated by the caller from this pool). The caller checked
        that a running slot is free (len(running) < max_num_seqs)."""
        request = self.requests[request_id]
        if request.status is not RequestStatus.WAITING or request.page_ids:
            raise ValueError(f"request {request_id!r} is not a fresh waiting request")
        if len(self.running) >= self.config.max_num_seqs:
            raise ValueError(f"no running slot for {request_id!r} (max_num_seqs)")
        self.waiting.remove(request)
        request.page_ids = list(page_ids)
        request.num_computed_tokens = num_computed_tokens
        request.num_registered_pages = 0  # registered in the prefix cache after a step
        request.first_scheduled_s = now_s
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._ranked = None
        return request

    # ---- stats ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """The host-side part of every engine's `stats()` (the keys serving reads)."""
        pool, sc = self.pool, self.config
        used = pool.num_used_pages
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_pages_total": sc.num_pages - 1,
            "kv_pages_used": used,
            "kv_pages_free": pool.num_free_pages,
            "kv_pages_cached": pool.num_cached_pages,
            "kv_usage": used / max(1, sc.num_pages - 1),
            "page_size": sc.page_size,
            "kv_capacity_tokens": (sc.num_pages - 1) * sc.page_size,
            "max_model_len": sc.max_model_len,
            "max_num_seqs": sc.max_num_seqs,
            "num_preemptions": self.num_preemptions,
            "allocation_failures": pool.stats.allocation_failures,
            "prefix_cache_queries_tokens": pool.stats.queried_tokens,
            "prefix_cache_hit_tokens": pool.stats.hit_tokens,
            "prefix_cache_hit_rate": pool.stats.hit_rate,
            "prefix_cache_evictions": pool.stats.evictions,
            "prefix_cache_expirations": pool.stats.expirations,
            "prefix_cache_prefill_tokens_saved": pool.stats.hit_tokens,
            "prefix_cache_cached_pages": pool.num_cached_pages,
            "prefix_cache_enabled": pool.enable_prefix_caching,
            **host_tier_stats(pool.host_tier),
        }
