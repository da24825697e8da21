"""Copies between the device KV cache and the prefix cache's host tier
(engine/sched/host_tier.py holds the tier, its states and its LRU).

Per launch of a step (EngineCore._launch), around the scheduler:

    offload.before_schedule()   saves dispatched by earlier launches whose gather has
                                finished land in the host store (hit-able from now)
    scheduler.schedule()        evictions queue saves, host hits queue loads (page pool)
    kv = offload.flush(kv)      ONE gather of the pages to save, their copy to host started
                                and not waited for; then ONE scatter of the pages to load
                                (the cache donated)
    the step(kv)

Ordering: JAX dispatch is asynchronous and the order of dispatch is the order of data. The
gather reads the cache as every step dispatched so far leaves it, before the step that
reuses the evicted pages rewrites them; the scatter writes the loaded pages before the step
that reads them. A page evicted and handed to a host hit in the same launch is gathered
before the scatter overwrites it. The bytes of a save are read on the host at the first launch
that finds its gather finished (an entry is SAVING, not hit-able, until then), so saving
never makes the host wait for the device; loading costs a host read of the store and one
transfer.

Page counts are padded to a power of two (the padding reads or writes the null page, which
nobody reads) and capped at the pages of one max_model_len request (more is split), so a
few programs serve every count; `warm` builds them ahead of time at warm-up.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from engine.runner.kv_cache import PagedKVCache
from engine.sched.host_tier import HostEntry, HostKVTier

KV_FIELDS = ("k_pages", "v_pages", "k_scales", "v_scales")


def page_fields(kv: PagedKVCache) -> dict[str, tuple]:
    """{field: (shape of one page, dtype)} of the cache's present fields."""
    out = {}
    for name in KV_FIELDS:
        x = getattr(kv, name)
        if x is not None:
            out[name] = ((*x.shape[:2], *x.shape[3:]), x.dtype)
    return out


def page_bytes_of(kv: PagedKVCache) -> int:
    """Bytes of one page over every field (K, V and the int8 scales)."""
    return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in page_fields(kv).values())


def bucket(n: int) -> int:
    """The power of two a page count is padded to."""
    return 1 << max(0, (n - 1).bit_length())


# NOTE: a loop of one-page dynamic slices, not x[:, :, ids] / x.at[:, :, ids].set(p): on
# XLA:CPU the gather / scatter along axis 2 ran 1.4x / 3x slower (64 SmolLM2 pages, 47 MB
# per field: 23 vs 16 ms, 60 vs 18 ms, 2026-12-05 under load).
@jax.jit
def gather_pages(kv: PagedKVCache, ids: jax.Array) -> PagedKVCache:
    """every field [L, K, N, ...] -> [L, K, n, ...] (ids [n] int32)"""

    def gather(x):
        out = jnp.zeros((*x.shape[:2], ids.shape[0], *x.shape[3:]), x.dtype)

        def body(j, out):
            page = lax.dynamic_slice_in_dim(x, ids[j], 1, axis=2)
            return lax.dynamic_update_slice_in_dim(out, page, j, axis=2)

        return lax.fori_loop(0, ids.shape[0], body, out)

    return jax.tree.map(gather, kv)


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_pages(kv: PagedKVCache, ids: jax.Array, pages: PagedKVCache) -> PagedKVCache:
    """kv with pages[:, :, j] written to page ids[j] of every field (cache donated)."""

    def scatter(x, p):
        p = p.astype(x.dtype)

        def body(j, x):
            page = lax.dynamic_slice_in_dim(p, j, 1, axis=2)
            return lax.dynamic_update_slice_in_dim(x, page, ids[j], axis=2)

        return lax.fori_loop(0, ids.shape[0], body, x)

    return jax.tree.map(scatter, kv, pages)


