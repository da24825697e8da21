"""The host half of an engine step, shared by the real engine (engine/core.py EngineCore)
and serving's mock (serving/engine_host/mock_engine.py MockEngine), so the two cannot drift apart.

Everything an engine does around its device step that is not about the device lives here:

    add_request(er)            validate, queue in the Scheduler, a StopChecker per request
    plan = scheduler.schedule(now)
    outputs  = finished(plan)  final deltas of requests ended inside schedule()
                               ("cancelled", "timed_out")
    ... device step: sampled token ids for the plan's sampling rows ...
    outputs += commit(plan, sampled, now)    update_after_step, stop checks (EOS, stop ids,
                                             stop strings, max_tokens), RequestOutput deltas
    or, when the device step raised:
    outputs += fail(plan, error, now)        every request of the plan ends "failed"
    stats = {**scheduler.stats(), ...device stats}

A device step is anything that maps a SchedulerOutput to {request_id: sampled token id}:
the jitted model step in EngineCore, a hand-checkable rule in MockEngine. `on_finished(id)`
tells the owner that a request has left (EngineCore frees its sampler slot and seed).

Per step (`emit`), one pass over the rows that received a token: a row that only
continues (no stop string, no grammar, not a stop id, below max_tokens, no logprobs:
`StopChecker.continues`) gets its text from `detokenize_next` (models/
detokenizer.py: the common token from a memo, no tokenizer call) and its delta built
directly; the others go through `StopChecker.add_token` and, when they end, `_final`.
Host time (issue 20): at 256 running requests every per-row layer here was measurable.

Plain Python, no JAX: the mock engine (and the serving tests) import it without a device.
"""

from __future__ import annotations

from collections.abc import Callable

