"""BatchBuilder.build (engine/batch/builder.py) against the per-row builder it replaced (issue 20:
the plan read in one pass, no per-row numpy stores): on random multi-step plans, with
decodes whose token the host knows or not, prefill chunks, speculative drafts, page tables
that grow between steps and slots released and reused, both give the same device batch
byte for byte."""

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.batch.builder import BatchBuilder, BatchShape, pow2_bucket, query_len_bound
from engine.sampling.params import SamplingParams
from engine.sched.request import Request
from engine.sched.scheduler import ScheduledRequest

PAGE_SIZE, MAX_PAGES, CHUNK = 4, 16, 8


def fit(needed: BatchShape) -> BatchShape:
    tp = pow2_bucket(needed.num_prefill_tokens, 16) if needed.num_prefill_tokens else 0
    return BatchShape(
        num_decode=pow2_bucket(needed.num_decode),
        num_prefill_tokens=tp,
        num_prefill_seqs=pow2_bucket(needed.num_prefill_seqs) if tp else 0,
        pages_per_seq=pow2_bucket(needed.pages_per_seq, 4, MAX_PAGES),
        max_query_len=query_len_bound(tp, CHUNK),
    )


class ReferenceBuilder(BatchBuilder):
    """The per-row build of the previous commit (one Python iteration per scheduled row,
    numpy element stores), kept as the oracle."""

    def build(self, scheduled, fit_shape=None):
        from engine.batch.builder import BuiltStep, StepBatch, chunk_token_ids  # noqa: F401

        ps, n = self.page_size, len(scheduled)
        slots, starts = np.empty(n, np.int32), np.empty(n, np.int32)
        out_index, samples = np.empty(n, np.int32), np.empty(n, bool)
        num_new, tokens = np.empty(n, np.int32), np.empty(n, np.int32)
        for i, s in enumerate(scheduled):
            req = s.request
            slot = self.slot_of[req.request_id]
            self._sync_pages(slot, req.page_ids)
            slots[i], starts[i], out_index[i], samples[i] = slot, s.start, s.output_index, s.samples
            num_new[i] = s.num_new_tokens
            if s.num_new_tokens == 1:
                known = req.all_token_ids
                tokens[i] = known[s.start] if s.start < len(known) else -1
        is_decode = num_new == 1
        d, p = np.flatnonzero(is_decode), np.flatnonzero(~is_decode)
        chunks = [scheduled[i] for i in p]
        ends = starts + num_new
        needed = BatchShape(
            num_decode=len(d),
            num_prefill_tokens=sum(s.num_new_tokens for s in chunks),
            num_prefill_seqs=len(p),
            pages_per_seq=int(-(-ends.max() // ps)),
            max_query_len=max((s.num_new_tokens for s in chunks), default=0),
        )
        shape = (fit_shape or self.fit_shape)(needed)
        batch = StepBatch.zeros(shape)
        self._fill_decode(batch, slots[d], starts[d], tokens[d])
        self._fill_prefill(batch, shape, chunks, slots[p], starts[p])
        sampler_rows = np.empty(n, np.int32)
        sampler_rows[d] = np.arange(len(d))
        sampler_rows[p] = shape.num_decode + np.arange(len(p))
        self._fill_sampling(batch, sampler_rows, slots, out_index, samples)
        return BuiltStep(
            batch,
            shape,
            sampler_rows,
            slots,
            full_sampler=bool(self.needs_full[slots].any()),
            penalties=bool(self.needs_penalties[slots].any()),
            logprobs=bool(self.needs_logprobs[slots].any()),
        )


def _builder(cls, max_num_seqs):
    return cls(
        max_num_seqs=max_num_seqs,
        max_pages_per_seq=MAX_PAGES,
        page_size=PAGE_SIZE,
        prefill_chunk_size=CHUNK,
        eos_token_ids=(2,),
        fit_shape=fit,
    )


@dataclasses.dataclass
class _Live:
    request: Request
    computed: int = 0
    pending: int = 0  # an output sampled on the "device", not appended yet
    drafted: bool = False


def _params(i: int) -> SamplingParams:
    if i % 3 == 1:
        return SamplingParams(temperature=0.7, top_k=5, seed=i, max_tokens=40)
    if i % 3 == 2:
        return SamplingParams(temperature=0.0, logprobs=2, stop_token_ids=[7], max_tokens=40)
    return SamplingParams(temperature=0.0, repetition_penalty=1.2, min_tokens=3, max_tokens=40)


def _plan(rng, live: dict, next_page: list, num_slots: int):
    """One step: admit, advance and end requests at random; returns the ScheduledRequests."""
    if len(live) < num_slots and rng.random() < 0.6:
        i = len(next_page) + 1000 * rng.integers(1, 9)
        prompt = [int(t) for t in rng.integers(3, 200, rng.integers(1, 20))]
        live[f"r{next_page[0]}-{i}"] = _Live(Request(f"r{next_page[0]}-{i}", prompt, _params(i)))
    scheduled = []
    for rid, lv in list(live.items()):
        req = lv.request
        if lv.pending and (lv.drafted or rng.random() < 0.7):  # the host learns the token
            req.append_output_token(int(rng.integers(3, 200)), 0.0)
            lv.pending = 0
        num_tokens = req.num_known_tokens + lv.pending
        if num_tokens >= MAX_PAGES * PAGE_SIZE - 8 or rng.random() < 0.1:
            del live[rid]  # ends (its slot is released by the test)
            continue
        remaining = num_tokens - lv.computed
        if remaining <= 0:
            continue
        drafts = ()
        if remaining == 1 and not lv.pending and rng.random() < 0.2:
            drafts = tuple(int(t) for t in rng.integers(3, 200, rng.integers(1, 4)))
        num_new = min(remaining, CHUNK) + len(drafts)
        need = -(-(lv.computed + num_new) // PAGE_SIZE) - len(req.page_ids)
        for _ in range(max(need, 0)):
            req.page_ids.append(next_page[0] % 500 + 1)
            next_page[0] += 1
        samples = lv.computed + num_new == num_tokens + len(drafts)
        out_index = req.num_output_tokens + lv.pending if samples else 0
        scheduled.append(ScheduledRequest(req, num_new, lv.computed, samples, out_index, drafts))
        lv.computed += num_new - len(drafts)
        lv.pending += samples
        lv.drafted = bool(drafts)  # a speculative step is synchronous: learnt next step
    return scheduled


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), num_slots=st.sampled_from([1, 3, 8]))
def test_build_equals_the_per_row_builder(seed, num_slots):
    rng = np.random.default_rng(seed)
    new, ref = _builder(BatchBuilder, num_slots), _builder(ReferenceBuilder, num_slots)
    live, next_page = {}, [0]
    for _ in range(12):
        scheduled = _plan(rng, live, next_page, num_slots)
        for rid in list(new.slot_of):
            if rid not in live:
                new.release(rid)
                ref.release(rid)
        if not scheduled:
            continue
        for k, s in enumerate(scheduled):
            assert new.assign(s.request, k) == ref.assign(s.request, k)
        a, b = new.build(scheduled), ref.build(scheduled)
        assert a.shape == b.shape
        pa, pb = a.batch.pack(), b.batch.pack()
        np.testing.assert_array_equal(pa.ints, pb.ints)
        np.testing.assert_array_equal(pa.floats, pb.floats)
        np.testing.assert_array_equal(a.sampler_rows, b.sampler_rows)
        np.testing.assert_array_equal(a.slots, b.slots)
        assert (a.full_sampler, a.penalties, a.logprobs) == (
            b.full_sampler,
            b.penalties,
            b.logprobs,
        )


def test_build_reads_known_decode_tokens_and_leaves_pending_ones_on_device():
    builder = _builder(BatchBuilder, 2)
    known = Request("known", [5, 6, 7])  # all three known: computes token 7 at position 2
    pending = Request("pending", [5, 6])  # a sampled output not yet on the host
    known.page_ids, pending.page_ids = [3], [4]
    builder.assign(known, 0)
    builder.assign(pending, 0)
    built = builder.build(
        [ScheduledRequest(known, 1, 2, True, 0), ScheduledRequest(pending, 1, 2, True, 1)]
    )
    b = built.batch
    assert b.token_ids[:2].tolist() == [7, 0]
    assert b.token_slots[:2].tolist() == [-1, builder.slot_of["pending"]]
    assert b.positions[:2].tolist() == [2, 2]
    assert b.slot_mapping[:2].tolist() == [3 * PAGE_SIZE + 2, 4 * PAGE_SIZE + 2]
