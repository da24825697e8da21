"""Per-step expert load of a mixture-of-experts model, on the host (numpy only).

The MoE families return, beside the logits, how many real tokens each layer routed to each
expert (models/moe.py `expert_token_counts`, the family's AUX_OUTPUT "expert_tokens"); the
step hands it back with its packed results in one `device_get` (engine/runner/step.py,
engine/core.py). Padding rows of the fixed-shape batch are not counted.

    counts [L, E] int32     one step; a dense layer of a mixed model is all zeros (dropped)
    per sparse layer:       sum_e counts[l, e] = real tokens x k

    imbalance = sum_l max_e counts[l, e] / sum_l mean_e counts[l, e]        (>= 1)

Why this ratio: a sparse layer is done when its busiest expert is (with expert parallelism,
the device holding it), and layers run one after another, so a step's expert work goes as
sum_l max_e against sum_l mean_e when balanced. 1.0 is perfect balance; the ceiling is E / k
(an expert gets at most one row per token), which a single decoding token always reaches.

Reported: each step's imbalance and routed (token, choice) total in
`EngineCore.last_step_info` (the serving layer's per-step histogram,
serving/frontend/metrics.py); the last step's counts and the cumulative counts in
`EngineCore.stats()` (the notebook API's `LLM.stats()`, and the per-expert counter).
"""

from __future__ import annotations

import dataclasses

import numpy as np


def imbalance(counts: np.ndarray) -> float:
    """counts [L, E] (sparse layers only) -> the step's max/mean ratio (module doc); 0.0
    when no token was routed (an all-padding step)."""
    counts = np.asarray(counts, np.float64)
    mean = counts.mean(axis=1).sum()
    return float(counts.max(axis=1).sum() / mean) if mean > 0 else 0.0


@dataclasses.dataclass
class ExpertLoad:
    """Expert load summed over an engine's steps (one per EngineCore of an MoE model)."""

    sparse_layers: tuple[int, ...]  # indices of the model's sparse layers
    num_experts: int
    tokens: np.ndarray | None = None  # [len(sparse_layers), E] int64: routed real tokens, all steps
    num_steps: int = 0
    imbalance_sum: float = 0.0
    last_tokens: np.ndarray | None = None  # [len(sparse_layers), E] of the last step
    last_imbalance: float = 0.0

    def __post_init__(self):
        if self.tokens is None:
            self.tokens = np.zeros((len(self.sparse_layers), self.num_experts), np.int64)

    @classmethod
    def for_config(cls, cfg) -> ExpertLoad:
        """From an MoE config (`sparse_layers`, `num_experts`: models/moe.py MoeConfig)."""
        sparse = tuple(i for i, s in enumerate(cfg.sparse_layers) if s)
        return cls(sparse, cfg.num_experts)

    def observe(self, counts: np.ndarray) -> dict:
        """One step's counts [L, E] (every layer); returns its step info entries."""
        step = np.asarray(counts)[list(self.sparse_layers)]  # [L_sparse, E]
        ratio = imbalance(step)
        self.tokens += step
        self.num_steps += 1
        self.imbalance_sum += ratio
        self.last_tokens, self.last_imbalance = step, ratio
        # NOTE: the counts themselves stay here (stats()): this dict is built every step and
        # crosses a pipe with an out-of-process engine; [L, E] is 6,144 ints at 48 x 128.
        return {"expert_imbalance": round(ratio, 4), "routed_tokens": int(step.sum())}

    def stats(self) -> dict:
        """Cumulative figures for EngineCore.stats(). `moe_expert_tokens`: per sparse layer,
        per expert; `moe_expert_tokens_by_expert`: summed over layers (expert e of every
        layer sits on the same device under expert parallelism, so this is per-device load
        up to grouping)."""
        return {
            "moe_sparse_layers": list(self.sparse_layers),
            "moe_steps": self.num_steps,
            "moe_expert_tokens": self.tokens.tolist(),
            "moe_expert_tokens_by_expert": self.tokens.sum(axis=0).tolist(),
            "moe_imbalance_mean": self.imbalance_sum / max(self.num_steps, 1),
            "moe_last_step_expert_tokens": (
                None if self.last_tokens is None else self.last_tokens.tolist()
            ),
            "moe_last_step_imbalance": self.last_imbalance,
        }
