"""The KV page allocator with prefix caching (host side, plain Python).

The pool hands out page ids into the device's paged KV cache
(`k_pages[L, K, num_pages, page_size, hd]`). Page 0 is the reserved null page: it is never
handed out. Every other page is in exactly one of these states:

    allocate()                       free() to refcount 0
    ---------->  IN USE (ref >= 1)  ----------------------+
                 |   ^   acquire()  (a cache hit on a     |
                 |   +-------------- free cached page)    |
                 |                                        v
           free(), no key        FREE CACHED (LRU queue, key kept, still hit-able)
                 |                    |  evicted by allocate() (oldest first) when
                 v                    |  FREE PLAIN is empty, or expired by expire(),
           FREE PLAIN (no key) <------+  or dropped by clear_cache()

Allocation never raises for lack of room: `allocate(n)` returns None and the scheduler
decides whom to preempt. Sharing happens only through reference counts: a cached page can be
in the page tables of several requests at once, and returns to a free state when the last
one frees it.

Prefix caching (vLLM-style block hashing). Only FULL pages are cached. Page i of a request's
token ids has the key

    key_i = hash((key_{i-1} or None, token ids of page i, extra_keys))
    extra_keys = (model revision, tokenizer hash, chat-template hash, adapter id, cache_salt)

The pool keeps the parent key, token ids and extra keys of every cached page and compares
them on lookup, so a hash collision is a miss, never a wrong hit. The `cache_salt` is made by
the server from the authenticated tenant (`cache_salt_for`): same salt shares, different salts
never do. `find_cached_prefix` never covers a request's last token (its logits are needed):
at most `num_tokens - 1` tokens are served from the cache, in whole pages. A cached page
that nobody uses expires `ttl_s` after it was last released (`expire(now_s)`, called by the
scheduler every step; pages in use never expire). `clear_cache(new_model_keys)` drops every
key when the model revision changes.

Host tier (optional, `host_tier`: engine/sched/host_tier.py): a cached page that allocate()
evicts is offered to it (its K/V copied to host memory by the runner before the page is
reused), and `find_prefix` continues a prefix through the host tier where the device pool
has no page; `attach_prefix` then gives each host hit a fresh page, registers it as cached
and queues its copy back. Without a host tier both reduce to the device-only lookup.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
from collections.abc import Sequence

from configs.engine_config import CacheSharingPolicy, SchedulerConfig
from engine.sched.request import Request

NULL_PAGE = 0


def cache_salt_for(tenant: str, policy: CacheSharingPolicy | None = None) -> str:
    """The prefix-cache salt of one request of `tenant` (the server calls this with the
    AUTHENTICATED tenant, never a client-set field).

    Default: one salt per tenant (a tenant shares with itself only). A tenant in a shared
    group gets the group's salt. A tenant with sharing disabled gets a fresh random salt per
    request, so its requests neither hit nor seed the cache (not even for each other).
    """
    policy = policy or CacheSharingPolicy()
    if tenant in policy.isolated_tenants:
        return "private:" + secrets.token_hex(16)
    group = policy.group_of(tenant)
    if group is not None:
        return "group:" + group
    return "tenant:" + tenant


def chain_page_keys(
    token_ids: Sequence[int], page_size: int, extra_keys: tuple, keys: list[int] | None = None
) -> list[int]:
    """The prefix-cache keys of the full pages of `token_ids` (key_i = hash((key_{i-1} or None,
    page i's ids, extra_keys))), extending `keys` (the keys of the first pages, already made) in
    place. Python's hash: a key means something only inside the process that made it
    (serving/ray_serve/router.py keys prompt blocks with it, in the router's process)."""
    keys = [] if keys is None else keys
    ps = page_size
    for i in range(len(keys), len(token_ids) // ps):
        parent = keys[i - 1] if i else None
        keys.append(hash((parent, tuple(token_ids[i * ps : (i + 1) * ps]), extra_keys)))
    return keys


def model_keys_of(identity) -> tuple:
    """What a cached page's K/V depends on besides its tokens: the weights revision, the
    tokenizer and the chat template (a models.identity.ModelIdentity or the same fields)."""
    return (identity.revision, identity.tokenizer_hash, identity.chat_template_hash)


@dataclasses.dataclass
class CachedPage:
    """What a cached page holds, kept to check a key match against collisions."""

    key: int
    parent_key: int | None
    token_ids: tuple[int, ...]
    extra_keys: tuple
    released_s: float = 0.0  # when its reference count last fell to 0


@dataclasses.dataclass
class PagePoolStats:
    queried_tokens: int = 0  # prompt tokens looked up in the prefix cache (on admission)
    hit_tokens: int = 0  # of those, served from the cache (= prefill tokens saved)
    evictions: int = 0  # cached pages whose key was dropped to reuse the page
    expirations: int = 0  # cached pages dropped by the TTL
    # allocate() calls answered "no room", plus steps whose next admission did not fit
    allocation_failures: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclasses.dataclass
class PrefixHit:
    """A prefix found in the cache: per covered page, its device page id, or NULL_PAGE where
    the host tier holds it (`host_entries`, in page order: host_tier.HostEntry)."""

    pages: list[int]
    host_entries: list

    @property
    def device_pages(self) -> list[int]:
        return [p for p in self.pages if p != NULL_PAGE]


class PagePool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_caching: bool = True,
        ttl_s: float | None = None,
        model_keys: tuple = (),
    ):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} is invalid: >= 2 (page 0 is reserved)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ttl_s = ttl_s
        self.model_keys = tuple(model_keys)  # (revision, tokenizer hash, chat-template hash)
        self.generation = 0  # bumped by clear_cache; invalidates requests' page_keys
        self.ref_counts = [0] * num_pages
        self._free_plain = list(range(num_pages - 1, 0, -1))  # a stack: pops 1, 2, 3, ...
        self._free_cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._cached: dict[int, CachedPage] = {}  # page -> content, in use or free
        self._page_of_key: dict[int, int] = {}
        self.stats = PagePoolStats()
        self.events = None  # engine/sched/kv_events.KvEventRecorder: cache transitions, for llm-d
        self.host_tier = None  # engine/sched/host_tier.HostKVTier: evicted pages' second home

    @classmethod
    def from_config(cls, cfg: SchedulerConfig, model_keys: tuple = ()) -> PagePool:
        return cls(
            cfg.num_pages,
            cfg.page_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            ttl_s=cfg.prefix_cache_ttl_s,
            model_keys=model_keys,
        )

    # ---- sizes -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages allocate() can hand out (plain free + cached free, which it would evict)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - 1 - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- allocation --------------------------------------------------------------------
    def can_allocate(self, num_pages: int, reserving: list[int] = ()) -> bool:
        """Whether allocate(num_pages) would succeed after acquire(reserving)."""
        num_reserved_free = sum(1 for p in reserving if self.ref_counts[p] == 0)
        return num_pages + num_reserved_free <= self.num_free_pages

    def allocate(self, num_pages: int) -> list[int] | None:
        """`num_pages` fresh pages (reference count 1), or None when there is no room."""
        if num_pages > self.num_free_pages:
            self.stats.allocation_failures += 1
            return None
        pages = []
        for _ in range(num_pages):
            if self._free_plain:
                page = self._free_plain.pop()
            else:  # evict the least recently released cached page
                page, _ = self._free_cached.popitem(last=False)
                cached = self._uncache(page)
                self.stats.evictions += 1
                if self.host_tier is not None:
                    self.host_tier.offer(page, cached)
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def acquire(self, page_ids: list[int]) -> None:
        """Take one more reference on each page (cache hits from find_cached_prefix)."""
        for page in page_ids:
            if self.ref_counts[page] == 0:
                if page not in self._free_cached:
                    raise ValueError(f"page {page} is free and not cached: cannot acquire it")
                del self._free_cached[page]
            self.ref_counts[page] += 1

    def free(self, page_ids: list[int], now_s: float) -> None:
        """Drop one reference on each page. Frees the tail first, so that a request's last
        pages (least likely shared) are the first evicted."""
        for page in reversed(page_ids):
            if page == NULL_PAGE or self.ref_counts[page] <= 0:
                raise ValueError(
                    f"page {page} freed with reference count "
                    f"{self.ref_counts[page]}: double free or foreign page"
                )
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                cached = self._cached.get(page)
                if cached is None:
                    self._free_plain.append(page)
                else:
                    cached.released_s = now_s
                    self._free_cached[page] = None

    # ---- prefix cache ------------------------------------------------------------------
    def extra_keys(self, request: Request) -> tuple:
        return self.model_keys + (request.adapter_id, request.cache_salt)

    def page_keys(self, request: Request) -> list[int]:
        """The keys of the request's full pages (cached on the request, extended lazily)."""
        if request.page_keys_generation != self.generation:
            request.page_keys, request.page_keys_generation = [], self.generation
        keys, ps, tokens = request.page_keys, self.page_size, request.all_token_ids
        return chain_page_keys(tokens, ps, self.extra_keys(request), keys)

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """(page ids, tokens covered): the longest chain of cached full pages that starts the
        request's tokens, covering at most num_tokens - 1 tokens. Takes no reference: call
        acquire(page_ids) when the request is admitted."""
        if not self.enable_prefix_caching:
            return [], 0
        keys, ps, tokens = self.page_keys(request), self.page_size, request.all_token_ids
        extra = self.extra_keys(request)
        pages: list[int] = []
        for i in range((request.num_tokens - 1) // ps):
            page = self._page_of_key.get(keys[i])
            if page is None:
                break
            cached = self._cached[page]
            if (
                cached.parent_key != (keys[i - 1] if i else None)
                or cached.extra_keys != extra
                or cached.token_ids != tuple(tokens[i * ps : (i + 1) * ps])
            ):
                break  # a hash collision: a miss, never a wrong hit
            pages.append(page)
        return pages, len(pages) * ps

    def find_prefix(self, request: Request) -> PrefixHit:
        """find_cached_prefix across both tiers: page by page, the device page of the key,
        else a READY host-tier entry, until neither has it. Takes no reference: call
        attach_prefix when the request is admitted."""
        if self.host_tier is None:
            pages, _ = self.find_cached_prefix(request)
            return PrefixHit(pages, [])
        if not self.enable_prefix_caching:
            return PrefixHit([], [])
        keys, ps, tokens = self.page_keys(request), self.page_size, request.all_token_ids
        extra = self.extra_keys(request)
        pages: list[int] = []
        host: list = []
        for i in range((request.num_tokens - 1) // ps):
            page = self._page_of_key.get(keys[i])
            entry = None if page is not None else self.host_tier.get(keys[i])
            content = self._cached[page] if page is not None else getattr(entry, "page", None)
            if content is None or (
                content.parent_key != (keys[i - 1] if i else None)
                or content.extra_keys != extra
                or content.token_ids != tuple(tokens[i * ps : (i + 1) * ps])
            ):
                break  # absent, or a hash collision: a miss, never a wrong hit
            pages.append(NULL_PAGE if page is None else page)
            if entry is not None:
                host.append(entry)
        return PrefixHit(pages, host)

    def attach_prefix(
        self, request: Request, hit: PrefixHit, fresh: list[int], now_s: float
    ) -> list[int]:
        """The page table of an admitted request: `hit`'s pages (device hits acquired by the
        caller), its host hits in the first len(hit.host_entries) of `fresh` (allocated by the
        caller), then the rest of `fresh`. Each host hit's page is registered as cached at
        once (a later admission of this step hits it on the device) and its K/V queued to
        be copied back before the step runs."""
        fresh_iter = iter(fresh)
        entries = iter(hit.host_entries)
        page_ids = []
        for page in hit.pages:
            if page == NULL_PAGE:
                page, entry = next(fresh_iter), next(entries)
                self.host_tier.queue_load(page, entry, now_s)
                cached = dataclasses.replace(entry.page)
                if cached.key not in self._page_of_key:
                    self._cached[page] = cached
                    self._page_of_key[cached.key] = page
                    if self.events is not None:
                        self.events.page_stored(
                            cached.key, cached.parent_key, cached.token_ids, request.adapter_id
                        )
            page_ids.append(page)
        page_ids.extend(fresh_iter)
        return page_ids

    def record_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queried_tokens += num_queried_tokens
        self.stats.hit_tokens += num_hit_tokens

    def cache_full_pages(self, request: Request) -> None:
        """Register the request's pages that are full of computed tokens whose values the host
        knows (call after each step; with overlapped steps the computed count may run ahead
        of the known tokens). A page whose key is already cached elsewhere stays uncached."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_known_tokens) // self.page_size
        if request.num_registered_pages >= num_full:
            return
        if request.page_keys_generation not in (-1, self.generation):
            return  # admitted before clear_cache: its K/V came (partly) from the old model
        keys, ps, tokens = self.page_keys(request), self.page_size, request.all_token_ids
        extra = self.extra_keys(request)
        for i in range(request.num_registered_pages, num_full):
            page = request.page_ids[i]
            if page in self._cached or keys[i] in self._page_of_key:
                continue
            self._cached[page] = CachedPage(
                keys[i], keys[i - 1] if i else None, tuple(tokens[i * ps : (i + 1) * ps]), extra
            )
            self._page_of_key[keys[i]] = page
            if self.events is not None:
                cached = self._cached[page]
                self.events.page_stored(
                    keys[i], cached.parent_key, cached.token_ids, request.adapter_id
                )
        request.num_registered_pages = num_full

    def expire(self, now_s: float) -> int:
        """Drop cached free pages released at least ttl_s ago; returns how many."""
        if self.ttl_s is None:
            return 0
        num_expired = 0
        while self._free_cached:
            page = next(iter(self._free_cached))
            if now_s - self._cached[page].released_s < self.ttl_s:
                break  # the queue is in release order, so the rest are younger
            del self._free_cached[page]
            self._uncache(page)
            self._free_plain.append(page)
            num_expired += 1
        self.stats.expirations += num_expired
        if self.host_tier is not None:
            self.host_tier.expire(now_s, self.ttl_s)
        return num_expired

    def clear_cache(self, model_keys: tuple | None = None) -> None:
        """Forget every cached page (a model revision change). Pages in use stay in use, and
        nothing a request admitted before the clear computes is ever cached (its K/V mixes
        the old model's); a request readmitted after a preemption is keyed afresh."""
        if model_keys is not None:
            self.model_keys = tuple(model_keys)
        self.generation += 1
        if self.events is not None:
            self.events.cleared()
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()
        self._cached.clear()
        self._page_of_key.clear()
        if self.host_tier is not None:
            self.host_tier.clear()

    def _uncache(self, page: int) -> CachedPage:
        cached = self._cached.pop(page)
        del self._page_of_key[cached.key]
        if self.events is not None:
            self.events.page_removed(cached.key)
        return cached

    @property
    def cached_keys(self) -> frozenset[int]:
        """The keys a prefix lookup can hit now (pages in use or free cached)."""
        return frozenset(self._page_of_key)

    def page_of_key(self, key: int) -> int | None:
        """The device page cached under `key` (in use or free), or None."""
        return self._page_of_key.get(key)

    @property
    def cached_pages(self) -> list[CachedPage]:
        """What every cached page holds, in the order they were cached (parents first)."""
        return list(self._cached.values())

    # ---- checks ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call this)."""
        plain, free_cached = set(self._free_plain), set(self._free_cached)
        assert len(plain) == len(self._free_plain), "a page is twice in the free list"
        assert NULL_PAGE not in plain | free_cached and self.ref_counts[NULL_PAGE] == 0
        assert not plain & free_cached, "a page is both plain free and cached free"
        for page in range(1, self.num_pages):
            is_free = page in plain or page in free_cached
            assert is_free == (self.ref_counts[page] == 0), f"page {page}: free xor referenced"
            assert self.ref_counts[page] >= 0
        assert free_cached <= set(self._cached) and not plain & set(self._cached)
        assert {c.key: p for p, c in self._cached.items()} == self._page_of_key
        if self.host_tier is not None:
            self.host_tier.check_invariants()