from configs.engine_config import CacheSharingPolicy
from engine.api_types import (
    EngineRequest,
    FinishReason,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from engine.errors import DuplicateRequestError, InvalidRequestError
from engine.sched.page_pool import cache_salt_for
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler, SchedulerOutput
from engine.sched.stop_checker import StopChecker
from models.detokenizer import detokenize_next


def request_metrics(req: Request) -> RequestMetrics:
    """Final timings of a finished request (engine clock, time.monotonic())."""
    t = req.token_times_s
    m = RequestMetrics(
        cached_tokens=max(req.num_cached_tokens, 0),
        num_preemptions=req.num_preemptions,
        spec_drafted_tokens=req.spec_drafted_tokens,
        spec_accepted_tokens=req.spec_accepted_tokens,
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


class OutputProcessor:
    """Per-request host state (a StopChecker each) and the step's RequestOutput deltas."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer,
        *,
        vocab_size: int,
        cache_sharing: CacheSharingPolicy | None = None,
        on_finished: Callable[[str], None] | None = None,
    ):
        """`tokenizer`: eos_token_ids and new_detokenizer(prompt_ids, skip_special_tokens)."""
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_sharing = cache_sharing
        self._on_finished = on_finished
        self._stops: dict[str, StopChecker] = {}

    # ---- requests in ------------------------------------------------------------------------
    def add_request(
        self,
        er: EngineRequest,
        now_s: float,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        grammar_done: Callable[[int], bool] | None = None,
    ) -> Request:
        """Validate and queue. Raises InvalidRequestError (DuplicateRequestError) naming the
        field, the value and the limit. `grammar_done`: structured output's stop rule
        (engine/sched/stop_checker.py)."""
        if not er.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids", [], "must hold at least one token")
        bad = [t for t in er.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                "prompt_token_ids", bad[0], f"token ids must be in [0, {self.vocab_size})"
            )
        if er.request_id in self._stops:
            raise DuplicateRequestError(er.request_id)
        if cache_salt is None:
            cache_salt = cache_salt_for(er.tenant, self.cache_sharing)
        req = Request.from_engine_request(
            er, now_s=now_s, cache_salt=cache_salt, adapter_id=adapter_id
        )
        self.scheduler.add_request(req)
        detok = self.tokenizer.new_detokenizer(er.prompt_token_ids, er.sampling.skip_special_tokens)
        self._stops[er.request_id] = StopChecker(
            er.sampling, self.tokenizer.eos_token_ids, detok, grammar_done
        )
        return req

    def is_tracked(self, request_id: str) -> bool:
        return request_id in self._stops

    # ---- one step's outputs -------------------------------------------------------------------
    def finished(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Final deltas of the requests schedule() ended (cancelled, timed out)."""
        return [self._final(req, []) for req in plan.finished_requests]

    def fail(
        self, plan: SchedulerOutput, error: BaseException, now_s: float
    ) -> list[RequestOutput]:
        """The device step of `plan` raised: each of its requests ends "failed"."""
        error_text = f"engine step failed: {error!r}"
        failed = [self.end(s.request, "failed", now_s, error_text) for s in plan.scheduled]
        return [out for out in failed if out is not None]

    def end(
        self, req: Request, reason: FinishReason, now_s: float, error: str | None = None
    ) -> RequestOutput | None:
        """End one request now (e.g. "failed": its step or its logits went wrong) and return
        its final delta; None if it had already ended."""
        if not self.scheduler.finish_request(req.request_id, reason, now_s):
            return None
        return self._final(req, [], error=error)

    def commit(
        self,
        plan: SchedulerOutput,
        sampled: dict[str, int],
        now_s: float,
        logprobs: dict[str, TokenLogprob] | None = None,
    ) -> list[RequestOutput]:
        """The device step of `plan` produced `sampled` ({request_id: token id} for the rows
        that sample): advance the scheduler, run the stop checks, build the deltas.
        `logprobs[request_id]`: the token's logprobs, for requests that asked for them."""
        received = self.scheduler.update_after_step(plan, sampled, now_s)
        return self.emit(received, now_s, logprobs)

    def emit(
        self,
        received: list[Request],
        now_s: float,
        logprobs: dict[str, TokenLogprob] | None = None,
        tokens: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Stop checks and deltas for the requests that just received a token (what
        `scheduler.update_after_step` returned; `commit` = the two together). `tokens`:
        their new tokens, when the caller has them (`scheduler.receive_tokens`)."""
        # ---- host time (#20): one pass; a row that only continues (StopChecker.continues)
        # gets its text (detokenize_next) and delta without the per-row layers
        stops_of = self._stops
        if tokens is None:
            tokens = [req.output_token_ids[-1] for req in received]
        outputs = []
        append = outputs.append
        for req, token in zip(received, tokens):
            rid = req.request_id
            stop = stops_of[rid]
            lp = logprobs.get(rid) if logprobs else None
            if lp is None and stop.continues(token):
                cached = req.num_cached_tokens
                # NOTE: positional: RequestOutput's field order (about 2x cheaper than
                # keywords for the hundreds built per step)
                append(
                    RequestOutput(
                        rid,
                        [token],
                        detokenize_next(stop.detokenizer, token),
                        req.token_times_s[-1:],
                        False,
                        None,
                        len(req.prompt_token_ids),
                        cached if cached > 0 else 0,
                        len(req.output_token_ids),
                    )
                )
            else:
                # a token that ends the request as a stop id is never detokenized
                text = None if stop.ends_on(token) else detokenize_next(stop.detokenizer, token)
                append(self._on_token(req, stop, token, text, lp, now_s))
        return outputs

    def emit_tokens(
        self, req: Request, tokens: list[int], now_s: float, logprobs: list | None = None
    ) -> RequestOutput:
        """Several new tokens of one request at once (a speculative step's accepted run,
        engine/spec/decode.py): each is appended and stop-checked in order; a stop (EOS,
        stop id or string, max_tokens) ends the request there and drops the rest."""
        stop, texts = self._stops[req.request_id], []
        for i, token in enumerate(tokens):
            req.append_output_token(token, now_s)
            text, reason = stop.add_token(token)
            texts.append(text)
            if reason is not None:
                self.scheduler.finish_request(req.request_id, reason, now_s)
                lps = None if logprobs is None else logprobs[: i + 1]
                return self._final(req, tokens[: i + 1], "".join(texts), lps)
        return self._delta(req, list(tokens), "".join(texts), logprobs)

    def _on_token(
        self, req: Request, stop: StopChecker, token: int, text, lp, now_s: float
    ) -> RequestOutput:
        text, reason = stop.add_token(token, text)
        logprobs = [lp] if lp is not None else None
        if reason is not None:
            self.scheduler.finish_request(req.request_id, reason, now_s)
            return self._final(req, [token], text, logprobs)
        return self._delta(req, [token], text, logprobs)

    def _final(
        self, req: Request, tokens: list[int], text: str = "", logprobs=None, error=None
    ) -> RequestOutput:
        stop = self._stops.pop(req.request_id, None)
        if stop is not None and req.finish_reason in ("stop", "length"):
            text += stop.flush()
        if self._on_finished is not None:
            self._on_finished(req.request_id)
        return self._delta(req, tokens, text, logprobs, finished=True, error=error)

    @staticmethod
    def _delta(
        req: Request,
        tokens: list[int],
        text: str,
        logprobs=None,
        finished: bool = False,
        error: str | None = None,
    ) -> RequestOutput:
        k = len(tokens)
        return RequestOutput(  # positional, in field order (see emit)
            req.request_id,
            tokens,
            text,
            req.token_times_s[len(req.token_times_s) - k :] if k else [],
            finished,
            req.finish_reason if finished else None,
            req.num_prompt_tokens,
            max(req.num_cached_tokens, 0),
            req.num_output_tokens,
            logprobs,
            request_metrics(req) if finished else None,
            error,
        )
