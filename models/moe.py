"""Mixture-of-experts building block (Mixtral, Qwen3-MoE: models/mixtral.py, qwen3_moe.py).

One sparse MLP over a flat token batch h [T, D] with E experts, each token sent to k:

    logits = h @ router                         [T, E]   (float32)
    (weights, experts) = route(logits)          [T, k], [T, k]
        "topk_softmax" (Mixtral): softmax over the k largest logits
        "softmax_topk" (Qwen3-MoE): softmax over all E, the k largest, renormalised to sum
                                    to 1 when `norm_topk_prob` (else kept as they are)
    rows: the T*k (token, choice) pairs sorted by expert (stable), so expert e owns the
          contiguous rows group_sizes[:e].sum() : group_sizes[:e+1].sum()
    x = h[token of row]                         [T*k, D]
    y = down(act(gate(x)) * up(x))              one grouped matmul per projection over the
                                                ragged groups (`jax.lax.ragged_dot`, or see NOTE)
    out[t] = sum_j weights[t, j] * y[row of (t, j)]              [T, D]

No token is dropped (no capacity factor): every shape is fixed by T and k, the groups are
data, and the result equals the dense per-expert loop of the reference up to summation order.
Padding rows of the engine's bucketed batch are routed like any token (their output is
discarded).

Expert load (the family's auxiliary output, models/families.py `AUX_OUTPUT`): given
`real_tokens` [T] bool (the engine's non-padding rows), each layer also returns how many real
tokens chose each expert, [E] int32 (zeros for a dense layer); the decoder scaffold stacks
them to [L, E]. Summed over experts: real tokens x k per sparse layer.

NOTE: on XLA:CPU `ragged_dot` lowers to one dense [T*k, E*D] x [E*D, F] matmul with masks
(E times the FLOPs of the grouped product), so the model runs `pallas_kernels.grouped_matmul`
(`MoeConfig.grouped_matmul`): `lax` loops over the groups on CPU, ragged_dot elsewhere,
Pallas TPU (megablox gmm style) and GPU (Triton) kernels on request.

Weights (per layer; stacked on a leading L axis in `MoeLayerWeights`):
    router   [D, E]         moe_gate, moe_up [E, D, Fm]         moe_down [E, Fm, D]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig
from models import layers
from models import llama as llama_family
from models.errors import ModelLoadError
from models.llama import param_field

Array = jax.Array
# grouped_matmul(x [M, K], w [E, K, N], group_sizes [E] int32) -> [M, N]
GroupedMatmul = Callable[[Array, Array, Array], Array]
ROUTINGS = ("topk_softmax", "softmax_topk")
SPARSE, DENSE = "moe", "dense"
# the families' auxiliary step output (models/families.py): [L, E] int32 real tokens routed
# to each expert in each layer (dense layers: zeros)
AUX_OUTPUT = "expert_tokens"


@dataclasses.dataclass(frozen=True)
class MoeConfig(ModelConfig):
    """A decoder whose MLP is a mixture of experts in its sparse layers. `ffn_size` is the
    dense MLP's width (layers listed dense in `sparse_layers`), `moe_ffn_size` each expert's.
    `sparse_layers`: one bool per layer (() means every layer is sparse)."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_ffn_size: int = 0  # 0: ffn_size
    routing: str = "softmax_topk"
    norm_topk_prob: bool = True
    sparse_layers: tuple[bool, ...] = ()
    # the grouped matmul (pallas_kernels.grouped_matmul): "auto" = `lax` loops on XLA:CPU,
    # ragged_dot elsewhere; a mesh with an expert axis runs "ragged_dot" (XLA partitions it)
    grouped_matmul: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        if self.moe_ffn_size == 0:
            object.__setattr__(self, "moe_ffn_size", self.ffn_size)
        object.__setattr__(self, "sparse_layers", tuple(bool(s) for s in self.sparse_layers))
        if not self.sparse_layers:
            object.__setattr__(self, "sparse_layers", (True,) * self.num_layers)
        if len(self.sparse_layers) != self.num_layers:
            raise ValueError(
                f"sparse_layers has {len(self.sparse_layers)} entries, num_layers={self.num_layers}"
            )
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r}: expected one of {ROUTINGS}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok}: must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if self.moe_ffn_size <= 0:
            raise ValueError(f"moe_ffn_size={self.moe_ffn_size}: must be > 0")
        from pallas_kernels.grouped_matmul import IMPLS  # lazy: Pallas loads only for MoE

        impls = ("auto", *IMPLS)
        if self.grouped_matmul not in impls:
            raise ValueError(f"grouped_matmul={self.grouped_matmul!r}: expected one of {impls}")

    @property
    def mixed(self) -> bool:
        """Both dense and sparse layers (each stacked field then holds every layer)."""
        return not all(self.sparse_layers)

    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(SPARSE if s else DENSE for s in self.sparse_layers)

    def _mlp_params(self) -> tuple[int, int, int]:
        """(dense MLP, one expert, router) parameters of one layer."""
        d = self.hidden_size
        return 3 * d * self.ffn_size, 3 * d * self.moe_ffn_size, d * self.num_experts

    @property
    def num_params(self) -> int:
        """Every weight, all experts included."""
        dense, expert, router = self._mlp_params()
        n_sparse = sum(self.sparse_layers)
        mlp_delta = n_sparse * (self.num_experts * expert + router - dense)
        return super().num_params + mlp_delta

    @property
    def num_active_params(self) -> int:
        """Weights one token reads: its k experts in each sparse layer (and the router)."""
        dense, expert, router = self._mlp_params()
        n_sparse = sum(self.sparse_layers)
        mlp_delta = n_sparse * (self.num_experts_per_tok * expert + router - dense)
        return super().num_params + mlp_delta

    def flops_per_token(self, context_tokens: int = 0) -> float:
        dense, expert, router = self._mlp_params()
        n_sparse = sum(self.sparse_layers)
        delta = n_sparse * (self.num_experts_per_tok * expert + router - dense)
        return super().flops_per_token(context_tokens) + 2.0 * delta


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MoeLayerWeights(llama_family.LayerWeights):
    """Llama's layer weights (w_gate/w_up/w_down None unless some layers are dense) plus the
    router and the expert stacks."""

    router: Array = param_field("layers", "embed", "expert_logits")  # [L, D, E]
    moe_gate: Array = param_field("layers", "experts", "embed", "moe_ffn")  # [L, E, D, Fm]
    moe_up: Array = param_field("layers", "experts", "embed", "moe_ffn")  # [L, E, D, Fm]
    moe_down: Array = param_field("layers", "experts", "moe_ffn", "embed")  # [L, E, Fm, D]