class KVOffload:
    """The runner's half of the host tier: `EngineCore.offload` when host_kv_gib > 0."""

    def __init__(self, tier: HostKVTier, max_pages_per_copy: int):
        self.tier = tier
        self.max_bucket = bucket(max(1, max_pages_per_copy))
        self._landing: list[tuple[list[HostEntry], PagedKVCache]] = []  # dispatched saves

    @classmethod
    def attach(cls, pool, kv, host_kv_bytes: int, max_pages_per_copy: int) -> KVOffload:
        """A host tier of `host_kv_bytes` for `pool` (set as `pool.host_tier`) and the copier
        between it and `kv`. ValueError when the cache is not one PagedKVCache or the bytes
        hold no page."""
        if not isinstance(kv, PagedKVCache):
            raise ValueError(
                f"host_kv_gib: the host tier needs one paged cache, not {type(kv).__name__}"
            )
        page_bytes = page_bytes_of(kv)
        if host_kv_bytes < page_bytes:
            raise ValueError(
                f"host_kv_gib={host_kv_bytes / 2**30:g} is invalid: >= one page "
                f"({page_bytes} bytes) or 0 (off)"
            )
        tier = HostKVTier(host_kv_bytes // page_bytes, pool.page_size, page_fields(kv))
        pool.host_tier = tier
        return cls(tier, max_pages_per_copy)

    # ---- per launch ------------------------------------------------------------------------
    def before_schedule(self, wait: bool = False) -> None:
        """Land the dispatched saves whose gather has finished in the host store (their
        entries become READY), oldest first; `wait`: all of them. NOTE: never waiting is
        what keeps the overlap: a gather runs after the step before it, beside the step
        after it, so waiting here would wait for most of that step."""
        if not self._landing:
            return
        t0 = time.perf_counter()
        while self._landing:
            entries, gathered = self._landing[0]
            if not wait and not all(x.is_ready() for x in jax.tree.leaves(gathered)):
                break
            arrays = {name: np.asarray(getattr(gathered, name)) for name in self.tier.store}
            self.tier.write(entries, arrays)
            self._landing.pop(0)
        self.tier.stats.save_s += time.perf_counter() - t0

    def dispatch_saves(self, kv: PagedKVCache) -> None:
        """Gather the pages the pool evicted since the last call (before anything rewrites
        them) and start their copy to host. Whoever allocates pages and then writes them
        outside a launch (a KV import) calls this first."""
        saves = self.tier.take_saves()
        if not saves:
            return
        t0 = time.perf_counter()
        for start in range(0, len(saves), self.max_bucket):
            chunk = saves[start : start + self.max_bucket]
            gathered = gather_pages(kv, self._padded_ids([page for page, _ in chunk]))
            for leaf in jax.tree.leaves(gathered):
                leaf.copy_to_host_async()
            self._landing.append(([entry for _, entry in chunk], gathered))
        self.tier.stats.save_s += time.perf_counter() - t0

    def flush(self, kv: PagedKVCache) -> PagedKVCache:
        """Dispatch this launch's saves, then its loads; returns the cache to step on. The
        host reads of every load come first: with async scheduling they run while the step
        dispatched before is still computing (counted in `loads_hidden` when it still was
        once they were done), and only the scatters wait for that step on the device."""
        self.dispatch_saves(kv)
        loads = self.tier.take_loads()
        if not loads:
            return kv
        t0 = time.perf_counter()
        chunks = []
        for start in range(0, len(loads), self.max_bucket):
            chunk = loads[start : start + self.max_bucket]
            ids = self._padded_ids([page for page, _ in chunk])
            entries = [entry for _, entry in chunk]
            entries += [entries[0]] * (len(ids) - len(entries))  # padding: null page
            chunks.append((ids, PagedKVCache(**self.tier.read(entries))))
        stats = self.tier.stats
        stats.load_launches += 1
        stats.loads_hidden += not kv.k_pages.is_ready()  # the step before still computes
        for ids, pages in chunks:
            kv = scatter_pages(kv, ids, pages)
        stats.loaded_pages += len(loads)
        stats.load_s += time.perf_counter() - t0
        return kv

    # ---- warm-up ---------------------------------------------------------------------------
    def warm(self, kv: PagedKVCache) -> int:
        """Build the gather and scatter of every bucket ahead of time (without running them);
        returns the number of programs."""
        n = 0
        for size in (1 << i for i in range(self.max_bucket.bit_length())):
            ids = np.zeros(size, np.int32)
            gather_pages.lower(kv, ids).compile()
            pages = {
                name: np.zeros((*shape[:2], size, *shape[2:]), dtype)
                for name, (shape, dtype) in page_fields(kv).items()
            }
            scatter_pages.lower(kv, ids, PagedKVCache(**pages)).compile()
            n += 2
        return n

    def _padded_ids(self, page_ids: list[int]) -> np.ndarray:
        ids = np.zeros(bucket(len(page_ids)), np.int32)  # padding -> the null page 0
        ids[: len(page_ids)] = page_ids
        return ids
