"""Token sampling in JAX: one fixed-shape function for a batch whose rows each carry their own
sampling parameters (greedy, temperature, top-k, top-p, min-p, penalties, seed).

Data flow inside the engine's jitted step (S = batch slots, V = vocab):

    logits [S, V] f32
      -> apply_penalties(counts, prompt_mask)       (only if `counts` is passed: static)
      -> ban EOS/stop ids while step < min_tokens
      = processed logits l              -> logsumexp, top_k(C) = greedy pick, top-20 logprobs
      -> l / temperature -> top-k -> top-p -> min-p -> draw with the row's own key
    SampleResult(tokens, logprobs, top_ids, top_logprobs) -> pack() -> ONE [S, 42] array to host

Design notes:
- Reproducibility: a row's random numbers depend only on (its seed, its output position):
  key = fold_in(key(seed), step), never its slot, its batch companions or the static flags.
  Requests without a seed get one drawn on the host when they arrive (`resolve_seed`), so
  the device has one code path.
- Randomness is the expensive part on CPU (threefry: ~100 ms for 64 x 49152 numbers), so rows
  without top-k/top-p draw hierarchically: a block of BLOCK tokens by Gumbel-max over block
  masses, then a token inside it by Gumbel-max over its logits. Exact (P(block) *
  P(token | block)) with only V / BLOCK + BLOCK random numbers per row.
- top-k / top-p avoid a full sort of V (about 1 s on this CPU for 64 x 49152): they work on the
  row's top `max_candidates` C (default 256, one `jax.lax.top_k` that also gives the greedy
  token and the top-20 logprobs) and such rows draw by Gumbel-max among the kept candidates.
  Exact for top_k <= C and for a nucleus that fits in C tokens; a top_k in (C, V) acts as
  top_k = C, and a nucleus wider than C is truncated to the top C tokens (never a token
  outside the true nucleus). top_k = 0 or >= V is off. `SamplingFlags(max_candidates=V)`
  makes both exact at the cost of a full sort. Candidates tied with the cut value are kept.
- Cost on CPU (64 x 49,152 logits): the greedy pick is two plain reductions
  (`argmax_and_max`; `jnp.argmax` is ~6x slower on XLA:CPU); in the full variant the C
  candidates are computed only when a sampling row filters this step and the random draw
  only when a row samples (`lax.cond` inside the one compiled program, so no extra compile),
  otherwise a top-K for the logprobs. Measured: greedy variant 16 -> 3.5 ms CPU, full
  variant on greedy rows 16 -> 7 ms.
- Penalties need per-slot token counts. They stay on the device: `token_counts [S_max, V]
  int32` (output tokens) and `prompt_mask [S_max, V] bool`; `reset_slot_counts` fills a slot's
  rows when a request is inserted (prompt ids sent once), `update_counts` scatters each step's
  sampled tokens. Memory: S_max * V * 5 bytes = 31 MB at S=128, V=49152 (counts alone 25 MB).
  When no row in the batch uses penalties, the engine passes counts=None and they are skipped.
- logprobs are of the processed logits l above: log_softmax after penalties and the
  min_tokens ban, before temperature and the top-k/top-p/min-p filters (the distribution a
  temperature-1, unfiltered sampler would draw from). MAX_LOGPROBS alternatives are always
  computed (unless the static flag turns them off); the host slices to what a request asked.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.sampling.params import MAX_LOGPROBS, SamplingParams
from engine.structured.mask import apply_token_bitmask

Array = jax.Array

BLOCK = 256  # tokens per block of the hierarchical sampler
DEFAULT_MAX_CANDIDATES = 256  # static cap on the top-k / top-p candidate set
MAX_MIN_TOKENS_STOP_IDS = 16  # EOS + stop_token_ids banned before min_tokens (per row)
_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class SamplingFlags:
    """Static choices that select a compiled variant of `sample` (hashable; a jit static arg).

    Fewer distinct flag values mean fewer compilations: an engine that wants exactly one
    compiled sampler per bucket passes the default (everything on)."""

    filters: bool = True  # some row uses top-k or top-p (needs the candidate top_k)
    all_greedy: bool = False  # no row samples: skip randomness and filters entirely
    top_logprobs: bool = True  # compute the MAX_LOGPROBS alternatives (else zeros)
    max_candidates: int = DEFAULT_MAX_CANDIDATES

    def __post_init__(self):
        if self.max_candidates < MAX_LOGPROBS:
            raise ValueError(f"max_candidates={self.max_candidates} must be >= {MAX_LOGPROBS}")

    @classmethod
    def for_batch(
        cls,
        params_list: Sequence[SamplingParams | None],
        max_candidates: int = DEFAULT_MAX_CANDIDATES,
    ) -> SamplingFlags:
        """The cheapest flags that are still exact for this batch."""
        active = [p for p in params_list if p is not None]
        return cls(
            filters=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in active),
            all_greedy=all(p.greedy for p in active),
            top_logprobs=any(p.logprobs for p in active),
            max_candidates=max_candidates,
        )


# The two compiled sampler variants an engine uses (warm-up compiles both).
GREEDY_FLAGS = SamplingFlags(filters=False, all_greedy=True, top_logprobs=False)
FULL_FLAGS = SamplingFlags()
SAMPLER_VARIANTS = {"greedy": GREEDY_FLAGS, "full": FULL_FLAGS}


def sampler_flags(params_list: Sequence[SamplingParams | None]) -> SamplingFlags:
    """The sampler variant a batch runs: GREEDY_FLAGS when every row is greedy and wants no
    logprobs, else FULL_FLAGS. NOTE: two variants rather than `for_batch`'s cheapest exact
    one, so a step shape has at most two compiled programs to warm up."""
    active = [p for p in params_list if p is not None]
    return GREEDY_FLAGS if all(p.greedy and not p.logprobs for p in active) else FULL_FLAGS


def uses_penalties(params_list: Sequence[SamplingParams | None]) -> bool:
    """Whether any row needs token counts (else pass counts=None to `sample`)."""
    return any(
        p is not None
        and (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)
        for p in params_list
    )


def seed_to_key_data(seed: int) -> np.ndarray:
    """[2] uint32: (high, low) 32-bit halves, the key data of `jax.random.key(seed)` (threefry)."""
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], dtype=np.uint32)


def resolve_seed(params: SamplingParams, rng: random.Random | None = None) -> int:
    """The request's seed, or a fresh one drawn once on the host (the engine stores it)."""
    if params.seed is not None:
        return params.seed
    return (rng or random.SystemRandom()).getrandbits(63)


