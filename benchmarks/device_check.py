"""Accelerator readiness in ONE run (< 8 minutes on one H200 or TPU): what works and how fast.

    python -m benchmarks.device_check --out=device_check        # writes .json and .md
    python -m benchmarks.device_check --smoke --out=/tmp/dc     # CPU, tiny, interpret mode

Sections (each timed, each recorded even when it fails, so one broken part does not hide
the others):
1. devices: backend, device kinds and count, JAX / jaxlib versions.
2. peaks: a donated large copy (read + write bytes / s) and a large bf16 matmul (FLOP/s).
3. kernels: the Pallas kernels of this backend (GPU: Triton lowering; TPU: Mosaic), compiled
   for real (interpret only with --smoke), against the jnp reference on random ragged,
   decode, sliding-window and int8-KV cases (NaN in every slot that must not be read).
4. decode attention: 64 sequences x 4k context, bf16: GB/s of K/V read vs the copy bandwidth
   (target >= 70%), and JAX's shipped Pallas paged attention on the same inputs.
5. ragged prefill: 8 fresh 2k-token prompts in one ragged batch, causal: TFLOP/s.
6. grouped matmul: the MoE grouped matmul of this backend's Pallas kernel (GPU: gmm_gpu,
   Triton; TPU: gmm_tpu) against `ragged_dot` on random top-8 routing over 64 experts,
   K 2048 -> N 768, at 8 / 64 / 512 tokens; each timed beside `ragged_dot` and a dense
   einsum of the same active FLOPs ([tokens x 8, K] @ [K, N]), with the weight bytes of the
   experts used against the copy bandwidth (the floor while few tokens reach each expert).
7. model: Llama-3.1-8B shape (configs preset), random bf16 weights built on the device (no
   file): the engine's jitted step (`engine.runner.step.engine_step`, the same code the server
   runs), batch-1 decode tok/s vs the floor (weight bytes / measured copy bandwidth) and
   64-way decode tok/s; all shapes warmed first, then the step's compile count must not
   move while timing ("recompiles_after_warmup": 0).
Each figure names its floor; the Markdown summary lists them with pass/fail against the
targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks import kernels_bench
from engine.runner import compiles
from pallas_kernels import testing

DECODE_BW_TARGET = 0.7  # fraction of the measured copy bandwidth


@dataclasses.dataclass(frozen=True)
class Sizes:
    model: str  # configs preset
    dtype: str
    decode_batch: int
    decode_context: int
    prefill_seqs: int
    prefill_len: int
    model_context: int  # context of the model decode steps
    model_batch: int  # the "64-way" batch
    num_kv_heads: int
    num_heads: int
    head_dim: int
    page_size: int
    iters: int
    # grouped matmul: experts, top-k, K -> N, token counts
    gmm_experts: int = 64
    gmm_top_k: int = 8
    gmm_k: int = 2048
    gmm_n: int = 768
    gmm_tokens: tuple[int, ...] = (8, 64, 512)


FULL = Sizes("llama-3.1-8b", "bfloat16", 64, 4096, 8, 2048, 1024, 64, 8, 32, 128, 16, 10)
SMOKE = Sizes("tiny", "float32", 2, 64, 2, 32, 24, 4, 2, 4, 64, 16, 2, 4, 2, 40, 48, (3, 8))


def timed_section(results: dict, name: str, fn, *args):
    t0 = time.perf_counter()
    try:
        results[name] = fn(*args)
        results[name]["ok"] = results[name].get("ok", True)
    except Exception as e:  # record and go on: one broken part must not hide the others
        results[name] = {"ok": False, "error": repr(e), "traceback": traceback.format_exc()}
    results[name]["section_s"] = time.perf_counter() - t0
    print(f"[{name}] {results[name]['section_s']:.1f}s ok={results[name]['ok']}", flush=True)


# ---------------------------------------------------------------- 1-2 devices and peaks


def devices_info() -> dict:
    import jaxlib

    devs = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_kind": devs[0].device_kind,
        "device_count": len(devs),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
    }


def peaks(smoke: bool) -> dict:
    bw, flops = kernels_bench.measure_peaks(iters=3 if smoke else 10, small=smoke)
    return {"copy_gb_s": bw / 1e9, "matmul_tflop_s": flops / 1e12}


# ---------------------------------------------------------------- 3 kernels vs reference


def kernel_impl() -> str:
    return "tpu" if jax.default_backend() == "tpu" else "gpu"


def kernel_cases(sizes: Sizes, smoke: bool) -> tuple[list, dict]:
    """([(name, make_case kwargs, attention options)], kwargs common to every case)."""
    kv = dict(page_size=sizes.page_size, num_kv_heads=sizes.num_kv_heads, head_dim=sizes.head_dim)
    group = sizes.num_heads // sizes.num_kv_heads
    long = 64 if smoke else 1500
    return [
        ("ragged_mixed", dict(kv_lens=[long, 37, 5, 1], q_lens=[17, 37, 1, 1]), {}),
        ("ragged_window", dict(kv_lens=[long, 40], q_lens=[9, 1]), {"sliding_window": 32}),
        ("ragged_int8_kv", dict(kv_lens=[long, 21], q_lens=[5, 21], int8=True), {}),
        ("decode_only", dict(kv_lens=[long, 33, 1, 7], q_lens=[1, 1, 1, 1]), {}),
    ], {"group": group, **kv}


def _ragged_on_case(case, sm_scale, opts, impl, interpret):
    return pk.ragged_paged_attention(
        *case.attention_args(),
        sm_scale=sm_scale,
        max_query_len=case.max_query_len,
        impl=impl,
        interpret=interpret,
        k_scales=case.k_scales,
        v_scales=case.v_scales,
        **opts,
    )


def kernels_vs_reference(sizes: Sizes, smoke: bool) -> dict:
    impl = kernel_impl()
    cases, common = kernel_cases(sizes, smoke)
    dtype = jnp.dtype(sizes.dtype)
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-3
    rng = np.random.default_rng(0)
    rows = []
    for name, kw, opts in cases:
        case = testing.make_case(rng, dtype=dtype, **common, **kw)
        run = functools.partial(_ragged_on_case, case, sizes.head_dim**-0.5, opts)
        t0 = time.perf_counter()
        got = np.asarray(jax.block_until_ready(run(impl, smoke)).astype(jnp.float32))
        compile_s = time.perf_counter() - t0
        want = np.asarray(run("reference", False).astype(jnp.float32))
        err = float(np.max(np.abs(got - want))) if got.size else 0.0
        finite = bool(np.all(np.isfinite(got)))
        rows.append(
            {
                "case": name,
                "impl": impl,
                "interpret": smoke,
                "max_abs_err": err,
                "tolerance": tol,
                "finite": finite,
                "ok": finite and err <= tol,
                "first_call_s": compile_s,
            }
        )
    return {"impl": impl, "interpret": smoke, "cases": rows, "ok": all(r["ok"] for r in rows)}


# ---------------------------------------------------------------- 4-5 attention speed


def decode_inputs(sizes: Sizes) -> kernels_bench.Inputs:
    """The decode case: `decode_batch` sequences of `decode_context` tokens, one query each."""
    return kernels_bench.make_inputs(
        "decode",
        sizes.decode_batch,
        sizes.decode_context,
        num_heads=sizes.num_heads,
        num_kv_heads=sizes.num_kv_heads,
        head_dim=sizes.head_dim,
        page_size=sizes.page_size,
        chunk=1,
        dtype=jnp.dtype(sizes.dtype),
    )


def decode_attention(sizes: Sizes, peak: dict, smoke: bool) -> dict:
    inputs = decode_inputs(sizes)
    sm_scale = sizes.head_dim**-0.5
    args = (inputs.k_pages, inputs.v_pages, inputs.kv_lens, inputs.page_table, 0)
    fns = {
        "ours": jax.jit(
            lambda: pk.decode_paged_attention(
                inputs.q, *args, sm_scale=sm_scale, impl=kernel_impl(), interpret=smoke
            )
        ),
        "jax_shipped": kernels_bench.shipped_decode(inputs, sm_scale),
    }
    out = {"batch": sizes.decode_batch, "context": sizes.decode_context}
    out["bytes"] = inputs.bytes_moved
    copy_b_s = peak["copy_gb_s"] * 1e9
    for name, fn in fns.items():
        try:
            t = kernels_bench.time_median_s(fn, iters=sizes.iters)
        except Exception as e:  # the shipped kernel may not support this JAX/device
            out[name] = {"error": repr(e)}
            continue
        out[name] = {
            "ms": 1e3 * t,
            "gb_s": inputs.bytes_moved / t / 1e9,
            "frac_copy_bw": inputs.bytes_moved / t / copy_b_s,
        }
    frac = out.get("ours", {}).get("frac_copy_bw", 0.0)
    out["target"] = f">= {DECODE_BW_TARGET:.0%} of copy bandwidth"
    out["met"] = frac >= DECODE_BW_TARGET
    return out


def ragged_prefill(sizes: Sizes, peak: dict, smoke: bool) -> dict:
    """`prefill_seqs` fresh prompts of `prefill_len` tokens, causal, in one ragged call."""
    n, length = sizes.prefill_seqs, sizes.prefill_len
    rng = np.random.default_rng(1)
    case = testing.make_case(
        rng,
        kv_lens=[length] * n,
        q_lens=[length] * n,
        page_size=sizes.page_size,
        num_kv_heads=sizes.num_kv_heads,
        group=sizes.num_heads // sizes.num_kv_heads,
        head_dim=sizes.head_dim,
        dtype=jnp.dtype(sizes.dtype),
        nan_fill=False,
        shuffle=False,
    )
    fn = jax.jit(
        lambda: pk.ragged_paged_attention(
            *case.attention_args(),
            sm_scale=sizes.head_dim**-0.5,
            max_query_len=length,
            impl=kernel_impl(),
            interpret=smoke,
        )
    )
    t = kernels_bench.time_median_s(fn, iters=sizes.iters)
    # QK^T and PV over the causal triangle: 4 * attended keys * H * hd
    flops = 4 * n * (length * (length + 1) // 2) * sizes.num_heads * sizes.head_dim
    return {
        "seqs": n,
        "prompt_len": length,
        "ms": 1e3 * t,
        "tflop_s": flops / t / 1e12,
        "frac_matmul_peak": flops / t / (peak["matmul_tflop_s"] * 1e12),
    }


# ---------------------------------------------------------------- 6 grouped matmul


def gmm_inputs(sizes: Sizes, tokens: int, rng) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x [tokens*k, K], w [E, K, N], group_sizes [E] int32): random top-k routing, rows
    sorted by expert, outputs ~ N(0, 1)."""
    e, k = sizes.gmm_experts, sizes.gmm_top_k
    experts = np.argsort(rng.random((tokens, e)), axis=1)[:, :k]  # [tokens, k] distinct
    group_sizes = np.bincount(experts.ravel(), minlength=e).astype(np.int32)  # [E]
    dtype = jnp.dtype(sizes.dtype)
    x = jnp.asarray(rng.normal(size=(tokens * k, sizes.gmm_k)), dtype)
    w = jnp.asarray(rng.normal(size=(e, sizes.gmm_k, sizes.gmm_n)) / sizes.gmm_k**0.5, dtype)
    return x, w, jnp.asarray(group_sizes)


