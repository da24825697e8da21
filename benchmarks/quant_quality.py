"""Quality of a quantized configuration against float32 (the quant report's section 1), the
method of llama.cpp's `perplexity --kl-divergence`: run the float32 model and the quantized
one over the same token windows, and compare their next-token distributions token by token.

    corpus      Python's own documentation, assembled at run time from the installed stdlib
                (module, class and function docstrings via `inspect`); nothing downloaded
    per token   KL(p_float || p_quant) in nats, top-1 agreement, -log p(actual next token)
    summary     mean and p99 KL, top-1 agreement, perplexity of each and its change

The forward pass is the model's own (`models.llama.forward`) with a dense causal attention.
int8 KV is simulated exactly as the paged cache stores it: every K and V row quantized per
token per KV head (absmax/127, `pallas_kernels.quantize_int8`) and dequantized before the
attention reads it (the paged engine writes K/V to the cache first and attends over the
stored values, the current chunk included, so the numbers are the same up to summation
order). The behaviour section (quant_report) runs the real paged engine.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from configs.model_config import ModelConfig
from models.llama import forward
from pallas_kernels import quantize_int8

STDLIB_MODULES = (
    "collections", "json", "itertools", "functools", "os", "re", "string", "textwrap",
    "argparse", "logging", "unittest", "asyncio", "typing", "dataclasses", "pathlib",
    "inspect", "subprocess", "threading", "decimal", "fractions", "statistics", "random",
    "heapq", "bisect", "contextlib", "abc", "csv", "sqlite3", "zipfile", "tarfile", "shutil",
    "tempfile", "datetime", "calendar", "difflib", "pprint", "enum", "io", "pickle", "copy",
    "struct", "socket", "urllib.parse", "configparser", "doctest", "timeit", "tokenize", "ast",
    "email.message", "http.client", "gzip", "base64", "hashlib", "queue", "sched", "weakref",
)  # fmt: skip


def stdlib_corpus(min_chars: int) -> str:
    """Docstrings of stdlib modules and their public members, in a fixed order, until the
    text has `min_chars` characters (raises if the installed stdlib has fewer)."""
    parts: list[str] = []
    size = 0
    for name in STDLIB_MODULES:
        mod = importlib.import_module(name)
        docs = [inspect.getdoc(mod) or ""]
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            obj = getattr(mod, attr, None)
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200:
                docs.append(f"{attr}\n{doc}")
        for d in docs:
            if d:
                parts.append(d)
                size += len(d)
        if size >= min_chars:
            return "\n\n".join(parts)
    raise RuntimeError(f"the installed stdlib docstrings hold {size} characters < {min_chars}")


def corpus_windows(tokenizer, num_windows: int, window_tokens: int) -> np.ndarray:
    """[num_windows, window_tokens] int32 token ids of consecutive corpus windows."""
    need = num_windows * window_tokens
    chars = need * 5
    while True:
        ids = tokenizer.encode(stdlib_corpus(chars), add_special_tokens=False)
        if len(ids) >= need:
            return np.asarray(ids[:need], np.int32).reshape(num_windows, window_tokens)
        chars *= 2


def dense_causal_attention(cfg: ModelConfig, kv_int8: bool):
    """attention(q [T,H,hd], k/v [T,K,hd], layer, cache) -> ([T,H,hd], cache) over the
    tokens of this call only (one window; no cache), K/V optionally through int8."""
    group = cfg.num_heads // cfg.num_kv_heads

    def through_int8(x):
        q, scale = quantize_int8(x)  # per token per KV head
        return q.astype(jnp.float32) * scale[..., None]

    def attention(q, k, v, layer, cache):
        if kv_int8:
            k, v = through_int8(k), through_int8(v)
        k = jnp.repeat(k, group, axis=1)  # [T, H, hd]
        v = jnp.repeat(v, group, axis=1)
        t = q.shape[0]
        logits = jnp.einsum("THd,SHd->HTS", q, k) * cfg.head_dim**-0.5
        causal = jnp.tril(jnp.ones((t, t), bool))
        probs = jax.nn.softmax(jnp.where(causal[None], logits, -jnp.inf), axis=-1)
        return jnp.einsum("HTS,SHd->THd", probs, v), cache

    return attention


@functools.partial(jax.jit, static_argnames=("cfg", "kv_int8"))
def window_log_probs(params, tokens, *, cfg: ModelConfig, kv_int8: bool) -> jax.Array:
    """log-softmax of the next-token logits at every position: [T, V] float32."""
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    logits, _ = forward(params, cfg, tokens, positions, None, dense_causal_attention(cfg, kv_int8))
    return jax.nn.log_softmax(logits, axis=-1)


@jax.jit
def compare(ref_logp, logp, targets):
    """Per position: KL(ref || q) nats, top-1 agreement, NLL of targets for both."""
    kl = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1)
    agree = jnp.argmax(ref_logp, -1) == jnp.argmax(logp, -1)
    take = lambda lp: -jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]  # noqa: E731
    return kl, agree, take(ref_logp), take(logp)


def quality(variants: dict, cfg: ModelConfig, windows: np.ndarray) -> dict[str, dict]:
    """variants: name -> (params, kv_int8); the first is the float32 reference.
    Returns name -> summary (mean/p99/max KL, top-1 agreement, perplexities)."""
    names = list(variants)
    acc = {n: {"kl": [], "agree": [], "nll": [], "ref_nll": []} for n in names}
    for w in windows:
        tokens = jnp.asarray(w)
        ref_params, ref_kv = variants[names[0]]
        ref = window_log_probs(ref_params, tokens, cfg=cfg, kv_int8=ref_kv)[:-1]
        targets = tokens[1:]
        for n in names:
            params, kv_int8 = variants[n]
            logp = window_log_probs(params, tokens, cfg=cfg, kv_int8=kv_int8)[:-1]
            kl, agree, ref_nll, nll = compare(ref, logp, targets)
            for key, val in (("kl", kl), ("agree", agree), ("nll", nll), ("ref_nll", ref_nll)):
                acc[n][key].append(np.asarray(val, np.float64))
    out = {}
    for n in names:
        kl = np.concatenate(acc[n]["kl"])
        ppl = float(np.exp(np.concatenate(acc[n]["nll"]).mean()))
        ref_ppl = float(np.exp(np.concatenate(acc[n]["ref_nll"]).mean()))
        out[n] = {
            "tokens": int(kl.size),
            "mean_kl_nats": float(kl.mean()),
            "p99_kl_nats": float(np.percentile(kl, 99)),
            "max_kl_nats": float(kl.max()),
            "top1_agreement": float(np.concatenate(acc[n]["agree"]).mean()),
            "perplexity": ppl,
            "perplexity_change_pct": 100.0 * (ppl / ref_ppl - 1.0),
            "kl_histogram": np.histogram(np.log10(np.maximum(kl, 1e-8)), bins=40, range=(-8, 1))[
                0
            ].tolist(),
        }
    return out


def teacher_forced(params, cfg: ModelConfig, kv_int8: bool, ids: list[int], start: int) -> dict:
    """Mean entropy (temperature 1) of the next-token distribution and mean log-prob of the
    given tokens ids[start:] (the float32 greedy continuation), padded to a 256 bucket so a
    few lengths compile."""
    n = len(ids)
    padded = -(-n // 256) * 256
    tokens = jnp.asarray(np.pad(np.asarray(ids, np.int32), (0, padded - n)))
    logp = window_log_probs(params, tokens, cfg=cfg, kv_int8=kv_int8)[start - 1 : n - 1]
    chosen = jnp.take_along_axis(logp, tokens[start:n, None], axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return {"entropy_t1": float(entropy.mean()), "logprob_of_float_tokens": float(chosen.mean())}
