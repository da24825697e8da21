"""The engine: host-side scheduling over a paged KV cache and a jitted device step.

Top-level modules (the engine's public face):
    interface.py     Engine: the interface serving drives (a Protocol)
    core.py          EngineCore: the step loop (schedule, build, run, process outputs)
    factory.py       create_engine: one device, a mesh, data-parallel replicas
    llm.py           LLM: the notebook API (llm_options.py: its options)
    api_types.py     EngineRequest, RequestOutput, TokenLogprob: what crosses the interface
    errors.py        the engine's exceptions
Sub-packages (each __init__ maps its own folder):
    sched/        host side, plain Python: requests, pages, scheduler, stop checks, outputs
    batch/        plan -> fixed-shape arrays (the host/device boundary)
    runner/       device side: the jitted step, its programs, KV cache, penalties, warm-up
    sampling/     SamplingParams, the device sampler, logprobs
    spec/         speculative decoding: proposers, verify step, acceptance rule
    structured/   structured output (llguidance)
    chat/         tool calls and reasoning in a chat's output; tools on the request side
    lora/         LoRA adapters
    parallel/     sharding (tensor), replicas (data), distributed (hosts)
    kv_transfer/  KV export/import between engines (disaggregation)

Import rule: engine never imports serving; sched never imports JAX (tests/test_layers.py).
"""


def __getattr__(name):
    # Lazy, so `import engine.sched.scheduler` does not pull in JAX.
    if name in ("LLM", "CompletionOutput", "GenerateOutput"):
        from engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from engine.sampling.params import SamplingParams

        return SamplingParams
    if name == "EngineCore":
        from engine.core import EngineCore

        return EngineCore
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineCore", "CompletionOutput", "GenerateOutput"]
