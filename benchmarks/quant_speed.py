"""Speed of each configuration through the real paged engine (the quant report's section 3):
batch-1 decode tok/s, 64-way decode tok/s and a 1k-token prefill, each configuration next to
float32 in the same process. Every engine is warmed up (its shapes compiled) before it is
timed; prefix caching is off so a repeated prompt is computed again; each figure is the best
of `repeats` runs and carries the 1-minute load average, because this machine is shared.
The float32 engine stays alive and is measured again right after each variant, so every
ratio compares two measurements taken minutes apart at most (paired), not hours.
"""

from __future__ import annotations

import os
import time

import numpy as np

from engine import LLM, SamplingParams


def _prompt(rng, length: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(3, vocab, size=length)]


def _decode_rate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Aggregate decode tok/s: sequences / median time per output token."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    tpots = [o.metrics.tpot_s for o in outs if o.metrics and o.metrics.tpot_s]
    return len(prompts) / float(np.median(tpots))


def _prefill_s(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - t0


def engine_for(model, scheme, kv_dtype: str, batch: int, prefill_tokens: int) -> LLM:
    pages = batch * 4 + prefill_tokens // 16 + 8
    return LLM(
        model,
        quantization=scheme.scheme,
        quantize_lm_head=scheme.quantize_lm_head,
        kv_dtype=kv_dtype,
        num_pages=pages,
        max_num_seqs=batch,
        max_num_batched_tokens=max(prefill_tokens, batch),
        prefill_chunk_size=prefill_tokens,
        max_model_len=max(prefill_tokens + 8, 64),
        prefix_caching=False,
    )


def measure(
    llm: LLM,
    *,
    batch: int,
    prefill_tokens: int,
    decode_tokens: int,
    repeats: int,
    seed: int = 0,
    warm_up: bool = True,
) -> dict:
    rng = np.random.default_rng(seed)
    vocab = llm.model.config.vocab_size
    one = [_prompt(rng, 16, vocab)]
    many = [_prompt(rng, 16, vocab) for _ in range(batch)]
    long = _prompt(rng, prefill_tokens, vocab)
    if warm_up:  # compile the shapes used below
        _decode_rate(llm, one, 4)
        _decode_rate(llm, many, 4)
        _prefill_s(llm, long)
    res = {"batch1_tok_s": 0.0, f"batch{batch}_tok_s": 0.0, "prefill_s": float("inf")}
    for _ in range(repeats):
        res["batch1_tok_s"] = max(res["batch1_tok_s"], _decode_rate(llm, one, decode_tokens))
        res[f"batch{batch}_tok_s"] = max(
            res[f"batch{batch}_tok_s"], _decode_rate(llm, many, decode_tokens)
        )
        res["prefill_s"] = min(res["prefill_s"], _prefill_s(llm, long))
    res["prefill_tok_s"] = prefill_tokens / res["prefill_s"]
    res["loadavg_1m"] = round(os.getloadavg()[0], 1)
    return res
