"""Repetition / presence / frequency penalties: the paged engine against a dense loop that
applies the same penalties in NumPy (vLLM's definitions, written out here independently of
engine/sampling/sampler.py), token for token, on the tiny model.

A penalty that never reaches the step, reaches the wrong batch row, counts the wrong tokens
or applies the wrong formula changes some greedy pick below; the must-differ check catches an
engine that ignores penalties on a prompt whose plain continuation repeats itself."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from engine import LLM, SamplingParams
from models.dense_generate import DenseKVCache, dense_step

OPTS = dict(
    page_size=8, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=32, max_model_len=128
)
PROMPT = [1, 185, 345, 293, 132, 166]  # plain greedy repeats 132 (a prompt token), 375, 470
MAX_TOKENS = 16


def penalised_logits(logits, prompt_ids, output_ids, rep, presence, frequency):
    """vLLM's penalties on one row of logits [V] (float64): a token seen in the prompt or the
    output has a positive logit divided by `rep`, a negative one multiplied; then each token
    loses frequency * (its output count) and presence * (1 if it is in the output)."""
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=logits.size)  # [V]
    seen = counts > 0
    seen[list(prompt_ids)] = True
    out = np.where(seen, np.where(logits > 0, logits / rep, logits * rep), logits)
    return out - frequency * counts - presence * (counts > 0)


def dense_penalised_greedy(params, cfg, prompt_ids, max_tokens, rep=1.0, presence=0.0, freq=0.0):
    """Greedy decoding over a contiguous KV cache (models.dense_generate.dense_step), one token
    per step, with the penalties applied to every step's logits on the host."""
    n = len(prompt_ids)
    cache = DenseKVCache.zeros(cfg, 128)
    tokens = np.zeros(64, np.int32)  # [64] one prefill bucket
    tokens[:n] = prompt_ids
    logits, cache = dense_step(
        params, cfg, cache, jnp.asarray(tokens), jnp.arange(64, dtype=jnp.int32), jnp.int32(n - 1)
    )
    out: list[int] = []
    for i in range(max_tokens):
        row = np.asarray(logits, np.float64)  # [V]
        out.append(int(np.argmax(penalised_logits(row, prompt_ids, out, rep, presence, freq))))
        pos = jnp.array([n + i], jnp.int32)
        logits, cache = dense_step(
            params, cfg, cache, jnp.array([out[-1]], jnp.int32), pos, jnp.int32(0)
        )
    return out


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", num_pages=64, **OPTS)


CASES = {  # name -> (repetition, presence, frequency)
    "plain": (1.0, 0.0, 0.0),
    "frequency": (1.0, 0.0, 1.5),
    "presence": (1.0, 1.5, 0.0),
    # Negative: a seen token is favoured by 1 however often it was seen (frequency -1 would
    # repeat token 25 forever here), so presence applied per count changes the output.
    "negative_presence": (1.0, -1.0, 0.0),
    "repetition": (3.0, 0.0, 0.0),
    "all": (1.5, 0.5, 0.5),
}


def test_penalties_match_a_dense_loop_token_for_token(llm):
    """All six cases run as ONE batch (rows with and without penalties side by side), each
    equal to the dense loop with the same penalties, and the penalised ones differ from the
    plain one. Shown (2026-12-04) to catch each of these planted bugs, one at a time:
    the step never applying penalties (engine/runner/step.py `use_penalties` forced False),
    presence subtracted without the `counts > 0` test (apply_penalties using counts),
    the repetition penalty ignoring the prompt (prompt_mask dropped from apply_penalties)."""
    params, cfg = llm.engine.runner.params, llm.model.config
    sps = [
        SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            repetition_penalty=r,
            presence_penalty=p,
            frequency_penalty=f,
        )
        for r, p, f in CASES.values()
    ]
    outs = llm.generate([PROMPT] * len(sps), sps)
    got = {name: o.token_ids for name, o in zip(CASES, outs)}
    want = {
        name: dense_penalised_greedy(params, cfg, PROMPT, MAX_TOKENS, *v)
        for name, v in CASES.items()
    }
    # The prompt must make penalties matter: the plain continuation repeats tokens (of its own
    # and of the prompt), so every penalty changes some greedy pick.
    plain = want["plain"]
    assert len(set(plain)) < len(plain) and set(plain) & set(PROMPT)
    for name in CASES:
        assert got[name] == want[name], name
        if name != "plain":
            assert want[name] != plain, f"{name}: the penalty must change this continuation"
    assert llm.engine.pool.num_used_pages == 0
