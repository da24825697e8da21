r"""Prefill/decode K/V transfer, measured on this machine.

    python -m benchmarks.disagg_bench [--sections=transfer] \
        [--model=tiny|smollm2-135m] [--smoke] [--json=FILE]

Sections (each prints its figures with os.getloadavg() as soon as they exist):
  transfer      an in-process prefill server (real gRPC on loopback) streams a request's K/V
                (KVTransfer.Prefill) for several prompt lengths: KV bytes per token, wire
                time and GB/s (header -> trailer, sha256 included), the prefill it follows
                (server side, arrival -> exported), and the import into a second engine;
                per transport (`--transports`: grpc bytes, jax.experimental.transfer),
                with the export's engine-thread time (metadata + gather dispatch) and its
                host copy + sha256 (handler thread; none with jax). Each length runs once
                untimed first (compiles).
The affinity and interference sections ran through our own router and cluster launcher
(serving/router/, retired for Ray Serve, issue 32): their last figures are in
benchmarks/RESULTS.md. Prefix hit rate with affinity vs Serve's default routing:
`python -m benchmarks.ray_serve_bench`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
import sys
import time

from absl import app, flags

F = flags.FLAGS


def define_flags() -> None:
    """Defined only when run as a program (tests import this module)."""
    flags.DEFINE_list("sections", ["transfer"], "what to run")
    flags.DEFINE_string("model", "tiny", "tiny | smollm2-135m")
    flags.DEFINE_bool("smoke", False, "small sizes (a quick check that it runs)")
    flags.DEFINE_string("json", None, "write every figure here")
    flags.DEFINE_integer("transfer_repeats", 5, "transfer: timed repeats per length")
    flags.DEFINE_list("transports", ["grpc", "jax"], "transfer: K/V transports to measure")


@dataclasses.dataclass(frozen=True)
class Options:
    """The sizes (the flags of the same names)."""

    model: str = "tiny"
    smoke: bool = False
    transfer_repeats: int = 5
    transports: tuple[str, ...] = ("grpc", "jax")


ENGINE = {"page_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 256}
ENGINE["prefill_chunk_size"] = 256


def load() -> str:
    return "load {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


def report(results: dict, section: str, figures: dict) -> None:
    figures = {**figures, "loadavg": os.getloadavg()}
    results[section] = figures
    print(f"[{section}] {json.dumps(figures, default=float)}", file=sys.stderr, flush=True)


def worker_args(model: str, max_model_len: int, shapes: int = 0) -> list[str]:
    """`shapes` > 0: the engine's whole step-shape set, built before serving (nothing
    compiles while serving; batches are padded to one of them); 0: compile on use."""
    flags_ = {**ENGINE, "max_model_len": max_model_len}
    return [
        f"--model={model}",
        f"--warmup_max_shapes={shapes}",
        "--capacity_probe=false",
        "--log_level=warning",
        *(f"--{k}={v}" for k, v in flags_.items()),
    ]


# ---- transfer -----------------------------------------------------------------------------------
def transfer(results: dict, o: Options) -> None:
    from configs.engine_config import EngineConfig
    from models.registry import load_model

    model = load_model(o.model)
    config = EngineConfig(model=o.model, max_model_len=1024, num_pages=512, **ENGINE)
    rows = []
    for transport in o.transports:
        rows += transfer_rows(model, config, transport, o)
    report(results, "transfer", {"model": o.model, "rows": rows})


def transfer_rows(model, config, transport: str, o: Options) -> list[dict]:
    """One prefill server (`--kv_transport=transport`) and a receiving engine in this
    process; per prompt length: the median of `transfer_repeats` timed transfers."""
    import grpc

    from engine.api_types import EngineRequest
    from engine.core import EngineCore
    from engine.kv_transfer.transfer import import_request
    from engine.kv_transfer.transfer_engine import KVTransferEngine
    from engine.sampling.params import SamplingParams
    from serving.client import build_request
    from serving.disagg.jax_transfer import TRANSPORT_METADATA, JaxTransport
    from serving.disagg.wire import receive_payload
    from serving.frontend.admission import AdmissionConfig
    from serving.proto import kv_transfer_pb2_grpc as kv_grpc
    from serving.testing import running_server

    vocab = min(model.config.vocab_size, model.tokenizer.vocab_size)
    lengths = [64, 256] if o.smoke else [64, 256, 512, 960]
    receiver = EngineCore(model, config)
    puller = JaxTransport() if transport == "jax" else None
    metadata = ((TRANSPORT_METADATA, transport),)
    rows = []
    with running_server(
        KVTransferEngine(EngineCore(model, config)),
        admission=AdmissionConfig(max_model_len=1024),
        capacity_probe=False,
        role="prefill",
        kv_transport=transport,
    ) as (server, _):
        stub = kv_grpc.KVTransferStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        counters = server.loop.engine.counters
        rng = random.Random(0)
        for n in lengths:
            timed = []  # (TransferStats, import_s, engine-thread s, host-copy s) after rep 0
            for rep in range(1 + o.transfer_repeats):
                ids = [rng.randrange(3, vocab) for _ in range(n)]
                rid = f"t{n}-{rep}"
                req = build_request(token_ids=ids, request_id=rid, max_tokens=1, temperature=0.0)
                before = counters["kv_export_engine_s"], counters["kv_export_s"]
                call = stub.Prefill(req, timeout=600, metadata=metadata)
                payload, stats = receive_payload(call, puller)
                engine_s = counters["kv_export_engine_s"] - before[0]
                copy_s = counters["kv_export_s"] - before[1]
                er = EngineRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=2))
                t0 = time.perf_counter()
                import_request(receiver, er, payload)
                receiver.runner.state.kv.k_pages.block_until_ready()
                import_s = time.perf_counter() - t0
                receiver.abort_request(rid)
                while receiver.has_unfinished():
                    receiver.step()
                if rep:
                    timed.append((stats, import_s, engine_s, copy_s))
            rows.append(transfer_row(transport, n, timed))
            print(f"  transfer {rows[-1]} ({load()})", file=sys.stderr, flush=True)
    return rows


def transfer_row(transport: str, n: int, timed: list) -> dict:
    stats = timed[-1][0]
    wire_s = statistics.median(t.transfer_s for t, *_ in timed)
    prefill_s = statistics.median(t.prefill_s for t, *_ in timed)
    return {
        "transport": transport,
        "prompt_tokens": n,
        "kv_bytes": stats.num_bytes,  # jax: the page bucket's bytes (padded to 2^k pages)
        "kv_bytes_per_token": stats.num_bytes / n,
        "wire_ms_median": 1e3 * wire_s,
        "wire_ms_min": 1e3 * min(t.transfer_s for t, *_ in timed),
        "wire_gb_per_s_median": stats.num_bytes / wire_s / 1e9,
        "prefill_ms_median": 1e3 * prefill_s,
        "import_ms_median": 1e3 * statistics.median(t[1] for t in timed),
        "export_engine_thread_ms_median": 1e3 * statistics.median(t[2] for t in timed),
        "export_host_copy_ms_median": 1e3 * statistics.median(t[3] for t in timed),
        "wire_over_prefill": wire_s / prefill_s,
    }


# ---- affinity -----------------------------------------------------------------------------
def main(argv) -> None:
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    o = Options(**{f.name: getattr(F, f.name) for f in dataclasses.fields(Options)})
    for section in F.sections:
        {"transfer": transfer}[section](results, o)
    if F.json:
        with open(F.json, "w") as f:
            json.dump(results, f, indent=1, default=float)
    print(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    define_flags()
    app.run(main)
