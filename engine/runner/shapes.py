"""The set of step shapes an engine compiles: fixed at start-up, at most `max_shapes`, and
always enough.

A step's shape (engine/batch/builder.py `BatchShape`) is

    Sd decode rows  x  Tp prefill tokens  x  Sp prefill sequences  x  P page-table width

each on a power-of-two ladder (Sd: 1..max_num_seqs, Tp: 16..max_num_batched_tokens,
Sp: 1..min(max_num_seqs, Tp / 2), P: 4..max_pages_per_seq), and max_query_len a function
of Tp. The full product (`reachable_shapes`) runs into the thousands for a server config
(1,896 for 32 sequences, 512 tokens, 8,192-token context), too many to compile before
serving. So an engine fixes a `ShapeSet` at start-up (at most `max_shapes` shapes) and pads
every batch to the cheapest shape of the set that fits it (`ShapeSet.fit`): no step ever
needs a shape outside the set, so after warming the set (engine/runner/warmup.py) nothing
compiles while serving.

How the set is chosen (`step_shapes`): two groups of shapes,

    decode-only:  Sd rungs x P rungs                      (most steps while serving)
    with prefill: Sd rungs (0 too) x Tp rungs x Sp rungs(Tp) x P rungs

where each of the six ladders (decode Sd, decode P, prefill Sd, Tp, Sp, prefill P) keeps
every e-th rung from the bottom plus its top (`_every`; ratio 2**e between kept rungs; e
past the ladder's length keeps only the top). Starting from every rung (e = 1), the
exponent of one ladder at a time is raised, each time the one that removes the most shapes
per unit of expected padding cost (`_padding_cost`), until the set fits `max_shapes`. At
the coarsest, two shapes are left (the largest decode-only step and the largest step), so
any `max_shapes >= 2` is honoured and the largest shape is always in the set. The expected
padding cost is the mean of `step_cost(fit) / step_cost(needed)` over a fixed sample of
needed shapes drawn from a prior that favours short contexts and small prefills, as chat
traffic does (`_needs_sample`; NOTE: a prior, not a measured trace; the figures of what it
costs are in benchmarks/RESULTS.md). Padding never changes a result: padding rows write the
null page and read nothing.

Two additions on every level but the coarsest (issue 39): each prefill (Sd, Tp, P) rung
keeps Sp = 1 beside its thinned Sp rungs, and `_lone_prefill_shapes` adds one shape per Tp
rung up to the chunk for a fresh prompt computed alone (Sd 0, Sp 1, the narrowest page
table). Measured: a 130-token prompt alone padded to (32, 256, 32, 32) took 1.1-1.4 s, to
(0, 128, 1, 8) 0.2-0.4 s; Sp padding multiplies the reference ragged attention's query
blocks, decode-row padding costs little (benchmarks/RESULTS.md, "Served path").

`ShapeSet.fit` orders the candidates by an estimate of a step's cost: tokens through the
weights plus attended key positions divided by `ATTENTION_POSITIONS_PER_TOKEN` (a decode
row reads P * page_size positions, a prefill sequence max_query_len x that). The ratio is
the model-independent order of magnitude of (FLOPs per token) / (FLOPs per attended
position) for the models served here (~4,000 for SmolLM2-135M).

Attention whose work follows the real lengths (`padded_attention=False`): the CPU loops of
pallas_kernels/cpu_kernels.py stop at the last real query block and the last real cache
chunk, so Sp and P padding cost them (almost) nothing, and a set that keeps only the top P
rung (and thinned Sp rungs) holds every batch at the price of its tokens alone. Such an
engine costs a shape by its tokens (`step_cost`) and takes the first of `BOUNDED_LEVELS`
that fits, where both P ladders are at their top: for the server's default config 33 shapes
and 39 step programs instead of 54 and 70, so a cold start compiles about half as much
(benchmarks/RESULTS.md, "CPU attention loops"). The reference and the Pallas kernels keep
the padded model (the Pallas kernels' grids are also bounded by the lengths, but their
padding costs on an accelerator have not been measured here).

Sampler variants (`sampler_variants`): a decode-only shape is built twice, "greedy" (argmax
only: every row greedy, no logprobs, no penalties, no token bitmask) and "full" (sampling,
top-k/top-p, logprobs, penalties and structured output's bitmask, all in one program; the
penalty and bitmask passes are exact no-ops for rows that do not use them). A shape with a
prefill is built "full" only: its step is dominated by the prefill, so the full sampler's
few milliseconds over Sd + Sp rows cost little there. So a set of D decode-only and M
prefill shapes is 2D + M step programs.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from engine.batch.builder import BatchShape, pow2_bucket, query_len_bound

ATTENTION_POSITIONS_PER_TOKEN = 4096
DEFAULT_MAX_SHAPES = 56
MIN_PREFILL_TOKENS = 16
MIN_PAGES = 4


def _ladder(lo: int, hi: int) -> list[int]:
    """Powers of two from lo up to hi, hi included (hi need not be a power of two)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi] if hi >= lo else out


