"""The quantization validation report: every quantized configuration against float32.

    python -m benchmarks.quant_report --model=smollm2-135m --out=/tmp/quant
    -> /tmp/quant/report.md, report.json, kl_histogram.png, speed.png

Configurations (weights x KV cache): float32 (the reference), int8 weights, W8A8 (int8
weights and activations: the fast CPU formulation, validated as its own configuration),
int8 KV, and int8 weights + int8 KV (and W8A8 + int8 KV). Sections:
  1. quality vs float32 on a stdlib-docstring corpus: mean/p99 KL, top-1, perplexity
     (benchmarks/quant_quality.py)
  2. behaviour: greedy continuations through the paged engine on English, French, Japanese,
     code, a chat turn and a long-context question: identical tokens vs float32, the engine's
     logprobs of its chosen tokens, entropy at temperature 1 (teacher forced on float32's
     continuation)
  3. speed through the engine: batch-1 and N-way decode, a 1k-token prefill (quant_speed.py),
     plus the matmul formulations table (quant_formulations.py)
  4. memory and capacity: weight bytes, KV bytes per token, pages in a KV budget, concurrent
     2,000-token sequences in a device budget, and the float32 fallback
  5. the artifact: scheme, granularity, scale dtype, float tensors, source GGUF types
Targets (SmolLM2-135M, issue 12) are checked in report.json["targets"].
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import time

import jax
import numpy as np

from benchmarks import quant_quality, quant_speed
from configs.engine_config import EngineConfig
from configs.kv_memory import kv_bytes_per_token
from configs.quant_config import QuantConfig
from engine import LLM, SamplingParams
from models.identity import REVISION_SEPARATOR, quantized_revision
from models.quant import QUANTIZED_LAYER_WEIGHTS, layer_weight_bytes, param_bytes
from models.registry import load_model
from serving.extras import require

# name -> (weight scheme, KV dtype)
VARIANTS = {
    "float32": ("none", "float32"),
    "int8-w": ("int8", "float32"),
    "w8a8": ("w8a8", "float32"),
    "kv-int8": ("none", "int8"),
    "int8-w+kv-int8": ("int8", "int8"),
    "w8a8+kv-int8": ("w8a8", "int8"),
}
TARGETS = {  # issue 12, SmolLM2-135M
    "int8-w mean KL < 0.005 nats": ("int8-w", "mean_kl_nats", "<", 0.005),
    "int8-w top-1 agreement >= 97%": ("int8-w", "top1_agreement", ">=", 0.97),
    "kv-int8 mean KL < 0.01 nats": ("kv-int8", "mean_kl_nats", "<", 0.01),
}
PAGE_SIZE = 16
SECTION_SIZES = {  # the arguments that size each measured section (for --combine)
    "quality": ("windows", "window_tokens"),
    "behaviour": ("max_new_tokens", "long_context_tokens"),
    "speed": ("speed_configs", "speed_batch", "prefill_tokens", "decode_tokens", "speed_repeats"),
}


# ---- behaviour prompts ----------------------------------------------------------------------
def behaviour_prompts(tokenizer, long_context_tokens: int) -> dict[str, list[int]]:
    chat = lambda msgs: tokenizer.encode(  # noqa: E731
        tokenizer.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False
    )
    user = lambda text: chat([{"role": "user", "content": text}])  # noqa: E731
    fact = "Note for readers: the access code for the archive room is 7351."
    filler = tokenizer.decode(
        quant_quality.corpus_windows(tokenizer, 1, long_context_tokens)[0].tolist()
    )
    half = len(filler) // 2
    long_doc = filler[:half] + "\n" + fact + "\n" + filler[half:]
    return {
        "english": user("Explain in two sentences why the sky is blue."),
        "french": user("Explique en deux phrases pourquoi le ciel est bleu."),
        "japanese": user("空が青い理由を二文で説明してください。"),
        "code": tokenizer.encode(
            'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
        ),
        "chat_turn": chat(
            [
                {"role": "user", "content": "Hi! What is your name?"},
                {"role": "assistant", "content": "I am a small assistant model."},
                {"role": "user", "content": "Suggest three names for a cat."},
            ]
        ),
        "long_context": user(
            long_doc + "\n\nQuestion: what is the access code for the archive room?"
        ),
    }


def behaviour(models: dict, cfg, prompts: dict, max_new_tokens: int) -> dict:
    """models: variant -> (LoadedModel, kv_dtype, params_for_teacher_forcing)."""
    names = list(models)
    longest = max(len(p) for p in prompts.values()) + max_new_tokens + 16
    outs = {}
    for name in names:
        model, kv_dtype, _ = models[name]
        llm = LLM(
            model,
            quantization=_scheme_of(model),
            quantize_lm_head="+lm_head" in model.identity.quantization,
            kv_dtype=kv_dtype,
            num_pages=len(prompts) * (-(-longest // PAGE_SIZE)) + 8,
            max_num_seqs=len(prompts),
            max_num_batched_tokens=512,
            max_model_len=longest,
            prefix_caching=False,
        )
        sp = SamplingParams(temperature=0, max_tokens=max_new_tokens, logprobs=1, ignore_eos=True)
        res = llm.generate(list(prompts.values()), sp)
        outs[name] = {
            k: (o.token_ids, [lp.logprob for lp in (o.logprobs or [])], o.text)
            for k, o in zip(prompts, res)
        }
        outs[name]["_revision"] = llm.engine.identity.revision
    ref = outs[names[0]]
    table = {}
    for name in names:
        _, kv_dtype, params = models[name]
        rows = {}
        for k, prompt in prompts.items():
            toks, lps, text = outs[name][k]
            ref_toks = ref[k][0]
            same = sum(a == b for a, b in zip(toks, ref_toks)) / max(len(ref_toks), 1)
            prefix = next(
                (i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b),
                min(len(toks), len(ref_toks)),
            )
            tf = quant_quality.teacher_forced(
                params, cfg, kv_dtype == "int8", prompt + ref_toks, len(prompt)
            )
            rows[k] = {
                "prompt_tokens": len(prompt),
                "identical_token_share": same,
                "common_prefix_tokens": prefix,
                "mean_logprob_chosen": float(np.mean(lps)) if lps else None,
                **tf,
                "text": text,
            }
        table[name] = {"prompts": rows, "revision": outs[name]["_revision"]}
    return table


def _scheme_of(model) -> str:
    desc = model.identity.quantization
    return {"none": "none", "int8-w-perchannel": "int8", "int8-w8a8-perchannel": "w8a8"}[
        desc.split("+")[0]
    ]


# ---- memory and capacity --------------------------------------------------------------------
def memory(models: dict, cfg, kv_budget_bytes: int, device_bytes: int, seq_tokens: int) -> dict:
    float_layers = sum(layer_weight_bytes(models["float32"][0].params.layers).values())
    pages_per_seq = -(-seq_tokens // PAGE_SIZE)
    out = {}
    for name, (model, kv_dtype, _) in models.items():
        weights = param_bytes(model.params)
        layers = sum(layer_weight_bytes(model.params.layers).values())
        page_bytes = kv_bytes_per_token(cfg, kv_dtype) * PAGE_SIZE
        kv_pages = EngineConfig(kv_cache_bytes=kv_budget_bytes, kv_dtype=kv_dtype).num_pages_for(
            cfg
        )
        left = device_bytes - weights
        device_pages = max(0, left // page_bytes)
        out[name] = {
            "weight_bytes": weights,
            "layer_weight_bytes": layers,
            "layer_weight_ratio_vs_float32": layers / float_layers,
            "kv_bytes_per_token": kv_bytes_per_token(cfg, kv_dtype),
            "kv_pages_in_budget": kv_pages,
            "kv_tokens_in_budget": kv_pages * PAGE_SIZE,
            "device_kv_pages": int(device_pages),
            "max_concurrent_seqs": int(max(0, device_pages - 1) // pages_per_seq),
        }
    ref = out["float32"]
    for row in out.values():
        row["kv_tokens_ratio_vs_float32"] = row["kv_tokens_in_budget"] / ref["kv_tokens_in_budget"]
        row["concurrency_lost_on_float32_fallback"] = (
            row["max_concurrent_seqs"] - ref["max_concurrent_seqs"]
        )
    return out


def measured_kv_bytes_per_token(cfg, kv_dtype: str) -> float:
    """Bytes per token of the cache the engine really allocates (shapes only, no memory)."""
    from engine.runner.kv_cache import PagedKVCache

    shapes = jax.eval_shape(lambda: PagedKVCache.zeros(cfg, 2, PAGE_SIZE, kv_dtype))
    total = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(shapes))
    return total / (2 * PAGE_SIZE)


# ---- artifact ---------------------------------------------------------------------------------
def artifact(models: dict, source: str, loader_log: list[str]) -> dict:
    types = {}
    if source.endswith(".gguf"):
        from models.loaders.gguf_loader import open_gguf, tensor_types

        types = tensor_types(open_gguf(source))
    quantized = sorted(QUANTIZED_LAYER_WEIGHTS)
    return {
        "source": source,
        "source_tensor_types": types,
        "loader_paths": loader_log,
        "weights": {
            "scheme": "symmetric int8 (-127..127), no zero point",
            "granularity": "per output channel (one scale per row of the PyTorch [out, in] matrix)",
            "scale_dtype": "float32",
            "quantized_tensors": [f"layers.{n}" for n in quantized],
            "float_tensors": "embed, attn_norm, mlp_norm, final_norm, Q/K/V biases, LM head "
            "(unless quantize_lm_head)",
            "w8a8_activations": "int8, dynamic per token (absmax/127 over the contracted axes), "
            "int8 x int8 dot with int32 accumulation",
        },
        "kv_int8": "int8 per token per KV head, float32 absmax/127 scale for K and for V",
        "revisions": {  # as an engine with the variant's KV dtype names it
            n: m[0].identity.with_quantization(kv_dtype=m[1]).revision for n, m in models.items()
        },
    }


# ---- driver ----------------------------------------------------------------------------------
class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def load_variants(model_name: str, names: list[str]) -> tuple[dict, list[str]]:
    """variant -> (LoadedModel, kv_dtype, params); each weight scheme loaded once through the
    real loader (Orbax-cached), so the report validates the artifact users get."""
    handler = _ListHandler()
    logging.getLogger("models.loaders.gguf_loader").addHandler(handler)
    logging.getLogger("models.loaders.gguf_loader").setLevel(logging.INFO)
    loaded = {}
    for scheme in dict.fromkeys(VARIANTS[n][0] for n in names):
        loaded[scheme] = load_model(model_name, quantization=scheme, use_cache=False)
    logging.getLogger("models.loaders.gguf_loader").removeHandler(handler)
    models = {}
    for n in names:
        scheme, kv = VARIANTS[n]
        models[n] = (loaded[scheme], kv, loaded[scheme].params)
    return models, handler.lines


def run(args) -> dict:
    t_start = time.perf_counter()
    names = ["float32"] + [n for n in args.configs.split(",") if n and n != "float32"]
    for n in names:
        if n not in VARIANTS:
            raise SystemExit(f"--configs: {n!r} is not one of {sorted(VARIANTS)}")
    models, loader_log = load_variants(args.model, names)
    base = models["float32"][0]
    cfg, tok = base.config, base.tokenizer
    report: dict = {
        "model": args.model,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "sizes": {k: getattr(args, k) for k in vars(args) if k not in ("out",)},
        "loadavg_start": [round(x, 1) for x in os.getloadavg()],
    }
    sections = set(args.sections.split(","))
    if "quality" in sections:
        windows = quant_quality.corpus_windows(tok, args.windows, args.window_tokens)
        variants = {n: (m[2], m[1] == "int8") for n, m in models.items()}
        report["quality"] = quant_quality.quality(variants, cfg, windows)
    if "behaviour" in sections:
        prompts = behaviour_prompts(tok, args.long_context_tokens)
        report["behaviour"] = behaviour(models, cfg, prompts, args.max_new_tokens)
    report["memory"] = memory(models, cfg, args.kv_budget_bytes, args.device_bytes, args.seq_tokens)
    report["kv_bytes_per_token_allocated"] = {
        kv: measured_kv_bytes_per_token(cfg, kv) for kv in ("float32", "int8")
    }
    report["artifact"] = artifact(models, base.source, loader_log)
    if "speed" in sections:
        speed_names = ["float32"] + [n for n in args.speed_configs.split(",") if n in models]
        report["speed"] = speed({n: models[n] for n in dict.fromkeys(speed_names)}, args)
        from benchmarks import quant_formulations

        report["formulations"] = quant_formulations.measure(
            layers=cfg.num_layers, d=cfg.hidden_size, f=cfg.ffn_size, repeats=args.speed_repeats
        )
    report["targets"] = check_targets(report)
    report["loadavg_end"] = [round(x, 1) for x in os.getloadavg()]
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    return report


def speed(models: dict, args) -> dict:
    """Each variant, then float32 again right after it (paired ratios; see quant_speed)."""

    def engine(name):
        model, kv_dtype, _ = models[name]
        scheme = QuantConfig(_scheme_of(model))
        return quant_speed.engine_for(
            model, scheme, kv_dtype, args.speed_batch, args.prefill_tokens
        )

    opts = {
        "batch": args.speed_batch,
        "prefill_tokens": args.prefill_tokens,
        "decode_tokens": args.decode_tokens,
        "repeats": args.speed_repeats,
    }
    float_llm = engine("float32")
    out = {"float32": quant_speed.measure(float_llm, **opts)}
    for name in models:
        if name == "float32":
            continue
        llm = engine(name)
        row = quant_speed.measure(llm, **opts)
        del llm
        ref = quant_speed.measure(float_llm, **opts, warm_up=False)
        for k in list(row):
            if k not in ("loadavg_1m", "prefill_s"):
                row[f"{k}_vs_float32"] = row[k] / ref[k]
        row["float32_paired"] = {k: ref[k] for k in ref if k != "prefill_s"}
        out[name] = row
    return out


def check_targets(report: dict) -> dict:
    out = {}
    q = report.get("quality", {})
    for label, (variant, key, op, limit) in TARGETS.items():
        if variant in q:
            v = q[variant][key]
            out[label] = {"value": v, "pass": v < limit if op == "<" else v >= limit}
    mem = report["memory"]
    if "kv-int8" in mem:
        v = mem["kv-int8"]["kv_tokens_ratio_vs_float32"]
        out["kv-int8 holds >= 3.5x the tokens of float32 (scales included)"] = {
            "value": v,
            "pass": v >= 3.5,
        }
    if "int8-w" in mem:
        v = mem["int8-w"]["layer_weight_ratio_vs_float32"]
        out["int8 layer weights <= 0.26x float32 (scales included)"] = {
            "value": v,
            "pass": v <= 0.26,
        }
    return out


def combine(paths: list[str]) -> dict:
    """One report from runs of different sections (same model and variants): the measured
    sections of each, the first run's memory/artifact, targets checked again."""
    parts = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    report = dict(parts[0])
    sizes = dict(parts[0]["sizes"])
    for part in parts:
        for key, size_keys in SECTION_SIZES.items():
            if key in part:
                report[key] = part[key]
                sizes.update({k: part["sizes"][k] for k in size_keys})
        if "formulations" in part:
            report["formulations"] = part["formulations"]
    report["sizes"] = {**sizes, "combined_from": paths}
    report["artifact"]["revisions"] = {  # runs from before revisions named the KV dtype
        n: _with_kv(rev, VARIANTS[n][1]) for n, rev in report["artifact"]["revisions"].items()
    }
    report["loadavg_end"] = max((p["loadavg_end"] for p in parts), key=lambda x: x[0])
    report["wall_s"] = max(p["wall_s"] for p in parts)
    report["targets"] = check_targets(report)
    return report


