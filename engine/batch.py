"""The one host->device boundary of a step: the scheduler's plan -> fixed-shape arrays.

A step's flat token batch has two groups, each padded to a bucket so that a handful of
shapes are ever compiled:

    rows [0, Sd)        decode group: one token per sequence (query_len 1), Sd = bucket
    rows [Sd, Sd + Tp)  prefill group: chunks of up to Sp sequences, ragged, Tp = bucket

    token_ids, positions, slot_mapping    [Sd + Tp]
    decode:  kv_lens_d [Sd], page_table_d [Sd, P]
    prefill: kv_lens_p [Sp], page_table_p [Sp, P], query_start_p [Sp + 1], num_seqs_p [1]
    logits_indices [Sd + Sp]   the row of each sequence's last new token (sampler rows:
                               decode sequences first, then prefill sequences)

Splitting the groups lets the decode rows use the decode attention (cost ~ context) and
the prefill rows the ragged attention padded to `max_query_len` per sequence, instead of
padding every decode to a prefill chunk. Padding rows write their K/V to the null page
(slot 0) and have kv_lens 0, so they read nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from engine.sampling import SamplingTensors


def pow2_bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    b = max(minimum, 1 << max(0, (n - 1)).bit_length()) if n > 0 else 0
    return b if maximum is None else min(b, max(maximum, minimum))


def query_len_bound(num_prefill_tokens: int, prefill_chunk_size: int) -> int:
    """The static per-sequence query bound of a prefill group of this token bucket."""
    return min(num_prefill_tokens, prefill_chunk_size) if num_prefill_tokens else 1


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The static shape of one step (part of the jit cache key)."""

    num_decode: int  # Sd
    num_prefill_tokens: int  # Tp
    num_prefill_seqs: int  # Sp
    pages_per_seq: int  # P
    max_query_len: int  # static bound on a prefill sequence's chunk


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "token_ids",
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
        "sampling",
    ],
    meta_fields=[],
)
@dataclasses.dataclass
class StepBatch:
    token_ids: np.ndarray  # [Sd + Tp] int32
    positions: np.ndarray  # [Sd + Tp] int32
    slot_mapping: np.ndarray  # [Sd + Tp] int32
    kv_lens_d: np.ndarray  # [Sd] int32
    page_table_d: np.ndarray  # [Sd, P] int32
    kv_lens_p: np.ndarray  # [Sp] int32
    page_table_p: np.ndarray  # [Sp, P] int32
    query_start_p: np.ndarray  # [Sp + 1] int32
    num_seqs_p: np.ndarray  # [1] int32
    logits_indices: np.ndarray  # [Sd + Sp] int32
    sample_mask: np.ndarray  # [Sd + Sp] bool: the row's sequence samples a token this step
    slot_ids: np.ndarray  # [Sd + Sp] int32: persistent slot (penalty state row)
    sampling: SamplingTensors  # rows [Sd + Sp]


@dataclasses.dataclass
class BatchRow:
    """Host bookkeeping for one sequence in the batch."""

    request_id: str
    sampler_row: int
    samples: bool


def _page_row(page_ids: list[int], num_tokens: int, page_size: int, width: int) -> np.ndarray:
    row = np.zeros(width, np.int32)
    n = -(-num_tokens // page_size)
    row[:n] = page_ids[:n]
    return row


def build_batch(
    scheduled,
    page_size: int,
    *,
    max_prefill_tokens: int,
    prefill_chunk_size: int,
    max_pages_per_seq: int,
    slot_of: dict[str, int],
    seed_of: dict[str, int],
    eos_token_ids: tuple[int, ...],
) -> tuple[StepBatch, BatchShape, list[BatchRow]]:
    """`scheduled`: the scheduler's ScheduledRequest list. Returns numpy arrays."""
    decodes = [s for s in scheduled if s.num_new_tokens == 1]
    prefills = [s for s in scheduled if s.num_new_tokens > 1]
    n_prefill_tokens = sum(s.num_new_tokens for s in prefills)
    max_pages = max(-(-(s.start + s.num_new_tokens) // page_size) for s in scheduled)
    shape = BatchShape(
        num_decode=pow2_bucket(len(decodes)),
        num_prefill_tokens=pow2_bucket(n_prefill_tokens, 16, max_prefill_tokens),
        num_prefill_seqs=pow2_bucket(len(prefills)),
        pages_per_seq=pow2_bucket(max_pages, 4, max_pages_per_seq),
        max_query_len=0,
    )
    # NOTE: max_query_len is tied to the prefill token bucket (not to the longest chunk) so
    # it adds no dimension to the set of compiled shapes.
    shape = dataclasses.replace(
        shape, max_query_len=query_len_bound(shape.num_prefill_tokens, prefill_chunk_size)
    )
    Sd, Tp, Sp, P = (
        shape.num_decode,
        shape.num_prefill_tokens,
        shape.num_prefill_seqs,
        shape.pages_per_seq,
    )
    T, R = Sd + Tp, Sd + Sp
    token_ids, positions, slots = (np.zeros(T, np.int32) for _ in range(3))
    kv_lens_d, kv_lens_p = np.zeros(Sd, np.int32), np.zeros(Sp, np.int32)
    page_table_d, page_table_p = np.zeros((Sd, P), np.int32), np.zeros((Sp, P), np.int32)
    query_start_p = np.zeros(Sp + 1, np.int32)
    logits_indices, slot_ids = np.zeros(R, np.int32), np.zeros(R, np.int32)
    sample_mask = np.zeros(R, bool)
    rows: list[BatchRow] = []
    params, out_lens, seeds = [None] * R, [0] * R, [None] * R

    def fill_tokens(s, first_row: int) -> None:
        req, n = s.request, s.num_new_tokens
        pos = np.arange(s.start, s.start + n, dtype=np.int32)
        token_ids[first_row : first_row + n] = req.all_token_ids[s.start : s.start + n]
        positions[first_row : first_row + n] = pos
        pages = np.asarray(req.page_ids, np.int32)
        slots[first_row : first_row + n] = pages[pos // page_size] * page_size + pos % page_size

    def fill_row(s, r: int, token_row: int) -> None:
        req = s.request
        logits_indices[r] = token_row
        sample_mask[r] = s.samples
        slot_ids[r] = slot_of[req.request_id]
        params[r], out_lens[r], seeds[r] = (
            req.sampling,
            req.num_output_tokens,
            seed_of[req.request_id],
        )
        rows.append(BatchRow(req.request_id, r, s.samples))

    for i, s in enumerate(decodes):
        fill_tokens(s, i)
        kv_lens_d[i] = s.start + 1
        page_table_d[i] = _page_row(s.request.page_ids, s.start + 1, page_size, P)
        fill_row(s, i, i)
    row = Sd
    for j, s in enumerate(prefills):
        fill_tokens(s, row)
        end = s.start + s.num_new_tokens
        kv_lens_p[j] = end
        page_table_p[j] = _page_row(s.request.page_ids, end, page_size, P)
        query_start_p[j + 1] = query_start_p[j] + s.num_new_tokens
        row += s.num_new_tokens
        fill_row(s, Sd + j, row - 1)
    query_start_p[len(prefills) + 1 :] = query_start_p[len(prefills)]
    sampling = SamplingTensors.from_params(params, out_lens, seeds, R, eos_token_ids)
    batch = StepBatch(
        token_ids,
        positions,
        slots,
        kv_lens_d,
        page_table_d,
        kv_lens_p,
        page_table_p,
        query_start_p,
        np.array([len(prefills)], np.int32),
        logits_indices,
        sample_mask,
        slot_ids,
        sampling,
    )
    return batch, shape, rows