MOE_FIELDS = ("router", "moe_gate", "moe_up", "moe_down")


def moe_shapes(cfg: MoeConfig, base_layers, layer_cls, **extra):
    """`layer_cls` abstract layer weights: `base_layers`' fields (dense MLP dropped when every
    layer is sparse) plus the router and expert stacks, float32."""
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    L, D, E, Fm = cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_size
    fields = {f.name: getattr(base_layers, f.name) for f in dataclasses.fields(base_layers)}
    if not cfg.mixed:
        fields.update(w_gate=None, w_up=None, w_down=None)
    return layer_cls(
        **fields,
        **extra,
        router=s(L, D, E),
        moe_gate=s(L, E, D, Fm),
        moe_up=s(L, E, D, Fm),
        moe_down=s(L, E, Fm, D),
    )


# ---- routing and the sparse MLP ------------------------------------------------------------
def route(
    logits: Array, top_k: int, routing: str = "softmax_topk", norm_topk_prob: bool = True
) -> tuple[Array, Array]:
    """logits [T, E] -> (weights [T, k] float32, experts [T, k] int32), largest first."""
    logits = logits.astype(jnp.float32)
    if routing == "topk_softmax":
        top, experts = jax.lax.top_k(logits, top_k)  # [T, k]
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    if routing != "softmax_topk":
        raise ValueError(f"routing={routing!r}: expected one of {ROUTINGS}")
    probs = jax.nn.softmax(logits, axis=-1)  # [T, E]
    top, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, experts.astype(jnp.int32)


