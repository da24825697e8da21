"""KV export and import between engines: exactly one request's pages, with what they mean.

Prefill/decode disaggregation moves a request from the engine that computed its prompt
(prefill worker) to one that continues decoding (decode worker). What moves:

    KVMeta      token ids (prompt + the first sampled token), kv_len (tokens whose K/V the
                pages hold = the prompt), the model identity, KV dtype, page size, the
                cache geometry (layers, KV heads, head dim), the first token's logprobs
    arrays      k_pages, v_pages  [L, K, n, page_size, hd]   (n = ceil(kv_len / page_size))
                k_scales, v_scales [L, K, n, page_size] float32 (only for int8 KV)
    checksum    sha256 over the metadata's JSON and every array's bytes, in that order

Export (prefill side, `export_pages`): the request ran with max_tokens=1; when it ended, the
scheduler's `on_finish` hook took one more reference on its pages
(engine/kv_transfer/transfer_engine.py), so
they cannot be reused before one jitted gather copies them out (page ids padded to a power of
two with the null page, so a few programs serve every length) and the references are
dropped. Import (decode side, `import_request`): the metadata is checked against this engine
(`check_compatible`: a different model revision, tokenizer, KV dtype, page size or cache
geometry is refused with KVTransferMismatchError naming the field), pages are allocated from
THIS engine's pool (its own page ids), one jitted scatter writes them (cache donated), the
scheduler adopts the request as running with `num_computed_tokens = kv_len`, and the first
token goes through the OutputProcessor as if this engine had sampled it (stop checks,
detokenizer, metrics), so the decode worker owns the whole output stream. Its next step is
the decode of that first token. When the pool or the running slots are full, the request is
queued normally instead (it recomputes its prompt: slower, same tokens) and counted as a
fallback.

Ordering with overlapped steps: both the gather and the scatter take the runner's KV cache
(ModelRunner.state.kv) as it is after the step in flight (data dependence on the donated
cache), and the pages they touch are held by no step in flight (exported pages are
referenced until the gather is dispatched; every later step takes the cache after it;
imported pages were free). With a tensor-parallel mesh the gather / scatter are plain jit
over the sharded cache; the scatter keeps its sharding
(tests/kv_transfer_mesh_worker.py, model:2). JAX is imported on first use, so serving
imports this module (metadata, wire format) without it (the server with --model=mock
starts without JAX).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time

import numpy as np

from configs.errors import PagedJaxError
from engine.api_types import EngineRequest, RequestOutput, TokenLogprob
from engine.errors import InvalidRequestError
from engine.sampling.params import SamplingParams

KV_FIELDS = ("k_pages", "v_pages", "k_scales", "v_scales")
# identity fields that must agree for K/V to mean the same thing on both sides
IDENTITY_FIELDS = ("revision", "tokenizer_hash", "chat_template_hash", "quantization", "kv_dtype")


class KVTransferMismatchError(PagedJaxError):
    """The two engines disagree on something the K/V depends on (field, value, expected)."""

    def __init__(self, field: str, value, expected):
        self.field, self.value, self.expected = field, value, expected
        super().__init__(
            f"KV transfer refused: {field}={value!r} from the sender, this engine has "
            f"{expected!r} (both must be equal)"
        )


class KVChecksumError(PagedJaxError):
    """The received bytes do not match the sender's checksum."""