@jax.tree_util.register_dataclass  # every field is an array (a pytree leaf)
@dataclasses.dataclass
class SamplingTensors:
    """Per-slot sampling parameters, one row per batch slot. Padding rows are greedy."""

    temperature: Array  # [S] f32, 0 = greedy
    top_k: Array  # [S] i32, 0 = off
    top_p: Array  # [S] f32, 1 = off
    min_p: Array  # [S] f32, 0 = off
    repetition_penalty: Array  # [S] f32, 1 = off
    presence_penalty: Array  # [S] f32, 0 = off
    frequency_penalty: Array  # [S] f32, 0 = off
    key_data: Array  # [S, 2] u32, threefry key of the request's seed
    step: Array  # [S] i32, output position of the token being sampled (folded into the key)
    min_tokens: Array  # [S] i32, stop_ids are banned while step < min_tokens
    stop_ids: Array  # [S, MAX_MIN_TOKENS_STOP_IDS] i32, EOS + stop_token_ids, -1 padded

    @classmethod
    def from_params(
        cls,
        params_list: Sequence[SamplingParams | None],
        output_lens: Sequence[int],
        seeds: Sequence[int | None] | None,
        num_slots: int,
        eos_token_ids: Sequence[int] = (),
    ) -> SamplingTensors:
        """Host-side numpy rows padded to `num_slots`. `output_lens[i]` is how many tokens row i
        has already produced; `seeds[i]` its resolved seed (see `resolve_seed`; None falls back
        to params.seed, and only greedy rows may have no seed at all)."""
        if len(params_list) > num_slots:
            raise ValueError(f"params_list has {len(params_list)} rows > num_slots={num_slots}")
        if len(output_lens) != len(params_list):
            raise ValueError(
                f"output_lens has {len(output_lens)} rows, params_list {len(params_list)}"
            )
        rows = greedy_sampler_rows(num_slots)
        for i, p in enumerate(params_list):
            if p is not None:
                seed = seeds[i] if seeds is not None and seeds[i] is not None else p.seed
                fill_sampler_row(rows, i, p, output_lens[i], seed, eos_token_ids)
        return cls(**rows)


