"""LoRA adapters: loading, device slots, each request's adapter.

    adapters.py       AdapterManager: names -> device slots, requests -> slots, a step's rows
    refs.py           adapter references and identities (no JAX)
    core_adapters.py  EngineCore's side of LoRA (a mixin): load/unload, per-request acquire

May import: configs, models, engine's top level, engine/parallel/, engine/batch/.
Never serving.
"""
