r"""Prefill/decode disaggregation and cache-aware routing, measured on this machine.

    python -m benchmarks.disagg_bench [--sections=transfer,affinity,interference] \
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
  affinity      3 `both` replicas (serving.router.cluster), 20 shared system prompts x questions,
                once through the affinity router and once through a round-robin router
                (each with its own 20 system prompts, so one phase cannot warm the other):
                prefix-cache hit rate (cached / prompt tokens, from each answer's usage)
                and the median TTFT of warm requests (system prompt seen before).
  interference  streaming chats (short prompts, long outputs) while long prompts arrive:
                p50/p99 inter-token latency of the chats (server token times) and TTFT of
                the long prompts, colocated (2 `both` replicas) vs disaggregated (1 prefill
                + 1 decode), each worker pinned to one core. NOTE: this machine has 2 cores
                shared with other jobs, so each worker gets at most one core and the
                router and the client compete with them; the figures show the mechanism
                (decode steps no longer wait for prefill chunks), not a production ratio.
"""

from __future__ import annotations

import concurrent.futures
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
    flags.DEFINE_list("sections", ["transfer", "affinity", "interference"], "what to run")
    flags.DEFINE_string("model", "tiny", "tiny | smollm2-135m")
    flags.DEFINE_bool("smoke", False, "small sizes (a quick check that it runs)")
    flags.DEFINE_string("json", None, "write every figure here")
    flags.DEFINE_integer("num_system_prompts", 20, "affinity: shared system prompts")
    flags.DEFINE_integer("questions", 4, "affinity: requests per system prompt")
    flags.DEFINE_integer("chats", 4, "interference: concurrent streaming chats")
    flags.DEFINE_integer("chat_tokens", 96, "interference: output tokens per chat")
    flags.DEFINE_integer("long_prompts", 3, "interference: long prompts arriving during the chats")
    flags.DEFINE_integer("transfer_repeats", 5, "transfer: timed repeats per length")
    flags.DEFINE_list("transports", ["grpc", "jax"], "transfer: K/V transports to measure")
    flags.DEFINE_integer("long_prompt_tokens", 0, "0: 960 (tiny) or 2000 (smollm2-135m)")


@dataclasses.dataclass(frozen=True)
class Options:
    """The sizes (the flags of the same names)."""

    model: str = "tiny"
    smoke: bool = False
    num_system_prompts: int = 20
    questions: int = 4
    chats: int = 4
    chat_tokens: int = 96
    long_prompts: int = 3
    long_prompt_tokens: int = 0
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
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "omega",
    "river",
    "stone",
    "cloud",
    "maple",
    "orbit",
    "ember",
    "quartz",
    "lantern",
]


def system_prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return "System: " + " ".join(rng.choice(WORDS) for _ in range(words)) + ".\n"


def run_phase(target: str, prompts: list[str], concurrency: int = 3) -> list:
    from serving.client import GenerateClient

    with GenerateClient(target) as client, concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
        jobs = [
            ex.submit(client.generate, p, max_tokens=4, temperature=0.0, timeout_s=600)
            for p in prompts
        ]
        return [j.result() for j in jobs]


def affinity(results: dict, o: Options) -> None:
    from serving.router.cluster import LocalCluster
    from serving.router.server import Router

    n_sys, n_q = (6, 3) if o.smoke else (o.num_system_prompts, o.questions)
    figures = {}
    with LocalCluster(0, 0, 3, worker_args=worker_args(o.model, 1024)) as cluster:
        rr = Router([w.address for w in cluster.workers], policy="round_robin").start()
        try:  # untimed: every replica compiles its shapes on prompts no phase uses
            run_phase(f"127.0.0.1:{rr.port}", [system_prompt(3000 + i, 120) for i in range(6)])
            for phase, (target, seed0) in {
                "round_robin": (f"127.0.0.1:{rr.port}", 1000),
                "affinity": (cluster.address, 2000),
            }.items():
                order = [(s, q) for s in range(n_sys) for q in range(n_q)]
                random.Random(seed0).shuffle(order)
                prompts = [
                    system_prompt(seed0 + s, 120) + f"User: question {q} about {WORDS[q]}?"
                    for s, q in order
                ]
                t0 = time.perf_counter()
                res = run_phase(target, prompts)
                bad = [r.code for r in res if not r.ok]
                assert not bad, bad
                seen, warm = set(), []
                for (s, _), r in zip(order, res):
                    if s in seen:
                        warm.append(r.server_timings["ttft_s"])
                    seen.add(s)
                figures[phase] = {
                    "requests": len(res),
                    "hit_rate": sum(r.cached_tokens for r in res)
                    / sum(r.prompt_tokens for r in res),
                    "warm_ttft_ms_median": 1e3 * statistics.median(warm),
                    "wall_s": time.perf_counter() - t0,
                }
                print(f"  affinity {phase} {figures[phase]} ({load()})", file=sys.stderr)
        finally:
            rr.stop()
    report(results, "affinity", figures)


