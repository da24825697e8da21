"""The engine with only its device step faked, so the serving layer is tested without a model
or JAX (JetStream's mock_engine idea), on the real host code: engine.sched.scheduler.Scheduler,
engine.sched.page_pool.PagePool and engine.sched.outputs.OutputProcessor (validation, StopChecker,
RequestOutput deltas, metrics) are the ones EngineCore runs, so the mock cannot drift from
the engine in scheduling, preemption, prefix caching, stop handling or metrics
(tests/test_engine_vs_mock.py runs one request script through both).

Tokenizer: one token per UTF-8 byte (token id = byte value, vocab 256, EOS = 0).
Fake device step: every request that samples this step gets

    next_token(t) = 32 + (t - 32 + 1) % 95        # t: its last token (prompt or output)

the next printable ASCII character, cyclically: the prompt "abc" continues "defghij...",
and "~" wraps to " !\"#...". As on the real device, EOS and stop_token_ids are banned while
a request has fewer than min_tokens outputs: a banned token is replaced by the one after it
(`next_token` applied again). Everything else is the real engine's: whole prompts prefill in
one step when they fit the token budget (then one token per request per step), pages are
`page_size` tokens, the pool's page 0 is reserved, preemption by recompute, prefix-cache
hits in whole pages.

Hooks for tests: `fail_next_steps(n)` makes the next n device steps fail (their requests end
"failed", as in EngineCore); `step_time_s` makes each step sleep (overload tests);
`abort_log` records (request_id, step at abort_request, step whose schedule() freed it).
"""

from __future__ import annotations

import codecs
import dataclasses
import time
from collections.abc import Callable

from configs.engine_config import SchedulerConfig
from engine.api_types import EngineRequest, RequestOutput
from engine.errors import EngineStepError
from engine.sched.outputs import OutputProcessor
from engine.sched.page_pool import PagePool, model_keys_of
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler, SchedulerOutput
from models.identity import ModelIdentity

VOCAB_SIZE = 256
EOS_TOKEN_ID = 0


def next_token(last_token: int) -> int:
    """The fake device's output after `last_token`."""
    return 32 + (last_token - 32 + 1) % 95


def expected_continuation(last_prompt_token: int, num_tokens: int) -> list[int]:
    """The mock's output token ids (no stop ids banned), for tests to compare against."""
    out, t = [], last_prompt_token
    for _ in range(num_tokens):
        t = next_token(t)
        out.append(t)
    return out


@dataclasses.dataclass(frozen=True)
class MockIdentity(ModelIdentity):
    """The mock model's identity: a ModelIdentity (so engine code reads the same fields)
    with hand-checkable defaults."""

    name: str = "mock"
    revision: str = "mock-rev-1"
    tokenizer_hash: str = "bytes-v1"
    chat_template_hash: str = "mock-chat-v1"
    engine_version: str = "mock-engine-0.1"


class _ByteDetokenizer:
    """Incremental UTF-8: a character split across byte tokens is emitted once complete."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add_token(self, token_id: int) -> str:
        return self._decoder.decode(bytes([token_id % 256]))


class ByteTokenizer:
    """token id = UTF-8 byte value."""

    eos_token_ids = (EOS_TOKEN_ID,)
    vocab_size = VOCAB_SIZE
    sha256 = MockIdentity.tokenizer_hash
    chat_template_sha256 = MockIdentity.chat_template_hash

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        del kwargs  # chat_template_kwargs: the mock's fixed template takes none
        parts = [f"<{m['role']}>{m['content']}\n" for m in messages]
        return "".join(parts) + ("<assistant>" if add_generation_prompt else "")

    def new_detokenizer(self, prompt_ids=None, skip_special_tokens: bool = True):
        del prompt_ids, skip_special_tokens  # bytes need no look-behind; none is special
        return _ByteDetokenizer()


def fake_device_step(plan: SchedulerOutput, eos_token_ids=(EOS_TOKEN_ID,)) -> dict[str, int]:
    """{request_id: sampled token} for the plan's sampling rows (see the module doc)."""
    return {
        s.request.request_id: _sample(s.request, eos_token_ids) for s in plan.scheduled if s.samples
    }


