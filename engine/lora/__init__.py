"""LoRA adapters: loading, device slots, each request's adapter.

    adapters.py       AdapterManager: names -> device slots, requests -> slots, a step's rows
    refs.py           adapter references and identities (no JAX)

The slot stack is built by the ModelRunner (engine/runner/model_runner.py), whose steps
read it; EngineCore loads, unloads, acquires and releases adapters through it.

May import: configs, models, engine's top level, engine/parallel/, engine/batch/.
Never serving.
"""
