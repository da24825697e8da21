"""Which weights are quantized, and how (a frozen config; the arithmetic is models/quant.py).

    QuantConfig("none")                      float weights (the reference)
    QuantConfig("int8")                      weight-only int8, per output channel, float32
                                             scales; activations stay float
    QuantConfig("w8a8")                      int8 weights as above AND int8 activations with a
                                             dynamic per-token scale (int8 x int8 dot, int32
                                             accumulation): the fast formulation on XLA:CPU
    QuantConfig("int8", quantize_lm_head=True)   the LM head too (default: float)

`descriptor` is how identities, revisions and cache keys name it.
"""

from __future__ import annotations

import dataclasses

# scheme -> (descriptor, how activations enter the matmul)
SCHEMES: dict[str, tuple[str, str]] = {
    "none": ("none", "float"),
    "int8": ("int8-w-perchannel", "float"),
    "w8a8": ("int8-w8a8-perchannel", "int8"),
}


class QuantizationConfigError(ValueError):
    """A quantization option with a bad value; the message names option, value and choices."""


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    scheme: str = "none"  # "none" | "int8" | "w8a8"
    quantize_lm_head: bool = False

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise QuantizationConfigError(
                f"quantization={self.scheme!r} is not supported; allowed: {sorted(SCHEMES)}"
            )
        if not isinstance(self.quantize_lm_head, bool):
            raise QuantizationConfigError(
                f"quantize_lm_head={self.quantize_lm_head!r} is invalid: a bool"
            )
        if self.quantize_lm_head and self.scheme == "none":
            raise QuantizationConfigError(
                "quantize_lm_head=True needs quantization='int8' or 'w8a8' (got 'none')"
            )

    @classmethod
    def of(cls, value: QuantConfig | str | None) -> QuantConfig:
        """A QuantConfig from a config, a scheme name or None ("none")."""
        if isinstance(value, QuantConfig):
            return value
        if value is None:
            return cls()
        if not isinstance(value, str):
            raise QuantizationConfigError(
                f"quantization={value!r} is invalid: a scheme name, one of {sorted(SCHEMES)}"
            )
        return cls(value)

    @property
    def enabled(self) -> bool:
        return self.scheme != "none"

    @property
    def activations(self) -> str:
        return SCHEMES[self.scheme][1]

    @property
    def descriptor(self) -> str:
        """ "none", "int8-w-perchannel", "int8-w8a8-perchannel", with "+lm_head" when the LM
        head is quantized too."""
        return SCHEMES[self.scheme][0] + ("+lm_head" if self.quantize_lm_head else "")