# The SamplingTensors rows copied straight from SamplingParams (same name, one value per row).
_ROWS_FROM_PARAMS = tuple(
    f.name
    for f in dataclasses.fields(SamplingTensors)
    if f.name in {g.name for g in dataclasses.fields(SamplingParams)}
)


def greedy_sampler_rows(num_slots: int) -> dict[str, np.ndarray]:
    S = num_slots
    f32 = lambda fill: np.full(S, fill, np.float32)
    i32 = lambda fill: np.full(S, fill, np.int32)
    return {
        "temperature": f32(0.0),
        "top_k": i32(0),
        "top_p": f32(1.0),
        "min_p": f32(0.0),
        "repetition_penalty": f32(1.0),
        "presence_penalty": f32(0.0),
        "frequency_penalty": f32(0.0),
        "key_data": np.zeros((S, 2), np.uint32),
        "step": i32(0),
        "min_tokens": i32(0),
        "stop_ids": np.full((S, MAX_MIN_TOKENS_STOP_IDS), -1, np.int32),
    }


def fill_sampler_row(
    rows: dict[str, np.ndarray],
    i: int,
    p: SamplingParams,
    output_len: int,
    seed: int | None,
    eos_token_ids: Sequence[int],
) -> None:
    if seed is None and not p.greedy:
        raise ValueError(
            f"row {i} samples (temperature={p.temperature}) but has no seed: "
            "draw one with resolve_seed() when the request arrives"
        )
    for name in _ROWS_FROM_PARAMS:
        rows[name][i] = getattr(p, name)
    rows["key_data"][i] = seed_to_key_data(seed or 0)
    rows["step"][i] = output_len
    # NOTE: past the cap, extra stop ids are not banned on device; the host StopChecker
    # still refuses to stop on them before min_tokens, so they are emitted as plain tokens.
    ids = list(dict.fromkeys([*eos_token_ids, *p.stop_token_ids]))[:MAX_MIN_TOKENS_STOP_IDS]
    rows["stop_ids"][i, : len(ids)] = ids


K = MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleResult:
    tokens: Array  # [S] i32
    logprobs: Array  # [S] f32, of `tokens` under log_softmax(processed logits)
    top_ids: Array  # [S, K] i32, most likely tokens, descending
    top_logprobs: Array  # [S, K] f32

    def pack(self) -> Array:
        """[S, 2 + 2K] f32, ids bit-cast (exact), so the host fetches one array."""
        as_f32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)
        return jnp.concatenate(
            [
                as_f32(self.tokens)[:, None],
                self.logprobs[:, None],
                as_f32(self.top_ids),
                self.top_logprobs,
            ],
            axis=1,
        )

    @staticmethod
    def unpack(packed: np.ndarray) -> SampleResult:
        """Host side: numpy arrays back from `pack()`'s output."""
        packed = np.ascontiguousarray(packed, dtype=np.float32)
        ids = packed.view(np.int32)
        return SampleResult(
            tokens=ids[:, 0].copy(),
            logprobs=packed[:, 1].copy(),
            top_ids=ids[:, 2 : 2 + K].copy(),
            top_logprobs=packed[:, 2 + K :].copy(),
        )


# ---------------------------------------------------------------- penalties (device side)


def init_counts(num_slots: int, vocab_size: int) -> tuple[Array, Array]:
    """Zeroed (token_counts [S, V] i32, prompt_mask [S, V] bool)."""
    return (
        jnp.zeros((num_slots, vocab_size), jnp.int32),
        jnp.zeros((num_slots, vocab_size), jnp.bool_),
    )


def reset_slot_counts(
    counts: Array,
    prompt_mask: Array,
    slot: Array | int,
    prompt_ids: Array,
    prompt_len: Array | int,
    output_ids: Array | None = None,
    output_len: Array | int = 0,
) -> tuple[Array, Array]:
    """Rows of `slot` for a newly inserted request. prompt_ids [P] (padded; P static, bucket it),
    output_ids [O] the tokens already generated (a request resumed after preemption).
    Jit with counts and prompt_mask donated."""
    V = counts.shape[1]
    in_prompt = jnp.arange(prompt_ids.shape[0]) < prompt_len  # [P]
    mask_row = (
        jnp.zeros((V,), jnp.bool_).at[jnp.where(in_prompt, prompt_ids, V)].set(True, mode="drop")
    )  # [V]
    count_row = jnp.zeros((V,), jnp.int32)  # [V]
    if output_ids is not None:
        in_output = jnp.arange(output_ids.shape[0]) < output_len  # [O]
        count_row = count_row.at[jnp.where(in_output, output_ids, V)].add(1, mode="drop")
    return counts.at[slot].set(count_row), prompt_mask.at[slot].set(mask_row)


