"""The ngram proposer (prompt lookup decoding): model-free drafts from the sequence itself.

For a sequence t_0..t_{L-1}, try suffix lengths n = max_n down to min_n: find the most
recent earlier occurrence of the last n tokens (t_{L-n}..t_{L-1} found at i..i+n-1 with
i + n <= L - 1; the most recent one followed by k known tokens if any) and propose what
followed it, t_{i+n} .. t_{i+n+k-1} (at most k tokens,
fewer when the sequence ends first). No match: no draft (the sequence decodes normally).

Host side, numpy only; the drafts are point masses, so the acceptance rule accepts x with
probability p(x) (engine/spec/rule.py). Cost: O(L * n) compares per sequence and step.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids, k: int, min_n: int, max_n: int, window: int = 4096) -> list[int]:
    """Up to k drafted tokens continuing `token_ids` (a list or [L] array); [] if no match.
    Only the last `window` tokens are searched (bounds the per-step cost)."""
    tokens = np.asarray(token_ids[-window:], np.int32)  # [L]
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]  # [n]
        windows = sliding_window_view(tokens[: L - 1], n)  # [L - n, n]: starts 0..L-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= L]  # occurrences followed by k known tokens
            start = int(full[-1] if full.size else hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
