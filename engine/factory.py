"""Engine creation: the one place that decides which engine a model and a mesh get.

    create_engine(model, config)                          EngineCore, one device
    create_engine(model, config, mesh="model:4")          EngineCore, tensor parallel
    create_engine(model, config, mesh="data:2,model:4")   DataParallelEngine
                                                          (engine/parallel/replicas.py)

Multi-host engines: engine/parallel/distributed.py's `create_multihost_engine`.
"""

from __future__ import annotations

from jax.sharding import Mesh

from engine.core import EngineCore
from engine.parallel.replicas import DataParallelEngine
from engine.parallel.sharding import DATA, make_mesh


def create_engine(model, config, *, impl: str = "auto", mesh: str | Mesh | None = None):
    """EngineCore for no mesh or data axis 1, else a DataParallelEngine over the data rows.
    `model`: a models.registry.LoadedModel; `config`: a configs.engine_config.EngineConfig."""
    if mesh is None:
        return EngineCore(model, config, impl=impl)
    mesh = make_mesh(mesh)
    if mesh.shape[DATA] == 1:
        return EngineCore(model, config, impl=impl, mesh=mesh)
    return DataParallelEngine(model, config, impl=impl, mesh=mesh)
