"""K/V transfer between tensor-parallel engines (mesh model:2 on 2 virtual CPU devices),
printed as one JSON line: tests/test_kv_transfer.py runs it in a subprocess (JAX fixes its
device count when it initializes; the suite runs on one device).

    prefill on A (model:2) -> export -> import on B (model:2) -> decode  ==  one engine C
    (model:2) running the same requests; B's cache keeps its sharding after the scatter and
    nothing compiles for the imports once B is warm (its steps and its scatter programs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

jax.config.update("jax_num_cpu_devices", 2)

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest
from engine.factory import create_engine
from engine.kv_transfer.transfer import prefill_sampling
from engine.kv_transfer.transfer_engine import KVTransferEngine
from engine.parallel.sharding import loader_shardings
from engine.runner import compiles
from engine.sampling.params import SamplingParams
from models.registry import load_model

MESH = "model:2"
OPTS = dict(page_size=8, num_pages=24, max_num_seqs=4, max_num_batched_tokens=32)
PROMPTS = [[5, 9, 11, 40, 7], list(range(3, 20)), [300, 301, 302, 303, 304, 305, 306, 307]]


def run(engine, ers=()) -> dict:
    for er in ers:
        engine.add_request(er)
    tokens: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def main() -> None:
    model = load_model("tiny", shardings_for=loader_shardings(MESH))
    config = EngineConfig(model="tiny", prefill_chunk_size=32, max_model_len=48, **OPTS)
    a, b, c = (KVTransferEngine(create_engine(model, config, mesh=MESH)) for _ in range(3))
    ers = [
        EngineRequest(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6))
        for i, p in enumerate(PROMPTS)
    ]
    want = run(c, ers)
    for er in ers:
        a.expect_export(er.request_id)
        a.add_request(dataclasses.replace(er, sampling=prefill_sampling(er.sampling)))
    run(a)
    run(b, [dataclasses.replace(er, request_id="warm") for er in ers[:1]])  # compiles B
    b.warm_transfer("decode")  # the scatter programs, as a decode worker's start-up does
    sharding = b.core.runner.state.kv.k_pages.sharding
    for er in ers:
        b.stage(er.request_id, a.take_export(er.request_id, timeout_s=0))
    before = compiles.count()
    got = run(b, ers)
    print(
        json.dumps(
            {
                "same": got == want,
                "imports": b.counters["kv_imports"],
                "sharding_kept": b.core.runner.state.kv.k_pages.sharding == sharding,
                "num_devices": len(sharding.device_set),
                "compiles": compiles.count() - before,
                "pages_used": [e.pool.num_used_pages for e in (a, b)],
            }
        )
    )


if __name__ == "__main__":
    main()
