"""The one host->device boundary of a step: the scheduler's plan -> fixed-shape arrays.

A step's flat token batch has two groups, each padded to a bucket so that a handful of
shapes are ever compiled (the set is fixed at start-up: engine/runner/shapes.py):

    rows [0, Sd)        decode group: one token per sequence (query_len 1), Sd = bucket
    rows [Sd, Sd + Tp)  prefill group: chunks of up to Sp sequences, ragged, Tp = bucket

    token_ids, positions, slot_mapping, token_slots    [Sd + Tp]
    decode:  kv_lens_d [Sd], page_table_d [Sd, P]
    prefill: kv_lens_p [Sp], page_table_p [Sp, P], query_start_p [Sp + 1], num_seqs_p [1]
    logits_indices [Sd + Sp]   the row of each sequence's last new token (sampler rows:
                               decode sequences first, then prefill sequences)

Splitting the groups lets the decode rows use the decode attention (cost ~ context) and
the prefill rows the ragged attention padded to `max_query_len` per sequence, instead of
padding every decode to a prefill chunk. Padding rows write their K/V to the null page
(slot 0) and have kv_lens 0, so they read nothing.

Persistent batch state (vLLM v1's InputBatch): a request holds a *slot* in [0, max_num_seqs)
from its admission to its end or preemption. `BatchBuilder` keeps per-slot numpy rows of
the page table and the sampling parameters and writes a row only when it changes (a new
request, new pages); a step's arrays are then numpy gathers by slot, not per-row Python:
the plan is read in one pass into an [n, 6] int32 array (slot, start, new tokens, output
index, samples, known tokens; `_plan_columns`), which also writes the page-table rows that
grew, and every field is filled from it with whole-array operations.

Tokens the host does not know yet: with overlapped steps a decode's input is the token the
previous step sampled, still on the device. Such a row has `token_slots[row] = slot` and
the device step reads `last_tokens[slot]` (engine/runner/step.py); rows whose token the host knows
have `token_slots[row] = -1` and carry it in `token_ids`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

from engine.sampling.sampler import (
    MAX_MIN_TOKENS_STOP_IDS,
    SamplingTensors,
    fill_sampler_row,
    greedy_sampler_rows,
)
from engine.sched.request import Request


def pow2_bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    b = max(minimum, 1 << max(0, (n - 1)).bit_length()) if n > 0 else 0
    return b if maximum is None else min(b, max(maximum, minimum))


def query_len_bound(num_prefill_tokens: int, prefill_chunk_size: int) -> int:
    """The static per-sequence query bound of a prefill group of this token bucket."""
    return min(num_prefill_tokens, prefill_chunk_size) if num_prefill_tokens else 1


@dataclasses.dataclass(frozen=True, order=True)
class BatchShape:
    """The static shape of one step (part of the jit cache key)."""

    num_decode: int  # Sd
    num_prefill_tokens: int  # Tp
    num_prefill_seqs: int  # Sp
    pages_per_seq: int  # P
    max_query_len: int  # static bound on a prefill sequence's chunk

    def fits(self, other: BatchShape) -> bool:
        """Whether a batch needing `other` can be padded to this shape."""
        return (
            self.num_decode >= other.num_decode
            and self.num_prefill_tokens >= other.num_prefill_tokens
            and self.num_prefill_seqs >= other.num_prefill_seqs
            and self.pages_per_seq >= other.pages_per_seq
            and self.max_query_len >= other.max_query_len
        )


@jax.tree_util.register_dataclass  # every field is data (inferred)
@dataclasses.dataclass
class StepBatch:
    token_ids: np.ndarray  # [Sd + Tp] int32
    token_slots: np.ndarray  # [Sd + Tp] int32: -1, or the slot whose last sampled token it is
    positions: np.ndarray  # [Sd + Tp] int32
    slot_mapping: np.ndarray  # [Sd + Tp] int32
    kv_lens_d: np.ndarray  # [Sd] int32
    page_table_d: np.ndarray  # [Sd, P] int32
    kv_lens_p: np.ndarray  # [Sp] int32
    page_table_p: np.ndarray  # [Sp, P] int32
    query_start_p: np.ndarray  # [Sp + 1] int32
    num_seqs_p: np.ndarray  # [1] int32
    logits_indices: np.ndarray  # [Sd + Sp] int32
    sample_mask: np.ndarray  # [Sd + Sp] bool (int32 0/1 on the host): samples this step
    slot_ids: np.ndarray  # [Sd + Sp] int32: persistent slot (penalty state, last token)
    sampling: SamplingTensors  # rows [Sd + Sp]

    @classmethod
    def zeros(cls, shape: BatchShape) -> StepBatch:
        """An all-padding batch of `shape` (no sequence; every token writes the null page).
        Its arrays are views into the two flat buffers of `pack()`, so filling them fills
        the buffers and a step sends two arrays to the device, not 25."""
        ints_layout, floats_layout = _layout(shape)
        template_ints, template_floats = _padding_buffers(shape)
        ints, floats = template_ints.copy(), template_floats.copy()  # host time (#20)
        v = {**_views(ints, ints_layout, np), **_views(floats, floats_layout, np)}
        v["key_data"] = v["key_data"].view(np.uint32)
        return cls._from_views(v)

    @classmethod
    def _from_views(cls, v: dict) -> StepBatch:
        sampling = SamplingTensors(**{f: v[f] for f in _SAMPLING_FIELDS})
        return cls(**{f: v[f] for f in _BATCH_FIELDS}, sampling=sampling)

    def pack(self) -> PackedBatch:
        """The batch as (int32, float32) flat buffers: the ones it views when it was made by
        `zeros`, else a copy."""
        base = self.token_ids.base
        if base is not None and all(
            getattr(self, f).base is base for f in ("positions", "slot_ids")
        ):
            return PackedBatch(base, self.sampling.temperature.base)
        ints = [np.asarray(getattr(self, f)).astype(np.int32).ravel() for f in _INT_FIELDS]
        ints += [
            np.asarray(getattr(self.sampling, f)).view(np.int32).ravel()
            if f == "key_data"
            else np.asarray(getattr(self.sampling, f), np.int32).ravel()
            for f in _INT_SAMPLING_FIELDS
        ]
        floats = [np.asarray(getattr(self.sampling, f), np.float32) for f in _FLOAT_FIELDS]
        return PackedBatch(np.concatenate(ints), np.concatenate(floats))


_INT_FIELDS = (
    "token_ids",
    "token_slots",
    "positions",
    "slot_mapping",
    "kv_lens_d",
    "page_table_d",
    "kv_lens_p",
    "page_table_p",
    "query_start_p",
    "num_seqs_p",
    "logits_indices",
    "sample_mask",
    "slot_ids",
)
_INT_SAMPLING_FIELDS = ("top_k", "key_data", "step", "min_tokens", "stop_ids")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_BATCH_FIELDS = _INT_FIELDS
_SAMPLING_FIELDS = _INT_SAMPLING_FIELDS + _FLOAT_FIELDS


@functools.lru_cache(maxsize=1024)
def _layout(shape: BatchShape) -> tuple[list, list]:
    """(name, shape) of each field in the int32 and the float32 buffer, in order."""
    Sd, Sp, P = shape.num_decode, shape.num_prefill_seqs, shape.pages_per_seq
    T, R = Sd + shape.num_prefill_tokens, Sd + Sp
    ints = [
        ("token_ids", (T,)),
        ("token_slots", (T,)),
        ("positions", (T,)),
        ("slot_mapping", (T,)),
        ("kv_lens_d", (Sd,)),
        ("page_table_d", (Sd, P)),
        ("kv_lens_p", (Sp,)),
        ("page_table_p", (Sp, P)),
        ("query_start_p", (Sp + 1,)),
        ("num_seqs_p", (1,)),
        ("logits_indices", (R,)),
        ("sample_mask", (R,)),
        ("slot_ids", (R,)),
        ("top_k", (R,)),
        ("key_data", (R, 2)),
        ("step", (R,)),
        ("min_tokens", (R,)),
        ("stop_ids", (R, MAX_MIN_TOKENS_STOP_IDS)),
    ]
    return ints, [(f, (R,)) for f in _FLOAT_FIELDS]


@functools.lru_cache(maxsize=1024)
def _padding_buffers(shape: BatchShape) -> tuple[np.ndarray, np.ndarray]:
    """The (int32, float32) buffers of an all-padding batch of `shape`: zeros, but
    token_slots and stop_ids -1, top_p and repetition_penalty 1 (read-only: copy them)."""
    ints_layout, floats_layout = _layout(shape)
    ints = np.zeros(_layout_size(ints_layout), np.int32)
    floats = np.zeros(_layout_size(floats_layout), np.float32)
    v = {**_views(ints, ints_layout, np), **_views(floats, floats_layout, np)}
    v["token_slots"][:] = -1
    v["stop_ids"][:] = -1
    v["top_p"][:] = 1.0
    v["repetition_penalty"][:] = 1.0
    ints.flags.writeable = floats.flags.writeable = False
    return ints, floats


def _layout_size(layout) -> int:
    return sum(math.prod(s) for _, s in layout)


def _views(buf, layout, xp) -> dict:
    """Field name -> buf[offset : offset + size].reshape(shape) (numpy views, or jnp slices)."""
    out, offset = {}, 0
    for name, s in layout:
        size = math.prod(s)
        out[name] = buf[offset : offset + size].reshape(s)
        offset += size
    return out


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ints", "floats"], meta_fields=[])
@dataclasses.dataclass
class PackedBatch:
    """A StepBatch as two flat buffers (one host->device copy each); see `StepBatch.pack`."""

    ints: np.ndarray  # [N] int32 (uint32 key data and the bool mask stored as int32)
    floats: np.ndarray  # [6 * (Sd + Sp)] float32

    def unpack(self, shape: BatchShape) -> StepBatch:
        """Inside the jitted step: the StepBatch of `shape` (static slices)."""
        import jax.numpy as jnp

        ints_layout, floats_layout = _layout(shape)
        v = {**_views(self.ints, ints_layout, jnp), **_views(self.floats, floats_layout, jnp)}
        v["key_data"] = jax.lax.bitcast_convert_type(v["key_data"], jnp.uint32)
        v["sample_mask"] = v["sample_mask"] != 0
        return StepBatch._from_views(v)


@dataclasses.dataclass
class BuiltStep:
    """A built step: the device batch, its shape, and where each scheduled request's token
    comes back (`sampler_rows[i]` for `plan.scheduled[i]`)."""

    batch: StepBatch
    shape: BatchShape
    sampler_rows: np.ndarray  # [len(scheduled)] int32, row of the packed result
    slots: np.ndarray  # [len(scheduled)] int32, the request's slot when built
    full_sampler: bool  # some row samples or wants logprobs (else the greedy variant)
    penalties: bool  # some row uses repetition/presence/frequency penalties
    logprobs: bool  # some row wants logprobs


class BatchBuilder:
    """Per-slot state that outlives a step, and the step's arrays gathered from it.

    `fit_shape(needed) -> BatchShape` picks the compiled shape a batch is padded to
    (engine/runner/shapes.py), so this module decides no bucket itself. `take_slot(request)`,
    when set, is called by `build` for a scheduled request without a slot (the engine
    assigns it, binds its adapter, resets its penalty row); without it such a request is
    a KeyError."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_pages_per_seq: int,
        page_size: int,
        prefill_chunk_size: int,
        eos_token_ids: Sequence[int],
        fit_shape: Callable[[BatchShape], BatchShape],
    ):
        S = max_num_seqs
        self.page_size = page_size
        self.prefill_chunk_size = prefill_chunk_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.fit_shape = fit_shape
        self.take_slot: Callable[[Request], object] | None = None
        self.page_table = np.zeros((S, max_pages_per_seq), np.int32)  # [S, P_max]
        self.num_pages = [0] * S  # [S] filled entries of each row (a list: read per row)
        self.sampling = greedy_sampler_rows(S)  # field -> [S] (or [S, n]) per-slot parameters
        # host time (#20): the float fields are the rows of one [F, S] array, in the order
        # of a batch's float buffer, so a step gathers and stores them in one operation
        self._floats = np.stack([self.sampling[f] for f in _FLOAT_FIELDS])  # [F, S]
        for i, f in enumerate(_FLOAT_FIELDS):
            self.sampling[f] = self._floats[i]  # a view: fill_sampler_row writes through it
        # the others but `step` (each step's output index, set from the plan)
        self._int_sampling = [
            (f, v) for f, v in self.sampling.items() if f not in _FLOAT_FIELDS and f != "step"
        ]
        # [S] per-slot needs that pick the compiled sampler variant (engine/runner/programs.py), the
        # rows of one [3, S] array (one gather per step)
        self._needs = np.zeros((3, S), bool)
        self.needs_full, self.needs_penalties, self.needs_logprobs = self._needs
        self.slot_of: dict[str, int] = {}
        self._free_slots = list(range(S - 1, -1, -1))

    # ---- slots ------------------------------------------------------------------------------
    def assign(self, req: Request, seed: int) -> tuple[int, bool]:
        """The request's slot, writing its sampling row when new; (slot, is_new)."""
        slot = self.slot_of.get(req.request_id)
        if slot is not None:
            return slot, False
        slot = self._free_slots.pop()
        self.slot_of[req.request_id] = slot
        self.num_pages[slot] = 0
        p = req.sampling
        fill_sampler_row(self.sampling, slot, p, 0, seed, self.eos_token_ids)
        self.needs_logprobs[slot] = p.logprobs is not None
        self.needs_full[slot] = not p.greedy or p.logprobs is not None
        self.needs_penalties[slot] = (
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        )
        return slot, True

    def release(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def trim_pages(self, request_id: str, num_pages: int) -> None:
        """The request's page table row keeps at most `num_pages` entries (its pages were
        cut: a speculative step's rejected lookahead, Scheduler.roll_back_drafts)."""
        slot = self.slot_of.get(request_id)
        if slot is not None:
            self.num_pages[slot] = min(int(self.num_pages[slot]), num_pages)

    def _sync_pages(self, slot: int, page_ids: list[int]) -> None:
        n = self.num_pages[slot]
        if len(page_ids) > n:  # a request's page table only grows while it holds a slot
            self.page_table[slot, n : len(page_ids)] = page_ids[n:]
            self.num_pages[slot] = len(page_ids)

    # ---- one step ---------------------------------------------------------------------------
    def build(self, scheduled, fit_shape: Callable | None = None) -> BuiltStep:
        """`scheduled`: the plan's ScheduledRequest list (each request holds a slot);
        `fit_shape` overrides the builder's (speculative steps: engine/spec/decode.py)."""
        ps = self.page_size
        cols = self._plan_columns(scheduled)  # [n, 6]
        slots, starts, num_new, out_index = cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3]
        samples = cols[:, 4].astype(bool)
        is_decode = num_new == 1
        d = np.flatnonzero(is_decode)
        p = np.flatnonzero(~is_decode)
        # decode rows: the input token when the host knows it, else -1 (on the device)
        tokens = np.full(len(d), -1, np.int32)
        for j in np.flatnonzero(starts[d] < cols[d, 5]).tolist():
            i = int(d[j])
            tokens[j] = scheduled[i].request.all_token_ids[int(starts[i])]
        chunks = [scheduled[i] for i in p.tolist()]
        ends = starts + num_new
        needed = BatchShape(
            num_decode=len(d),
            num_prefill_tokens=int(num_new[p].sum()),
            num_prefill_seqs=len(p),
            pages_per_seq=int(-(-ends.max() // ps)),
            max_query_len=int(num_new[p].max()) if len(p) else 0,
        )
        shape = (fit_shape or self.fit_shape)(needed)
        batch = StepBatch.zeros(shape)
        self._fill_decode(batch, slots[d], starts[d], tokens)
        self._fill_prefill(batch, shape, chunks, slots[p], starts[p])
        Sd = shape.num_decode
        sampler_rows = np.empty(len(cols), np.int32)
        sampler_rows[d] = np.arange(len(d))
        sampler_rows[p] = Sd + np.arange(len(p))
        self._fill_sampling(batch, sampler_rows, slots, out_index, samples)
        full_sampler, penalties, logprobs = self._needs[:, slots].any(axis=1).tolist()
        return BuiltStep(
            batch,
            shape,
            sampler_rows,
            slots,
            full_sampler=full_sampler,
            penalties=penalties,
            logprobs=logprobs,
        )

    def _plan_columns(self, scheduled) -> np.ndarray:
        """[n, 6] int32 (slot, start, num_new_tokens, output_index, samples, known tokens)
        of each scheduled request, in one pass that also writes the page-table rows that
        grew (host time, #20: no per-row numpy stores)."""
        slot_of, num_pages, flat = self.slot_of, self.num_pages, []
        extend = flat.extend
        for s in scheduled:
            req = s.request
            slot = slot_of.get(req.request_id)
            if slot is None:  # host time (#20): slot work only for new requests, here
                slot = self._new_slot(req)
            if len(req.page_ids) != num_pages[slot]:
                self._sync_pages(slot, req.page_ids)
            # known tokens = req.num_known_tokens, without the property call (host time)
            known = len(req.prompt_token_ids) + len(req.output_token_ids)
            extend((slot, s.start, s.num_new_tokens, s.output_index, s.samples, known))
        return np.array(flat, np.int32).reshape(-1, 6)

    def _new_slot(self, req: Request) -> int:
        if self.take_slot is None:
            raise KeyError(req.request_id)
        self.take_slot(req)
        return self.slot_of[req.request_id]

    def _fill_decode(self, b: StepBatch, slots, starts, tokens) -> None:
        nd, ps, P = len(slots), self.page_size, b.page_table_d.shape[1]
        if not nd:
            return
        pending = tokens < 0
        b.token_ids[:nd] = np.where(pending, 0, tokens)
        b.token_slots[:nd] = np.where(pending, slots, -1)
        b.positions[:nd] = starts
        b.slot_mapping[:nd] = self.page_table[slots, starts // ps] * ps + starts % ps
        b.kv_lens_d[:nd] = starts + 1
        b.page_table_d[:nd] = self.page_table[slots, :P]
        b.logits_indices[:nd] = np.arange(nd)

    def _fill_prefill(self, b: StepBatch, shape: BatchShape, chunks, slots, starts) -> None:
        if not chunks:
            return
        ps, P, Sd = self.page_size, shape.pages_per_seq, shape.num_decode
        lens = np.array([s.num_new_tokens for s in chunks], np.int32)
        qs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)  # [n + 1]
        T = int(qs[-1])
        rows = Sd + np.arange(T)
        seq = np.repeat(np.arange(len(chunks)), lens)  # [T] chunk of each token
        pos = starts[seq] + (np.arange(T) - qs[seq])  # [T]
        b.token_ids[rows] = np.concatenate([chunk_token_ids(s) for s in chunks])
        b.positions[rows] = pos
        b.slot_mapping[rows] = self.page_table[slots[seq], pos // ps] * ps + pos % ps
        n = len(chunks)
        b.kv_lens_p[:n] = starts + lens
        b.page_table_p[:n] = self.page_table[slots, :P]
        b.query_start_p[: n + 1] = qs
        b.query_start_p[n + 1 :] = T
        b.num_seqs_p[0] = n
        b.logits_indices[Sd : Sd + n] = Sd + qs[1:] - 1

    def _fill_sampling(self, b: StepBatch, rows, slots, out_index, samples) -> None:
        b.sample_mask[rows] = samples
        b.slot_ids[rows] = slots
        t = b.sampling
        for name, per_slot in self._int_sampling:
            getattr(t, name)[rows] = per_slot[slots]
        t.step[rows] = out_index
        # NOTE: a batch made by StepBatch.zeros views one float buffer holding the float
        # fields one after another ([F, R], _layout): all of them in one store
        floats = t.temperature.base.reshape(len(_FLOAT_FIELDS), -1)  # [F, Sd + Sp]
        floats[:, rows] = self._floats[:, slots]


def chunk_token_ids(s) -> list[int]:
    """The token ids a prefill-group sequence computes this step: known tokens, then (for a
    speculating decode, engine/spec/decode.py) its drafted tokens."""
    ids = s.request.all_token_ids[s.start : s.start + s.num_new_tokens]
    return ids + list(s.spec_token_ids) if s.spec_token_ids else ids
