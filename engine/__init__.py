"""The engine: host-side scheduling over a paged KV cache and a jitted device step.

engine.interface.Engine                  the interface serving drives (a Protocol)
engine.request / page_pool / scheduler   host side, plain Python (no device)
engine.outputs                           host half of a step: stop checks, output deltas
engine.batch                             plan -> fixed-shape arrays (the boundary)
engine.step / kv_cache / sampling        device side, pure jitted functions
engine.core.EngineCore                   the step loop (serving drives it); its device
  programs, penalty counts and LoRA side: engine.step_programs / penalty_state / engine_adapters
engine.factory / replicas / distributed  engine creation: one device, mesh, data, hosts
engine.llm.LLM                           the notebook API
"""


def __getattr__(name):
    # Lazy, so `import engine.scheduler` does not pull in JAX.
    if name in ("LLM", "CompletionOutput", "GenerateOutput"):
        from engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineCore":
        from engine.core import EngineCore

        return EngineCore
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineCore", "CompletionOutput", "GenerateOutput"]