def ragged_matmul(x: Array, w: Array, group_sizes: Array) -> Array:
    """The portable grouped matmul: rows of group e times w[e]. x [M, K], w [E, K, N]."""
    return jax.lax.ragged_dot(x, w, group_sizes)


def grouped_matmul_fn(impl: str) -> GroupedMatmul:
    """`pallas_kernels.grouped_matmul` with `impl` ("auto" or one of its IMPLS)."""
    from pallas_kernels.grouped_matmul import grouped_matmul

    return functools.partial(grouped_matmul, impl=impl)


def sort_by_expert(experts: Array, num_experts: int) -> tuple[Array, Array]:
    """experts [T, k] -> (order [T*k]: flat (token, choice) index of each sorted row,
    group_sizes [E] int32: rows per expert)."""
    flat = experts.reshape(-1)  # [T*k]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, group_sizes


def expert_token_counts(experts: Array, real_tokens: Array, num_experts: int) -> Array:
    """experts [T, k] int32, real_tokens [T] bool -> [E] int32: the real tokens routed to
    each expert (a token counts once per choice; padding rows not at all)."""
    k = experts.shape[1]
    weights = jnp.repeat(real_tokens.astype(jnp.int32), k)  # [T*k]
    return jnp.zeros(num_experts, jnp.int32).at[experts.reshape(-1)].add(weights)


