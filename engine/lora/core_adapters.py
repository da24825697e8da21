"""EngineCore's side of LoRA: adapters by name, each request's adapter, each step's inputs.

    load_adapter(name, path) / unload_adapter(name)    between steps (engine/llm.py, serving)
    _acquire_adapter(er)     add_request: the adapter's content hash keys the prefix cache
    _release_adapter(id)     the request left the engine (or its admission failed)
    _lora_inputs(batch, shape)   the step program's `lora` argument; None without adapters

The slots themselves (names -> device slots, requests -> slots, a step's rows -> slots) are
engine/lora/adapters.py's AdapterManager; `self.adapters` is one, or None when
EngineConfig.max_loras is 0 (then every call here is a no-op, or an error naming max_loras).
A mixin of EngineCore (engine/core.py), separate from the host loop because none of it is
about a step's order; it reads config, sched_config, cfg, params and mesh from EngineCore.
"""

from __future__ import annotations

from engine.api_types import EngineRequest
from engine.batch.builder import BatchShape, StepBatch
from engine.errors import InvalidRequestError
from engine.lora.adapters import AdapterManager, UnknownAdapterError
from models.llama import LayerWeights


class EngineAdapters:
    """LoRA adapters of an EngineCore (see above)."""

    def _adapter_manager(self, model, device_or_sharding):
        if not self.config.max_loras:
            return None
        return AdapterManager(
            model.config,
            self.cfg,
            max_loras=self.config.max_loras,
            max_lora_rank=self.config.max_lora_rank,
            max_num_seqs=self.sched_config.max_num_seqs,
            dtype=self.params.embed.dtype,
            mesh=self.mesh,
            device=None if self.mesh is not None else device_or_sharding,
            unrolled=not isinstance(self.params.layers, LayerWeights),
        )

    def load_adapter(self, name: str, path: str):
        """Installs a PEFT LoRA adapter under `name` (between steps; safe while requests
        run). Returns its AdapterRef. Needs EngineConfig(max_loras >= 1)."""
        if self.adapters is None:
            raise InvalidRequestError("max_loras", 0, ">= 1 to load LoRA adapters")
        return self.adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        if self.adapters is None:
            raise UnknownAdapterError(name, [])
        self.adapters.unload(name)

    def _acquire_adapter(self, er: EngineRequest):
        if er.adapter is None:
            return None
        if self.adapters is None:
            raise UnknownAdapterError(er.adapter, [])
        return self.adapters.acquire(er.request_id, er.adapter)

    def _release_adapter(self, request_id: str) -> None:
        if self.adapters is not None:
            self.adapters.release(request_id)

    def _lora_inputs(self, batch: StepBatch | None, shape: BatchShape):
        return None if self.adapters is None else self.adapters.inputs(batch, shape)