def grouped_matmul_check(sizes: Sizes, peak: dict, smoke: bool) -> dict:
    """This backend's Pallas grouped matmul against `ragged_dot` (max abs error), and the
    time of each beside a dense matmul of the same active FLOPs."""
    from pallas_kernels.grouped_matmul import grouped_matmul

    impl = kernel_impl()
    tol = 6e-2 if jnp.dtype(sizes.dtype) == jnp.bfloat16 else 2e-3
    kernel = jax.jit(functools.partial(grouped_matmul, impl=impl, interpret=smoke))
    ragged = jax.jit(jax.lax.ragged_dot)
    dense = jax.jit(lambda x, w: jnp.einsum("mk,kn->mn", x, w))  # [tokens*k, K] @ [K, N]
    peak_flop_s, copy_b_s = peak["matmul_tflop_s"] * 1e12, peak["copy_gb_s"] * 1e9
    rng = np.random.default_rng(2)
    rows = []
    for tokens in sizes.gmm_tokens:
        x, w, group_sizes = gmm_inputs(sizes, tokens, rng)
        got = np.asarray(kernel(x, w, group_sizes).astype(jnp.float32))
        want = np.asarray(ragged(x, w, group_sizes).astype(jnp.float32))
        err = float(np.max(np.abs(got - want)))
        flops = 2 * x.shape[0] * sizes.gmm_k * sizes.gmm_n
        used = int(np.count_nonzero(np.asarray(group_sizes)))
        weight_bytes = used * sizes.gmm_k * sizes.gmm_n * w.dtype.itemsize  # experts read
        row = {"tokens": tokens, "rows": x.shape[0], "experts_used": used}
        row |= {"max_abs_err": err, "tolerance": tol, "weight_bytes": weight_bytes}
        row["ok"] = bool(np.all(np.isfinite(got))) and err <= tol
        timed = {
            impl: (kernel, x, w, group_sizes),
            "ragged_dot": (ragged, x, w, group_sizes),
            "dense": (dense, x, w[0]),
        }
        for name, (fn, *args) in timed.items():
            t = kernels_bench.time_median_s(fn, *args, iters=sizes.iters)
            row[name] = {"ms": 1e3 * t, "tflop_s": flops / t / 1e12}
            row[name]["frac_matmul_peak"] = flops / t / peak_flop_s
        row["kernel_over_dense"] = row[impl]["ms"] / row["dense"]["ms"]
        row["kernel_frac_copy_bw"] = weight_bytes / (row[impl]["ms"] / 1e3) / copy_b_s
        rows.append(row)
    return {
        "impl": impl,
        "interpret": smoke,
        "experts": sizes.gmm_experts,
        "top_k": sizes.gmm_top_k,
        "k": sizes.gmm_k,
        "n": sizes.gmm_n,
        "cases": rows,
        "ok": all(r["ok"] for r in rows),
    }