@dataclasses.dataclass(frozen=True)
class KVMeta:
    request_id: str
    token_ids: tuple[int, ...]  # prompt + first sampled token
    num_prompt_tokens: int
    kv_len: int  # tokens whose K/V the pages hold (= num_prompt_tokens)
    num_cached_tokens: int  # prompt tokens the sender's prefix cache served
    model: dict  # ModelIdentity.as_dict() of the sender
    kv_dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    first_logprob: tuple | None = None  # (token id, logprob, ((id, logprob), ...)) or None
    adapter_id: str | None = None  # LoRA adapter content hash the K/V was computed with

    @property
    def num_pages(self) -> int:
        return -(-self.kv_len // self.page_size)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> KVMeta:
        d = json.loads(data)
        d["token_ids"] = tuple(d["token_ids"])
        if d.get("first_logprob") is not None:
            tok, lp, top = d["first_logprob"]
            d["first_logprob"] = (tok, lp, tuple(tuple(t) for t in top))
        return cls(**d)


@dataclasses.dataclass
class KVPayload:
    meta: KVMeta
    arrays: dict[str, np.ndarray]  # KV_FIELDS present in the cache, each [L, K, n, ps(, hd)]
    checksum: str  # hex sha256 (payload_checksum)
    # jax.experimental.transfer (serving/disagg/jax_transfer.py): `arrays` are device arrays
    # padded to the page-count bucket, and the checksum covers the metadata and
    # `device_digest` (engine/kv_transfer/digest.py: the sender's digest of the arrays; "" = none)
    on_device: bool = False
    device_digest: str = ""

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def verify(self) -> None:
        got = payload_checksum(self.meta, {} if self.on_device else self.arrays, self.device_digest)
        if got != self.checksum:
            raise KVChecksumError(
                f"KV payload of {self.meta.request_id!r}: checksum {got} != sent {self.checksum}"
            )

    def verify_device_digest(self) -> None:
        """The pulled arrays' digest against the sender's (on_device payloads that carry
        one): a reduction on this device, no host copy of the pages."""
        from engine.kv_transfer.digest import device_digest

        got = device_digest(self.arrays)
        if got != self.device_digest:
            raise KVChecksumError(
                f"KV pages of {self.meta.request_id!r}: device digest {got} != sent "
                f"{self.device_digest}"
            )


def payload_checksum(meta: KVMeta, arrays: dict[str, np.ndarray], device_digest: str = "") -> str:
    h = hashlib.sha256(meta.to_json())
    if device_digest:
        h.update(device_digest.encode())
    for name in KV_FIELDS:
        if name in arrays:
            h.update(name.encode())
            h.update(np.ascontiguousarray(arrays[name]).data)
    return h.hexdigest()


def paged_kv_of(core):
    """The engine's KV cache when it is one PagedKVCache; NotImplementedError for the
    per-group cache of release_local_pages (its local layers hold a window, not the prompt's
    K/V)."""
    from engine.runner.kv_cache import PagedKVCache

    kv = core.runner.state.kv
    if not isinstance(kv, PagedKVCache):
        raise NotImplementedError("KV transfer with release_local_pages=True")
    return kv


def engine_kv_meta(core) -> dict:
    """What this engine's K/V depends on, in KVMeta's field names."""
    cfg, kv = core.cfg, paged_kv_of(core)
    return {
        "model": core.identity.as_dict(),
        "kv_dtype": str(kv.k_pages.dtype),
        "page_size": core.sched_config.page_size,
        "num_layers": cfg.num_layers,
        "num_kv_heads": kv.k_pages.shape[1],
        "head_dim": cfg.head_dim,
    }


def check_compatible(meta: KVMeta, core) -> None:
    """Raise KVTransferMismatchError unless `meta` was produced by an engine whose K/V this
    engine can use as its own."""
    mine = engine_kv_meta(core)
    for field in IDENTITY_FIELDS:
        if meta.model.get(field) != mine["model"].get(field):
            raise KVTransferMismatchError(
                f"model.{field}", meta.model.get(field), mine["model"].get(field)
            )
    for field in ("kv_dtype", "page_size", "num_layers", "num_kv_heads", "head_dim"):
        if getattr(meta, field) != mine[field]:
            raise KVTransferMismatchError(field, getattr(meta, field), mine[field])
    if len(meta.token_ids) != meta.num_prompt_tokens + 1 or meta.kv_len != meta.num_prompt_tokens:
        raise KVTransferMismatchError(
            "token_ids", len(meta.token_ids), f"num_prompt_tokens + 1 = {meta.kv_len + 1}"
        )


# ---- device: one gather, one scatter ----------------------------------------------------
def _bucket(n: int) -> int:
    """Page counts are padded to a power of two: a few programs serve every length."""
    return 1 << max(0, (n - 1).bit_length())


def _padded_ids(page_ids: list[int]) -> np.ndarray:
    ids = np.zeros(_bucket(len(page_ids)), np.int32)  # padding -> the null page 0
    ids[: len(page_ids)] = page_ids
    return ids


@functools.cache
def device_fns():
    """(gather, scatter), jitted on first use."""
    import jax

    @jax.jit
    def gather(kv, ids):
        # every field [L, K, N, ...] -> [L, K, n, ...]
        return jax.tree.map(lambda x: x[:, :, ids], kv)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def scatter(kv, ids, pages):
        # padding ids write the null page, whose contents nobody reads
        return jax.tree.map(lambda x, p: x.at[:, :, ids].set(p.astype(x.dtype)), kv, pages)

    return gather, scatter


def export_pages(core, page_ids: list[int]) -> dict[str, np.ndarray]:
    """Copy pages `page_ids` of the engine's KV cache to host numpy arrays
    ({field: [L, K, n, ...]})."""
    return _host_pages(gather_pages(core, page_ids), len(page_ids))


def gather_pages(core, page_ids: list[int]):
    """Dispatch the gather of pages `page_ids` (a PagedKVCache of device arrays [L, K, b,
    ...], b = the page count's power-of-two bucket). Returns without waiting for it."""
    gather, _ = device_fns()
    return gather(paged_kv_of(core), _padded_ids(page_ids))


def _host_pages(gathered, num_pages: int) -> dict[str, np.ndarray]:
    import jax

    got = jax.device_get(gathered)
    return {
        name: np.asarray(getattr(got, name))[:, :, :num_pages]
        for name in KV_FIELDS
        if getattr(got, name) is not None
    }


def import_pages(core, page_ids: list[int], arrays: dict[str, np.ndarray]) -> None:
    """Write `arrays` into pages `page_ids` of the engine's KV cache (donated and replaced,
    through ModelRunner.update_kv)."""
    paged_kv_of(core)
    ids = _padded_ids(page_ids)
    pad = len(ids) - len(page_ids)

    def padded(name):
        a = arrays.get(name)
        if getattr(core.runner.state.kv, name) is None:
            return None
        if a is None:
            raise KVTransferMismatchError(name, None, "present (int8 KV)")
        if a.shape[2] == len(ids):  # already the bucket's size (on device: jax transport)
            return a
        return np.pad(a, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3))

    from engine.runner.kv_cache import PagedKVCache

    _, scatter = device_fns()
    core.runner.update_kv(scatter, ids, PagedKVCache(*(padded(name) for name in KV_FIELDS)))