def update_counts(counts: Array, slots: Array, tokens: Array, valid: Array) -> Array:
    """counts[slots[i], tokens[i]] += 1 where valid[i]. slots/tokens/valid [S]."""
    return counts.at[slots, tokens].add(valid.astype(jnp.int32), mode="drop")


def apply_penalties(
    logits: Array, counts: Array, prompt_mask: Array, tensors: SamplingTensors
) -> Array:
    """vLLM's definitions. logits/counts/prompt_mask [S, V] with rows aligned (gather
    `counts[slot_ids]` first if batch rows are not slots). Repetition: tokens seen in prompt or
    output get positive logits divided, negative multiplied by the penalty; then frequency
    (times output count) and presence (output count > 0) are subtracted."""
    in_output = counts > 0  # [S, V]
    rep = tensors.repetition_penalty[:, None]  # [S, 1]
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(prompt_mask | in_output, penalized, logits)
    logits = logits - tensors.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return logits - tensors.presence_penalty[:, None] * in_output.astype(jnp.float32)


def ban_stop_ids_before_min_tokens(logits: Array, tensors: SamplingTensors) -> Array:
    """EOS and stop_token_ids get -inf while a row has produced fewer than min_tokens."""
    S, V = logits.shape
    banned = (tensors.stop_ids >= 0) & (tensors.step < tensors.min_tokens)[:, None]  # [S, B]
    ids = jnp.where(banned, tensors.stop_ids, V)  # [S, B], V = out of range -> dropped
    return logits.at[jnp.arange(S)[:, None], ids].set(_NEG_INF, mode="drop")


# ---------------------------------------------------------------- filters and sampling


def _gumbels(tensors: SamplingTensors, sizes: tuple[int, ...]) -> list[Array]:
    """Per row, one [S, n] Gumbel draw per size; keys from (seed, output position) only.
    NOTE: one threefry draw sliced, not split keys: each threefry instance costs seconds of
    XLA compile time on CPU."""
    keys = jax.random.wrap_key_data(tensors.key_data, impl="threefry2x32")  # [S]
    keys = jax.vmap(jax.random.fold_in)(keys, tensors.step)  # [S]
    g = jax.vmap(lambda k: jax.random.gumbel(k, (sum(sizes),)))(keys)  # [S, sum(sizes)]
    offsets = np.cumsum((0, *sizes))
    return [g[:, a:b] for a, b in itertools.pairwise(offsets)]


def _top_k_on(tensors: SamplingTensors, vocab_size: int) -> Array:
    """[S] bool: top-k restricts the row (0 and top_k >= V mean off)."""
    return (tensors.top_k > 0) & (tensors.top_k < vocab_size)


def top_k_top_p_threshold(
    cand: Array, temperature: Array, lse_scaled: Array, tensors: SamplingTensors, vocab_size: int
) -> Array:
    """[S] lowest processed logit kept by top-k then top-p (-inf for rows using neither).
    cand [S, C]: the row's top processed logits, descending; lse_scaled [S]: logsumexp of
    logits / temperature over the whole row."""
    C = cand.shape[1]
    j = jnp.arange(C)[None, :]  # [1, C]
    k_on = _top_k_on(tensors, vocab_size)  # [S]
    keep_k = ~k_on[:, None] | (j < tensors.top_k[:, None])  # [S, C]
    scaled = jnp.where(keep_k, cand / temperature[:, None], _NEG_INF)  # [S, C]
    # top-p renormalizes the top-k distribution: over the candidates when top-k is on.
    norm = jnp.where(k_on, jax.nn.logsumexp(scaled, axis=-1), lse_scaled)  # [S]
    probs = jnp.exp(scaled - norm[:, None])  # [S, C]
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [S, C] exclusive prefix sums
    p_on = tensors.top_p < 1.0  # [S]
    keep = keep_k & (~p_on[:, None] | (mass_before < tensors.top_p[:, None]))
    last = jnp.maximum(jnp.sum(keep, axis=-1) - 1, 0)  # [S] keep is a prefix of the candidates
    thr = jnp.take_along_axis(cand, last[:, None], axis=-1)[:, 0]  # [S]
    return jnp.where(k_on | p_on, thr, _NEG_INF)


