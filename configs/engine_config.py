"""Engine configuration: frozen, hashable dataclasses checked on creation.

`EngineConfig` holds every engine option a user can pass to `LLM(model=..., **options)`;
`SchedulerConfig` is the host-side subset the scheduler and page pool read, derived from it by
`EngineConfig.scheduler_config(model_cfg)` (which resolves a KV memory budget into pages).
`CacheSharingPolicy` says which tenants may share prefix-cache pages (see
`engine.sched.page_pool.cache_salt_for`). Tests build tiny variants with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses

from configs.kv_memory import (
    DTYPE_BYTES,
    kv_bytes_per_token,
    kv_bytes_per_token_per_layer,
    local_layer_window,
    ring_pages,
)
from configs.model_config import ModelConfig
from configs.quant_config import QuantConfig
from configs.spec_config import SpeculativeConfig

PARAM_DTYPES = (None, "float32", "bfloat16", "float16")


def _check(field: str, value, ok: bool, limit: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r} is invalid: {limit}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler and the page pool need (all host side)."""

    page_size: int = 16  # tokens per KV page
    num_pages: int = 512  # pages in the pool, including the reserved null page 0
    max_num_seqs: int = 64  # slot limit: requests running at once (and per step)
    max_num_batched_tokens: int = 512  # token budget of one step (decodes + prefill chunks)
    prefill_chunk_size: int = 256  # most prompt tokens one request computes in one step
    max_model_len: int = 8192  # prompt + output tokens of one request
    # Effective priority = priority + priority_aging_per_s * seconds since arrival, so a
    # request of priority p waiting d/rate seconds overtakes fresh ones of priority p + d.
    priority_aging_per_s: float = 0.1
    # All slots taken and a waiting request of a higher priority class than a running one:
    # the lowest-priority running request is preempted (recompute, its outputs kept) so the
    # higher one runs now (serving lets such requests past its inflight limit: issue 34).
    priority_preemption: bool = False
    enable_prefix_caching: bool = True
    # A cached page nobody uses expires this long after it was last released (None: never).
    prefix_cache_ttl_s: float | None = 600.0

    def __post_init__(self):
        _check("page_size", self.page_size, self.page_size >= 1, ">= 1")
        _check(
            "num_pages",
            self.num_pages,
            self.num_pages >= 2,
            ">= 2 (page 0 is the reserved null page)",
        )
        _check("max_num_seqs", self.max_num_seqs, self.max_num_seqs >= 1, ">= 1")
        _check(
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            self.max_num_batched_tokens >= 1,
            ">= 1",
        )
        _check(
            "prefill_chunk_size",
            self.prefill_chunk_size,
            1 <= self.prefill_chunk_size <= self.max_num_batched_tokens,
            f"1 <= x <= max_num_batched_tokens ({self.max_num_batched_tokens})",
        )
        _check("max_model_len", self.max_model_len, self.max_model_len >= 2, ">= 2")
        _check(
            "priority_aging_per_s",
            self.priority_aging_per_s,
            self.priority_aging_per_s >= 0.0,
            ">= 0",
        )
        _check(
            "prefix_cache_ttl_s",
            self.prefix_cache_ttl_s,
            self.prefix_cache_ttl_s is None or self.prefix_cache_ttl_s > 0.0,
            "None (never expire) or > 0",
        )

    @property
    def max_pages_per_seq(self) -> int:
        """Page-table width P: pages one request of max_model_len tokens needs."""
        return -(-self.max_model_len // self.page_size)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every engine option (`LLM(model=..., **options)`).

    The pool size is `num_pages` when given, else as many pages as `kv_cache_bytes` holds
    for the model (`scheduler_config(model_cfg)` does the arithmetic).
    """

    model: str = "smollm2-135m"
    # Weights and activations: "float32" | "bfloat16" | "float16"; None: the loader's default
    # (float32 on CPU, where bfloat16 matmuls are slow; bfloat16 on accelerators).
    dtype: str | None = None
    kv_dtype: str = "float32"  # "float32" | "bfloat16" | "int8"
    # Weights: "none" | "int8" (weight-only) | "w8a8" (int8 activations too); models/quant.py
    quantization: str = "none"
    quantize_lm_head: bool = False  # with int8/w8a8: the LM head too (default: float)
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_bytes: int = 512 * 2**20  # used when num_pages is None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefill_chunk_size: int | None = None  # None: min(256, max_num_batched_tokens)
    max_model_len: int | None = None  # None: the model's max_seq_len
    priority_aging_per_s: float = 0.1
    prefix_caching: bool = True
    prefix_cache_ttl_s: float | None = 600.0
    # A second prefix-cache tier in host memory, in GiB (0 = off): cached pages evicted from
    # the device pool are copied there and copied back on a later hit instead of being
    # recomputed (engine/sched/host_tier.py, engine/runner/kv_offload.py). Per replica.
    host_kv_gib: float = 0.0
    # Sliding-window layers of a model with local and global layers (Gemma 3) keep K/V only
    # for their window: a ring of pages per sequence slot (engine/runner/kv_cache.py
    # WindowedKVCache) instead of pool pages for the whole context. Needs prefix_caching
    # False and no speculative decoding (a cached prefix or a rejected draft has no local K/V).
    release_local_pages: bool = False
    # "auto" | "scan" | "unrolled": how the model loops over layers (models/llama.py
    # `layer_layout`); "auto" unrolls on a single CPU device, scans elsewhere and with a mesh.
    layer_loop: str = "auto"
    # Which tenants share prefix-cache pages (EngineCore derives each request's salt from it).
    cache_sharing: CacheSharingPolicy = dataclasses.field(
        default_factory=lambda: CacheSharingPolicy()
    )
    # Overlap host work with the device step: schedule and dispatch step N+1 before reading
    # step N's tokens (engine/core.py). False: the synchronous loop (same outputs).
    async_scheduling: bool = True
    # The compiled step shapes: at most this many (the coarsest set if that is larger);
    # every batch is padded to one of them (engine/runner/shapes.py).
    max_step_shapes: int = 56
    # Speculative decoding (configs/spec_config.py; engine/spec/decode.py): None = off, or
    # a SpeculativeConfig / dict / string such as "ngram:k=4".
    speculative: SpeculativeConfig | None = None
    # ---- LoRA (engine/lora/adapters.py): device slots for this many adapters of rank <= R;
    # 0 = no LoRA (the step programs are exactly the plain model's).
    max_loras: int = 0
    max_lora_rank: int = 16

    def __post_init__(self):
        object.__setattr__(self, "speculative", SpeculativeConfig.of(self.speculative))
        _check("page_size", self.page_size, self.page_size >= 1, ">= 1")
        _check("dtype", self.dtype, self.dtype in PARAM_DTYPES, f"one of {PARAM_DTYPES}")
        _check(
            "kv_dtype",
            self.kv_dtype,
            self.kv_dtype in DTYPE_BYTES,
            f"one of {sorted(DTYPE_BYTES)}",
        )
        self.quant_config  # noqa: B018 (validates quantization and quantize_lm_head)
        _check("max_loras", self.max_loras, self.max_loras >= 0, ">= 0 (0: no LoRA)")
        _check("max_lora_rank", self.max_lora_rank, self.max_lora_rank >= 1, ">= 1")
        _check(
            "cache_sharing",
            self.cache_sharing,
            isinstance(self.cache_sharing, CacheSharingPolicy),
            "a CacheSharingPolicy",
        )
        _check(
            "num_pages",
            self.num_pages,
            self.num_pages is None or self.num_pages >= 2,
            "None (use kv_cache_bytes) or >= 2",
        )
        _check("kv_cache_bytes", self.kv_cache_bytes, self.kv_cache_bytes > 0, "> 0")
        _check("max_step_shapes", self.max_step_shapes, self.max_step_shapes >= 1, ">= 1")
        _check(
            "layer_loop",
            self.layer_loop,
            self.layer_loop in ("auto", "scan", "unrolled"),
            "one of 'auto', 'scan', 'unrolled'",
        )
        _check(
            "max_model_len",
            self.max_model_len,
            self.max_model_len is None or self.max_model_len >= 2,
            "None or >= 2",
        )
        _check("host_kv_gib", self.host_kv_gib, self.host_kv_gib >= 0, ">= 0 (0: off)")
        if self.host_kv_gib > 0:
            _check(
                "prefix_caching",
                self.prefix_caching,
                self.prefix_caching,
                f"True with host_kv_gib={self.host_kv_gib} (the host tier holds cached pages)",
            )
            method = None if self.speculative is None else self.speculative.method
            _check(
                "speculative",
                method,
                method != "draft",
                "not 'draft' with host_kv_gib > 0 (the draft model's K/V is not offloaded)",
            )
        if self.release_local_pages:
            _check(
                "prefix_caching",
                self.prefix_caching,
                not self.prefix_caching,
                "False with release_local_pages=True (a cached prefix's released local-layer "
                "K/V cannot be restored)",
            )
            _check(
                "speculative",
                self.speculative,
                self.speculative is None,
                "None with release_local_pages=True (not supported together)",
            )
        # The remaining fields are checked by SchedulerConfig; build one now so a bad value
        # fails at construction, not at engine start.
        self._scheduler_config(num_pages=2, max_model_len=self.max_model_len or 2)

    @property
    def quant_config(self) -> QuantConfig:
        return QuantConfig(self.quantization, self.quantize_lm_head)

    def num_pages_for(self, model_cfg: ModelConfig) -> int:
        """Pages in the pool (null page included) for this model."""
        if self.num_pages is not None:
            return self.num_pages
        page_bytes = kv_bytes_per_token(model_cfg, self.kv_dtype) * self.page_size
        budget = self.kv_cache_bytes
        ring = self.local_ring_pages(model_cfg)
        if ring is not None:  # the rings first; the pool's pages hold the global layers only
            per_layer = kv_bytes_per_token_per_layer(model_cfg, self.kv_dtype) * self.page_size
            num_local = sum(w is not None for w in model_cfg.layer_windows())
            budget -= num_local * per_layer * (1 + self.max_num_seqs * ring)
            page_bytes = (model_cfg.num_layers - num_local) * per_layer
        num_pages = max(budget, 0) // page_bytes
        _check(
            "kv_cache_bytes",
            self.kv_cache_bytes,
            num_pages >= 2,
            f">= 2 pages of {page_bytes} bytes for {model_cfg.name}"
            + (" after the local-layer rings" if ring is not None else ""),
        )
        return num_pages

    def local_ring_pages(self, model_cfg: ModelConfig) -> int | None:
        """With release_local_pages: the pages of one slot's ring in the sliding-window layers
        (`configs.kv_memory.ring_pages` for the prefill chunk); None otherwise. ValueError
        naming the model when it has no local/global split."""
        if not self.release_local_pages:
            return None
        return ring_pages(local_layer_window(model_cfg), self.page_size, self._prefill_chunk_size)

    @property
    def _prefill_chunk_size(self) -> int:
        if self.prefill_chunk_size is not None:
            return self.prefill_chunk_size
        return min(256, self.max_num_batched_tokens)

    def scheduler_config(self, model_cfg: ModelConfig) -> SchedulerConfig:
        return self._scheduler_config(
            num_pages=self.num_pages_for(model_cfg),
            max_model_len=self.max_model_len or model_cfg.max_seq_len,
        )

    def _scheduler_config(self, num_pages: int, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            page_size=self.page_size,
            num_pages=num_pages,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            prefill_chunk_size=self._prefill_chunk_size,
            max_model_len=max_model_len,
            priority_aging_per_s=self.priority_aging_per_s,
            enable_prefix_caching=self.prefix_caching,
            prefix_cache_ttl_s=self.prefix_cache_ttl_s,
        )


@dataclasses.dataclass(frozen=True)
class CacheSharingPolicy:
    """Who may share prefix-cache pages. By default each tenant shares only with itself.

    `isolated_tenants`: tenants with sharing disabled (every request gets a fresh random salt,
    so it neither hits nor seeds the cache for anyone, itself included).
    `shared_groups`: (group name, tenants) pairs; the tenants of one group share one salt
    (e.g. a public system prompt served to several customers).
    """

    isolated_tenants: frozenset[str] = frozenset()
    shared_groups: tuple[tuple[str, frozenset[str]], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "isolated_tenants", frozenset(self.isolated_tenants))
        groups = tuple((str(name), frozenset(members)) for name, members in self.shared_groups)
        object.__setattr__(self, "shared_groups", groups)
        seen: dict[str, str] = {}
        for name, members in groups:
            for tenant in members:
                _check(
                    "shared_groups",
                    tenant,
                    tenant not in seen,
                    f"a tenant may be in one group only (also in {seen.get(tenant)!r})",
                )
                _check(
                    "shared_groups",
                    tenant,
                    tenant not in self.isolated_tenants,
                    "a tenant cannot be both isolated and in a shared group",
                )
                seen[tenant] = name

    def group_of(self, tenant: str) -> str | None:
        for name, members in self.shared_groups:
            if tenant in members:
                return name
        return None
