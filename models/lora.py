"""LoRA adapters: PEFT directories read into host arrays, and the batched LoRA matmul.

A PEFT LoRA adapter adds to a projection `y = x @ W` the low-rank term

    y += scaling * (x @ A) @ B        A [*in, r], B [r, *out]
    scaling = lora_alpha / r          (PEFT's default)
            = lora_alpha / sqrt(r)    (use_rslora=True)

`read_adapter(path, cfg, max_rank)` reads `adapter_config.json` + `adapter_model.safetensors`
into a `LoraAdapter`: per target projection (a `LayerWeights` field: wq wk wv wo w_gate w_up
w_down), A [L, *in, r] and B [L, r, *out] with `scaling` folded into B, in the model's
layout (Hugging Face's: PEFT adapters made on the transformers model map one to one, the
GGUF loader having undone llama.cpp's Q/K permutation). Everything a file can get wrong is a
`LoraConfigError` naming the field, the value and the limit: a rank above `max_rank`, a
target the model lacks, a tensor shaped for another base model, PEFT options the forward
does not implement (DoRA, biases, modules_to_save, per-module rank/alpha patterns).

Serving many adapters in one batch (the Punica/BGMV idea, in the form that is two dense
matmuls): the engine keeps every loaded adapter in fixed device slots, `LoraWeights`

    a[target]  [L, *in, N, R]      N = max_loras slots, R = max_lora_rank (zero padded)
    b[target]  [L, N, R, *out]

and each token row carries its adapter slot (0 = base model, s = stored slot s - 1). Per
layer and target, with I = prod(in), O = prod(out):

    xa    = x [T, I] @ a [I, N*R]             every slot's x·A (one matmul, N*R columns)
    xa   *= mask [T, N*R]                     keep the R columns of the row's own slot
    delta = xa @ b [N*R, O]                   only that slot's B contributes

NOTE: a literal per-row gather of A/B (`a[:, slot_of_row]` -> [T, I, R]) copies T*I*R
floats per projection and then runs T matrix-vector products; on XLA:CPU that is memory
bound: for a SmolLM2 gate projection (I 576, O 1536, N 4, R 16) the masked form took
0.07 ms at T=32 and 0.29 ms at T=256, the gather 0.14 ms and 15 ms (min of 30, load 22;
benchmarks/RESULTS.md, "LoRA"). The masked matmul does N x the gather's flops, at matmul
speed. The mask IS the gather:
`lora_row_mask` builds it once per forward from the rows' slot ids. `lora_delta_gather` is
the literal BGMV form, kept as the test reference and for accelerators with many slots.

Shapes never depend on which adapters are loaded: loading writes one slot of the stack
(`write_slot`, jitted with the stack donated), so nothing recompiles. The slot axis sits
after L so `lax.scan` over layers slices a layer's slots together with its base weights.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from configs.model_config import ModelConfig

Array = jax.Array

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# PEFT module name -> (LayerWeights field, number of contracted axes of that field after L)
LORA_TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("wq", 1),
    "k_proj": ("wk", 1),
    "v_proj": ("wv", 1),
    "o_proj": ("wo", 2),
    "gate_proj": ("w_gate", 1),
    "up_proj": ("w_up", 1),
    "down_proj": ("w_down", 1),
}
TARGET_FIELDS = tuple(field for field, _ in LORA_TARGETS.values())
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(LORA_TARGETS) + r")\.lora_([AB])"
    r"\.weight$"
)


class LoraConfigError(ValueError):
    """An adapter this engine cannot serve: names the field, the value and the limit."""

    def __init__(self, field: str, value, limit: str):
        self.field, self.value, self.limit = field, value, limit
        super().__init__(f"adapter {field}={value!r} is invalid: {limit}")


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """LayerWeights field -> (in shape, out shape) of its projection (no L axis)."""
    if hasattr(cfg, "num_experts"):
        raise LoraConfigError(
            "model", cfg.name, "LoRA is not supported for mixture-of-experts models"
        )
    D, H, K, hd, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_size
    return {
        "wq": ((D,), (H, hd)),
        "wk": ((D,), (K, hd)),
        "wv": ((D,), (K, hd)),
        "wo": ((H, hd), (D,)),
        "w_gate": ((D,), (F,)),
        "w_up": ((D,), (F,)),
        "w_down": ((F,), (D,)),
    }


# ---- one adapter on the host -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One PEFT adapter, read and checked against a model config (host numpy arrays)."""

    path: str
    content_hash: str  # "sha256:<hex>" of adapter_config.json + adapter_model.safetensors
    rank: int  # r
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    a: dict[str, np.ndarray]  # target field -> [L, *in, r]
    b: dict[str, np.ndarray]  # target field -> [L, r, *out], scaling folded in

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(sorted(self.a))


