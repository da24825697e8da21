"""Which prompt tokens admission should expect the prefix cache to serve.

The capacity model times prefill per computed token (a step's prompt tokens less its cache
hits), so a prompt must be charged for its uncached share only. That share is known in the
engine only once the request is scheduled; admission judges it earlier, on a handler thread,
often in a burst whose requests all arrive before the first reaches the engine. This shadow
answers from the prompts admission let in: the chained keys of each admitted prompt's full
pages (the engine's own hashing, engine.sched.page_pool.chain_page_keys) in an LRU bounded
by the engine's page count. A request whose leading pages an earlier admitted request
already brought is expected to hit them: the earlier one prefills first (FIFO within a
class), so by the time this one prefills they are cached.

Approximate by design: pages the engine evicted under pressure, or a request cancelled
before its prefill, still count here (optimistic, by at most what the margin measures), and
two requests offered at the same moment may both miss (pessimistic, safe). Keys are Python
hashes: meaningful only in this process.

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
    """Thread-safe LRU of page keys of admitted prompts."""

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

    def admit(self, keys: Sequence[int]) -> None:
        """An admitted prompt's pages: the most recently used, the oldest past `max_pages`
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
