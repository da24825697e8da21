"""The engine interface the serving layer drives, defined once.

Implemented by engine.core.EngineCore (one model replica),
engine.parallel.replicas.DataParallelEngine (several) and
serving.engine_host.mock_engine.MockEngine (the real Scheduler, PagePool, StopChecker and
output code of engine/sched/outputs.py with only the device step replaced by a hand-checkable
rule). engine.kv_transfer.transfer_engine.KVTransferEngine wraps an EngineCore for prefill/decode
disaggregation (K/V export and import; serving/disagg/service.py also calls its
mailboxes). serving/ calls nothing else on an engine.

All methods are called from ONE thread (serving/frontend/engine_loop.py's engine thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from engine.api_types import EngineRequest, RequestOutput


class EngineTokenizer(Protocol):
    """What serving and the stop checks use of a tokenizer."""

    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True
    ) -> str: ...

    def new_detokenizer(
        self, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> Any:
        """An object whose add_token(id) returns the new complete text
        (engine.sched.stop_checker)."""
        ...


@runtime_checkable
class Engine(Protocol):
    # identity: name, revision, tokenizer_hash, chat_template_hash, engine_version
    # (models.identity.ModelIdentity or an object with the same fields)
    identity: Any
    tokenizer: EngineTokenizer

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request. Raises engine.errors.InvalidRequestError (field, value, limit)."""
        ...

    def abort_request(self, request_id: str) -> None:
        """End it "cancelled" at the next step (its pages are freed then); unknown ids and
        finished requests are ignored."""
        ...

    def step(self) -> list[RequestOutput]:
        """One scheduler + device step: a delta per request that produced something or
        ended. A failed device step ends its requests with finish_reason "failed"."""
        ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict:
        """At least engine.sched.scheduler.Scheduler.stats()' keys, plus "num_steps"."""
        ...
