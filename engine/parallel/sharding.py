"""Tensor parallelism over a `jax.sharding` mesh: mesh from a string, one logical-axis rules
table, param and KV-cache shardings, KV-head replication, and data-parallel replicas.

    mesh = make_mesh("data:2,model:4")            # axes ("data", "expert", "model"), always all
    cfg, params = shard_params(params, cfg, mesh)  # Megatron layout; may replicate KV heads
    kv = PagedKVCache.zeros(cfg, ..., sharding=kv_sharding(mesh))

Megatron-style over `model` (Shoeybi et al. 2019): Q/K/V column-parallel by heads, the
output projection row-parallel (heads on its input axis), MLP gate/up column-parallel and
down row-parallel, embedding and LM head by vocab, norms replicated. Inside the jitted step
XLA inserts the collectives (one all-reduce after `wo` and one after `w_down` per layer, an
all-gather of the logits before sampling); the attention kernels run per shard under
`jax.shard_map` (`engine.runner.step.paged_attention_fn`), each shard on its own KV heads.

KV heads: the cache is sharded by KV head, so every shard needs whole KV heads for its own
query heads. With model axis m and K KV heads:
    m <= K: K % m == 0 required; each shard holds K/m KV heads (no extra memory).
    m  > K: m % K == 0 required; each KV head is replicated r = m/K times (the weights wk/wv
            and bk/bv are repeated along the head axis, and the engine's config says
            num_kv_heads = m). KV memory over the whole mesh grows r-fold; per device it is
            1 head instead of K/m (a multiplier of r on what perfect sharding would give).
Query heads and the FFN must divide evenly: H % m == 0, F % m == 0. SmolLM2 (H=9, K=3,
F=1536) therefore runs at model 1 or 3 only (2/4/8 do not divide 9 heads; 9 does not divide
F). We chose this over padding query heads with zeros, which would waste 1/3 to 7/9 of the
attention compute and complicate the GQA grouping; the error names the field, the value and
the allowed degrees (`allowed_model_degrees(cfg)`).

Expert axis (mixture-of-experts models, models/moe.py): `expert:e` splits every expert stack
[L, E, D, F] on E, e ways (E % e == 0, refused otherwise; a dense model is refused: the
axis would only copy it). Everything else is replicated across the axis: each of its
devices holds the attention weights and KV cache of its model shard and computes the same
attention (the engine runs one batch per core, so there is no batch to split there). In the
sparse MLP (one `ragged_dot` per projection) XLA's partitioner gives each device the rows of
its own experts (the others' rows come out zero) and all-reduces the projections' [T*k, F]
and [T*k, D] outputs: local compute plus an all-reduce, no all-to-all and no weight
all-gather (the tokens are already on every device). Weight memory per device: the expert
stacks / e; KV: unchanged (not divided by e). With the axis the model runs the
`ragged_dot` form of the grouped matmul (`MoeConfig.grouped_matmul`): the CPU loops index
one expert at a time, which the partitioner would serve by gathering the stacks.

Data axis: `data:d` runs d independent engine replicas, replica g on mesh row g (its own
params copy, KV cache, scheduler and page pool; `replica_meshes`): engine/parallel/replicas.py's
`DataParallelEngine` routes each request to the least loaded one, and engine/factory.py's
`create_engine` picks it when the data axis is > 1. This module imports no engine.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from configs.model_config import ModelConfig
from models.llama import Params, param_axes
from models.quant import quant_config_of, quantized_param_shapes, quantized_shardings, repeat_heads

DATA, EXPERT, MODEL = "data", "expert", "model"
AXES = (DATA, EXPERT, MODEL)
_ALIASES = {"data": DATA, "dp": DATA, "expert": EXPERT, "ep": EXPERT, "model": MODEL, "tp": MODEL}

# Logical axis -> mesh axis (None: replicated). The one place a layout decision lives. Each
# param declares its logical axes next to its shape (the fields of models.llama.LayerWeights
# and Params); the KV cache's are KV_CACHE_AXES below.
LOGICAL_RULES: dict[str, str | None] = {
    "batch": DATA,
    "layers": None,
    "embed": None,  # hidden D
    "vocab": MODEL,
    "heads": MODEL,
    "kv_heads": MODEL,
    "head_dim": None,
    "ffn": MODEL,
    "experts": EXPERT,  # mixture-of-experts stacks (models/moe.py)
    "moe_ffn": MODEL,  # each expert's FFN width: tensor-parallel like "ffn"
    "expert_logits": None,  # the router's output: every shard routes every token
    "pages": None,
    "page_slot": None,
    "lora_slots": None,  # LoRA adapter slot stacks (engine/lora/adapters.py)
    "lora_rank": None,
}

KV_CACHE_AXES = ("layers", "kv_heads", "pages", "page_slot", "head_dim")


class ShardingConfigError(ValueError):
    """A mesh that cannot shard this model; the message names field, value and limit."""


# ---- mesh --------------------------------------------------------------------------------
def parse_mesh_spec(spec: str) -> dict[str, int]:
    """ "model:4" / "data:2,expert:2" / "tp=2" -> {"data": d, "expert": e, "model": m}
    (missing axes = 1)."""
    sizes = {DATA: 1, EXPERT: 1, MODEL: 1}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(\w+)\s*[:=]\s*(\d+)", part)
        if not m or m.group(1) not in _ALIASES or int(m.group(2)) < 1:
            raise ShardingConfigError(
                f"mesh={spec!r}: bad entry {part!r}; expected 'data:N', 'expert:N' and/or "
                f"'model:N' (N >= 1), e.g. 'data:2,model:4'"
            )
        sizes[_ALIASES[m.group(1)]] = int(m.group(2))
    return sizes


def make_mesh(spec: str | Mesh, devices=None) -> Mesh:
    """A ("data", "expert", "model") mesh over the first data*expert*model of `devices`
    (default: all)."""
    if isinstance(spec, Mesh):
        return spec
    sizes = parse_mesh_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    need = mesh_devices(sizes)
    if need > len(devices):
        raise ShardingConfigError(f"mesh={spec!r} needs {need} devices; {len(devices)} available")
    grid = np.array(devices[:need], dtype=object).reshape(*(sizes[a] for a in AXES))
    return Mesh(grid, AXES)


def mesh_devices(sizes: dict[str, int]) -> int:
    """Devices a parsed mesh spec needs."""
    return sizes[DATA] * sizes[EXPERT] * sizes[MODEL]


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One (1, expert, model) mesh per data row: the devices of each data-parallel replica."""
    return [Mesh(mesh.devices[g : g + 1], AXES) for g in range(mesh.shape[DATA])]


