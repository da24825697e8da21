"""Model architecture configuration: one frozen, hashable dataclass and named presets.

A `ModelConfig` is static (it is passed to jitted functions as a static argument), so it is
frozen and holds only hashable fields. Tests build tiny variants with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "llama3" (Llama 3.1 style) or "linear"."""

    kind: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ("llama3", "linear"):
            raise ValueError(f"rope_scaling.kind={self.kind!r}: expected 'llama3' or 'linear'")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor={self.factor}: must be > 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama-family decoder architecture (Llama 2/3/3.1, Mistral, SmolLM2, Qwen2); the other
    families (models/qwen3.py, phi3.py, gemma3.py) subclass it with their own fields and
    `family` (models/families.py maps it to the family's forward and weight layout)."""

    family: ClassVar[str] = "llama"

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    vocab_size: int
    head_dim: int = 0  # 0: derived as hidden_size // num_heads
    max_seq_len: int = 8192
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on Q, K and V projections
    sliding_window: int | None = None  # Mistral v0.1; None: full attention
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)

    def __post_init__(self):
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by "
                    f"num_heads={self.num_heads}; set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        for field in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "ffn_size",
            "vocab_size",
            "head_dim",
            "max_seq_len",
        ):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field}={getattr(self, field)}: must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window in tokens (None: full attention). Every layer shares
        `sliding_window` here; a family with local and global layers (Gemma 3) overrides it."""
        return (self.sliding_window,) * self.num_layers

    @property
    def q_per_kv(self) -> int:
        """Grouped-query ratio: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        d, f, hd = self.hidden_size, self.ffn_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.num_layers * per_layer + self.vocab_size * d + head + d

    def flops_per_token(self, context_tokens: int = 0) -> float:
        """Forward FLOPs for one token: 2 x (layer weights + LM head) + attention over context."""
        d, f, hd = self.hidden_size, self.ffn_size, self.head_dim
        layer_matmul = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2) + 3 * d * f
        attn = 4 * self.num_heads * hd * context_tokens
        return float(self.num_layers * (2 * layer_matmul + attn) + 2 * self.vocab_size * d)


_LLAMA3_SCALING = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)

PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="smollm2-135m",
        num_layers=30,
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        ffn_size=1536,
        vocab_size=49152,
        max_seq_len=8192,
        rope_theta=100000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "llama-3.2-1b": ModelConfig(
        name="llama-3.2-1b",
        num_layers=16,
        hidden_size=2048,
        num_heads=32,
        num_kv_heads=8,
        ffn_size=8192,
        vocab_size=128256,
        head_dim=64,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
        tie_embeddings=True,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.1-8b": ModelConfig(
        name="llama-3.1-8b",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        ffn_size=14336,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_SCALING,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.1-70b": ModelConfig(
        name="llama-3.1-70b",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        ffn_size=28672,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_SCALING,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    "mistral-7b": ModelConfig(
        name="mistral-7b",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        ffn_size=14336,
        vocab_size=32768,
        max_seq_len=32768,
        rope_theta=1000000.0,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "qwen2.5-0.5b": ModelConfig(
        name="qwen2.5-0.5b",
        num_layers=24,
        hidden_size=896,
        num_heads=14,
        num_kv_heads=2,
        ffn_size=4864,
        vocab_size=151936,
        max_seq_len=32768,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
        attention_bias=True,
        bos_token_id=None,
        eos_token_ids=(151645, 151643),
    ),
    # Tiny config for tests: GQA 4:2, QKV bias, untied head. Runs in milliseconds on CPU.
    "tiny": ModelConfig(
        name="tiny",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        ffn_size=128,
        vocab_size=512,
        max_seq_len=1024,
        rope_theta=10000.0,
        attention_bias=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
}


def from_name(name: str) -> ModelConfig:
    """Returns the preset called `name`; raises KeyError listing the known presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
