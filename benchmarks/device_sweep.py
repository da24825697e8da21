"""Where a GPU's decode time goes, in one short run beside benchmarks/device_check.py.

    python -m benchmarks.device_sweep --out=device_sweep          # on the GPU (~4 minutes)
    python -m benchmarks.device_sweep --smoke --out=/tmp/sweep     # CPU, tiny, interpret mode

1. decode kernel: the launch table of pallas_kernels/gpu_common.py (KV block tokens, splits
   per sequence, Triton warps and stages) swept on device_check's decode case (64 sequences x
   4k context, bf16, GQA 32:8, head dim 128); GB/s of K/V read against the copy bandwidth
   measured in the same run. The best row is the candidate for the table's defaults.
2. the model's step (device_check's model section: Llama-3.1-8B shape, bf16, batch 1 and 64)
   with the layers under `lax.scan` and unrolled: what the layer loop costs on the device.
Each result is written to OUT.json as soon as it is measured (a lease cut short keeps it).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
import traceback

import jax

from benchmarks import device_check, kernels_bench
from pallas_kernels import gpu_common
from pallas_kernels.gpu_decode import decode_paged_attention_gpu


def _save(r: dict, out: str) -> None:
    with open(out + ".json", "w") as f:
        json.dump(r, f, indent=1, default=str)


def decode_sweep(
    sizes, copy_gb_s: float, smoke: bool, r: dict, out: str, full_grid: bool = False
) -> None:
    inputs = device_check.decode_inputs(sizes)
    args = (inputs.q, inputs.k_pages, inputs.v_pages, inputs.kv_lens, inputs.page_table, 0)
    default_block = gpu_common.KV_BLOCK_TOKENS["decode"]
    default_launch = dict(gpu_common.DECODE_LAUNCH)
    if full_grid:  # NOTE: each program compiles for ~35 s on the H200 (JAX 0.11, Triton)
        grid = list(itertools.product((64, 128, 256), (None, 1, 4, 8, 16), (4, 8), (2, 3)))
    else:
        grid = [(128, None, 4, 2), (64, None, 4, 2), (256, None, 4, 2)]
    rows = r.setdefault("decode_sweep", [])
    for block, splits, warps, stages in grid[:2] if smoke else grid:
        gpu_common.KV_BLOCK_TOKENS["decode"] = block
        gpu_common.DECODE_LAUNCH.update(num_warps=warps, num_stages=stages)
        row = {"block_tokens": block, "splits": splits, "num_warps": warps, "num_stages": stages}
        try:
            fn = jax.jit(
                lambda s=splits: decode_paged_attention_gpu(
                    *args, sm_scale=sizes.head_dim**-0.5, interpret=smoke, num_splits=s
                )
            )
            t = kernels_bench.time_median_s(fn, iters=sizes.iters)
            row.update(ms=1e3 * t, gb_s=inputs.bytes_moved / t / 1e9)
            row["frac_copy_bw"] = row["gb_s"] / copy_gb_s
        except Exception as e:  # a launch Triton refuses (too many registers, say)
            row["error"] = repr(e)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
        _save(r, out)
    gpu_common.KV_BLOCK_TOKENS["decode"] = default_block
    gpu_common.DECODE_LAUNCH.update(default_launch)
    good = [x for x in rows if "ms" in x]
    r["decode_best"] = min(good, key=lambda x: x["ms"]) if good else None


def model_steps(sizes, r: dict, out: str, peak: dict) -> None:
    from models import llama

    for loop, context in (("scan", sizes.model_context), ("unrolled", sizes.model_context)):
        s = dataclasses.replace(sizes, model_context=context)
        original = llama.layer_layout
        llama.layer_layout = lambda p, _mode, loop=loop, f=original: f(p, loop)
        try:
            res = device_check.model_decode(s, peak, smoke=False)
        except Exception:
            res = {"error": traceback.format_exc()[-1500:]}
        finally:
            llama.layer_layout = original
        r[f"model_{loop}_ctx{context}"] = res
        print(loop, context, json.dumps(res, default=str)[:600], flush=True)
        _save(r, out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="device_sweep")
    p.add_argument("--skip_model", action="store_true")
    p.add_argument("--full_grid", action="store_true", help="60 launches (~35 min on an H200)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    sizes = device_check.SMOKE if args.smoke else device_check.FULL
    t0 = time.perf_counter()
    r: dict = {"devices": device_check.devices_info(), "peaks": device_check.peaks(args.smoke)}
    print(json.dumps(r, default=str), flush=True)
    decode_sweep(sizes, r["peaks"]["copy_gb_s"], args.smoke, r, args.out, args.full_grid)
    if not args.skip_model and not args.smoke:
        model_steps(sizes, r, args.out, r["peaks"])
    r["total_s"] = time.perf_counter() - t0
    _save(r, args.out)
    print("best decode launch:", json.dumps(r.get("decode_best")), flush=True)
    return r


if __name__ == "__main__":
    main()
