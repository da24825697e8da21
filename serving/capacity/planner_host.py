r"""The host KV tier as a planned resource (extends serving.capacity.planner's `plan`).

    python -m serving.capacity.planner plan --model=smollm2-135m --kv_dtype=float32 \
        --device_memory_gib=2 --weights_gib=0.5 --workspace_gib=0 --max_num_seqs=8 \
        --host_kv_gib=1 --shared_prefix_tokens=256 --sessions=200 --session_tokens=288

A prefix cache reuses the KV of what returning sessions (multi-turn chats, agent loops)
computed before; the server's host tier (`--host_kv_gib`, engine/sched/host_tier.py) keeps
the pages the device pool evicts. Inputs: the host bytes, and the prefix workload as
`sessions` that come back, each with `session_tokens` of its own reusable context (the
mean context a returning turn finds, past the shared prefix), behind `shared_prefix_tokens`
every request shares (a system prompt):

    device cache tokens = (KV pages - running sequences x mean pages per sequence) x page
                          (what the running batch leaves to cached pages)
    host tier tokens    = floor(host bytes / page bytes) x page
    working set tokens  = shared prefix + sessions x session_tokens       (whole pages)
    sessions that fit   = cache tokens / session_tokens      (device only; device + host)
    hit rate (of the reusable session tokens), LRU, sessions returning in random order:
        device only     = min(1, device cache / working set)
        device + host   = min(1, max(device cache, host tier) / working set)

Random interleaving with equal popularity makes every eviction policy's hit rate the cache's
share of the working set; the shared prefix, used by every request, stays cached and always
hits. The host tier is inclusive (a page reloaded to the device keeps its host copy), so
the two tiers hold at least the larger of them, not their sum: the figure is a lower bound.
A strict round robin over more sessions than fit is LRU's worst case (0 hits below the
working set): benchmarks/chat_trace_bench.py measures that order.

Reload vs recompute (both optional, measured on the target: the host tier's loaded bytes
over its load seconds, and the prefill rate at the operating point):

    reload seconds per 1k tokens    = 1000 x KV bytes per token / host bandwidth
    recompute seconds per 1k tokens = 1000 / prefill tokens per s
"""

from __future__ import annotations

import dataclasses
import math

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class PrefixWorkload:
    shared_prefix_tokens: int = 0  # every request's common prefix (a system prompt)
    sessions: int = 0  # sessions that come back (conversations, agent loops)
    session_tokens: float = 0.0  # mean reusable context of a returning session, own tokens

    def __post_init__(self):
        for name in ("shared_prefix_tokens", "sessions", "session_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: >= 0")

    def working_set_tokens(self, page_size: int) -> int:
        pages = math.ceil(self.shared_prefix_tokens / page_size) + self.sessions * math.ceil(
            self.session_tokens / page_size
        )
        return pages * page_size


def hit_rate(cache_tokens: float, working_set_tokens: float) -> float:
    """Hit rate of a cache over a working set referenced in random order, equal popularity."""
    if working_set_tokens <= 0:
        return 1.0
    return min(1.0, max(0.0, cache_tokens) / working_set_tokens)


def host_tier_plan(
    *,
    kv_pages: int,
    page_size: int,
    kv_bytes_per_token: int,
    host_kv_bytes: int,
    running_sequences: int,
    mean_pages_per_sequence: float,
    workload: PrefixWorkload,
    host_bytes_per_s: float | None = None,
    prefill_tokens_per_s: float | None = None,
) -> dict:
    """Tokens each tier caches, sessions that fit and expected hit rates (module docstring)."""
    if host_kv_bytes < 0 or running_sequences < 0:
        raise ValueError(
            f"host_kv_bytes={host_kv_bytes}, running_sequences={running_sequences}: both >= 0"
        )
    page_bytes = kv_bytes_per_token * page_size
    running_pages = math.ceil(running_sequences * mean_pages_per_sequence)
    device_tokens = max(0, kv_pages - running_pages) * page_size
    host_pages = host_kv_bytes // page_bytes
    host_tokens = host_pages * page_size
    ws = workload.working_set_tokens(page_size)
    both = max(device_tokens, host_tokens)
    per_session = workload.session_tokens
    out = {
        "host_kv_gib": host_kv_bytes / GIB,
        "host_pages": host_pages,
        "host_tokens": host_tokens,
        "running_sequences": running_sequences,
        "device_cache_tokens": device_tokens,
        "working_set_tokens": ws,
        "working_set_gib": ws * kv_bytes_per_token / GIB,
        "shared_prefix_cached": 0 < workload.shared_prefix_tokens <= device_tokens,
        "sessions_that_fit": {
            "device": int(device_tokens // per_session) if per_session else None,
            "device_and_host": int(both // per_session) if per_session else None,
        },
        "hit_rate": {
            "device": hit_rate(device_tokens, ws),
            "device_and_host": hit_rate(both, ws),
        },
    }
    reused = {
        k: workload.shared_prefix_tokens + per_session * h for k, h in out["hit_rate"].items()
    }
    out["cached_tokens_per_returning_request"] = reused
    if host_bytes_per_s:
        out["reload_s_per_1k_tokens"] = 1000 * kv_bytes_per_token / host_bytes_per_s
    if prefill_tokens_per_s:
        out["recompute_s_per_1k_tokens"] = 1000 / prefill_tokens_per_s
    if host_bytes_per_s and prefill_tokens_per_s:
        out["reload_speedup"] = out["recompute_s_per_1k_tokens"] / out["reload_s_per_1k_tokens"]
    return out


def render_host_tier(h: dict) -> list[str]:
    """The plan's host-tier lines."""
    fits = h["sessions_that_fit"]
    lines = [
        (
            f"host KV tier: {h['host_kv_gib']:.2f} GiB = {h['host_pages']} pages, "
            f"{h['host_tokens']:,} tokens; the device caches {h['device_cache_tokens']:,} "
            f"tokens beside {h['running_sequences']} running sequences"
        ),
        (
            f"prefix working set {h['working_set_tokens']:,} tokens "
            f"({h['working_set_gib']:.2f} GiB of KV): sessions that fit "
            f"{fits['device']} on the device, {fits['device_and_host']} with the host tier; "
            f"expected hit rate of returning sessions' context {h['hit_rate']['device']:.0%} "
            f"-> {h['hit_rate']['device_and_host']:.0%} (random order; at least, the tier is "
            "inclusive)"
        ),
    ]
    if "reload_speedup" in h:
        lines.append(
            f"reload {h['reload_s_per_1k_tokens']:.3f} s vs recompute "
            f"{h['recompute_s_per_1k_tokens']:.3f} s per 1k tokens "
            f"({h['reload_speedup']:.1f}x)"
        )
    return lines
