"""Tenants: who a call belongs to (from its `x-api-key` metadata) and what it may use.

Config file (`--tenants_config`, JSON):

    {"tenants": [{"name": "acme", "api_keys": ["k-acme-1"],
                  "max_concurrency": 4, "tokens_per_minute": 60000,
                  "default_request_timeout_s": 30}],
     "allow_anonymous": false,
     "default": {"max_concurrency": 64, "tokens_per_minute": null}}

With no config, every call is tenant "default" with no limits. With a config, a call without
a key is "default" only if allow_anonymous; an unknown key is UnknownApiKey (UNAUTHENTICATED).

Keys are kept only as SHA-256 digests and a presented key is compared against every stored
digest with hmac.compare_digest, without stopping at a match, so the time taken says nothing
about which key (or how much of one) matched. Keys are never logged: errors say only
"unknown x-api-key".

Budgets (TenantLimiter): a tenant's concurrency counts its queued + running requests. Its
token budget is a bucket of `tokens_per_minute` tokens refilled continuously at
tokens_per_minute / 60 per second; a request reserves prompt + max_tokens up front (the worst
case) and the unused part (max_tokens - completion tokens) is refunded when it ends.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import threading
import time
from collections.abc import Callable

from engine.errors import InvalidRequestError
from serving.frontend.admission import Rejected

DEFAULT_TENANT = "default"


class UnknownApiKey(Exception):
    """Maps to UNAUTHENTICATED."""


@dataclasses.dataclass(frozen=True)
class TenantPolicy:
    name: str
    max_concurrency: int | None = None  # None: unlimited
    tokens_per_minute: int | None = None  # None: unlimited
    # the deadline of its calls that bring none (serving/frontend/deadlines.py); None: the server's
    default_request_timeout_s: float | None = None


class TenantRegistry:
    def __init__(
        self,
        tenants: dict[str, TenantPolicy] | None = None,
        api_keys: dict[str, str] | None = None,
        allow_anonymous: bool = True,
        default: TenantPolicy | None = None,
    ):
        self.tenants = dict(tenants or {})
        self._key_digests = [(_digest(k), name) for k, name in (api_keys or {}).items()]
        self.allow_anonymous = allow_anonymous
        self.default = default or TenantPolicy(DEFAULT_TENANT)

    @classmethod
    def from_dict(cls, cfg: dict) -> TenantRegistry:
        tenants, keys = {}, {}
        for t in cfg.get("tenants", []):
            policy = TenantPolicy(
                t["name"],
                t.get("max_concurrency"),
                t.get("tokens_per_minute"),
                _timeout_s(t),
            )
            tenants[policy.name] = policy
            for key in t.get("api_keys", []):
                keys[key] = policy.name
        d = cfg.get("default", {})
        default = TenantPolicy(
            DEFAULT_TENANT, d.get("max_concurrency"), d.get("tokens_per_minute"), _timeout_s(d)
        )
        return cls(tenants, keys, bool(cfg.get("allow_anonymous", not tenants)), default)

    @classmethod
    def from_file(cls, path: str | None) -> TenantRegistry:
        if not path:
            return cls()
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @property
    def has_api_keys(self) -> bool:
        return bool(self._key_digests)

    def authenticate(self, api_key: str | None) -> TenantPolicy:
        if api_key:
            digest, name = _digest(api_key), None
            for stored, tenant in self._key_digests:  # no early exit: constant time
                if hmac.compare_digest(stored, digest):
                    name = tenant
            if name is None:
                raise UnknownApiKey("unknown x-api-key")
            return self.tenants[name]
        if not self.allow_anonymous:
            raise UnknownApiKey("missing x-api-key")
        return self.default


def _timeout_s(entry: dict) -> float | None:
    value = entry.get("default_request_timeout_s")
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86_400
    ):
        raise ValueError(
            f"tenant {entry.get('name', DEFAULT_TENANT)!r}: default_request_timeout_s={value!r} "
            "must be a number of seconds > 0 and at most 86400"
        )
    return value


def _digest(api_key: str | bytes) -> bytes:
    raw = api_key.encode("utf-8", "surrogatepass") if isinstance(api_key, str) else api_key
    return hashlib.sha256(raw).digest()


@dataclasses.dataclass
class Reservation:
    tenant: str
    reserved_tokens: int
    max_tokens: int  # the completion part of the reservation


@dataclasses.dataclass
class _Bucket:
    level: float
    updated_s: float
    active: int = 0


class TenantLimiter:
    """Thread-safe per-tenant concurrency and token budgets; `clock` injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def acquire(self, policy: TenantPolicy, prompt_tokens: int, max_tokens: int) -> Reservation:
        need = prompt_tokens + max_tokens
        tpm = policy.tokens_per_minute
        if tpm is not None and need > tpm:
            raise InvalidRequestError(
                "max_tokens",
                max_tokens,
                f"prompt + max_tokens <= tenant budget of {tpm} tokens/minute",
            )
        with self._lock:
            b = self._bucket(policy)
            if policy.max_concurrency is not None and b.active >= policy.max_concurrency:
                raise Rejected(
                    "tenant_concurrency",
                    1000,
                    f"tenant {policy.name!r} has {b.active} requests in flight "
                    f"(limit {policy.max_concurrency})",
                )
            if tpm is not None and b.level < need:
                wait_ms = math.ceil(1000 * (need - b.level) / (tpm / 60.0))
                raise Rejected(
                    "tenant_tokens",
                    wait_ms,
                    f"tenant {policy.name!r} budget has {int(b.level)} tokens, "
                    f"request needs {need} (prompt + max_tokens)",
                )
            if tpm is not None:
                b.level -= need
            b.active += 1
            return Reservation(policy.name, need, max_tokens)

    def release(
        self, policy: TenantPolicy, r: Reservation, completion_tokens: int, refund_all: bool = False
    ) -> int:
        """End of a request: frees its concurrency slot and refunds the unused tokens
        (max_tokens - completion_tokens; everything if it never ran: refund_all)."""
        refund = r.reserved_tokens if refund_all else max(r.max_tokens - completion_tokens, 0)
        with self._lock:
            b = self._bucket(policy)
            b.active -= 1
            if policy.tokens_per_minute is not None:
                b.level = min(b.level + refund, float(policy.tokens_per_minute))
        return refund

    def level(self, policy: TenantPolicy) -> float:
        with self._lock:
            return self._bucket(policy).level

    def active(self, tenant: str) -> int:
        with self._lock:
            b = self._buckets.get(tenant)
            return 0 if b is None else b.active

    def _bucket(self, policy: TenantPolicy) -> _Bucket:
        """The tenant's bucket, refilled up to now."""
        now = self.clock()
        cap = float(policy.tokens_per_minute or 0)
        b = self._buckets.setdefault(policy.name, _Bucket(cap, now))
        if policy.tokens_per_minute is not None:
            b.level = min(cap, b.level + (now - b.updated_s) * cap / 60.0)
        b.updated_s = now
        return b
