"""How often the `layers` proposer's first draft would be accepted, by N (greedy), without
the engine: the target's first N layers + its final norm and head (engine/spec/layers.py
`truncated`) against the whole model, over the tokens of a prompt and its greedy
continuation, in one dense pass per N. The share of positions where both argmaxes agree
is the greedy acceptance of draft position 0; pick `num_draft_layers` from it.

    python -m benchmarks.spec_layers_probe                 # SmolLM2-135M, both workloads
    python -m benchmarks.spec_layers_probe --layers=4,8,16,24,28 --max_tokens=48
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp
import numpy as np

from benchmarks.spec_bench import WORKLOADS, load_avg
from engine.spec.layers import truncated
from models.dense_generate import DenseKVCache, dense_attention, generate_dense
from models.llama import forward
from models.registry import load_model


def argmaxes(params, cfg, token_ids: list[int]) -> np.ndarray:
    """[T] the model's greedy next token at every position (one dense pass)."""
    ids = jnp.asarray(token_ids, jnp.int32)
    positions = jnp.arange(len(token_ids), dtype=jnp.int32)
    cache = DenseKVCache.zeros(cfg, len(token_ids))
    logits, _ = forward(params, cfg, ids, positions, cache, dense_attention(cfg, positions))
    return np.asarray(jnp.argmax(logits, axis=-1))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="4,8,12,16,20,24,27,29")
    ap.add_argument("--max_tokens", type=int, default=48)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args(argv)
    model = load_model(args.model)
    params, cfg, tok = model.params, model.config, model.tokenizer
    out = {}
    for name, text in WORKLOADS.items():
        chat = [{"role": "user", "content": text}]
        rendered = tok.apply_chat_template(chat, add_generation_prompt=True)
        prompt = list(tok.encode(rendered, add_special_tokens=False))
        cont = generate_dense(params, cfg, prompt, args.max_tokens)["token_ids"]
        seq = prompt + cont
        full = argmaxes(params, cfg, seq)[len(prompt) - 1 : -1]  # predicts each output token
        for n in [int(x) for x in args.layers.split(",")]:
            p, c = truncated(params, cfg, n)
            agree = float(np.mean(argmaxes(p, c, seq)[len(prompt) - 1 : -1] == full))
            out[(name, n)] = agree
            print(f"{name:>5} N={n:<3} greedy agreement {agree:.2f}  [{load_avg()}]", flush=True)
    return out


if __name__ == "__main__":
    main()
