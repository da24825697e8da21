"""Prefix-aware replica choice through Ray Serve's request-router API (`RequestRouter`).

The ingress (serving/ray_serve/ingress.py) sees each request's body before Serve picks an
engine replica; it attaches a `RoutingKey` to the call, and `PrefixAffinityRouter` (the
engine deployment's `request_router_config`) reads it in `choose_replicas`:

    RoutingKey(block_keys, session_id)
        block_keys   chained keys of the prompt's full blocks, made by the engine's own page
                     hashing (engine.sched.page_pool.chain_page_keys) over the prompt as sent:
                     text as UTF-8 bytes in `block_bytes` blocks (64 bytes: about one 16-token
                     page), token ids in `block_tokens` blocks, chat as its messages' roles and
                     contents in order. The extra keys are the request's `model` (base or LoRA
                     adapter) and the caller's credential (the tenant's key): two tenants'
                     identical prompts get different keys, as the engine's salted pages do.
        session_id   the `x-session-id` header, if any

Choice, for one request (`choose_replicas` returns ranks; Serve sends to the least-queued
replica of the first rank that accepts, then the next rank):

  1. home = the replica of the request's session, else the replica that was last sent the
     longest chain of the request's block keys (the index learned in `on_request_routed`:
     block key -> replica, LRU-bounded), else none (a new prefix).
     A call without a key (not a generation) goes to the less loaded of two random replicas;
  2. load-aware spill: the home keeps the request while its ongoing requests (Serve's
     queue-length cache, updated on every send) are within `imbalance_threshold` of the
     least-loaded candidate's and below its `max_ongoing_requests`; otherwise, and for a new
     prefix, the least-loaded replica takes it (ties: the one that was sent the fewest
     prefixes, so new prefixes spread). A new prefix is learned when it is chosen, not only
     once Serve has sent it: a burst of new prefixes chosen before any is sent spreads too.

The index lives in the router's process (each ingress replica has its own router; keys are
Python hashes, meaningful only there): with several ingress replicas each learns the
placements of its own traffic. Replicas that leave are dropped from it.

May import: ray.serve's public request-router API, engine.sched.page_pool (hashing).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
from collections.abc import Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engine.sched.page_pool import chain_page_keys

SESSION_HEADER = "x-session-id"
DEFAULT_BLOCK_BYTES = 64
DEFAULT_BLOCK_TOKENS = 16
DEFAULT_IMBALANCE_THRESHOLD = 8
DEFAULT_MAX_INDEX_KEYS = 1 << 20
DEFAULT_MAX_SESSIONS = 1 << 16


@dataclasses.dataclass(frozen=True)
class RoutingKey:
    block_keys: tuple[int, ...] = ()
    session_id: str | None = None


def prompt_blocks(
    body: dict, block_bytes: int = DEFAULT_BLOCK_BYTES, block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> list[tuple[int, ...]]:
    """The full blocks of an OpenAI completions / chat body's (first) prompt, as it was sent."""
    if isinstance(body.get("messages"), list):
        data = b"".join(_message_bytes(m) for m in body["messages"])
        return _cut(tuple(data), block_bytes)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: routed by its first
    if isinstance(prompt, str):
        return _cut(tuple(prompt.encode("utf-8", "surrogatepass")), block_bytes)
    if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
        return _cut(tuple(prompt), block_tokens)
    return []


def _message_bytes(message) -> bytes:
    if not isinstance(message, dict):
        return b""
    return json.dumps([message.get("role"), message.get("content")]).encode() + b"\n"


