"""Runs sharded generations on 8 virtual CPU devices and prints one JSON line of results.

JAX fixes its device count when it initializes, and the rest of the suite runs on one
device, so tests/test_sharding.py runs this file in a subprocess:

    python tests/sharding_worker.py tiny       # tiny config: model 1/2/4, data 2, data2xmodel2
    python tests/sharding_worker.py kv8        # 8-KV-head config: model 8 vs one device
    python tests/sharding_worker.py smollm2    # SmolLM2-135M: model 3 vs one device
    python tests/sharding_worker.py spec       # ngram speculation under model 2 vs one device
    python tests/sharding_worker.py moe        # tiny Qwen3-MoE: expert 2/4, data2xexpert2, ...
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

jax.config.update("jax_num_cpu_devices", 8)

from engine.llm import LLM
from engine.parallel import sharding
from engine.runner import compiles
from engine.sampling.params import SamplingParams
from models.registry import load_model

# Prefix caching off: the second, identical run must hit the same shapes (a cache hit would
# legitimately shrink a prefill bucket and compile it).
OPTS = {
    "num_pages": 32,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "max_model_len": 128,
    "prefix_caching": False,
}
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def spec_of(x) -> list:
    return [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]


def generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def describe(llm: LLM, prompts, ref) -> dict:
    """Greedy outputs vs ref, and the shardings and per-device bytes the engine holds."""
    out = generate(llm, prompts)
    eng = llm.engine.replicas[0] if hasattr(llm.engine, "replicas") else llm.engine
    p = eng.runner.params
    # MoE: after one run of the prompts (data-parallel: summed over the replicas)
    expert_tokens = llm.stats().get("moe_expert_tokens")
    before = compiles.count()
    again = generate(llm, prompts)  # a second run must reuse the compiled steps
    return {
        "same": out == ref,
        "again_same": again == ref,
        "recompiled": compiles.count() - before,
        "expert_tokens": expert_tokens,
        "num_kv_heads": eng.cfg.num_kv_heads,
        "grouped_matmul": getattr(eng.cfg, "grouped_matmul", None),
        "specs": {
            name: spec_of(x)
            for name, x in [
                ("embed", p.embed),
                ("wq", p.layers.wq),
                ("wk", p.layers.wk),
                ("wo", p.layers.wo),
                ("w_gate", p.layers.w_gate),
                ("w_down", p.layers.w_down),
                ("attn_norm", p.layers.attn_norm),
                ("k_pages", eng.runner.state.kv.k_pages),
                ("moe_gate", getattr(p.layers, "moe_gate", None)),
                ("moe_down", getattr(p.layers, "moe_down", None)),
                ("router", getattr(p.layers, "router", None)),
            ]
            if x is not None
        },
        "kv_bytes_per_device": sorted(sharding.bytes_per_device(eng.runner.state.kv).values()),
        "kv_bytes_total": eng.runner.state.kv.num_bytes,
        "weights_bytes_per_device": sorted(sharding.bytes_per_device(p).values()),
        "kv_devices": sorted(sharding.bytes_per_device(eng.runner.state.kv)),
        "replica_devices": [
            sorted(sharding.bytes_per_device(r.runner.state.kv))
            for r in getattr(llm.engine, "replicas", [])
        ],
    }


def run(model, prompts, meshes, load_name: str | None = None) -> dict:
    """`load_name`: build the sharded LLMs from the name (the loader places each shard on
    its devices: Orbax restore with target shardings, or device_put) instead of `model`."""
    single = LLM(model, **OPTS)
    ref = generate(single, prompts)
    res = {
        "ref": ref,
        "ref_kv_bytes": single.engine.runner.state.kv.num_bytes,
        "ref_weights_bytes": single.stats()["weights_bytes"],
        "ref_expert_tokens": single.stats().get("moe_expert_tokens"),
    }
    for mesh in meshes:
        llm = LLM(load_name or model, mesh=mesh, **OPTS)
        res[mesh] = describe(llm, prompts, ref)
        if load_name:
            res[mesh]["loaded_wq_spec"] = spec_of(llm.model.params.layers.wq)
            res[mesh]["load_times"] = sorted(llm.model.load_times_s)
    return res


def speculative(model) -> dict:
    """ngram speculation under a model:2 mesh, drafts = the one-device continuation (so
    each is accepted iff the sharded verify step computes the same tokens): greedy tokens
    vs one device without speculation, and the acceptance counters."""
    prompts = [[1] + [7 + i, 40 + i, 90 + i] * 4 for i in range(3)]
    ref = generate(LLM(model, **OPTS), prompts)
    spec = {"num_speculative_tokens": 3, "disable_by_batch_size": None}
    llm = LLM(model, mesh="model:2", speculative=spec, **OPTS)
    future = {tuple(p): p + r for p, r in zip(prompts, ref)}
    llm.engine.spec.proposer = lambda req, k: future[tuple(req.prompt_token_ids)][
        req.num_known_tokens : req.num_known_tokens + k
    ]
    stats_before = llm.stats()
    out = generate(llm, prompts)
    stats = llm.stats()
    return {
        "ref": ref,
        "same": out == ref,
        "drafted": stats["spec_drafted_tokens"] - stats_before["spec_drafted_tokens"],
        "accepted": stats["spec_accepted_tokens"] - stats_before["spec_accepted_tokens"],
        "verify_steps": stats["spec_verify_steps"],
        "k_pages_spec": spec_of(llm.engine.runner.state.kv.k_pages),
    }


def main(which: str) -> None:
    if which == "tiny":
        res = run(
            load_model("tiny"),
            ["Hello world", "The quick brown fox", "abc"],
            ["model:1", "model:2", "model:4", "data:2", "data:2,model:2"],
            "tiny",
        )
    elif which == "kv8":
        m = load_model("tiny")
        cfg = dataclasses.replace(m.config, name="tiny-kv8", num_heads=16, num_kv_heads=8)
        from models.llama import init_params

        m = dataclasses.replace(
            m, config=cfg, params=init_params(cfg, jax.random.key(1), scale=0.2)
        )
        res = run(m, ["Hello world", "abc"], ["model:8"])
    elif which == "gemma3":  # a second family: QK-norm, local/global layers, (1 + w) norms
        from models.families import init_params
        from models.gemma3 import GLOBAL, LOCAL, Gemma3Config

        m = load_model("tiny")
        cfg = Gemma3Config(
            **{f: getattr(m.config, f) for f in ("vocab_size", "bos_token_id", "eos_token_ids")},
            name="tiny-gemma3",
            num_layers=3,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            ffn_size=128,
            sliding_window=8,
            layer_types=(LOCAL, GLOBAL, LOCAL),
            query_pre_attn_scalar=24.0,
            tie_embeddings=True,
        )
        params = init_params(cfg, jax.random.key(2), scale=0.2)
        m = dataclasses.replace(m, config=cfg, params=params)
        res = run(m, ["Hello world, a prompt past the window", "abc"], ["model:2"])
    elif which == "spec":
        res = speculative(load_model("tiny"))
    elif which == "moe":  # mixture of experts: one sparse and one dense layer, 4 experts
        from models.families import init_params
        from models.qwen3_moe import Qwen3MoeConfig

        m = load_model("tiny")
        cfg = Qwen3MoeConfig(
            **{f: getattr(m.config, f) for f in ("vocab_size", "bos_token_id", "eos_token_ids")},
            name="tiny-moe",
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            ffn_size=128,
            num_experts=4,
            num_experts_per_tok=2,
            moe_ffn_size=32,
            sparse_layers=(True, False),
            tie_embeddings=True,
        )
        params = init_params(cfg, jax.random.key(3), scale=0.2)
        m = dataclasses.replace(m, config=cfg, params=params)
        meshes = ["expert:2", "expert:4", "data:2,expert:2", "expert:2,model:2"]
        res = run(m, ["Hello world", "The quick brown fox", "abc"], meshes)
        res["refused"] = {}
        for mesh, model in (("expert:3", m), ("expert:2", load_model("tiny"))):
            try:
                LLM(model, mesh=mesh, **OPTS)
                res["refused"][mesh] = None
            except sharding.ShardingConfigError as e:
                res["refused"][mesh] = str(e)
    elif which == "smollm2":
        m = load_model("smollm2-135m")
        res = run(m, [[1, 504, 3458, 282, 4649, 314]], ["model:3"], "smollm2-135m")
    else:
        raise SystemExit(f"unknown scenario {which!r}")
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
