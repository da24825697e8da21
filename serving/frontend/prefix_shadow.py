"""Which prompt tokens admission should expect the prefix cache to serve.

The capacity model times prefill per computed token (a step's prompt tokens less its cache
hits), so a prompt must be charged for its uncached share only. That share is known in the
engine only once the request is scheduled; admission judges it earlier, on a handler thread,
often in a burst whose requests all arrive before the first reaches the engine. This shadow
answers from the prompts the engine has prefilled: the chained keys of each prefilled
prompt's full pages (the engine's own hashing, engine.sched.page_pool.chain_page_keys),
recorded by the engine thread at the request's first token, in an LRU bounded by the
engine's page count. An arriving request whose leading pages are there is expected to hit
them.

NOTE: pages are recorded at the first token, not at admission: requests of a burst that
arrive together are prefilled in the same steps and none hits what the others bring (the
engine caches a page once computed); credited at admission, a virtual-time burst of one chat
admitted 123 calls for a capacity of 98 and 59 ran late.

Approximate by design: pages the engine evicted under pressure still count here (optimistic,
by at most what the margin measures); requests of a burst that would hit pages its earlier
waves bring are charged whole (pessimistic, safe). Keys are Python hashes: meaningful only
in this process.

Admission credits the expected hits only once the capacity model's prefill rate was measured
on real traffic (WaitingQueue.expected_cached, CapacityModel.measured_on_traffic); the
shadow records prefilled prompts from the start.

NOTE: charged whole, 300 calls of one chat (32 of their 41 tokens served from the cache)
were predicted 2.3x late, the measured margin sat at its 0.8 floor, and a warm SmolLM2 burst
was served at 0.66 of capacity (benchmarks/RESULTS.md, issue 34).

May import: engine.sched.page_pool (hashing).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

from engine.sched.page_pool import chain_page_keys


class PrefixShadow:
    """Thread-safe LRU of page keys of prefilled prompts."""

    def __init__(self, page_size: int, max_pages: int):
        if page_size < 1 or max_pages < 1:
            raise ValueError(f"page_size={page_size}, max_pages={max_pages}: must be >= 1")
        self.page_size, self.max_pages = page_size, max_pages
        self._keys: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def keys(self, token_ids: Sequence[int], salt: tuple = ()) -> list[int]:
        """The chained keys of `token_ids`' full pages under `salt` (tenant, adapter: what
        keeps the engine's cached pages apart)."""
        return chain_page_keys(token_ids, self.page_size, salt)

    def expected_cached(self, keys: Sequence[int], num_prompt_tokens: int) -> int:
        """Prompt tokens the cache is expected to serve: the leading pages already brought,
        at most the pages before the last token (the engine computes that one)."""
        with self._lock:
            matched = 0
            for key in keys:
                if key not in self._keys:
                    break
                matched += 1
        limit = max(0, (num_prompt_tokens - 1) // self.page_size)
        return min(matched, limit) * self.page_size

    def prefilled(self, keys: Sequence[int]) -> None:
        """A prefilled prompt's pages: the most recently used, the oldest past `max_pages`
        forgotten. Its leading page counts as the most recent (a chain is matched from its
        start: the tail goes first, as the engine's cache evicts a sequence's last pages
        first)."""
        with self._lock:
            for key in reversed(keys):
                self._keys[key] = None
                self._keys.move_to_end(key)
            while len(self._keys) > self.max_pages:
                self._keys.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
