"""The device side of a step: the jitted step, its compiled programs, the KV cache pytree,
penalty counts, step shapes and the warm-up that builds them.

    step.py               engine_step: forward + sample, one jitted function of a StepBatch
    programs.py           the step programs EngineCore compiles (greedy/full sampler, variants)
    kv_cache.py           PagedKVCache: the paged K/V pytree
    kv_offload.py         KVOffload: copies between the KV cache and the prefix cache's host tier
    penalties.py          EngineCore's per-slot token counts and prompt mask (a mixin)
    shapes.py             ShapeSet: the fixed set of step shapes an engine compiles
    warmup.py             builds (and optionally runs) every program of the shape set
    compiles.py           counts XLA programs built (jax.monitoring)
    compilation_cache.py  JAX's persistent compilation cache

May import: configs, models, pallas_kernels, engine's top level (api_types, errors),
engine/sched/, engine/batch/, engine/sampling/, engine/structured/. Never serving.
"""