# ---------------------------------------------------------------- 7 the model's step


def random_params(cfg, dtype, key):
    """Random params of `cfg` in `dtype`, generated leaf by leaf on the device (no float32
    copy of the whole model, no file)."""
    from models.llama import param_shapes

    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(key, len(leaves))
    make = jax.jit(
        lambda k, shape: (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype),
        static_argnums=1,
    )
    out = [make(k, x.shape) for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, out)


def model_decode(sizes: Sizes, peak: dict, smoke: bool) -> dict:
    from benchmarks.step_profile import Case, make_batch
    from configs.model_config import from_name
    from engine.runner import step as step_module
    from engine.runner.kv_cache import PagedKVCache
    from engine.runner.state import DeviceState
    from engine.sampling.sampler import GREEDY_FLAGS
    from models.llama import layer_layout

    cfg = from_name(sizes.model)
    dtype = jnp.dtype(sizes.dtype)
    t0 = time.perf_counter()
    params = layer_layout(random_params(cfg, dtype, jax.random.key(0)), "auto")
    jax.block_until_ready(params)
    init_s = time.perf_counter() - t0
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    cases = {
        "batch1": Case((sizes.model_context,), (), chunk_size=sizes.prefill_len),
        f"batch{sizes.model_batch}": Case(
            (sizes.model_context,) * sizes.model_batch, (), chunk_size=sizes.prefill_len
        ),
    }
    built = {name: make_batch(c, page_size=sizes.page_size) for name, c in cases.items()}
    num_pages = max(n for _, _, n in built.values()) + 1
    kv = PagedKVCache.zeros(cfg, num_pages, sizes.page_size, sizes.dtype)
    state = DeviceState.without_penalties(kv, sizes.model_batch)  # one slot per sequence

    def step(batch, shape):
        nonlocal state
        state, packed, _ = step_module.engine_step(
            params,
            state,
            batch,
            cfg=cfg,
            shape=shape,
            flags=GREEDY_FLAGS,
            use_penalties=False,
        )
        return packed

    compile_s = {}
    for name, (batch, shape, _) in built.items():  # warm every shape
        t0 = time.perf_counter()
        jax.block_until_ready(step(batch, shape))
        compile_s[name] = time.perf_counter() - t0
    compiles.install()
    before = compiles.count()
    out = {
        "model": cfg.name,
        "dtype": sizes.dtype,
        "layer_loop": "scan" if not isinstance(params.layers, tuple) else "unrolled",
        "weight_bytes": weight_bytes,
        "init_s": init_s,
        "first_call_s": compile_s,
        "context": sizes.model_context,
    }
    floor_s = weight_bytes / (peak["copy_gb_s"] * 1e9)
    for name, (batch, shape, _) in built.items():
        step_s = kernels_bench.time_median_s(lambda b=batch, s=shape: step(b, s), iters=sizes.iters)
        seqs = len(cases[name].decode_contexts)
        out[name] = {
            "step_ms": 1e3 * step_s,
            "tokens_per_s": seqs / step_s,
            "weight_floor_ms": 1e3 * floor_s,
            "frac_of_floor": floor_s / step_s,
        }
    out["recompiles_after_warmup"] = compiles.count() - before
    out["ok"] = out["recompiles_after_warmup"] == 0
    return out