def moe_mlp(
    h: Array,
    router: Array,
    w_gate: Array,
    w_up: Array,
    w_down: Array,
    *,
    top_k: int,
    routing: str = "softmax_topk",
    norm_topk_prob: bool = True,
    act: str = "silu",
    grouped_matmul: GroupedMatmul = ragged_matmul,
    real_tokens: Array | None = None,
) -> Array | tuple[Array, Array]:
    """The sparse MLP (module doc). h [T, D], router [D, E], w_gate/w_up [E, D, F],
    w_down [E, F, D] -> [T, D] in h's dtype; with `real_tokens` [T] bool also the expert
    token counts [E] int32 (`expert_token_counts`)."""
    T, D = h.shape
    E = router.shape[-1]
    logits = jnp.dot(h, router, preferred_element_type=jnp.float32)  # [T, E]
    weights, experts = route(logits, top_k, routing, norm_topk_prob)  # [T, k] x2
    order, group_sizes = sort_by_expert(experts, E)  # [T*k], [E]
    x = h[order // top_k]  # [T*k, D], rows grouped by expert
    gate = grouped_matmul(x, w_gate, group_sizes)  # [T*k, F]
    up = grouped_matmul(x, w_up, group_sizes)  # [T*k, F]
    y = grouped_matmul(layers.gated_mlp(gate, up, act), w_down, group_sizes)  # [T*k, D]
    y = jnp.zeros_like(y).at[order].set(y, unique_indices=True)  # back to (token, choice)
    out = jnp.sum(y.reshape(T, top_k, D).astype(jnp.float32) * weights[..., None], axis=1)
    if real_tokens is not None:
        return out.astype(h.dtype), expert_token_counts(experts, real_tokens, E)
    return out.astype(h.dtype)  # [T, D]


def mlp_block(
    cfg: MoeConfig, h: Array, w, kind: str, proj, real_tokens: Array | None = None
) -> tuple[Array, tuple]:
    """The layer's MLP: dense (via `proj`, LoRA-capable) or sparse, by the layer's kind.
    Returns (out [T, D], aux): aux is () without `real_tokens`, else (expert token counts
    [E] int32,), zeros in a dense layer; a family's layer body returns (x, cache, *aux)."""
    if kind == DENSE:
        out = proj("w_down", layers.gated_mlp(proj("w_gate", h), proj("w_up", h), "silu"))
        no_counts = jnp.zeros(cfg.num_experts, jnp.int32)
        return out, () if real_tokens is None else (no_counts,)
    out = moe_mlp(
        h,
        w.router,
        w.moe_gate,
        w.moe_up,
        w.moe_down,
        top_k=cfg.num_experts_per_tok,
        routing=cfg.routing,
        norm_topk_prob=cfg.norm_topk_prob,
        grouped_matmul=grouped_matmul_fn(cfg.grouped_matmul),
        real_tokens=real_tokens,
    )
    return (out, ()) if real_tokens is None else (out[0], out[1:])


def moe_dense_reference(h, router, w_gate, w_up, w_down, *, top_k, routing, norm_topk_prob):
    """Every expert on every token, masked by the routing (tests): [T, D] float32."""
    logits = jnp.dot(h, router, preferred_element_type=jnp.float32)
    weights, experts = route(logits, top_k, routing, norm_topk_prob)
    E = router.shape[-1]
    dense_w = jnp.sum(jax.nn.one_hot(experts, E) * weights[..., None], axis=1)  # [T, E]
    gate = jnp.einsum("td,edf->tef", h, w_gate)
    up = jnp.einsum("td,edf->tef", h, w_up)
    y = jnp.einsum("tef,efd->ted", layers.gated_mlp(gate, up, "silu"), w_down)
    return jnp.einsum("ted,te->td", y, dense_w)


# ---- loading -------------------------------------------------------------------------------
def expert_stacks(t, prefix: str, cfg: MoeConfig, names: dict[str, str]) -> dict:
    """One sparse layer's router and expert stacks in our layout. `t(name, hf_shape,
    optional=False)` reads a checked float32 tensor (None for a missing optional one);
    `names` maps "router", "gate", "up", "down" to Hugging Face's per-expert suffixes (`{e}`:
    the expert index) and "stacked" to the suffix format of one stacked tensor per
    projection (`{p}`: gate / up / down; PyTorch [E, out, in], as GGUF stores experts),
    which is read first when present."""
    import numpy as np

    D, E, Fm = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_size
    shapes = {"gate": (Fm, D), "up": (Fm, D), "down": (D, Fm)}

    def stack(key):
        if "stacked" in names:
            whole = t(prefix + names["stacked"].format(p=key), (E, *shapes[key]), optional=True)
            if whole is not None:
                return whole.transpose(0, 2, 1)
        return np.stack([t(prefix + names[key].format(e=e), shapes[key]).T for e in range(E)])

    return {
        "router": t(prefix + names["router"], (E, D)).T,  # [D, E]
        "moe_gate": stack("gate"),  # [E, D, Fm]
        "moe_up": stack("up"),  # [E, D, Fm]
        "moe_down": stack("down"),  # [E, Fm, D]
    }


def zero_layer(shapes, fields) -> dict:
    """Zeros for `fields` of one layer (the other kind's weights in a mixed model)."""
    import numpy as np

    return {f: np.zeros(getattr(shapes, f).shape[1:], np.float32) for f in fields}


def hf_expert_fields(c: dict, path: str) -> dict:
    """The MoE fields of a config.json: both `num_experts` and `num_local_experts` are read
    (Hub checkpoints and transformers 5 write different ones); a clash is an error."""
    counts = {k: c[k] for k in ("num_experts", "num_local_experts") if c.get(k) is not None}
    if not counts:
        raise ModelLoadError(f"{path!r}: neither num_experts nor num_local_experts is set")
    if len(set(counts.values())) > 1:
        raise ModelLoadError(f"{path!r}: expert counts disagree: {counts}")
    if "num_experts_per_tok" not in c:
        raise ModelLoadError(f"{path!r}: key 'num_experts_per_tok' is missing")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{path!r}: hidden_act={act!r} is not supported (supported: silu)")
    return dict(
        num_experts=int(next(iter(counts.values()))),
        num_experts_per_tok=int(c["num_experts_per_tok"]),
    )


def check_divides(cfg: MoeConfig, axis: str, size: int) -> None:
    """Raises ValueError unless `size` divides the expert count (expert sharding)."""
    if cfg.num_experts % size:
        allowed = [d for d in range(1, cfg.num_experts + 1) if cfg.num_experts % d == 0]
        raise ValueError(
            f"num_experts={cfg.num_experts} is not divisible by the {axis} axis ({size}); "
            f"allowed {axis} sizes: {allowed}"
        )


def expert_bytes(cfg: MoeConfig, dtype_bytes: int) -> int:
    """Bytes of all expert stacks (the part expert parallelism divides)."""
    per_expert = 3 * cfg.hidden_size * cfg.moe_ffn_size * dtype_bytes
    return sum(cfg.sparse_layers) * cfg.num_experts * per_expert