def transfer_buckets(core) -> list[int]:
    """The page-count buckets a request of this engine can need: 1, 2, 4, ... up to the
    bucket of its longest request's pages (max_model_len, at most the pool)."""
    sc = core.sched_config
    most = min(core.pool.pages_for_tokens(sc.max_model_len), sc.num_pages - 1)
    return [1 << i for i in range(_bucket(max(1, most)).bit_length())]


def _zero_pages(kv, n: int, on_device: bool):
    """Zeros shaped like `n` pages of every field of `kv`, as import_pages receives them:
    host arrays (gRPC stream), or device arrays (jax transport)."""
    import jax

    from engine.runner.kv_cache import PagedKVCache

    def zeros(x):
        if x is None:
            return None
        z = np.zeros((*x.shape[:2], n, *x.shape[3:]), x.dtype)
        return jax.device_put(z, jax.devices()[0]) if on_device else z

    return PagedKVCache(*(zeros(getattr(kv, name)) for name in KV_FIELDS))


def _arrays_of(kv) -> dict:
    return {n: getattr(kv, n) for n in KV_FIELDS if getattr(kv, n) is not None}


def warm_transfer_programs(core, *, gather: bool, scatter: bool, on_device: bool = False) -> int:
    """Compile the gather (prefill side) and / or scatter (decode side) program of every
    bucket, so no transfer compiles while serving. Engine thread: the scatter replaces the
    engine's KV cache, writing zeros into the null page only (nobody reads it). Returns the
    number of programs run. `on_device`: the scatter of device arrays too (the jax transport's
    pulled pages; another jit cache entry than host arrays) and the device digest of the
    pages (engine/kv_transfer/digest.py) on either side."""
    import jax

    paged_kv_of(core)
    gather_fn, scatter_fn = device_fns()
    runner, runs = core.runner, 0
    for n in transfer_buckets(core):
        ids = np.zeros(n, np.int32)  # the null page
        if gather:
            jax.block_until_ready(gather_fn(runner.state.kv, ids))
            runs += 1
        for device in ((False, True) if on_device else (False,)) if scatter else ():
            runner.update_kv(scatter_fn, ids, _zero_pages(runner.state.kv, n, device))
            runs += 1
        if on_device:  # the jax transport's digest of the offered / pulled pages
            from engine.kv_transfer.digest import device_digest

            device_digest(_arrays_of(_zero_pages(runner.state.kv, n, True)))
            runs += 1
    jax.block_until_ready(runner.state.kv)
    return runs


