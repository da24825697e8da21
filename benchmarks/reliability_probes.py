"""Timing probe for cross-tenant prefix-cache leaks (the vLLM CVE-2025-46570 class).

Tenant A sends a prompt with a long prefix P, so P's pages sit in the prefix cache. Then
tenant B probes, one request at a time, alternating "hit" probes (P + a random suffix) and
"miss" probes (a random prefix of the same length + a random suffix), and the server's TTFT
of each is recorded. If B could reuse A's pages, hits would be faster; the AUC of
P(TTFT_miss > TTFT_hit) would rise above 0.5. The same probes sent by tenant A itself (who
does share with itself) are the control that shows the probe can see a hit.
"""

from __future__ import annotations

import random

import numpy as np

from serving.client import GenerateClient


def auc(hits: list[float], misses: list[float]) -> float:
    """P(miss > hit) + 0.5 P(tie): 0.5 = indistinguishable, 1.0 = hits always faster."""
    h, m = np.asarray(hits)[:, None], np.asarray(misses)[None, :]
    return float(((m > h).sum() + 0.5 * (m == h).sum()) / (h.size * m.size))


def probe_ttfts(
    target: str,
    api_key: str,
    prefix: list[int],
    n_probes: int,
    vocab: int,
    seed: int = 0,
    suffix_tokens: int = 4,
) -> tuple[list[float], list[float]]:
    rng = random.Random(seed)
    hits, misses = [], []
    with GenerateClient(target, api_key=api_key) as client:
        for i in range(n_probes):
            suffix = [rng.randrange(3, vocab) for _ in range(suffix_tokens)]
            if i % 2 == 0:
                ids, into = prefix + suffix, hits
            else:
                ids, into = [rng.randrange(3, vocab) for _ in prefix] + suffix, misses
            res = client.generate(token_ids=ids, max_tokens=1, temperature=0.0)
            if not res.ok:
                raise RuntimeError(f"probe failed: {res.code} {res.details}")
            into.append(res.server_timings["ttft_s"])
    return hits, misses


def timing_report(
    target: str, owner_key: str, other_key: str, prefix_len: int, n_probes: int, vocab: int
) -> dict:
    rng = random.Random(1234)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    with GenerateClient(target, api_key=owner_key) as owner:
        res = owner.generate(token_ids=prefix + [5], max_tokens=1, temperature=0.0)
        assert res.ok, res.details
    other = probe_ttfts(target, other_key, prefix, n_probes, vocab, seed=1)
    control = probe_ttfts(target, owner_key, prefix, n_probes, vocab, seed=2)
    return {
        "probes_per_tenant": n_probes,
        "prefix_tokens": prefix_len,
        "other_tenant_auc": auc(*other),
        "other_tenant_median_ttft_ms": {
            "hit": 1e3 * float(np.median(other[0])),
            "miss": 1e3 * float(np.median(other[1])),
        },
        "same_tenant_control_auc": auc(*control),
        "same_tenant_median_ttft_ms": {
            "hit": 1e3 * float(np.median(control[0])),
            "miss": 1e3 * float(np.median(control[1])),
        },
    }
