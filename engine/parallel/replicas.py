"""Data parallelism: d independent EngineCores behind the one engine interface
(engine/interface.py), replica g on row g of a ("data", "expert", "model") mesh.

engine/factory.py's `create_engine` builds one of these when the mesh's data axis is > 1.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from engine.core import EngineCore
from engine.parallel.sharding import replica_meshes


class DataParallelEngine:
    """d independent EngineCores, replica g on mesh row g (own params copy, KV cache,
    scheduler, page pool). A request goes to the replica with the fewest unfinished requests
    and stays there; `step()` steps every busy replica.

    NOTE: replicas step one after another on the caller's thread; with overlapped steps
    (the default, engine/core.py) each replica dispatches its next step before waiting for
    its previous one, so the replicas' device work overlaps too. Each replica has its own
    page pool, so prefix-cache hits happen only within a replica."""

    def __init__(self, model, config, *, impl: str, mesh: Mesh):
        self.mesh = mesh
        self.replicas = [
            EngineCore(model, config, impl=impl, mesh=sub) for sub in replica_meshes(mesh)
        ]
        self.identity = self.replicas[0].identity
        self.tokenizer = self.replicas[0].tokenizer
        self.config = config
        self._home: dict[str, int] = {}

    def add_request(self, request, cache_salt: str | None = None) -> None:
        load = [len(r.scheduler.running) + len(r.scheduler.waiting) for r in self.replicas]
        g = int(np.argmin(load))
        self.replicas[g].add_request(request, cache_salt)
        self._home[request.request_id] = g

    def abort_request(self, request_id: str) -> None:
        g = self._home.get(request_id)
        if g is not None:
            self.replicas[g].abort_request(request_id)

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def step(self) -> list:
        outputs = []
        for r in self.replicas:
            if r.has_unfinished():
                outputs += r.step()
        for out in outputs:
            if out.finished:
                self._home.pop(out.request_id, None)
        return outputs

    def stats(self) -> dict:
        per = [r.stats() for r in self.replicas]
        out = {
            k: (
                sum(s[k] for s in per)
                if isinstance(v, (int, float)) and not isinstance(v, bool)
                else v
            )
            for k, v in per[0].items()
        }
        used, total = out["kv_pages_used"], out["kv_pages_total"]
        out["kv_usage"] = used / max(1, total)
        out["prefix_cache_hit_rate"] = out["prefix_cache_hit_tokens"] / max(
            1, out["prefix_cache_queries_tokens"]
        )
        out["num_data_replicas"] = len(self.replicas)
        out["max_model_len"] = per[0]["max_model_len"]
        out["page_size"] = per[0]["page_size"]
        for key in (
            "num_step_shapes",
            "num_compiled_steps",
            "compiles_total",
            "compile_seconds_total",
        ):
            out[key] = per[0][key]  # per process (engine/runner/compiles.py), not per replica
        if "moe_expert_tokens" in out:
            out.update(merged_expert_load(per))
            for key in ("moe_last_step_expert_tokens", "moe_last_step_imbalance"):
                out.pop(key)  # one step of one replica: not a figure of the whole engine
        return out


def merged_expert_load(per: list[dict]) -> dict:
    """The MoE expert load of d replicas' stats (engine/runner/expert_load.py): counts summed
    elementwise, the mean step imbalance weighted by each replica's steps."""
    steps = [s["moe_steps"] for s in per]
    mean = sum(s["moe_imbalance_mean"] * n for s, n in zip(per, steps)) / max(sum(steps), 1)
    return {
        "moe_steps": sum(steps),
        "moe_imbalance_mean": mean,
        **{
            key: np.sum([s[key] for s in per], axis=0).tolist()
            for key in ("moe_expert_tokens", "moe_expert_tokens_by_expert")
        },
    }
