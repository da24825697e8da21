"""Multi-LoRA on 8 virtual CPU devices: prints one JSON line (tests/test_lora_sharding.py).

One-device reference vs meshes model:2, model:4 (the tiny model's 2 KV heads replicated 2x:
the adapters' K/V B matrices are repeated like wk/wv) and data:2,model:2 (each data replica
loads the adapters): a batch mixing the base model and two adapters must give the same
greedy tokens, the slot stacks must carry their base weights' layout, and neither a second
run nor loading another adapter may compile anything.

    python tests/lora_sharding_worker.py ADAPTER_ROOT
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

jax.config.update("jax_num_cpu_devices", 8)

from engine.llm import LLM  # noqa: E402
from engine.runner import compiles  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402
from models.lora_random import write_peft_adapter  # noqa: E402
from models.registry import load_model  # noqa: E402

OPTS = {
    "num_pages": 32,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "max_model_len": 128,
    "prefix_caching": False,
    "max_loras": 2,
    "max_lora_rank": 8,
}
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["Hello world", "The quick brown fox", "abc"]
ADAPTERS = [None, "a1", "a2"]


def spec_of(x) -> list | None:
    spec = getattr(x.sharding, "spec", None)  # None on one device
    return None if spec is None else [list(a) if isinstance(a, tuple) else a for a in spec]


def run_one(model, root: str, mesh: str | None) -> dict:
    llm = LLM(model, mesh=mesh, **OPTS)
    llm.load_adapter("a1", os.path.join(root, "a1"))
    llm.load_adapter("a2", os.path.join(root, "a2"))
    out = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, adapter=ADAPTERS)]
    before = compiles.count()
    again = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, adapter=ADAPTERS)]
    llm.load_adapter("a2", os.path.join(root, "a3"))  # swap content: no recompile either
    swapped = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, adapter=ADAPTERS)]
    eng = llm.engine.replicas[0] if hasattr(llm.engine, "replicas") else llm.engine
    w, p = eng.adapters.weights, eng.runner.params
    if mesh is None:  # one device: unrolled layers (a tuple), nothing sharded
        return {"out": out, "swapped": swapped, "lora_b_wk_shape": list(w.b["wk"].shape)}
    return {
        "out": out,
        "again_same": again == out,
        "swapped": swapped,
        "recompiled": compiles.count() - before,
        "specs": {
            "lora_a_wq": spec_of(w.a["wq"]),
            "lora_b_wq": spec_of(w.b["wq"]),
            "lora_b_wk": spec_of(w.b["wk"]),
            "lora_a_wo": spec_of(w.a["wo"]),
            "lora_a_w_down": spec_of(w.a["w_down"]),
            "lora_b_w_gate": spec_of(w.b["w_gate"]),
            "wq": spec_of(p.layers.wq),
            "w_down": spec_of(p.layers.w_down),
        },
        "lora_b_wk_shape": list(w.b["wk"].shape),
    }


def main(root: str) -> None:
    model = load_model("tiny")
    for name, seed in (("a1", 1), ("a2", 2), ("a3", 3)):
        write_peft_adapter(os.path.join(root, name), model.config, r=4, scale=0.3, seed=seed)
    res = {"single": run_one(model, root, None)}
    for mesh in ("model:2", "model:4", "data:2,model:2"):
        res[mesh] = run_one(model, root, mesh)
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