def model_axis_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[MODEL]


def expert_axis_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else dict(mesh.shape).get(EXPERT, 1)


def check_expert_axis(cfg: ModelConfig, e: int) -> None:
    """The expert axis must divide the experts; a dense model takes none (e == 1)."""
    if e == 1:
        return
    experts = getattr(cfg, "num_experts", None)
    if experts is None:
        raise ShardingConfigError(
            f"expert axis {e} cannot shard {cfg.name}: it is not a mixture-of-experts model "
            f"(allowed expert axis sizes: [1])"
        )
    if experts % e:
        allowed = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ShardingConfigError(
            f"expert axis {e} cannot shard {cfg.name}: num_experts={experts} must be "
            f"divisible by the expert axis ({e}); allowed expert axis sizes: {allowed}"
        )


# ---- layout checks and KV replication ------------------------------------------------------
def allowed_model_degrees(cfg: ModelConfig, limit: int = 64) -> list[int]:
    return [m for m in range(1, limit + 1) if _layout_error(cfg, m) is None]


def _layout_error(cfg: ModelConfig, m: int) -> str | None:
    H, K = cfg.num_heads, cfg.num_kv_heads
    if H % m:
        return f"num_heads={H} must be divisible by the model axis ({m})"
    if m <= K and K % m:
        return f"num_kv_heads={K} must be divisible by the model axis ({m}) when it is <= {K}"
    if m > K and m % K:
        return (
            f"the model axis ({m}) must be a multiple of num_kv_heads={K} when it is "
            f"larger (KV heads are replicated {m}/{K} times)"
        )
    if cfg.ffn_size % m:
        return f"ffn_size={cfg.ffn_size} must be divisible by the model axis ({m})"
    moe_ffn = getattr(cfg, "moe_ffn_size", 0)
    if moe_ffn % m:
        return f"moe_ffn_size={moe_ffn} must be divisible by the model axis ({m})"
    return None


