"""A Qwen3-MoE-shaped model against a dense model of the same active parameters, through the
whole engine: decode tokens/s at batch 1, 8 and 64 (issue 30, "Measure").

    python -m benchmarks.moe_engine_bench                  # D 1024, 4 layers, 64 experts top-8
    python -m benchmarks.moe_engine_bench --sizes=smoke    # what the test runs

Both models are random `transformers` checkpoints (`Qwen3MoeConfig` with every layer sparse,
and `Qwen3Config` whose MLP width is k x the expert width, so one token reads and computes the
same MLP weights in both), saved as safetensors and served by `engine.LLM` with the engine's
defaults for this machine (the MoE MLP's grouped matmul: models/moe.py picks the CPU loop over
non-empty groups). Decode rate = B x (long - short) / (time(long) - time(short)): two
generations of B prompts that differ only in max_tokens, so prefill and the first step's
compile cancel out (each timed after one untimed run of the same shape). The per-layer share
of routing/permutation vs expert matmuls is `benchmarks/moe_bench.py`'s.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

SIZES = {  # hidden, layers, experts, top-k, expert width, heads, kv heads, head_dim, vocab, batches
    "smoke": (64, 2, 8, 2, 32, 4, 2, 16, 512, (1, 4)),
    "default": (1024, 4, 64, 8, 256, 16, 4, 64, 8192, (1, 8, 64)),
}


def _save(folder: str, sparse: bool, size: str) -> None:
    import torch
    import transformers

    from models.registry import tiny_tokenizer

    D, L, E, k, Fm, H, KV, hd, V, _ = SIZES[size]
    common = dict(
        vocab_size=V,
        hidden_size=D,
        num_attention_heads=H,
        num_key_value_heads=KV,
        head_dim=hd,
        num_hidden_layers=L,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        rope_theta=1e6,
    )
    torch.manual_seed(0)
    if sparse:
        cfg = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=k * Fm,
            num_experts=E,
            num_experts_per_tok=k,
            moe_intermediate_size=Fm,
            norm_topk_prob=True,
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**common, intermediate_size=k * Fm)
        )
    model.save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer().backend.save(os.path.join(folder, "tokenizer.json"))


def _decode_rate(llm, batch: int, short: int, long: int, vocab: int) -> tuple[float, float]:
    """(decode tokens/s, ms per decode step) for `batch` concurrent 16-token prompts."""
    import numpy as np

    from engine import SamplingParams

    rng = np.random.default_rng(batch)
    prompts = [rng.integers(3, vocab, 16).tolist() for _ in range(batch)]

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate(prompts, params)  # untimed: compiles this shape's programs
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - t0

    dt = run(long) - run(short)
    steps = long - short
    return batch * steps / dt, 1e3 * dt / steps


def _load() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", choices=sorted(SIZES), default="default")
    ap.add_argument("--short", type=int, default=4, help="max_tokens of the short generation")
    ap.add_argument("--long", type=int, default=20, help="max_tokens of the long generation")
    args = ap.parse_args(argv)

    from engine import LLM

    D, L, E, k, Fm, H, KV, hd, V, batches = SIZES[args.sizes]
    print(
        f"D {D}, {L} layers, {E} experts top-{k} of width {Fm} vs a dense MLP of width {k * Fm}; "
        f"load {_load()}"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rates: dict[tuple[str, int], tuple[float, float]] = {}
        for name, sparse in (("dense", False), ("moe", True)):
            folder = os.path.join(tmp, name)
            _save(folder, sparse, args.sizes)
            llm = LLM(
                folder,
                max_num_seqs=max(batches),
                max_model_len=64 + args.long,
                page_size=16,
                num_pages=max(batches) * 8 + 8,
            )
            for b in batches:
                rates[name, b] = _decode_rate(llm, b, args.short, args.long, V)
            del llm
        for b in batches:
            (d_tps, d_ms), (m_tps, m_ms) = rates["dense", b], rates["moe", b]
            row = dict(batch=b, dense_tok_s=d_tps, moe_tok_s=m_tps, dense_ms=d_ms, moe_ms=m_ms)
            rows.append(row)
            print(
                f"batch {b:>3}: dense {d_tps:8.1f} tok/s ({d_ms:6.1f} ms/step)  "
                f"moe {m_tps:8.1f} tok/s ({m_ms:6.1f} ms/step)  moe/dense {m_tps / d_tps:.2f}"
            )
    print(f"load {_load()}")
    return rows


if __name__ == "__main__":
    main()
