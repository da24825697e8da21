"""Timing probe for cross-tenant prefix-cache leaks (the vLLM CVE-2025-46570 class).

In each round tenant A sends a fresh secret prefix P, so P's pages sit in the prefix cache;
then tenant B probes once, alternating "hit" rounds (P + a random suffix) and "miss" rounds
(a random prefix of the same length + a random suffix), and the server's TTFT of each probe
is recorded. If B could reuse A's pages, hits would be faster; the AUC of
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
    owner_key: str,
    prober_key: str,
    prefix_len: int,
    n_probes: int,
    vocab: int,
    seed: int = 0,
    suffix_tokens: int = 4,
) -> tuple[list[float], list[float]]:
    """n_probes rounds: the owner caches a FRESH secret prefix, then the prober sends either
    that prefix + a random suffix (even rounds: a hit if pages were shared) or a fresh random
    prefix (odd rounds: a miss). Fresh prefixes every round, so the prober never hits pages
    it seeded itself in an earlier round."""
    rng = random.Random(seed)
    fresh = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    hits, misses = [], []
    with (
        GenerateClient(target, api_key=owner_key) as owner,
        GenerateClient(target, api_key=prober_key) as prober,
    ):
        for i in range(n_probes):
            secret = fresh(prefix_len)
            seeded = owner.generate(token_ids=secret + [5], max_tokens=1, temperature=0.0)
            if not seeded.ok:
                raise RuntimeError(f"seeding failed: {seeded.code} {seeded.details}")
            ids, into = (secret, hits) if i % 2 == 0 else (fresh(prefix_len), misses)
            res = prober.generate(token_ids=ids + fresh(suffix_tokens), max_tokens=1)
            if not res.ok:
                raise RuntimeError(f"probe failed: {res.code} {res.details}")
            into.append(res.server_timings["ttft_s"])
    return hits, misses


def timing_report(
    target: str,
    owner_key: str,
    other_key: str,
    prefix_len: int,
    n_probes: int,
    vocab: int,
    n_control: int = 60,
) -> dict:
    other = probe_ttfts(target, owner_key, other_key, prefix_len, n_probes, vocab, seed=1)
    control = probe_ttfts(target, owner_key, owner_key, prefix_len, n_control, vocab, seed=2)
    return {
        "probes_other_tenant": n_probes,
        "probes_same_tenant_control": n_control,
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