# ---- whole requests ------------------------------------------------------------------------
def prefill_sampling(sampling: SamplingParams) -> SamplingParams:
    """What a prefill worker runs: the request's own sampling for its first token only
    (EOS stays banned for it when min_tokens >= 1)."""
    return dataclasses.replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1))


@dataclasses.dataclass
class PendingExport:
    """An export handed from the engine thread to the exporter thread: the metadata and the
    gathered pages on device (the gather is dispatched, maybe not yet run)."""

    meta: KVMeta
    gathered: object  # PagedKVCache of device arrays [L, K, bucket, ...]
    num_pages: int

    def finish(self) -> KVPayload:
        """Host copy (waits for the gather), trimmed to the request's pages, checksummed.
        Any thread: it touches neither the engine nor its cache."""
        arrays = _host_pages(self.gathered, self.num_pages)
        return KVPayload(self.meta, arrays, payload_checksum(self.meta, arrays))


def start_export(
    core, request, page_ids: list[int], first_logprob: TokenLogprob | None = None
) -> PendingExport:
    """Engine thread: the metadata of a request that ended after its first token (`request`
    is the scheduler's Request as the on_finish hook saw it; `page_ids` hold its prompt K/V)
    and the dispatched gather of its pages. The pages may be freed as soon as this returns:
    every later step takes the KV cache after the gather (the cache is donated), so none can
    overwrite them before they are read."""
    lp = None
    if first_logprob is not None:
        lp = (
            first_logprob.token_id,
            first_logprob.logprob,
            tuple(tuple(t) for t in first_logprob.top),
        )
    meta = KVMeta(
        request_id=request.request_id,
        token_ids=tuple(request.all_token_ids),
        num_prompt_tokens=request.num_prompt_tokens,
        kv_len=request.num_prompt_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        first_logprob=lp,
        adapter_id=request.adapter_id,
        **engine_kv_meta(core),
    )
    return PendingExport(meta, gather_pages(core, page_ids), len(page_ids))


def make_payload(
    core, request, page_ids: list[int], first_logprob: TokenLogprob | None = None
) -> KVPayload:
    """`start_export` and `finish` in one call (blocks until the pages are on the host)."""
    return start_export(core, request, page_ids, first_logprob).finish()


def can_import(core, meta: KVMeta) -> bool:
    """Room for the request now: a running slot and the pages."""
    sched = core.scheduler
    return len(sched.running) < sched.config.max_num_seqs and core.pool.can_allocate(meta.num_pages)


def import_request(
    core, er: EngineRequest, payload: KVPayload, cache_salt: str | None = None
) -> list[RequestOutput]:
    """Add `er` to `core` with the K/V of `payload` and emit its first token. Returns that
    token's delta (possibly final: EOS, max_tokens=1). Without room, or when this engine
    resolves another LoRA adapter for `er` than the sender used, `er` is added as a plain
    request (recomputed here) and [] is returned. Raises KVTransferMismatchError,
    KVChecksumError, InvalidRequestError (the prompt is not the payload's)."""
    meta = payload.meta
    check_compatible(meta, core)
    payload.verify()
    if tuple(er.prompt_token_ids) != meta.token_ids[: meta.num_prompt_tokens]:
        raise InvalidRequestError(
            "prompt_token_ids", f"<{len(er.prompt_token_ids)} tokens>", "the KV payload's prompt"
        )
    if not can_import(core, meta):
        core.add_request(er, cache_salt)
        return []
    core.add_request(er, cache_salt)
    if core.scheduler.get_request(er.request_id).adapter_id != meta.adapter_id:
        return []  # another LoRA adapter here: its K/V differ, the prompt is recomputed
    now = time.monotonic()
    page_ids = core.pool.allocate(meta.num_pages)
    if getattr(core, "offload", None) is not None:  # evicted pages to host before rewriting
        core.offload.dispatch_saves(core.runner.state.kv)
    import_pages(core, page_ids, payload.arrays)
    req = core.scheduler.adopt(er.request_id, page_ids, meta.kv_len, now)
    req.num_cached_tokens = meta.num_cached_tokens
    req.append_output_token(meta.token_ids[-1], now)
    logprobs = None
    if meta.first_logprob is not None and er.sampling.logprobs is not None:
        tok, lp, top = meta.first_logprob
        logprobs = {er.request_id: TokenLogprob(tok, lp, [tuple(t) for t in top])}
    return core.outputs.emit([req], now, logprobs)