def _sample(req: Request, eos_token_ids) -> int:
    token = next_token(req.all_token_ids[-1])
    if req.num_output_tokens < req.sampling.min_tokens:
        banned = {*eos_token_ids, *req.sampling.stop_token_ids}
        for _ in range(95):  # at most every printable character once
            if token not in banned:
                break
            token = next_token(token)
    return token


class MockEngine:
    """Implements engine.interface.Engine. Driven by one thread only."""

    def __init__(
        self,
        *,
        max_num_seqs: int = 8,
        num_pages: int = 256,
        page_size: int = 4,
        max_model_len: int = 512,
        max_num_batched_tokens: int = 512,
        prefill_chunk_size: int | None = None,
        step_time_s: float = 0.0,
        identity: MockIdentity | None = None,
        config: SchedulerConfig | None = None,
    ):
        """`config` (a SchedulerConfig) overrides the pool and budget arguments; `num_pages`
        counts the reserved null page, as in EngineConfig."""
        self.identity = identity or MockIdentity()
        self.tokenizer = ByteTokenizer()
        self.step_time_s = step_time_s
        self.sched_config = config or SchedulerConfig(
            page_size=page_size,
            num_pages=num_pages,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            prefill_chunk_size=prefill_chunk_size or min(256, max_num_batched_tokens),
            max_model_len=max_model_len,
        )
        self.pool = PagePool.from_config(self.sched_config, model_keys_of(self.identity))
        self.scheduler = Scheduler(self.sched_config, self.pool)
        self.outputs = OutputProcessor(self.scheduler, self.tokenizer, vocab_size=VOCAB_SIZE)
        self.num_steps = 0
        self.num_tokens_processed = 0  # prompt and decode tokens computed (as EngineCore's)
        self.num_failed_steps = 0
        self._fail_steps = 0
        self._pending_aborts: dict[str, int] = {}  # request id -> num_steps at abort_request
        self.abort_log: list[tuple[str, int, int]] = []
        # Called with each step's plan before its fake device step (a test's virtual clock
        # charges the step's cost from its rows and tokens: tests/capacity_sim.py).
        self.on_plan: Callable[[SchedulerOutput], None] | None = None

    # ---- the engine interface -------------------------------------------------------------
    def add_request(self, request: EngineRequest, cache_salt: str | None = None) -> None:
        self.outputs.add_request(request, time.monotonic(), cache_salt)

    def abort_request(self, request_id: str) -> None:
        if self.outputs.is_tracked(request_id):
            self._pending_aborts.setdefault(request_id, self.num_steps)
        self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def fail_next_steps(self, n: int) -> None:
        """The next n device steps (steps with something scheduled) fail."""
        self._fail_steps = n

    def step(self) -> list[RequestOutput]:
        """EngineCore.step with the device step replaced by `fake_device_step`."""
        self.num_steps += 1
        if self.step_time_s:
            time.sleep(self.step_time_s)
        plan = self.scheduler.schedule(time.monotonic())
        self._log_aborts(plan)
        outputs = self.outputs.finished(plan)
        if plan.is_empty:
            return outputs
        if self.on_plan is not None:
            self.on_plan(plan)
        self.num_tokens_processed += plan.total_num_scheduled_tokens
        if self._fail_steps > 0:
            self._fail_steps -= 1
            self.num_failed_steps += 1
            error = EngineStepError(f"mock step {self.num_steps} failed (injected)")
            return outputs + self.outputs.fail(plan, error, time.monotonic())
        sampled = self.device_step(plan)
        return outputs + self.outputs.commit(plan, sampled, time.monotonic())

    def device_step(self, plan: SchedulerOutput) -> dict[str, int]:
        """{request_id: sampled token}: the fake device (serving/engine_host/scripted_engine.py
        swaps it)."""
        return fake_device_step(plan, self.tokenizer.eos_token_ids)

    def stats(self) -> dict:
        return {
            **self.scheduler.stats(),
            "num_steps": self.num_steps,
            "num_failed_steps": self.num_failed_steps,
        }

    def _log_aborts(self, plan: SchedulerOutput) -> None:
        for request_id in plan.aborted_request_ids:
            asked = self._pending_aborts.pop(request_id, None)
            if asked is not None:
                self.abort_log.append((request_id, asked, self.num_steps))
        # Aborts of requests that ended first (stop, length) leave nothing to log.
        self._pending_aborts = {
            r: s for r, s in self._pending_aborts.items() if self.outputs.is_tracked(r)
        }