def _sample_random(
    logits: Array,
    row_max: Array,
    cand: Array | None,
    cand_ids: Array | None,
    tensors: SamplingTensors,
    num_candidates: int,
) -> Array:
    """[S] tokens for sampling rows: temperature -> top-k -> top-p -> min-p -> draw.

    Rows without top-k/top-p draw from the whole vocabulary, hierarchically: a block of
    BLOCK tokens by Gumbel-max over block masses, then a token by Gumbel-max inside it (exact,
    and V / BLOCK + BLOCK random numbers instead of V). Rows with top-k/top-p keep a subset of
    the candidates, so they draw by Gumbel-max over the candidates. Thresholds are compared in
    processed-logit units (dividing by T > 0 keeps the order)."""
    S, V = logits.shape
    nb = -(-V // BLOCK)
    temperature = jnp.where(tensors.temperature > 0, tensors.temperature, 1.0)  # [S]
    # min-p: p >= min_p * p_max  <=>  logit >= max + T * log(min_p); renormalizing keeps it.
    min_p_thr = jnp.where(
        tensors.min_p > 0, row_max + temperature * jnp.log(tensors.min_p), _NEG_INF
    )  # [S]
    pad = ((0, 0), (0, nb * BLOCK - V))
    blocks = jnp.pad(logits, pad, constant_values=_NEG_INF).reshape(S, nb, BLOCK)
    scaled = blocks / temperature[:, None, None]  # [S, NB, BLOCK]
    e = jnp.exp(scaled - (row_max / temperature)[:, None, None])  # [S, NB, BLOCK]
    kept = blocks >= min_p_thr[:, None, None]  # [S, NB, BLOCK]
    mass = jnp.sum(jnp.where(kept, e, 0.0), axis=-1)  # [S, NB]
    # The layout of the draws never depends on the flags (a row's token must not either).
    g_block, g_token, g_cand = _gumbels(tensors, (nb, BLOCK, num_candidates))
    block = jnp.argmax(jnp.log(mass) + g_block, axis=-1)  # [S]
    pick = lambda x: jnp.take_along_axis(x, block[:, None, None], axis=1)[:, 0]
    inside = jnp.where(pick(kept), pick(scaled), _NEG_INF)  # [S, BLOCK]
    drawn = block * BLOCK + jnp.argmax(inside + g_token, axis=-1)  # [S]
    if cand is None:
        return drawn.astype(jnp.int32)
    lse_scaled = row_max / temperature + jnp.log(jnp.sum(e, axis=(1, 2)))  # [S]
    thr = top_k_top_p_threshold(cand, temperature, lse_scaled, tensors, V)  # [S]
    thr = jnp.maximum(thr, min_p_thr)
    scores = jnp.where(cand >= thr[:, None], cand / temperature[:, None], _NEG_INF)  # [S, C]
    from_cand = jnp.take_along_axis(
        cand_ids, jnp.argmax(scores + g_cand, axis=-1)[:, None], axis=-1
    )[:, 0]  # [S]
    filtered = _filters_on(tensors, V)  # [S]
    return jnp.where(filtered, from_cand, drawn).astype(jnp.int32)


def _filters_on(tensors: SamplingTensors, vocab_size: int) -> Array:
    """[S] bool: top-k or top-p restricts the row."""
    return _top_k_on(tensors, vocab_size) | (tensors.top_p < 1.0)


def top_candidates(x: Array, k: int, pad_to: int | None = None) -> tuple[Array, Array]:
    """The k largest of each row of x [S, V], descending (ties: lowest id first), as
    ([S, n], [S, n] int32) with n = pad_to or k; padding columns hold -inf and id 0."""
    vals, ids = jax.lax.top_k(x, k)
    # NOTE: XLA:CPU runs top_k fast only when the sort it decomposes into feeds exactly
    # one slice; slicing the result again (vals[:, 0]) can otherwise fold into the sort
    # and leave a full sort of V (about 1 s here). The barrier keeps the pattern intact.
    vals, ids = jax.lax.optimization_barrier((vals, ids))
    if pad_to is not None and pad_to > k:
        pad = ((0, 0), (0, pad_to - k))
        vals = jnp.pad(vals, pad, constant_values=_NEG_INF)
        ids = jnp.pad(ids, pad)
    return vals, ids.astype(jnp.int32)


def argmax_and_max(x: Array) -> tuple[Array, Array]:
    """([S] int32 first index of the row maximum, [S] the maximum) of x [S, V].

    Two plain reductions (max, then min over the indices holding it): XLA:CPU runs
    `jnp.argmax`'s (value, index) reduce unvectorized, ~6x slower at 64 x 49,152. A row
    without a comparable maximum (NaN) gets V - 1."""
    row_max = jnp.max(x, axis=-1)  # [S]
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)  # [S, V]
    first = jnp.min(jnp.where(x == row_max[:, None], ids, x.shape[-1] - 1), axis=-1)
    return first, row_max