def read_adapter(path: str, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Reads a PEFT LoRA directory for a model of `cfg` (LoraConfigError on bad input,
    FileNotFoundError when a file is missing)."""
    from safetensors import safe_open

    config_path, weights_path = (os.path.join(path, n) for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS))
    for p in (config_path, weights_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"LoRA adapter {path!r}: {os.path.basename(p)} is missing")
    with open(config_path, "rb") as f:
        config_bytes = f.read()
    peft = json.loads(config_bytes)
    rank, scaling, listed = _check_peft_config(peft, max_rank)
    try:
        handle = safe_open(weights_path, framework="numpy")
    except Exception as e:
        raise LoraConfigError("adapter_model.safetensors", weights_path, f"unreadable: {e}") from e
    found: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
        m = _KEY.search(key)
        if m is None:
            raise LoraConfigError(
                "tensor", key, f"not a LoRA A/B of one of {sorted(LORA_TARGETS)} in a layer"
            )
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= cfg.num_layers:
            raise LoraConfigError("tensor", key, f"layer {layer} >= num_layers={cfg.num_layers}")
        found.setdefault((module, which), {})[layer] = handle.get_tensor(key)
    modules = sorted({module for module, _ in found})
    missing = sorted(set(listed or ()) - set(modules))
    if missing:
        raise LoraConfigError("target_modules", missing, "listed but no tensors in the file")
    a, b = {}, {}
    for module in modules:
        field = LORA_TARGETS[module][0]
        a[field], b[field] = _stack_target(cfg, module, found, rank, scaling)
    return LoraAdapter(
        path=os.path.abspath(path),
        content_hash=_content_hash(config_bytes, weights_path),
        rank=rank,
        scaling=scaling,
        a=a,
        b=b,
    )


def _check_peft_config(peft: dict, max_rank: int) -> tuple[int, float, list[str] | None]:
    """(rank, scaling, listed target modules or None for a regex) of a PEFT LoraConfig."""
    if peft.get("peft_type", "LORA") != "LORA":
        raise LoraConfigError("peft_type", peft.get("peft_type"), "only 'LORA'")
    rank, alpha = peft.get("r"), peft.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise LoraConfigError("r", rank, "an int >= 1")
    if rank > max_rank:
        raise LoraConfigError("r", rank, f"<= max_lora_rank={max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraConfigError("lora_alpha", alpha, "a number")
    unsupported = {
        "use_dora": (False, None),
        "bias": ("none", None),
        "fan_in_fan_out": (False, None),
        "modules_to_save": (None, []),
        "rank_pattern": (None, {}),
        "alpha_pattern": (None, {}),
        "lora_bias": (False, None),
        "use_qalora": (False, None),
        "use_bdlora": (None, False),
        "alora_invocation_tokens": (None,),
        "layer_replication": (None,),
        "target_parameters": (None, []),
        "trainable_token_indices": (None,),
    }
    for name, allowed in unsupported.items():
        if peft.get(name) not in allowed:
            raise LoraConfigError(name, peft.get(name), f"only {allowed[0]!r} is served")
    targets = peft.get("target_modules")
    listed = None
    if isinstance(targets, (list, tuple)):
        listed = [t.rsplit(".", 1)[-1] for t in targets]
        unknown = sorted(set(listed) - set(LORA_TARGETS))
        if unknown:
            raise LoraConfigError("target_modules", unknown, f"supported: {sorted(LORA_TARGETS)}")
    use_rslora = bool(peft.get("use_rslora", False))
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    return rank, float(scaling), listed


def _stack_target(cfg: ModelConfig, module: str, found, rank: int, scaling: float):
    """PyTorch-layout lora_A [r, in] / lora_B [out, r] of every layer -> A [L, *in, r],
    B [L, r, *out] (scaling folded into B). Layers without tensors stay zero."""
    field = LORA_TARGETS[module][0]
    in_shape, out_shape = target_shapes(cfg)[field]
    n_in, n_out = math.prod(in_shape), math.prod(out_shape)
    a = np.zeros((cfg.num_layers, n_in, rank), np.float32)
    b = np.zeros((cfg.num_layers, rank, n_out), np.float32)
    expected = {"A": (rank, n_in), "B": (n_out, rank)}
    for which, out in (("A", a), ("B", b)):
        for layer, t in found.get((module, which), {}).items():
            if tuple(t.shape) != expected[which]:
                raise LoraConfigError(
                    f"layers.{layer}.{module}.lora_{which}.weight shape",
                    tuple(t.shape),
                    f"{expected[which]} for this base model (r={rank})",
                )
            out[layer] = np.asarray(t, np.float32).T
    b *= np.float32(scaling)
    return a.reshape(cfg.num_layers, *in_shape, rank), b.reshape(cfg.num_layers, rank, *out_shape)


def _content_hash(config_bytes: bytes, weights_path: str) -> str:
    h = hashlib.sha256()
    h.update(hashlib.sha256(config_bytes).digest())
    with open(weights_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


# ---- the device slot stack -----------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraWeights:
    """Every slot's A and B, per target field (see the module docstring for the layout).
    Leaves carry a leading L axis (stacked) like `LayerWeights`; `forward` slices a layer."""

    a: dict[str, Array]  # field -> [L, *in, N, R]
    b: dict[str, Array]  # field -> [L, N, R, *out]

    @property
    def num_slots(self) -> int:  # N (stacked [L, *in, N, R] or one layer's [*in, N, R])
        return next(iter(self.a.values())).shape[-2]

    @property
    def max_rank(self) -> int:  # R
        return next(iter(self.a.values())).shape[-1]


@jax.jit
def split_layers(weights: LoraWeights) -> tuple[LoraWeights, ...]:
    """One LoraWeights per layer (copies), for the unrolled layer loop
    (`models.llama.layer_layout`): a layer reads its own arrays instead of copying a slice
    of the stack every step."""
    num_layers = next(iter(weights.a.values())).shape[0]
    return tuple(jax.tree.map(lambda x, i=i: x[i], weights) for i in range(num_layers))


def lora_shapes(cfg: ModelConfig, max_loras: int, max_rank: int, dtype=jnp.float32):
    """The abstract slot stack (ShapeDtypeStruct leaves) for `max_loras` adapters."""
    L, N, R = cfg.num_layers, max_loras, max_rank
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    shapes = target_shapes(cfg)
    return LoraWeights(
        a={f: s(L, *shapes[f][0], N, R) for f in TARGET_FIELDS},
        b={f: s(L, N, R, *shapes[f][1]) for f in TARGET_FIELDS},
    )


def init_lora_weights(cfg: ModelConfig, max_loras: int, max_rank: int, dtype=jnp.float32):
    """An all-zero slot stack (every slot serves the base model)."""
    shapes = lora_shapes(cfg, max_loras, max_rank, dtype)
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)


def adapter_slot_arrays(adapter: LoraAdapter | None, cfg: ModelConfig, max_rank: int):
    """One slot's content as host arrays: field -> (a [L, *in, R], b [L, R, *out]), the
    adapter's rank zero padded to R, absent targets all zero (None: an empty slot)."""
    shapes = target_shapes(cfg)
    L, out = cfg.num_layers, {}
    for f in TARGET_FIELDS:
        a = np.zeros((L, *shapes[f][0], max_rank), np.float32)
        b = np.zeros((L, max_rank, *shapes[f][1]), np.float32)
        if adapter is not None and f in adapter.a:
            a[..., : adapter.rank] = adapter.a[f]
            b[:, : adapter.rank] = adapter.b[f]
        out[f] = (a, b)
    return out


@functools.partial(jax.jit, donate_argnums=0)
def write_slot(weights: LoraWeights, slot: Array, a: dict, b: dict) -> LoraWeights:
    """The stack with storage slot `slot` (int32 scalar, traced: one program for every slot)
    replaced by a [L, *in, R] / b [L, R, *out]; the old stack is donated (updated in place)."""

    def put_a(stack, x):  # stack [L, *in, N, R], x [L, *in, R]
        return jax.lax.dynamic_update_index_in_dim(stack, x.astype(stack.dtype), slot, axis=-2)

    def put_b(stack, x):  # stack [L, N, R, *out], x [L, R, *out]
        return jax.lax.dynamic_update_index_in_dim(stack, x.astype(stack.dtype), slot, axis=1)

    return LoraWeights(
        a={f: put_a(weights.a[f], a[f]) for f in weights.a},
        b={f: put_b(weights.b[f], b[f]) for f in weights.b},
    )


# ---- the batched delta (inside the jitted forward) --------------------------------------------
def lora_row_mask(row_slots: Array, num_slots: int, max_rank: int, dtype) -> Array:
    """row_slots [T] int32 (0 = base, s = storage slot s - 1) -> mask [T, N*R]: 1 on the R
    columns of the row's slot, 0 elsewhere (all 0 for base rows)."""
    onehot = jax.nn.one_hot(row_slots - 1, num_slots, dtype=dtype)  # [T, N]; -1 -> zeros
    return jnp.repeat(onehot, max_rank, axis=1)  # [T, N*R]


def lora_delta(x: Array, a: Array, b: Array, mask: Array) -> Array:
    """x [T, *in], one layer's a [*in, N, R] and b [N, R, *out], mask [T, N*R]
    -> [T, *out]: each row's own adapter's x·A·B (two 2-D matmuls over free reshapes)."""
    t = x.shape[0]
    n, r = a.shape[-2:]
    out_shape = b.shape[2:]
    xa = x.reshape(t, -1) @ a.reshape(-1, n * r)  # [T, N*R]
    delta = (xa * mask) @ b.reshape(n * r, -1)  # [T, O]
    return delta.reshape(t, *out_shape).astype(x.dtype)


def lora_delta_gather(x: Array, a: Array, b: Array, row_slots: Array) -> Array:
    """The literal BGMV form of `lora_delta`: gather each row's A [I, R] and B [R, O], then
    per-row products. Base rows (slot 0) gather slot 0 and are zeroed."""
    t = x.shape[0]
    n, r = a.shape[-2:]
    out_shape = b.shape[2:]
    idx = jnp.maximum(row_slots - 1, 0)  # [T]
    a_rows = jnp.moveaxis(a.reshape(-1, n, r)[:, idx], 1, 0)  # [T, I, R]
    b_rows = b.reshape(n, r, -1)[idx]  # [T, R, O]
    xa = jnp.einsum("ti,tir->tr", x.reshape(t, -1), a_rows)
    delta = jnp.einsum("tr,tro->to", xa, b_rows)
    delta = jnp.where((row_slots > 0)[:, None], delta, 0)
    return delta.reshape(t, *out_shape).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraInputs:
    """What `models.llama.forward` needs for LoRA: the slot stack and each row's slot."""

    weights: LoraWeights | tuple[LoraWeights, ...]  # stacked, or per layer (`split_layers`)
    row_slots: Array  # [T] int32: 0 = base, s = storage slot s - 1