# ---------------------------------------------------------------- report


def markdown(r: dict) -> str:
    d = r.get("devices", {})
    lines = [
        f"# device_check: {d.get('device_kind', '?')} x{d.get('device_count', '?')} "
        f"({d.get('backend', '?')}), JAX {d.get('jax', '?')}"
        + (" -- SMOKE (CPU, interpret, tiny)" if r["smoke"] else ""),
        "",
        f"total {r['total_s']:.0f} s",
        "",
    ]
    p = r.get("peaks", {})
    if p.get("ok"):
        lines.append(
            f"- peaks: copy {p['copy_gb_s']:.0f} GB/s, matmul {p['matmul_tflop_s']:.1f} TFLOP/s"
        )
    k = r.get("kernels", {})
    for c in k.get("cases", []):
        lines.append(
            f"- kernel {c['impl']} {c['case']}: max abs err {c['max_abs_err']:.2e} "
            f"(tol {c['tolerance']:.0e}) {'ok' if c['ok'] else 'FAIL'}"
        )
    da = r.get("decode_attention", {})
    for name in ("ours", "jax_shipped"):
        x = da.get(name)
        if x and "gb_s" in x:
            lines.append(
                f"- decode attention {name}: {x['gb_s']:.0f} GB/s = {x['frac_copy_bw']:.0%} of "
                f"copy bandwidth ({x['ms']:.2f} ms)"
            )
        elif x:
            lines.append(f"- decode attention {name}: {x.get('error')}")
    if "met" in da:
        lines.append(f"  target {da['target']}: {'met' if da['met'] else 'NOT met'}")
    rp = r.get("ragged_prefill", {})
    if rp.get("ok"):
        lines.append(
            f"- ragged prefill {rp['seqs']} x {rp['prompt_len']}: {rp['tflop_s']:.1f} TFLOP/s "
            f"({rp['frac_matmul_peak']:.0%} of matmul peak)"
        )
    gm = r.get("grouped_matmul", {})
    for c in gm.get("cases", []):
        impl = gm["impl"]
        lines.append(
            f"- grouped matmul {impl} {gm['experts']} experts top-{gm['top_k']} "
            f"{gm['k']}->{gm['n']}, {c['tokens']} tokens: {c[impl]['ms']:.3f} ms "
            f"({c[impl]['tflop_s']:.1f} TFLOP/s), ragged_dot {c['ragged_dot']['ms']:.3f} ms, "
            f"dense same-FLOPs {c['dense']['ms']:.3f} ms ({c['kernel_over_dense']:.1f}x), "
            f"expert weights at {c['kernel_frac_copy_bw']:.0%} of copy bandwidth; "
            f"max abs err vs ragged_dot {c['max_abs_err']:.2e} (tol {c['tolerance']:.0e}) "
            f"{'ok' if c['ok'] else 'FAIL'}"
        )
    m = r.get("model", {})
    for name in [x for x in m if x.startswith("batch")]:
        x = m[name]
        lines.append(
            f"- {m['model']} {m['dtype']} {name} decode at context {m['context']}: "
            f"{x['tokens_per_s']:.1f} tok/s, step {x['step_ms']:.2f} ms, weight floor "
            f"{x['weight_floor_ms']:.2f} ms ({x['frac_of_floor']:.0%} of floor)"
        )
    if "recompiles_after_warmup" in m:
        lines.append(f"- recompiles after warm-up: {m['recompiles_after_warmup']}")
    for name, sec in r.items():
        if isinstance(sec, dict) and sec.get("ok") is False and "error" in sec:
            lines.append(f"- section {name} FAILED: {sec['error']}")
    return "\n".join(lines) + "\n"