def sample(
    logits: Array,
    tensors: SamplingTensors,
    counts: Array | None = None,
    prompt_mask: Array | None = None,
    flags: SamplingFlags = SamplingFlags(),
    token_bitmask: Array | None = None,
) -> SampleResult:
    """Pick one token per row. logits [S, V]; counts/prompt_mask [S, V] rows aligned with
    logits, or None to skip penalties. Call inside a jit with `flags` static.
    `token_bitmask` [S, ceil(V/32)] int32 (structured output, engine/structured/mask.py):
    disallowed tokens get -inf before anything else sees the logits; None (a separate
    trace) costs nothing."""
    S, V = logits.shape
    logits = logits.astype(jnp.float32)
    if counts is not None:
        if prompt_mask is None:
            raise ValueError("prompt_mask is required when counts is given")
        logits = apply_penalties(logits, counts, prompt_mask, tensors)
    logits = ban_stop_ids_before_min_tokens(logits, tensors)  # processed logits [S, V]
    # ---- structured output (engine/structured/mask.py) ----
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    # ---- end structured output ----
    lse = jax.nn.logsumexp(logits, axis=-1)  # [S]
    # One top_k serves the greedy pick, the top-K logprobs and the top-k/top-p candidates.
    filters = flags.filters and not flags.all_greedy
    num_candidates = min(max(flags.max_candidates, K), V)
    cand = cand_ids = None
    if filters and num_candidates > K:
        # Runtime choice inside ONE program: the C candidates only when a sampling row
        # filters; otherwise the top K, padded (the candidates past K are then never read).
        any_filter = jnp.any((tensors.temperature > 0) & _filters_on(tensors, V))
        cand, cand_ids = jax.lax.cond(
            any_filter,
            lambda x: top_candidates(x, num_candidates),
            lambda x: top_candidates(x, K, pad_to=num_candidates),
            logits,
        )
    elif filters or flags.top_logprobs:
        cand, cand_ids = top_candidates(logits, num_candidates if filters else K)
    if cand is not None:
        greedy, row_max = cand_ids[:, 0], cand[:, 0]
    else:
        greedy, row_max = argmax_and_max(logits)
    tokens = greedy.astype(jnp.int32)  # [S]
    if not flags.all_greedy:
        # Randomness (threefry, exp over [S, V]) only when some row samples this step.
        draw = lambda: _sample_random(
            logits,
            row_max,
            cand if filters else None,
            cand_ids if filters else None,
            tensors,
            num_candidates,
        )
        drawn = jax.lax.cond(jnp.any(tensors.temperature > 0), draw, lambda: tokens)
        tokens = jnp.where(tensors.temperature > 0, drawn, tokens)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]  # [S]
    if flags.top_logprobs:
        top_ids, top_logprobs = cand_ids[:, :K], cand[:, :K] - lse[:, None]
    else:
        top_ids, top_logprobs = jnp.zeros((S, K), jnp.int32), jnp.zeros((S, K), jnp.float32)
    return SampleResult(
        tokens=tokens,
        logprobs=chosen - lse,
        top_ids=top_ids.astype(jnp.int32),
        top_logprobs=top_logprobs,
    )


sample_jit = jax.jit(sample, static_argnames=("flags",))