def check_model_axis(cfg: ModelConfig, m: int) -> None:
    err = _layout_error(cfg, m)
    if err:
        raise ShardingConfigError(
            f"model axis {m} cannot shard {cfg.name}: {err}; allowed "
            f"model axis sizes: {allowed_model_degrees(cfg)}"
        )


def kv_replication(cfg: ModelConfig, m: int) -> int:
    """How many copies of each KV head the mesh holds (the KV memory multiplier)."""
    return max(1, m // cfg.num_kv_heads)


def sharded_config(cfg: ModelConfig, m: int) -> ModelConfig:
    """The config the engine runs: num_kv_heads raised to m when KV heads are replicated."""
    check_model_axis(cfg, m)
    r = kv_replication(cfg, m)
    return cfg if r == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * r)


def replicate_kv_heads(params: Params, r: int) -> Params:
    """Repeats each KV head r times (head k -> k*r .. k*r+r-1), so query head h still reads a
    copy of its original KV head h // (H/K): (h // (H/(K r))) // r == h // (H/K)."""
    if r == 1:
        return params
    rep = lambda a, axis: repeat_heads(a, r, axis)  # noqa: E731 (int8 weights: q and scale)
    w = params.layers
    layers = dataclasses.replace(
        w, wk=rep(w.wk, 2), wv=rep(w.wv, 2), bk=rep(w.bk, 1), bv=rep(w.bv, 1)
    )
    return dataclasses.replace(params, layers=layers)


# ---- shardings ---------------------------------------------------------------------------
def logical_to_spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """Maps logical axes through LOGICAL_RULES; an axis whose dim the mesh axis does not
    divide stays replicated (only vocab can: heads/ffn are checked up front)."""
    out, sizes = [], dict(mesh.shape)
    for name, dim in zip(axes, shape):
        mesh_axis = LOGICAL_RULES[name]
        size = sizes.get(mesh_axis, 1)  # a mesh without the axis: replicated
        ok = mesh_axis is not None and dim % size == 0
        out.append(mesh_axis if ok and size > 1 else None)
    while out and out[-1] is None:  # NOTE: the canonical short form, as jit returns it: a
        out.pop()  # KV cache placed with P(None, m, None...) would compile
    return P(*out)  # its first step twice (different cache key)


def _named(mesh: Mesh, axes, shape) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))


def param_shardings(cfg: ModelConfig, mesh: Mesh, quant=None) -> Params:
    """NamedShardings matching `models.llama.param_shapes(cfg)` (None where a param is None),
    from the logical axes each param field declares in `models/llama.py`. For a
    checkpoint-shaped cfg whose K the model axis does not divide, wk/wv come out replicated
    (they are repeated and resharded by `shard_params` afterwards). With a `quant` config
    (configs.quant_config), int8 weights get Int8Weight(q, scale) shardings: each scale
    split like its weight's output axes (models.quant.quantized_shardings)."""
    from models.families import param_shapes

    shapes = param_shapes(cfg)
    float_shardings = _field_shardings(shapes, mesh)
    if quant is None or not quant.enabled:
        return float_shardings
    return quantized_shardings(float_shardings, quantized_param_shapes(shapes, quant), quant)


