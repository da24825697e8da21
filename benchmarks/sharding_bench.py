"""Per-device memory and step time vs model-parallel degree, on virtual CPU devices.

    python -m benchmarks.sharding_bench [--model=bench|tiny|smollm2-135m] [--degrees=1,2,4,8]
        [--batch=8] [--prompt_tokens=64] [--decode_steps=16] [--devices=8]

On one CPU the "devices" share the same cores and memory bandwidth, so the step time shows
the cost of sharding (collectives, per-shard kernel launches, smaller matmuls), not a
speed-up; per-device memory is what sharding buys. The `bench` model is random weights with
8 KV heads, sized so weights dominate (so every degree up to 8 shards without replication).
Expected scaling on real chips: WORKSPACE.md, "Sharding and multi-host".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bench")
    p.add_argument("--degrees", default="1,2,4,8")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt_tokens", type=int, default=64)
    p.add_argument("--decode_steps", type=int, default=16)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--num_pages", type=int, default=256)
    return p.parse_args()


def load(name: str):
    import jax

    from models.llama import init_params
    from models.registry import load_model

    if name != "bench":
        return load_model(name)
    m = load_model("tiny")
    cfg = dataclasses.replace(
        m.config,
        name="bench",
        num_layers=4,
        hidden_size=512,
        num_heads=16,
        num_kv_heads=8,
        ffn_size=2048,
        vocab_size=8192,
        head_dim=32,
    )
    return dataclasses.replace(m, config=cfg, params=init_params(cfg, jax.random.key(0)))


def measure(model, mesh: str | None, args) -> dict:
    import numpy as np

    from configs.engine_config import EngineConfig
    from engine.api_types import EngineRequest
    from engine.core import EngineCore
    from engine.parallel import sharding
    from engine.sampling.params import SamplingParams

    config = EngineConfig(
        model=model.config.name,
        num_pages=args.num_pages,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(512, args.batch * args.prompt_tokens),
        max_model_len=args.prompt_tokens + 2 * args.decode_steps + 8,
    )
    engine = EngineCore(model, config, mesh=mesh)
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0, max_tokens=2 * args.decode_steps + 4, ignore_eos=True)

    def run(tag: str) -> tuple[float, list[float]]:
        for i in range(args.batch):
            ids = rng.integers(3, model.config.vocab_size, args.prompt_tokens).tolist()
            engine.add_request(EngineRequest(f"{tag}{i}", ids, sp))
        t0 = time.perf_counter()
        engine.step()  # the whole batch prefills in one step
        prefill = time.perf_counter() - t0
        decode = []
        for _ in range(args.decode_steps):
            t0 = time.perf_counter()
            engine.step()
            decode.append(time.perf_counter() - t0)
        for rid in [f"{tag}{i}" for i in range(args.batch)]:
            engine.abort_request(rid)
        engine.step()
        return prefill, decode

    run("warm")  # compiles the prefill and decode shapes
    prefill, decode = run("timed")
    w = sharding.bytes_per_device(engine.runner.params)
    kv = sharding.bytes_per_device(engine.runner.state.kv)
    m = sharding.model_axis_size(engine.mesh)
    return {
        "mesh": mesh or "none",
        "devices": len(w),
        "weights_mib": max(w.values()) / 2**20,
        "kv_mib": max(kv.values()) / 2**20,
        "kv_replication": sharding.kv_replication(model.config, m),
        "prefill_ms": 1e3 * prefill,
        "decode_ms": 1e3 * statistics.median(decode),
    }


def main() -> None:
    args = _parse()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    model = load(args.model)
    c = model.config
    print(
        f"model {c.name}: L={c.num_layers} D={c.hidden_size} H={c.num_heads} "
        f"K={c.num_kv_heads} F={c.ffn_size} V={c.vocab_size}; batch {args.batch} x "
        f"{args.prompt_tokens} prompt tokens; {args.num_pages} pages; "
        f"{jax.device_count()} CPU devices"
    )
    rows = [measure(model, None, args)]
    for m in (int(x) for x in args.degrees.split(",")):
        rows.append(measure(model, f"model:{m}", args))
    head = (
        f"{'mesh':>8} {'devs':>4} {'weights MiB/dev':>15} {'KV MiB/dev':>10} "
        f"{'KV repl':>7} {'prefill ms':>10} {'decode ms':>9}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['mesh']:>8} {r['devices']:>4} {r['weights_mib']:>15.2f} {r['kv_mib']:>10.2f} "
            f"{r['kv_replication']:>7} {r['prefill_ms']:>10.1f} {r['decode_ms']:>9.2f}"
        )


if __name__ == "__main__":
    main()