def _ladders(sched_config) -> tuple[list[int], list[int], list[int]]:
    sc = sched_config
    seqs = _ladder(1, pow2_bucket(sc.max_num_seqs))
    max_tp = pow2_bucket(sc.max_num_batched_tokens, MIN_PREFILL_TOKENS, sc.max_num_batched_tokens)
    tokens = _ladder(MIN_PREFILL_TOKENS, max_tp)
    pages = _ladder(MIN_PAGES, pow2_bucket(sc.max_pages_per_seq, MIN_PAGES, sc.max_pages_per_seq))
    return seqs, tokens, pages


def _prefill_seqs(seqs: list[int], tp: int) -> list[int]:
    """Sp rungs for a prefill bucket of tp tokens (a prefill chunk has >= 2 tokens)."""
    return [s for s in seqs if s <= max(1, tp // 2)]


def _shape(sd: int, tp: int, sp: int, p: int, chunk: int) -> BatchShape:
    return BatchShape(sd, tp, sp, p, query_len_bound(tp, chunk))


def reachable_shapes(sched_config) -> list[BatchShape]:
    """Every shape a bucketed batch of this config can have (the full product)."""
    seqs, tokens, pages = _ladders(sched_config)
    chunk = sched_config.prefill_chunk_size
    shapes = [_shape(sd, 0, 0, p, chunk) for sd, p in itertools.product(seqs, pages)]
    for sd, tp, p in itertools.product([0, *seqs], tokens, pages):
        shapes += [_shape(sd, tp, sp, p, chunk) for sp in _prefill_seqs(seqs, tp)]
    return sorted(shapes)


DECODE_SD, DECODE_P, PREFILL_SD, PREFILL_TP, PREFILL_SP, PREFILL_P = range(6)
NUM_NEEDS_SAMPLED = 512


def _every(ladder: list[int], e: int) -> list[int]:
    """Every e-th rung from the bottom plus the top; only the top once e >= len(ladder)."""
    if e >= len(ladder):
        return ladder[-1:]
    return sorted(set(ladder[::e]) | {ladder[-1]})


def _shapes_at(sched_config, e: tuple[int, ...]) -> list[BatchShape]:
    """The set of one choice of ladder exponents (see the module docstring)."""
    seqs, tokens, pages = _ladders(sched_config)
    chunk = sched_config.prefill_chunk_size
    decode = itertools.product(_every(seqs, e[DECODE_SD]), _every(pages, e[DECODE_P]))
    shapes = [_shape(sd, 0, 0, p, chunk) for sd, p in decode]
    sds = _every(seqs, e[PREFILL_SD])
    sds = sds if e[PREFILL_SD] >= len(seqs) else [0, *sds]  # pure prefill steps too
    for sd, tp, p in itertools.product(
        sds, _every(tokens, e[PREFILL_TP]), _every(pages, e[PREFILL_P])
    ):
        sps = _prefill_seqs(seqs, tp)
        # Sp = 1 is kept on every level but the coarsest: one prompt beside the decodes is
        # the common prefill step, and padding it to Sp = 32 sequences cost 2.3x its step
        # (benchmarks/RESULTS.md, "Served path", 2026-12-04).
        kept = set(_every(sps, e[PREFILL_SP])) | ({sps[0]} if any(x < TOP for x in e) else set())
        shapes += [_shape(sd, tp, sp, p, chunk) for sp in sorted(kept)]
    if any(x < TOP for x in e):
        shapes += _lone_prefill_shapes(sched_config)
    return sorted(set(shapes))


def _lone_prefill_shapes(sched_config) -> list[BatchShape]:
    """A fresh prompt computed alone (no decode row, one sequence) for every Tp rung up to
    the prefill chunk, with the narrowest page table that holds it: a short prompt at low
    concurrency pays for its own tokens, not for the largest prefill shape (issue 39)."""
    seqs, tokens, pages = _ladders(sched_config)
    chunk = sched_config.prefill_chunk_size
    out = []
    for tp in tokens:
        if tp > pow2_bucket(chunk, MIN_PREFILL_TOKENS):
            break
        need = -(-tp // sched_config.page_size)
        p = next((p for p in pages if p >= need), pages[-1])
        out.append(_shape(0, tp, 1, p, chunk))
    return out


def _needs_sample(sched_config) -> np.ndarray:
    """[NUM_NEEDS_SAMPLED, 5] bucketed shapes a server needs, drawn (fixed seed) from a prior:
    3 of 4 steps decode-only; rung i of the P, Tp and Sp ladders weighted 2**-i (short
    contexts and small prefills are the common case); Sd uniform over its rungs."""
    seqs, tokens, pages = _ladders(sched_config)
    every = reachable_shapes(sched_config)
    rank = {n: i for ladder in (tokens, pages) for i, n in enumerate(ladder)}
    seq_rank = {n: i for i, n in enumerate(seqs)}

    def weight(s: BatchShape) -> float:
        w = 0.5 ** rank[s.pages_per_seq]
        if s.num_prefill_tokens == 0:
            return 0.75 * w
        return 0.25 * w * 0.5 ** (rank[s.num_prefill_tokens] + seq_rank[s.num_prefill_seqs])

    weights = np.array([weight(s) for s in every])
    rng = np.random.default_rng(0)
    picked = rng.choice(len(every), NUM_NEEDS_SAMPLED, p=weights / weights.sum())
    return np.array([dataclasses.astuple(every[i]) for i in picked])


def _padding_cost(
    shapes: list[BatchShape], needs: np.ndarray, page_size: int, padded_attention: bool = True
) -> float:
    """Mean step_cost(fit) / step_cost(need) over `needs` (vectorized ShapeSet.fit)."""
    have = np.array([dataclasses.astuple(s) for s in shapes])  # [N, 5]
    fits = (have[None, :, :] >= needs[:, None, :]).all(-1)  # [M, N]
    cost = np.array([step_cost(s, page_size, padded_attention) for s in shapes])  # [N]
    fit_cost = np.where(fits, cost[None, :], np.inf).min(1)  # [M]
    own = np.array([step_cost(BatchShape(*n), page_size, padded_attention) for n in needs])
    return float((fit_cost / own).mean())


TOP = 99  # an exponent past every ladder: only its top rung
# Exponents (decode Sd, decode P, prefill Sd, Tp, Sp, prefill P), finest first; step_shapes
# takes the first level that fits. Prefill steps are coarsened first (their padding is a
# smaller share of a bigger step), their Sd first of all: a step with a prefill carries
# every decode row the set allows. Tp keeps a ratio of 4 as long as it can (a short prompt
# arriving alone is padded to at most 4x its tokens); Sp and P last, as their padding
# multiplies the attention work. Each level's size and modelled padding cost for the
# server's default config are in benchmarks/RESULTS.md.
LEVELS = (
    (1, 1, 1, 1, 1, 1),
    (1, 1, 2, 1, 2, 1),
    (1, 1, TOP, 1, 2, 2),
    (1, 2, TOP, 1, 2, 2),
    (1, 2, TOP, 2, 2, 2),
    (1, 2, TOP, 2, 2, 3),
    (1, 3, TOP, 2, 2, 3),
    (2, 3, TOP, 2, 2, 3),
    (2, 3, TOP, 2, 3, 3),
    (2, 3, TOP, 2, 3, 4),
    (2, 3, TOP, 3, 3, 4),
    (2, 3, TOP, 2, TOP, 3),
    (2, 3, TOP, 3, TOP, 3),
    (2, 3, TOP, 3, TOP, 4),
    (3, 4, TOP, 3, TOP, 4),
    (3, 4, TOP, TOP, TOP, 4),
    (TOP,) * 6,  # the largest decode-only step and the largest step
)


# The same exponents for attention bounded by the real lengths: P padding is free, so both P
# ladders keep only their top from the first level; then prefill Sd, Sp and Tp as above.
BOUNDED_LEVELS = (
    (1, TOP, 1, 1, 1, TOP),
    (1, TOP, 2, 1, 2, TOP),
    (1, TOP, TOP, 1, 2, TOP),
    (1, TOP, TOP, 2, 2, TOP),
    (1, TOP, TOP, 2, TOP, TOP),
    (2, TOP, TOP, 2, TOP, TOP),
    (2, TOP, TOP, 3, TOP, TOP),
    (3, TOP, TOP, TOP, TOP, TOP),
    (TOP,) * 6,
)


def step_shapes(
    sched_config, max_shapes: int = DEFAULT_MAX_SHAPES, *, padded_attention: bool = True
) -> list[BatchShape]:
    """At most `max_shapes` shapes that together hold every bucketed batch: the finest of
    LEVELS (BOUNDED_LEVELS without `padded_attention`) that fits (see the module docstring);
    `max_shapes` 1: the largest shape alone."""
    if max_shapes < 1:
        raise ValueError(f"max_shapes={max_shapes}: must be >= 1")
    every = reachable_shapes(sched_config)
    if len(every) <= max_shapes:
        return every
    if max_shapes == 1:
        return [max(every)]
    for level in LEVELS if padded_attention else BOUNDED_LEVELS:
        shapes = _shapes_at(sched_config, level)
        if len(shapes) <= max_shapes:
            return shapes
    raise AssertionError("the coarsest level has two shapes")


def padding_cost(sched_config, shapes: list[BatchShape], *, padded_attention: bool = True) -> float:
    """Mean step_cost(fit) / step_cost(needed) over a fixed sample of needed shapes from a
    chat-like prior (`_needs_sample`): what padding to `shapes` costs in the cost model."""
    needs = _needs_sample(sched_config)
    return _padding_cost(shapes, needs, sched_config.page_size, padded_attention)


def sampler_variants(shape: BatchShape) -> tuple[str, ...]:
    """The sampler programs a step of this shape can run (see the module docstring)."""
    return ("greedy", "full") if shape.num_prefill_tokens == 0 else ("full",)


def spec_shapes(sched_config, spec_len: int) -> list[BatchShape]:
    """Speculative steps (engine/spec/decode.py): Sv verified sequences of query_len <=
    spec_len in the prefill group (max_query_len = spec_len, so the ragged attention pads
    each to spec_len, not to a prefill chunk), beside Sd plain decodes, for every rung.
    NOTE: a set of its own (SpecDecoder.shapes), not the engine's warm-up set: compiled on
    first use; |Sd| x |Sv| x |P| shapes (224 for 32 sequences and 4 page-table widths)."""
    seqs, _, pages = _ladders(sched_config)
    return [
        BatchShape(sd, pow2_bucket(sv * spec_len, MIN_PREFILL_TOKENS), sv, p, spec_len)
        for sd, sv, p in itertools.product([0, *seqs], seqs, pages)
    ]


def step_cost(shape: BatchShape, page_size: int, padded_attention: bool = True) -> float:
    """Relative device time of a step of this shape (see the module docstring): its tokens,
    plus its padded attention when the attention pays for padding."""
    tokens = shape.num_decode + shape.num_prefill_tokens
    if not padded_attention:
        return tokens
    positions = shape.pages_per_seq * page_size
    attended = (shape.num_decode + shape.num_prefill_seqs * shape.max_query_len) * positions
    return tokens + attended / ATTENTION_POSITIONS_PER_TOKEN


class ShapeSet:
    """The compiled shapes of one engine; `fit(needed)` is the cheapest that holds a batch."""

    def __init__(self, shapes: list[BatchShape], page_size: int, padded_attention: bool = True):
        if not shapes:
            raise ValueError("a ShapeSet needs at least one shape")
        cost = lambda s: step_cost(s, page_size, padded_attention)  # noqa: E731
        self.shapes = sorted(set(shapes), key=lambda s: (cost(s), s))
        self._fit: dict[BatchShape, BatchShape] = {}

    @classmethod
    def for_config(
        cls, sched_config, max_shapes: int = DEFAULT_MAX_SHAPES, *, padded_attention: bool = True
    ) -> ShapeSet:
        shapes = step_shapes(sched_config, max_shapes, padded_attention=padded_attention)
        return cls(shapes, sched_config.page_size, padded_attention)

    def __len__(self) -> int:
        return len(self.shapes)

    def fit(self, needed: BatchShape) -> BatchShape:
        """The cheapest shape that holds a batch needing `needed` (exact sizes)."""
        shape = self._fit.get(needed)
        if shape is None:
            if len(self._fit) > 4096:  # exact sizes: bound the memo
                self._fit.clear()
            # a decode-only step stays on a decode-only shape (its greedy program) when one
            # holds it, even where a narrow Sp = 1 prefill shape would be cheaper
            decode = needed.num_prefill_tokens == 0
            holds = [s for s in self.shapes if s.fits(needed)]
            shape = next((s for s in holds if not (decode and s.num_prefill_tokens)), None)
            shape = shape or (holds[0] if holds else None)
            if shape is None:
                raise ValueError(
                    f"no compiled step shape holds {needed}; the largest is {max(self.shapes)}"
                )
            self._fit[needed] = shape
        return shape
