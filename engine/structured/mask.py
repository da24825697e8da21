"""Device side of structured output: a packed token bitmask applied to the logits.

    token_bitmask [S, W] int32, W = ceil(V / 32): bit (t % 32) of word t // 32 set = token t
    allowed (llguidance's and xgrammar's layout). Unpacked on the device:

    bits = (bitmask[:, :, None] >> arange(32)) & 1      [S, W, 32]
    allowed = bits.reshape(S, W * 32)[:, :V] != 0        [S, V]
    logits = where(allowed, logits, -inf)

Sending W = V / 32 words per row instead of V booleans keeps the host->device copy at
6 KB per row for V = 49,152. `sample` (engine/sampling/sampler.py) applies it after penalties and
the min_tokens ban and before everything else, so greedy, temperature, top-k/top-p/min-p
and the logprobs all see the masked distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def unpack_bitmask(token_bitmask: Array, vocab_size: int) -> Array:
    """[S, W] int32 -> [S, V] bool (token allowed)."""
    S, W = token_bitmask.shape
    shifts = jnp.arange(32, dtype=jnp.int32)  # [32]
    bits = jnp.right_shift(token_bitmask[:, :, None], shifts) & 1  # [S, W, 32]
    return bits.reshape(S, W * 32)[:, :vocab_size] != 0  # [S, V]


def apply_token_bitmask(logits: Array, token_bitmask: Array) -> Array:
    """logits [S, V] with disallowed tokens set to -inf."""
    allowed = unpack_bitmask(token_bitmask, logits.shape[1])  # [S, V]
    return jnp.where(allowed, logits, -jnp.inf)


def allowed_ids(token_bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Host-side reference: the allowed token ids of one [W] int32 row."""
    bits = np.unpackbits(token_bitmask_row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])