# ---- interference -----------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def interference_phase(target: str, long_tokens: int, o: Options, seed: int) -> dict:
    from serving.client import GenerateClient

    chats, chat_tokens = (2, 32) if o.smoke else (o.chats, o.chat_tokens)
    n_long = 1 if o.smoke else o.long_prompts
    rng = random.Random(seed)  # ids below 250: in every model's vocabulary here
    long_prompts = [[rng.randrange(3, 250) for _ in range(long_tokens)] for _ in range(n_long)]
    with GenerateClient(target) as client, concurrent.futures.ThreadPoolExecutor(8) as ex:

        def chat(i):
            return client.generate(
                f"chat {seed}-{i}: tell me a story", max_tokens=chat_tokens, temperature=0.0,
                ignore_eos=True, timeout_s=900,
            )  # fmt: skip

        def long(i):
            time.sleep(0.5 + i)  # arrive while the chats stream
            return client.generate(
                token_ids=long_prompts[i], max_tokens=2, temperature=0.0, timeout_s=900
            )

        chat_jobs = [ex.submit(chat, i) for i in range(chats)]
        long_jobs = [ex.submit(long, i) for i in range(n_long)]
        chat_res = [j.result() for j in chat_jobs]
        long_res = [j.result() for j in long_jobs]
    bad = [r.details for r in chat_res + long_res if not r.ok]
    assert not bad, bad
    itl = [
        (b - a) / 1e6
        for r in chat_res
        for a, b in zip(r.token_times_unix_ns, r.token_times_unix_ns[1:])
    ]
    return {
        "chat_itl_ms_p50": percentile(itl, 0.5),
        "chat_itl_ms_p99": percentile(itl, 0.99),
        "long_ttft_ms": [1e3 * r.client_ttft_s for r in long_res],
        "long_prompt_tokens": [r.prompt_tokens for r in long_res],
    }


def compiled_steps(cluster) -> int:
    """Step programs the cluster's workers have built so far (WorkerInfo stats)."""
    import grpc

    from serving.proto import kv_transfer_pb2 as kv_pb
    from serving.proto import kv_transfer_pb2_grpc as kv_grpc

    total = 0
    for w in cluster.workers:
        with grpc.insecure_channel(w.address) as ch:
            info = kv_grpc.KVTransferStub(ch).WorkerInfo(kv_pb.WorkerInfoRequest(), timeout=10)
        total += int(info.stats.get("num_compiled_steps", 0))
    return total


def interference(results: dict, o: Options) -> None:
    from serving.router.cluster import LocalCluster

    long_tokens = o.long_prompt_tokens or (960 if o.model == "tiny" else 2000)
    if o.smoke:
        long_tokens = 200
    max_len = 1024 if o.model == "tiny" else 2304
    figures = {}
    for name, (p, d, r) in {"colocated": (0, 0, 2), "disaggregated": (1, 1, 0)}.items():
        # NOTE: compile on use; a whole shape set built first took longer than 10 min per
        # worker at this load, so two untimed runs compile what the timed one needs and
        # the compiles that still land in it are counted
        with LocalCluster(p, d, r, worker_args=worker_args(o.model, max_len)) as cluster:
            # untimed, same sizes: compiles the step shapes and KV gather/scatter buckets
            for seed in (1, 3):  # other prompts than the timed run (no prefix-cache help)
                interference_phase(cluster.address, long_tokens, o, seed=seed)
            before = compiled_steps(cluster)
            figures[name] = interference_phase(cluster.address, long_tokens, o, seed=2)
            figures[name]["step_compiles_during_run"] = compiled_steps(cluster) - before
        print(f"  interference {name} {figures[name]} ({load()})", file=sys.stderr)
    report(results, "interference", figures)


def main(argv) -> None:
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    o = Options(**{f.name: getattr(F, f.name) for f in dataclasses.fields(Options)})
    for section in F.sections:
        {"transfer": transfer, "affinity": affinity, "interference": interference}[section](
            results, o
        )
    if F.json:
        with open(F.json, "w") as f:
            json.dump(results, f, indent=1, default=float)
    print(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    define_flags()
    app.run(main)
