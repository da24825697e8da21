"""The set of step shapes an engine compiles: fixed at start-up, small, and always enough.

A step's shape (engine/batch.py `BatchShape`) is

    Sd decode rows  x  Tp prefill tokens  x  Sp prefill sequences  x  P page-table width

each on a power-of-two ladder (Sd: 1..max_num_seqs, Tp: 16..max_num_batched_tokens,
Sp: 1..min(max_num_seqs, Tp / 2), P: 4..max_pages_per_seq), and max_query_len a function
of Tp. The full product (`reachable_shapes`) runs into the thousands for a server config,
too many to compile before serving. So an engine fixes a `ShapeSet` at start-up (about
`max_shapes` shapes) and pads every batch to the cheapest shape of the set that fits it
(`ShapeSet.fit`): no step ever needs a shape outside the set, so after warming the set
(engine/warmup.py) nothing compiles while serving.

How the set is chosen (`step_shapes`):
  - every rung of every ladder while the product fits in `max_shapes`;
  - otherwise decode-only steps (most steps while serving, where a wider page table would
    cost every step) keep every Sd x P rung, and steps with a prefill keep every Tp rung
    but only every k-th rung of Sd, Sp and P (counted down from the top, the bottom rung
    kept too), k growing until the total fits or every such ladder is down to its top and
    bottom rungs (so a large config may hold somewhat more than `max_shapes`);
  - the largest shape (every dimension at its top rung) is always in the set, so any batch
    the scheduler can build fits some shape.
Padding to a coarser shape costs device time (more rows, a wider page table) but never
changes a result: padding rows write the null page and read nothing.

`ShapeSet.fit` orders the candidates by an estimate of a step's cost: tokens through the
weights plus attended key positions divided by `ATTENTION_POSITIONS_PER_TOKEN` (a decode
row reads P * page_size positions, a prefill sequence max_query_len x that). The ratio is
the model-independent order of magnitude of (FLOPs per token) / (FLOPs per attended
position) for the models served here (~4,000 for SmolLM2-135M).
"""

from __future__ import annotations

import itertools

from engine.batch import BatchShape, pow2_bucket, query_len_bound

ATTENTION_POSITIONS_PER_TOKEN = 4096
DEFAULT_MAX_SHAPES = 64
MIN_PREFILL_TOKENS = 16
MIN_PAGES = 4


def _ladder(lo: int, hi: int) -> list[int]:
    """Powers of two from lo up to hi, hi included (hi need not be a power of two)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi] if hi >= lo else out


def _rungs(ladder: list[int], stride: int) -> list[int]:
    """Every stride-th rung counted down from the top, plus the bottom one."""
    kept = set(ladder[::-1][::stride]) | {ladder[0]} if ladder else set()
    return sorted(kept)


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


def step_shapes(sched_config, max_shapes: int = DEFAULT_MAX_SHAPES) -> list[BatchShape]:
    """Every decode-only shape, plus steps with a prefill on ladders coarsened until the
    total fits `max_shapes` or can be coarsened no further; the largest shape always among
    them (see the module docstring)."""
    every = reachable_shapes(sched_config)
    if len(every) <= max_shapes:
        return every
    seqs, tokens, pages = _ladders(sched_config)
    chunk = sched_config.prefill_chunk_size
    decode_only = [_shape(sd, 0, 0, p, chunk) for sd, p in itertools.product(seqs, pages)]

    def with_prefill(stride: int) -> list[BatchShape]:
        shapes = []
        m_seqs, m_pages = [0, *_rungs(seqs, stride)], _rungs(pages, stride)
        for sd, tp, p in itertools.product(m_seqs, tokens, m_pages):
            sps = _rungs(_prefill_seqs(seqs, tp), stride)
            shapes += [_shape(sd, tp, sp, p, chunk) for sp in sps]
        return shapes

    for stride in range(1, max(len(seqs), len(pages)) + 1):
        shapes = sorted(set(decode_only + with_prefill(stride)))
        if len(shapes) <= max_shapes:
            break
    return shapes


def spec_shapes(sched_config, spec_len: int) -> list[BatchShape]:
    """Speculative steps (engine/spec_decode.py): Sv verified sequences of query_len <=
    spec_len in the prefill group (max_query_len = spec_len, so the ragged attention pads
    each to spec_len, not to a prefill chunk), beside Sd plain decodes, for every rung.
    NOTE: a set of its own (SpecDecoder.shapes), not the engine's warm-up set: compiled on
    first use; |Sd| x |Sv| x |P| shapes (224 for 32 sequences and 4 page-table widths)."""
    seqs, _, pages = _ladders(sched_config)
    return [
        BatchShape(sd, pow2_bucket(sv * spec_len, MIN_PREFILL_TOKENS), sv, p, spec_len)
        for sd, sv, p in itertools.product([0, *seqs], seqs, pages)
    ]


def step_cost(shape: BatchShape, page_size: int) -> float:
    """Relative device time of a step of this shape (see the module docstring)."""
    positions = shape.pages_per_seq * page_size
    attended = (shape.num_decode + shape.num_prefill_seqs * shape.max_query_len) * positions
    tokens = shape.num_decode + shape.num_prefill_tokens
    return tokens + attended / ATTENTION_POSITIONS_PER_TOKEN


class ShapeSet:
    """The compiled shapes of one engine; `fit(needed)` is the cheapest that holds a batch."""

    def __init__(self, shapes: list[BatchShape], page_size: int):
        if not shapes:
            raise ValueError("a ShapeSet needs at least one shape")
        self.shapes = sorted(set(shapes), key=lambda s: (step_cost(s, page_size), s))
        self._fit: dict[BatchShape, BatchShape] = {}

    @classmethod
    def for_config(cls, sched_config, max_shapes: int = DEFAULT_MAX_SHAPES) -> ShapeSet:
        return cls(step_shapes(sched_config, max_shapes), sched_config.page_size)

    def __len__(self) -> int:
        return len(self.shapes)

    def fit(self, needed: BatchShape) -> BatchShape:
        """The cheapest shape that holds a batch needing `needed` (exact sizes)."""
        shape = self._fit.get(needed)
        if shape is None:
            if len(self._fit) > 4096:  # exact sizes: bound the memo
                self._fit.clear()
            shape = next((s for s in self.shapes if s.fits(needed)), None)
            if shape is None:
                raise ValueError(
                    f"no compiled step shape holds {needed}; the largest is {max(self.shapes)}"
                )
            self._fit[needed] = shape
        return shape
