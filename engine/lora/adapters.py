"""LoRA adapters in the engine: names, device slots, and each step's per-row slot ids.

    llm = LLM("smollm2-135m", max_loras=4, max_lora_rank=16)
    llm.load_adapter("sql", "/path/to/peft_dir")     # read, checked, written into a free slot
    llm.generate(prompts, params, adapter="sql")     # or a list, one per prompt; None = base
    llm.unload_adapter("sql")                        # the slot frees when its requests end

`AdapterManager` (one per EngineCore, host side) owns the device slot stack
(`models.lora.LoraWeights`, N = max_loras slots of rank R = max_lora_rank) and:

- names -> slots. Row slot ids are 0 (base model) and 1..N (storage slot s - 1). Loading
  writes a free slot with one jitted, donated update (`models.lora.write_slot`): shapes
  never change, so nothing recompiles. A slot is free when no name points at it AND no
  request uses it: unloading or reloading a name while its requests run is safe (they finish
  on the weights they started with; a reload goes to another slot).
- requests -> slots: `acquire(request_id, name)` at admission (UnknownAdapterError for a
  name not loaded), `bind(batch_slot, request_id)` when the request takes a persistent batch
  slot (engine/batch/builder.py), `release(request_id)` when it leaves the engine.
- a step's rows -> slots: `row_slots(batch, shape)` [T] int32, derived from the StepBatch
  alone (decode rows: their batch slot; prefill rows: their sequence's, via query_start_p),
  so engine/batch/builder.py is untouched.

Identity: an adapter is known by the sha256 of its two files (`AdapterRef.content_hash`);
requests carry it as their `adapter_id`, which is part of every prefix-cache key
(engine/sched/page_pool.py), so an adapter's pages are never hit by the base model or another
adapter, and a reloaded adapter with new content never hits the old content's pages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from configs.model_config import ModelConfig
from engine.api_types import AdapterRef
from engine.errors import InvalidRequestError
from engine.lora.refs import AdapterSlotsFullError, UnknownAdapterError
from models.llama import LayerWeights, param_axes
from models.lora import (
    LORA_TARGETS,
    LoraInputs,
    LoraWeights,
    adapter_slot_arrays,
    init_lora_weights,
    lora_shapes,
    read_adapter,
    split_layers,
    write_slot,
)

BASE_SLOT = 0  # row slot id of the base model


class AdapterManager:
    def __init__(
        self,
        checkpoint_cfg: ModelConfig,
        run_cfg: ModelConfig,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_num_seqs: int,
        dtype=jnp.float32,
        mesh=None,
        device=None,
        unrolled: bool = False,
    ):
        """`checkpoint_cfg`: the model as loaded (what adapters are checked against);
        `run_cfg`: as the engine runs it (KV heads may be replicated under a mesh);
        `unrolled`: the engine's params are one LoraWeights per layer (`layer_layout`), so
        the forward gets the stack split per layer too (`split_layers`, after each load)."""
        if max_loras < 1:
            raise ValueError(f"max_loras={max_loras} is invalid: >= 1 for an AdapterManager")
        self.cfg, self.run_cfg = checkpoint_cfg, run_cfg
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self._shardings = (
            None if mesh is None else lora_shardings(run_cfg, mesh, max_loras, max_lora_rank)
        )
        weights = init_lora_weights(run_cfg, max_loras, max_lora_rank, dtype)
        self.weights: LoraWeights = self._place(weights, device)  # stacked [L, ...]
        self.unrolled = unrolled
        self._run_weights = split_layers(self.weights) if unrolled else self.weights
        self._named: dict[str, AdapterRef] = {}
        self._users = [0] * (max_loras + 1)  # [row slot] live requests using it
        self._held: list[AdapterRef | None] = [None] * (max_loras + 1)  # [row slot] content
        self._request_slot: dict[str, int] = {}
        self._batch_slot = np.zeros(max_num_seqs, np.int32)  # [batch slot] row slot id

    @property
    def run_weights(self) -> LoraWeights | tuple[LoraWeights, ...]:
        """The slot stack as the forward reads it (split per layer when unrolled)."""
        return self._run_weights

    # ---- names ------------------------------------------------------------------------------
    @property
    def loaded(self) -> dict[str, AdapterRef]:
        return dict(self._named)

    def load(self, name: str, path: str) -> AdapterRef:
        """Reads, checks and installs an adapter under `name` (replacing that name's old
        content, whose slot frees when its requests end). LoraConfigError / FileNotFoundError
        for bad files, AdapterSlotsFullError when no slot is free."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("adapter name", name, "a non-empty str")
        adapter = read_adapter(path, self.cfg, self.max_rank)
        old = self._named.get(name)
        if old is not None and old.content_hash == adapter.content_hash:
            return old
        slot = self._free_slot(name)
        self._write(slot, adapter)
        ref = AdapterRef(name, adapter.content_hash, adapter.path, adapter.rank, slot)
        self._named[name] = ref
        self._held[slot] = ref
        return ref

    def unload(self, name: str) -> None:
        if name not in self._named:
            raise UnknownAdapterError(name, sorted(self._named))
        del self._named[name]  # the slot frees once its last request ends

    def _free_slot(self, name: str) -> int:
        """A slot no OTHER name points at and no request uses (a reloaded name's own old
        slot qualifies once its requests are done)."""
        named = {ref.slot for n, ref in self._named.items() if n != name}
        for slot in range(1, self.max_loras + 1):
            if slot not in named and self._users[slot] == 0:
                return slot
        raise AdapterSlotsFullError(name, self.max_loras)

    def _write(self, slot: int, adapter) -> None:
        arrays = adapter_slot_arrays(adapter, self.cfg, self.max_rank)
        rep = self.run_cfg.num_kv_heads // self.cfg.num_kv_heads  # KV heads replicated
        a = {f: a for f, (a, _) in arrays.items()}
        b = {f: b for f, (_, b) in arrays.items()}  # [L, R, *out]
        for f in ("wk", "wv"):
            b[f] = np.repeat(b[f], rep, axis=2)  # [L, R, K * rep, hd]
        self.weights = write_slot(self.weights, jnp.int32(slot - 1), a, b)
        if self._shardings is not None:
            self.weights = jax.device_put(self.weights, self._shardings)
        self._run_weights = split_layers(self.weights) if self.unrolled else self.weights

    def _place(self, weights: LoraWeights, device) -> LoraWeights:
        if self._shardings is not None:
            return jax.device_put(weights, self._shardings)
        return weights if device is None else jax.device_put(weights, device)

    # ---- requests -----------------------------------------------------------------------------
    def acquire(self, request_id: str, name: str | None) -> AdapterRef | None:
        """The adapter a new request runs with (None: the base model)."""
        if name is None:
            return None
        ref = self._named.get(name)
        if ref is None:
            raise UnknownAdapterError(name, sorted(self._named))
        self._request_slot[request_id] = ref.slot
        self._users[ref.slot] += 1
        return ref

    def release(self, request_id: str) -> None:
        slot = self._request_slot.pop(request_id, None)
        if slot is not None:
            self._users[slot] -= 1

    def bind(self, batch_slot: int, request_id: str) -> None:
        """The request now holds persistent batch slot `batch_slot` (engine/batch/builder.py)."""
        self._batch_slot[batch_slot] = self._request_slot.get(request_id, BASE_SLOT)

    # ---- one step -------------------------------------------------------------------------------
    def row_slots(self, batch, shape) -> np.ndarray:
        """[Sd + Tp] int32 row slot id of each token row of a StepBatch (0 for padding)."""
        Sd, Sp = shape.num_decode, shape.num_prefill_seqs
        out = np.zeros(Sd + shape.num_prefill_tokens, np.int32)
        per_seq = self._batch_slot[batch.slot_ids]  # [Sd + Sp]: decodes, then prefills
        out[:Sd] = per_seq[:Sd]
        lens = np.diff(batch.query_start_p)  # [Sp] tokens of each prefill sequence
        out[Sd : Sd + int(lens.sum())] = np.repeat(per_seq[Sd : Sd + Sp], lens)
        return out

    def inputs(self, batch, shape) -> LoraInputs:
        """What engine_step passes to the forward for `batch` (a StepBatch; None: padding)."""
        if batch is None:
            rows = np.zeros(shape.num_decode + shape.num_prefill_tokens, np.int32)
        else:
            rows = self.row_slots(batch, shape)
        return LoraInputs(self.run_weights, rows)

    def stats(self) -> dict:
        named = {ref.slot for ref in self._named.values()}
        used = [s for s in range(1, self.max_loras + 1) if s in named or self._users[s]]
        return {
            "lora_slots": self.max_loras,
            "lora_slots_used": len(used),
            "lora_adapters_loaded": len(self._named),
        }