def _field_shardings(shapes, mesh: Mesh):
    """The same dataclass tree as `shapes`, each array replaced by its NamedSharding."""
    out = {}
    for field in dataclasses.fields(shapes):
        x = getattr(shapes, field.name)
        if x is None:
            out[field.name] = None
        elif dataclasses.is_dataclass(x):  # Params.layers
            out[field.name] = _field_shardings(x, mesh)
        else:
            out[field.name] = _named(mesh, param_axes(field), x.shape)
    return type(shapes)(**out)


def loader_shardings(mesh: str | Mesh):
    """`shardings_for(cfg)` for `models.registry.load_model`: the checkpoint-layout shardings
    on the first data replica's devices (the others copy device to device)."""
    first = replica_meshes(make_mesh(mesh))[0]

    def shardings_for(cfg: ModelConfig) -> Params:
        check_model_axis(cfg, model_axis_size(first))
        check_expert_axis(cfg, expert_axis_size(first))
        return param_shardings(cfg, first)

    return shardings_for


def kv_sharding(mesh: Mesh, cfg: ModelConfig) -> NamedSharding:
    """KV pages [L, K, N, page_size, hd] by KV head (scales [L, K, N, page_size] take the
    same spec: a spec shorter than the rank leaves the rest replicated)."""
    shape = (cfg.num_layers, cfg.num_kv_heads, 1, 1, cfg.head_dim)
    return _named(mesh, KV_CACHE_AXES, shape)


def shard_params(params: Params, cfg: ModelConfig, mesh: Mesh) -> tuple[ModelConfig, Params]:
    """Places `params` (checkpoint layout) on `mesh`; returns the engine's (cfg, params).
    Host numpy leaves go straight to their shards; already-placed leaves are resharded."""
    m = model_axis_size(mesh)
    check_expert_axis(cfg, expert_axis_size(mesh))
    run_cfg = sharded_config(cfg, m)
    if expert_axis_size(mesh) > 1:  # the loops would gather every expert to each device
        run_cfg = dataclasses.replace(run_cfg, grouped_matmul="ragged_dot")
    quant = quant_config_of(params)
    params = put_global(params, param_shardings(cfg, mesh, quant))
    r = kv_replication(cfg, m)
    if r > 1:
        out = param_shardings(run_cfg, mesh, quant)
        params = jax.jit(replicate_kv_heads, static_argnums=1, out_shardings=out)(params, r)
    return run_cfg, params


def put_global(tree, shardings):
    """device_put of each leaf with its sharding; works across processes (every process
    passes the same host value) because each process only builds its addressable shards."""

    def put(x, s):
        if isinstance(x, jax.Array) and x.sharding == s:
            return x
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.jit(lambda a: a, out_shardings=s)(x)
        if isinstance(x, jax.Array) and s.is_fully_addressable:
            return jax.device_put(x, s)  # device to device, shard by shard
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

    return jax.tree.map(put, tree, shardings)


def bytes_per_device(tree) -> dict[int, int]:
    """Bytes each device holds of a pytree of jax.Arrays (its addressable shards)."""
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def engine_mesh(mesh: str | Mesh) -> Mesh:
    """The mesh one EngineCore runs on: data axis 1 (data replicas: `create_engine`)."""
    mesh = make_mesh(mesh)
    if mesh.shape[DATA] != 1:
        raise ShardingConfigError(
            f"mesh data axis={mesh.shape[DATA]}: one EngineCore runs one data replica (limit "
            f"1); build data-parallel engines with engine.factory.create_engine"
        )
    return mesh


def replicate(x, mesh: Mesh):
    """x copied whole to every device of the mesh."""
    return put_global(x, NamedSharding(mesh, P()))
