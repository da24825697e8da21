"""The host-memory tier of the prefix cache: pages the device pool evicts, kept in numpy.

Without it the page pool (engine/sched/page_pool.py) forgets a cached page when allocate()
reuses it. With it (`EngineConfig.host_kv_gib > 0`) the page's K/V is copied into a bounded
host store first, under the same prefix key, and a later request whose prefix reaches that
key gets a fresh device page and the K/V copied back instead of recomputing it:

    device pool                                   host tier (this module)
    FREE CACHED --allocate() evicts--> offer():   key already here: touched, no copy
                                                  else a slot (the LRU ready entry is
                                                  dropped if full), entry SAVING, queued
    runner, same launch, before the step that overwrites the page (engine/runner/kv_offload.py):
        one gather of every queued page, its copy to host started (not waited for)
    runner, a later launch, before schedule():    the arrays land in their slots: READY
                                                  (the first launch finding the gather done)
    admission: PagePool.find_prefix() -> a READY entry -> attach_prefix(): a fresh device
        page, registered as cached at once, queued to LOAD
    runner, same launch, before the step that reads the page: one scatter of every load

A SAVING entry is never hit (its bytes are not here yet) and never dropped (its slot is
about to be written). The store is [L, K, num_slots, page_size, hd] per field of the device
cache (k_pages, v_pages, and the float32 scales of int8 KV), the device layout with pages
on axis 2, so a batch of pages moves without a transpose. np.zeros reserves the bytes
lazily: memory is touched as slots fill, and never exceeds `num_slots` pages.

Keys, parents, token ids and extra keys (tenant salt, adapter, model revision) travel with
each entry as the pool's CachedPage, so a host hit is checked exactly like a device hit.
Entries expire with the pool's TTL and are dropped by clear_cache. Host side, plain Python
and numpy (never JAX); engine-thread only, like the pool.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from engine.sched.page_pool import CachedPage

HOST_MEDIUM = "CPU"  # the KV-events medium of this tier (vLLM's and llm-d's name)


@dataclasses.dataclass
class HostEntry:
    page: CachedPage  # key, parent key, token ids, extra keys; released_s = last used
    slot: int  # index on axis 2 of the store
    ready: bool = False  # the bytes are in the store (SAVING until then)


@dataclasses.dataclass
class HostTierStats:
    hit_pages: int = 0  # pages served from the host tier (attached to a request)
    saved_pages: int = 0  # device -> host copies
    loaded_pages: int = 0  # host -> device copies
    evictions: int = 0  # ready entries dropped (LRU) to make room
    expirations: int = 0  # entries dropped by the TTL
    dropped_offers: int = 0  # evicted device pages not kept: every slot was SAVING
    save_s: float = 0.0  # host seconds the runner spent on saves (dispatch + landing)
    load_s: float = 0.0  # host seconds the runner spent on loads (read + dispatch)
    load_launches: int = 0  # launches that loaded pages
    loads_hidden: int = 0  # ... whose host reads ended while the step before still computed


class HostKVTier:
    medium = HOST_MEDIUM

    def __init__(self, num_slots: int, page_size: int, fields: dict[str, tuple]):
        """`fields`: {name: (shape, dtype)} of ONE page of each device cache field, e.g.
        {"k_pages": ((L, K, page_size, hd), float32), ...}; the store adds the slot axis
        at position 2."""
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} is invalid: >= 1 host page")
        self.num_slots = num_slots
        self.page_size = page_size
        self.store = {
            name: np.zeros((*shape[:2], num_slots, *shape[2:]), dtype)
            for name, (shape, dtype) in fields.items()
        }
        self.page_bytes = sum(
            int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in fields.values()
        )
        self._entries: collections.OrderedDict[int, HostEntry] = collections.OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))  # a stack: pops 0, 1, 2, ...
        self.pending_saves: list[tuple[int, HostEntry]] = []  # (device page, entry)
        self.pending_loads: list[tuple[int, HostEntry]] = []  # (device page, entry)
        self.stats = HostTierStats()
        self.events = None  # engine/sched/kv_events.KvEventRecorder (medium "CPU")

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def num_used_slots(self) -> int:
        return len(self._entries)

    @property
    def bytes_total(self) -> int:
        return self.num_slots * self.page_bytes

    @property
    def bytes_used(self) -> int:
        return self.num_used_slots * self.page_bytes

    # ---- called by the page pool ---------------------------------------------------------
    def offer(self, page_id: int, cached: CachedPage) -> bool:
        """The pool evicts device page `page_id` holding `cached`: keep a copy. Returns True
        when a save was queued (the runner must gather the page before anything rewrites
        it), False when the key was already here (touched) or no slot could be freed."""
        entry = self._entries.get(cached.key)
        if entry is not None and entry.page == dataclasses.replace(
            cached, released_s=entry.page.released_s
        ):
            entry.page.released_s = max(entry.page.released_s, cached.released_s)
            self._entries.move_to_end(cached.key)
            return False
        if entry is not None:  # a colliding key with other content: replace it
            self._drop(entry)
        slot = self._take_slot()
        if slot is None:
            self.stats.dropped_offers += 1
            return False
        entry = HostEntry(dataclasses.replace(cached), slot)
        self._entries[cached.key] = entry
        self.pending_saves.append((page_id, entry))
        return True

    def get(self, key: int) -> HostEntry | None:
        """The READY entry of `key`, or None (absent, or its bytes still on their way)."""
        entry = self._entries.get(key)
        return entry if entry is not None and entry.ready else None

    def queue_load(self, page_id: int, entry: HostEntry, now_s: float) -> None:
        """Copy `entry` into device page `page_id` before the next step (a hit). The entry
        may have been dropped since the lookup (the same admission's evictions needed its
        slot): its bytes stay in the slot until the next launch, after this load is read."""
        if self._entries.get(entry.page.key) is entry:
            self._entries.move_to_end(entry.page.key)
        entry.page.released_s = now_s
        self.pending_loads.append((page_id, entry))
        self.stats.hit_pages += 1

    def expire(self, now_s: float, ttl_s: float) -> int:
        """Drop ready entries last used at least ttl_s ago, oldest first; returns how many."""
        num = 0
        while self._entries:
            entry = next(iter(self._entries.values()))
            if not entry.ready or now_s - entry.page.released_s < ttl_s:
                break
            self._drop(entry)
            num += 1
        self.stats.expirations += num
        return num

    def clear(self) -> None:
        """Forget every entry (a model revision change); saves in flight land nowhere."""
        for entry in list(self._entries.values()):
            self._drop(entry)
        self.pending_saves.clear()
        self.pending_loads.clear()

    # ---- called by the runner (engine/runner/kv_offload.py) ------------------------------
    def take_saves(self) -> list[tuple[int, HostEntry]]:
        saves, self.pending_saves = self.pending_saves, []
        return saves

    def take_loads(self) -> list[tuple[int, HostEntry]]:
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def write(self, entries: list[HostEntry], arrays: dict[str, np.ndarray]) -> None:
        """Saves landed: `arrays` [L, K, n, ...] (n >= len(entries)) go into the entries'
        slots, which become READY. Entries dropped meanwhile (clear) are skipped."""
        live = [i for i, e in enumerate(entries) if self._entries.get(e.page.key) is e]
        if not live:
            return
        slots = [entries[i].slot for i in live]
        for name, store in self.store.items():
            store[:, :, slots] = arrays[name][:, :, live]
        for i in live:
            entries[i].ready = True
            if self.events is not None:
                page = entries[i].page
                # NOTE: extra_keys = model keys + (adapter_id, cache_salt) (PagePool.extra_keys)
                self.events.page_stored(
                    page.key, page.parent_key, page.token_ids, page.extra_keys[-2], self.medium
                )
        self.stats.saved_pages += len(live)

    def read(self, entries: list[HostEntry]) -> dict[str, np.ndarray]:
        """The entries' pages, {field: [L, K, n, ...]} (a copy, in entry order)."""
        slots = [e.slot for e in entries]
        return {name: store[:, :, slots] for name, store in self.store.items()}

    @property
    def ready_entries(self) -> list[HostEntry]:
        """READY entries, least recently used first (KV events replay them)."""
        return [e for e in self._entries.values() if e.ready]

    # ---- inside ----------------------------------------------------------------------------
    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for entry in self._entries.values():  # least recently used first
            if entry.ready:
                self._drop(entry)
                self.stats.evictions += 1
                return self._free_slots.pop()
        return None

    def _drop(self, entry: HostEntry) -> None:
        # NOTE: a load of this entry queued in this launch still reads the right bytes: the
        # runner reads loads before any later save lands in the freed slot (a later launch).
        del self._entries[entry.page.key]
        self._free_slots.append(entry.slot)
        if entry.ready and self.events is not None:
            self.events.page_removed(entry.page.key, self.medium)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call this)."""
        slots = [e.slot for e in self._entries.values()]
        assert len(set(slots)) == len(slots), "two entries share a slot"
        assert not set(slots) & set(self._free_slots), "a slot is both used and free"
        assert len(slots) + len(self._free_slots) == self.num_slots, "a slot leaked"
        assert all(k == e.page.key for k, e in self._entries.items())


def host_tier_stats(tier: HostKVTier | None) -> dict:
    """The host tier's part of the engine's stats() (all zero without one)."""
    if tier is None:
        return {"host_kv_enabled": False}
    s, ps = tier.stats, tier.page_size
    return {
        "host_kv_enabled": True,
        "host_kv_pages_total": tier.num_slots,
        "host_kv_pages_used": tier.num_used_slots,
        "host_kv_bytes_total": tier.bytes_total,
        "host_kv_bytes_used": tier.bytes_used,
        "host_kv_hit_tokens": s.hit_pages * ps,
        "host_kv_hit_pages": s.hit_pages,
        "host_kv_saved_pages": s.saved_pages,
        "host_kv_loaded_pages": s.loaded_pages,
        "host_kv_saved_bytes": s.saved_pages * tier.page_bytes,
        "host_kv_loaded_bytes": s.loaded_pages * tier.page_bytes,
        "host_kv_evictions": s.evictions,
        "host_kv_expirations": s.expirations,
        "host_kv_dropped_offers": s.dropped_offers,
        "host_kv_save_s": s.save_s,
        "host_kv_load_s": s.load_s,
        "host_kv_load_launches": s.load_launches,
        "host_kv_loads_hidden": s.loads_hidden,
    }