def run(smoke: bool, out: str | None = None) -> dict:
    """Every section in order; with `out`, OUT.json is rewritten after each one, so a run
    cut short by the device lease still leaves what it measured."""
    sizes = SMOKE if smoke else FULL
    t0 = time.perf_counter()
    r: dict = {"smoke": smoke, "sizes": dataclasses.asdict(sizes)}

    def section(name: str, fn, *args) -> None:
        timed_section(r, name, fn, *args)
        if out is not None:
            with open(out + ".json", "w") as f:
                json.dump(r, f, indent=1, default=str)

    section("devices", devices_info)
    section("peaks", peaks, smoke)
    peak = r["peaks"] if r["peaks"]["ok"] else {"copy_gb_s": math.nan, "matmul_tflop_s": math.nan}
    section("kernels", kernels_vs_reference, sizes, smoke)
    section("decode_attention", decode_attention, sizes, peak, smoke)
    section("ragged_prefill", ragged_prefill, sizes, peak, smoke)
    section("grouped_matmul", grouped_matmul_check, sizes, peak, smoke)
    section("model", model_decode, sizes, peak, smoke)
    r["total_s"] = time.perf_counter() - t0
    r["ok"] = all(v.get("ok", True) for v in r.values() if isinstance(v, dict))
    return r


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, kernels interpreted")
    p.add_argument("--out", default="device_check", help="writes OUT.json and OUT.md")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    r = run(args.smoke, args.out)
    with open(args.out + ".json", "w") as f:
        json.dump(r, f, indent=1, default=str)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(r))
    print(markdown(r))
    return r


if __name__ == "__main__":
    main()