_NUM_IN = dict(LORA_TARGETS.values())  # field -> contracted axes after L


def lora_axes(field: str, which: str) -> tuple[str, ...]:
    """Logical axes of a slot stack's a/b leaf, derived from the base weight's declaration
    (models.llama.LayerWeights): A keeps the weight's input axes, B its output axes, so an
    adapter is split across a mesh exactly like the weight it adapts."""
    base = param_axes(next(f for f in dataclasses.fields(LayerWeights) if f.name == field))
    layers, num_in = base[0], _NUM_IN[field]
    if which == "a":
        return (layers, *base[1 : 1 + num_in], "lora_slots", "lora_rank")
    return (layers, "lora_slots", "lora_rank", *base[1 + num_in :])


def lora_shardings(cfg: ModelConfig, mesh, max_loras: int, max_rank: int) -> LoraWeights:
    """NamedShardings of the slot stack from `lora_axes` (each A split like its
    weight's input axes, each B like its output axes) through engine/parallel/sharding's rules."""
    from jax.sharding import NamedSharding

    from engine.parallel.sharding import logical_to_spec

    shapes = lora_shapes(cfg, max_loras, max_rank)

    def named(field, which, x):
        return NamedSharding(mesh, logical_to_spec(lora_axes(field, which), x.shape, mesh))

    return LoraWeights(
        a={f: named(f, "a", x) for f, x in shapes.a.items()},
        b={f: named(f, "b", x) for f, x in shapes.b.items()},
    )