def _with_kv(revision: str, kv_dtype: str) -> str:
    content, _, rest = revision.partition(REVISION_SEPARATOR)
    weights = rest.split(",")[0].removeprefix("quantization=") if rest else "none"
    return quantized_revision(content, weights, kv_dtype)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", required=True)
    p.add_argument("--configs", default=",".join(VARIANTS), help="comma list of variants")
    p.add_argument("--windows", type=int, default=16, help="corpus windows (quality)")
    p.add_argument("--window_tokens", type=int, default=512)
    p.add_argument("--max_new_tokens", type=int, default=48, help="behaviour continuations")
    p.add_argument("--long_context_tokens", type=int, default=3000)
    p.add_argument(
        "--sections",
        default="quality,behaviour,speed",
        help="which measured sections to run (memory and artifact always); runs of different "
        "sections can be merged with --combine",
    )
    p.add_argument("--speed_configs", default=",".join(VARIANTS), help="variants to time")
    p.add_argument(
        "--combine", default="", help="comma list of report.json files to merge into --out"
    )
    p.add_argument("--speed_batch", type=int, default=64)
    p.add_argument("--prefill_tokens", type=int, default=1024)
    p.add_argument("--decode_tokens", type=int, default=24)
    p.add_argument("--speed_repeats", type=int, default=2)
    p.add_argument("--kv_budget_bytes", type=int, default=512 * 2**20)
    p.add_argument("--device_bytes", type=int, default=2 * 2**30, help="capacity: total memory")
    p.add_argument("--seq_tokens", type=int, default=2000, help="capacity: tokens per sequence")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    require("bench", "matplotlib")  # the plots; checked before a long run, not after it
    from benchmarks.quant_render import render_markdown, render_plots

    logging.basicConfig(level=logging.WARNING)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = combine(args.combine.split(",")) if args.combine else run(args)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    render_plots(report, out)
    (out / "report.md").write_text(render_markdown(report))
    print(f"wrote {out / 'report.md'} ({report['wall_s']} s)")
    return report


if __name__ == "__main__":
    main()
