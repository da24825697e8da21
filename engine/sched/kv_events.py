"""KV-cache events: the prefix cache's own transitions, in the shape llm-d's KV-cache indexer
(and vLLM) uses, recorded on the engine thread for serving/gateway/kv_events_publisher.py to send.

The page pool (engine/sched/page_pool.py) calls a recorder, when one is attached, at exactly the
transitions that change what a prefix lookup can hit:

    cache_full_pages  a full page gets its key       -> ["BlockStored", hashes, parent,
                                                         token_ids, block_size, lora_id,
                                                         medium]
    _uncache          evicted (allocate) or expired  -> ["BlockRemoved", hashes, medium]
    clear_cache       model revision change          -> ["AllBlocksCleared"]

With a host tier (engine/sched/host_tier.py) a page evicted from the device and copied to
host memory is removed with medium "GPU" and stored again with medium "CPU" once its bytes
have landed; a host entry dropped (LRU, TTL) is removed with medium "CPU"; a host hit copied
back to the device is stored with medium "GPU".

Consecutive pages of one chain (each page's parent is the previous page) fold into one
BlockStored whose token_ids are the pages' tokens in order, as vLLM sends them; consecutive
removals fold into one BlockRemoved. A block hash is the page's prefix-cache key as an
unsigned 64-bit integer: the key already mixes the model revision, the LoRA adapter and the
tenant's cache salt (PagePool.extra_keys), so two tenants' identical prompts get different
hashes while the tenant's name, and its salt, are never sent. `lora_id` is None for the base
model, else a 63-bit integer from the adapter's content hash (llm-d decodes it as an int).

The recorder only appends small lists; `take()` hands the step's events over (one
EventBatch per engine step, like vLLM). It is engine-thread only, like the pool.
"""

from __future__ import annotations

MEDIUM = "GPU"  # vLLM's and llm-d's name for the accelerator's HBM tier (TPU HBM included)
_U64 = (1 << 64) - 1


def block_hash(key: int) -> int:
    """A prefix-cache key (Python's signed 64-bit hash) as the unsigned hash sent."""
    return key & _U64


def lora_id_of(adapter_id: str | None) -> int | None:
    """The integer id of an adapter's content hash (hex), None for the base model."""
    if adapter_id is None:
        return None
    return int(adapter_id[:15], 16) if _is_hex(adapter_id[:15]) else hash(adapter_id) & (_U64 >> 1)


def _is_hex(text: str) -> bool:
    return bool(text) and all(c in "0123456789abcdefABCDEF" for c in text)


class KvEventRecorder:
    """Attached to a PagePool as `pool.events`; `take()` drains what it recorded."""

    def __init__(self, block_size: int, medium: str = MEDIUM):
        self.block_size = block_size
        self.medium = medium
        self.pending: list[list] = []
        self.num_events = 0  # recorded since start (stored + removed + cleared)

    # ---- called by the page pool -------------------------------------------------------
    def page_stored(
        self,
        key: int,
        parent_key: int | None,
        token_ids: tuple[int, ...],
        adapter_id,
        medium: str | None = None,
    ) -> None:
        """`medium`: None for this recorder's (the device's)."""
        medium = medium or self.medium
        parent = None if parent_key is None else block_hash(parent_key)
        lora_id = lora_id_of(adapter_id)
        last = self.pending[-1] if self.pending else None
        if (
            last is not None
            and last[0] == "BlockStored"
            and last[1][-1] == parent
            and last[5] == lora_id
            and last[6] == medium
        ):
            last[1].append(block_hash(key))  # the chain goes on: one event
            last[3].extend(token_ids)
            return
        self.pending.append(
            [
                "BlockStored",
                [block_hash(key)],
                parent,
                list(token_ids),
                self.block_size,
                lora_id,
                medium,
            ]  # fmt: skip
        )
        self.num_events += 1

    def page_removed(self, key: int, medium: str | None = None) -> None:
        medium = medium or self.medium
        last = self.pending[-1] if self.pending else None
        if last is not None and last[0] == "BlockRemoved" and last[2] == medium:
            last[1].append(block_hash(key))
            return
        self.pending.append(["BlockRemoved", [block_hash(key)], medium])
        self.num_events += 1

    def announce(self, pages, medium: str | None = None) -> None:
        """BlockStored for pages cached before the recorder was attached (PagePool's
        cached_pages, parents first; or a host tier's entries with its medium), so that a
        stream's replay starts from the cache's content and every later BlockRemoved names a
        block it announced."""
        for page in pages:
            # NOTE: extra_keys = model keys + (adapter_id, cache_salt) (PagePool.extra_keys)
            self.page_stored(page.key, page.parent_key, page.token_ids, page.extra_keys[-2], medium)

    def cleared(self) -> None:
        self.pending.append(["AllBlocksCleared"])
        self.num_events += 1

    # ---- called once per engine step ---------------------------------------------------
    def take(self) -> list[list]:
        """The events recorded since the last take (oldest first)."""
        events, self.pending = self.pending, []
        return events


def pools_of(engine) -> list:
    """The page pools of an engine, one per data-parallel replica (their index is the
    EventBatch's data_parallel_rank). Raises ValueError for an engine whose pool is not in
    this process (--engine_process)."""
    replicas = getattr(engine, "replicas", None)
    if replicas:
        return [pool for replica in replicas for pool in pools_of(replica)]
    pool = getattr(engine, "pool", None)
    if pool is None:
        raise ValueError(
            f"kv_events_endpoint: the engine {type(engine).__name__} has no page pool in this "
            "process (not with --engine_process)"
        )
    return [pool]


def attach(engine, medium: str = MEDIUM) -> list[KvEventRecorder]:
    """A recorder on each of the engine's page pools (index = data-parallel rank)."""
    recorders = []
    for pool in pools_of(engine):
        pool.events = KvEventRecorder(pool.page_size, medium)
        pool.events.announce(pool.cached_pages)
        if pool.host_tier is not None:
            pool.host_tier.events = pool.events
            pool.events.announce(
                [e.page for e in pool.host_tier.ready_entries], pool.host_tier.medium
            )
        recorders.append(pool.events)
    return recorders
