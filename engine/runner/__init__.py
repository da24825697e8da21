"""The device side of a step: the runner that owns params and device state, the jitted
step, its programs, the KV cache pytree, penalty counts, step shapes and warm-up.

    model_runner.py       ModelRunner: params + DeviceState; program / run / verify /
                          compile / reset_slot (the one owner of device state)
    state.py              DeviceState: KV cache, penalty counts, prompt mask, last tokens
    step.py               engine_step: forward + sample, one jitted function of a StepBatch
    programs.py           StepProgram (greedy/full sampler, penalties, bitmask), the bitmask
    kv_cache.py           PagedKVCache: the paged K/V pytree
    kv_offload.py         KVOffload: copies between the KV cache and the prefix cache's host tier
    penalties.py          the per-slot token counts and prompt mask: allocate, reset a slot
    shapes.py             ShapeSet: the fixed set of step shapes an engine compiles
    warmup.py             builds (and optionally runs) every program of the shape set
    compiles.py           counts XLA programs built (jax.monitoring)
    expert_load.py        ExpertLoad: an MoE step's tokens per expert and imbalance (host)
    compilation_cache.py  JAX's persistent compilation cache

May import: configs, models, pallas_kernels, engine's top level (api_types, errors),
engine/sched/, engine/batch/, engine/sampling/, engine/structured/, engine/lora/,
engine/parallel/. Never engine/spec/ (it imports the runner: the verify program is handed
in) and never serving.
"""
