"""int8 weights on 8 virtual CPU devices: greedy tokens vs one device and the shardings of q
and scale, printed as one JSON line (tests/test_quant_sharding.py runs it in a subprocess,
because JAX fixes its device count when it starts)."""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

jax.config.update("jax_num_cpu_devices", 8)

from engine.llm import LLM  # noqa: E402 (after the device count is set)
from engine.sampling.params import SamplingParams  # noqa: E402

OPTS = {"num_pages": 32, "max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 128}
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["Hello world", "The quick brown fox"]


def spec(x) -> list:
    return [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]


def main(scheme: str) -> None:
    opts = {**OPTS, "quantization": scheme, "quantize_lm_head": True}
    ref = [o.token_ids for o in LLM("tiny", **opts).generate(PROMPTS, GREEDY)]
    res = {"ref": ref}
    for mesh in ("model:2", "model:4", "data:2,model:2"):
        llm = LLM("tiny", mesh=mesh, **opts)
        eng = llm.engine.replicas[0] if hasattr(llm.engine, "replicas") else llm.engine
        p = eng.runner.params
        res[mesh] = {
            "same": [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref,
            "revision": eng.identity.revision,
            "specs": {
                f"{name}.{part}": spec(getattr(w, part))
                for name, w in [
                    ("wq", p.layers.wq),
                    ("wk", p.layers.wk),
                    ("wo", p.layers.wo),
                    ("w_down", p.layers.w_down),
                    ("lm_head", p.lm_head),
                ]
                for part in ("q", "scale")
            },
            "wk_scale_shape": list(p.layers.wk.scale.shape),
        }
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