def _cut(data: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    return [data[i : i + size] for i in range(0, len(data) - size + 1, size)]


def routing_key(
    body: dict,
    headers: dict[str, str],
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> RoutingKey:
    """The RoutingKey of one request (`headers` lower-cased)."""
    blocks = prompt_blocks(body, block_bytes, block_tokens)
    credential = headers.get("authorization") or headers.get("x-api-key") or ""
    extra = (str(body.get("model")), credential)
    flat = [x for block in blocks for x in block]
    size = len(blocks[0]) if blocks else 1
    keys = chain_page_keys(flat, size, extra)
    return RoutingKey(tuple(keys), headers.get(SESSION_HEADER) or None)


def key_of(pending_request: PendingRequest | None) -> RoutingKey | None:
    """The RoutingKey the ingress attached to the call (its first argument's `.key`)."""
    if pending_request is None or not pending_request.args:
        return None
    key = getattr(pending_request.args[0], "key", None)
    # NOTE: read by attribute, not isinstance: serve.ingress serializes the ingress class by
    # value, so its RoutingKey can be a copy of this class rather than this class.
    if key is None or not hasattr(key, "block_keys"):
        return None
    return RoutingKey(tuple(key.block_keys), getattr(key, "session_id", None))


class PrefixAffinityRouter(RequestRouter):
    """Session, then longest learned prefix, then least load; spills when the home is busy."""

    def initialize_state(
        self,
        imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
        max_index_keys: int = DEFAULT_MAX_INDEX_KEYS,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        if imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold={imbalance_threshold}: must be >= 0")
        self.imbalance_threshold = imbalance_threshold
        self.max_index_keys = max_index_keys
        self.max_sessions = max_sessions
        self.owner: collections.OrderedDict[int, ReplicaID] = collections.OrderedDict()
        self.sessions: collections.OrderedDict[str, ReplicaID] = collections.OrderedDict()
        self.prefixes_sent: collections.Counter[ReplicaID] = collections.Counter()
        self.decisions: collections.Counter[str] = collections.Counter()  # home / spill / new

    # ---- choice ------------------------------------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = key_of(pending_request)
        if key is None:  # no prompt (models, metrics, stats): power of two choices
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        load = {r.replica_id: self.load_of(r) for r in candidate_replicas}
        ranked = sorted(
            candidate_replicas,
            key=lambda r: (load[r.replica_id], self.prefixes_sent[r.replica_id]),
        )
        home = self.home_of(key, candidate_replicas)
        if home is None:
            self.decisions["new"] += 1
            self.learn(key, ranked[0].replica_id)  # now: concurrent choices see it
            return [[ranked[0]], ranked[1:]]
        least = load[ranked[0].replica_id]
        busy = load[home.replica_id] >= home.max_ongoing_requests
        if busy or load[home.replica_id] - least > self.imbalance_threshold:
            self.decisions["spill"] += 1
            return [[r for r in ranked if r is not home][:1] or [home], ranked]
        self.decisions["home"] += 1
        return [[home], [r for r in ranked if r is not home]]

    def load_of(self, replica: RunningReplica) -> int:
        """Ongoing requests at the replica as Serve last saw them (0 when unknown)."""
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    def home_of(
        self, key: RoutingKey, candidates: Sequence[RunningReplica]
    ) -> RunningReplica | None:
        by_id = {r.replica_id: r for r in candidates}
        if key.session_id is not None and self.sessions.get(key.session_id) in by_id:
            return by_id[self.sessions[key.session_id]]
        home = None
        for block_key in key.block_keys:
            owner = self.owner.get(block_key)
            if owner is None:
                break
            home = by_id.get(owner, home)
        return home

    # ---- learning ----------------------------------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        key = key_of(pending_request)
        if key is not None:
            self.learn(key, replica_id)

    def learn(self, key: RoutingKey, replica_id: ReplicaID) -> None:
        """Place `key`'s blocks (and session) on `replica_id`. A new prefix is placed when it
        is chosen, before Serve sends it, so that requests chosen meanwhile (a burst of new
        prefixes) see the placement and spread; `on_request_routed` confirms or moves it."""
        if key.block_keys and self.owner.get(key.block_keys[0]) != replica_id:
            self.prefixes_sent[replica_id] += 1
        for block_key in key.block_keys:
            self.owner[block_key] = replica_id
            self.owner.move_to_end(block_key)
        while len(self.owner) > self.max_index_keys:
            self.owner.popitem(last=False)
        if key.session_id is not None:
            self.sessions[key.session_id] = replica_id
            self.sessions.move_to_end(key.session_id)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        if any(rid not in alive for rid in self.prefixes_sent):
            self.owner = collections.OrderedDict(
                (k, rid) for k, rid in self.owner.items() if rid in alive
            )
            self.sessions = collections.OrderedDict(
                (s, rid) for s, rid in self.sessions.items() if rid in alive
            )
            self.prefixes_sent = collections.Counter(
                {rid: n for rid, n in self.prefixes_sent.items() if rid in alive}
            )
