"""Building blocks the model families share (models/llama.py, qwen3.py, phi3.py, gemma3.py).

Pure functions over arrays, each matching its Hugging Face counterpart in float32:
- `rms_norm(x, w, eps, offset)`: Llama's `x * w` (offset 0) and Gemma's `x * (1 + w)` (offset
  1), computed in float32 and cast back.
- RoPE: `default_inv_freq` (theta over the rotated dims), `scaled_inv_freq` (Llama 3.1 /
  linear `RopeScaling`), `apply_rope` in the `rotate_half` layout with partial rotary (only
  the first 2 * len(inv_freq) dims of a head rotate; Phi-3) and a cos/sin scale (LongRoPE's
  attention factor). `inv_freq` may be [hd/2] or per token [T, hd/2] (LongRoPE picks the
  short or long factors per position).
- `gated_mlp`: down(act(gate(h)) * up(h)), act "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
- `proj`: x [T, *in] @ w [*in, *out] as one 2-D matmul (int8 `Int8Weight` dispatched).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from configs.model_config import RopeScaling
from models.quant import Int8Weight, int8_proj

Array = jax.Array


def rms_norm(x: Array, weight: Array, eps: float, offset: float = 0.0) -> Array:
    """RMSNorm over the last axis; `offset=1.0` is Gemma's (1 + weight) scale."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    return (x32 * (w + offset if offset else w)).astype(x.dtype)


def default_inv_freq(theta: float, rotary_dim: int) -> Array:
    """Inverse frequencies [rotary_dim / 2] of plain RoPE."""
    exponents = jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim  # [rd/2]
    return 1.0 / (theta**exponents)


def scaled_inv_freq(theta: float, rotary_dim: int, sc: RopeScaling | None) -> Array:
    """Inverse frequencies [rotary_dim / 2] with Llama-3 / linear scaling applied."""
    inv_freq = default_inv_freq(theta, rotary_dim)
    if sc is None:
        return inv_freq
    if sc.kind == "linear":
        return inv_freq / sc.factor
    # Llama 3.1: long wavelengths scaled by `factor`, short ones kept, a smooth ramp between.
    low_freq_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_freq_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * jnp.pi / inv_freq
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    smoothed = (1 - smooth) * inv_freq / sc.factor + smooth * inv_freq
    out = jnp.where(wavelen > low_freq_wavelen, inv_freq / sc.factor, inv_freq)
    is_medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return jnp.where(is_medium, smoothed, out)


def apply_rope(x: Array, positions: Array, inv_freq: Array, scale: float = 1.0) -> Array:
    """Rotary embedding, Hugging Face `rotate_half` layout. x [T, N, hd], positions [T],
    inv_freq [rd/2] or [T, rd/2] with rd <= hd (partial rotary: dims rd.. pass through);
    `scale` multiplies cos and sin (LongRoPE's attention factor)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, rd/2]
    cos = (jnp.cos(angles) * scale)[:, None, :]  # [T, 1, rd/2]
    sin = (jnp.sin(angles) * scale)[:, None, :]
    rd = 2 * inv_freq.shape[-1]
    x32 = x.astype(jnp.float32)
    x_rot, x_pass = x32[..., :rd], x32[..., rd:]  # [T, N, rd], [T, N, hd - rd]
    x1, x2 = jnp.split(x_rot, 2, axis=-1)  # [T, N, rd/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x_pass], axis=-1)
    return out.astype(x.dtype)


def proj(x: Array, w: Array, num_in: int = 1) -> Array:
    """x [T, *in] @ w [*in, *out] -> [T, *out] as one 2-D matmul (`num_in` = len(in)): the
    reshapes of a contiguous weight (or of its scanned slice) are free."""
    if isinstance(w, Int8Weight):  # int8 weights: pallas_kernels.int8_matmul
        return int8_proj(x, w, num_in)
    t = x.shape[0]
    w2 = w.reshape(math.prod(w.shape[:num_in]), -1)
    return (x.reshape(t, -1) @ w2).reshape(t, *w.shape[num_in:])


ACTIVATIONS = {
    "silu": jax.nn.silu,
    # Hugging Face "gelu_pytorch_tanh" / "gelu_new": the tanh approximation.
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def gated_mlp(gate: Array, up: Array, act: str) -> Array:
    """act(gate) * up, the input of the down projection (gate/up [T, F])."""
    return ACTIVATIONS[act](gate) * up


def soft_cap(logits: Array, cap: float | None) -> Array:
    """cap * tanh(logits / cap) (Gemma's final logit soft-capping); None: unchanged."""
    if cap is None:
        return logits
    return jnp.tanh(logits / cap) * cap
