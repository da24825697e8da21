"""Command-line interface (absl flags; the shared vocabulary is serving/flags.py).

    pagedjax generate --model=smollm2-135m \
        --prompt="What is the capital of France?" --max_tokens=32 --temperature=0
    (or: python -m serving.cli generate ...)

`--model` takes a preset name or a path to a GGUF file or a Hugging Face directory. The
model's chat template is applied unless `--raw`. `--engine=paged` (default) runs the paged
engine; `--engine=dense` runs the dense oracle loop. `--quantization=int8` (or `w8a8`) loads
int8 weights, `--kv_dtype=int8` an int8 KV cache (paged engine); the printed revision names
both. Every flag is checked before the model loads; a mistake prints one line and exits 2.
"""

from __future__ import annotations

import time

from absl import app, flags

from serving import flags as shared

FLAGS = flags.FLAGS
shared.define_model()
shared.define_prompt()
shared.define_sampling()
shared.define_log_level()
flags.DEFINE_enum("engine", "paged", ["paged", "dense"], "paged engine or dense oracle loop")
flags.DEFINE_string("mesh", None, "device mesh, e.g. 'model:4' or 'data:2,model:4'")
shared.define_quantization()
flags.DEFINE_string(
    "compilation_cache_dir",
    None,
    "JAX persistent compilation cache (default: ~/.cache/pagedjax/xla; '' or 'none': off)",
)
COMMANDS = ("generate",)


def check_flags(argv) -> None:
    """Everything a person can get wrong, before the model loads."""
    if len(argv) != 2 or argv[1] not in COMMANDS:
        got = " ".join(argv[1:]) or "(none)"
        raise shared.UsageError("", got, f"command {got!r}: expected one of {list(COMMANDS)}")
    shared.check_model(FLAGS.model)
    shared.require("prompt", "''", bool(FLAGS.prompt), "must not be empty")
    shared.check_sampling(**_sampling_fields())
    shared.check_mesh(FLAGS.mesh)


def _sampling_fields() -> dict:
    return {
        "max_tokens": FLAGS.max_tokens,
        "temperature": FLAGS.temperature,
        "top_p": FLAGS.top_p,
        "top_k": FLAGS.top_k,
        "seed": FLAGS.seed,
    }


def _messages() -> list[dict]:
    messages = [{"role": "system", "content": FLAGS.system}] if FLAGS.system else []
    return [*messages, {"role": "user", "content": FLAGS.prompt}]


def _generate_dense() -> str:
    from models.dense_generate import generate_dense
    from models.registry import load_model

    shared.progress(f"loading {FLAGS.model} ...")
    t0 = time.perf_counter()
    model = load_model(FLAGS.model, quantization=FLAGS.quantization)
    shared.progress(
        f"[loaded {model.identity.name} rev {model.identity.revision[:19]} "
        f"(quantization={model.identity.quantization}) in "
        f"{time.perf_counter() - t0:.1f}s: {model.load_times_s}]"
    )
    tok = model.tokenizer
    ids = tok.encode(FLAGS.prompt) if FLAGS.raw else tok.encode_chat(_messages())
    out = generate_dense(
        model.params,
        model.config,
        ids,
        FLAGS.max_tokens,
        temperature=FLAGS.temperature,
        seed=FLAGS.seed or 0,
        eos_token_ids=tok.eos_token_ids,
    )
    shared.progress(
        f"[prefill {out['prefill_s']:.2f}s, {len(out['token_ids'])} tokens in "
        f"{out['decode_s']:.2f}s, finish={out['finish_reason']}]"
    )
    return tok.decode(out["token_ids"], skip_special_tokens=True)


def _generate_paged() -> str:
    from engine import LLM, SamplingParams

    shared.progress(f"loading {FLAGS.model} ...")
    t0 = time.perf_counter()
    llm = LLM(
        FLAGS.model,
        mesh=FLAGS.mesh,
        quantization=FLAGS.quantization,
        kv_dtype=FLAGS.kv_dtype,
        compilation_cache_dir=FLAGS.compilation_cache_dir,
    )
    ident = llm.model.identity
    shared.progress(
        f"[loaded {ident.name} rev {ident.revision[:19]} (quantization={ident.quantization}, "
        f"kv={ident.kv_dtype}) in {time.perf_counter() - t0:.1f}s: "
        + ", ".join(f"{k}={v:.2f}s" for k, v in llm.model.load_times_s.items())
        + "]"
    )
    prompt = FLAGS.prompt if FLAGS.raw else _messages()
    out = llm.generate([prompt], SamplingParams(**_sampling_fields()))[0]
    m = out.metrics
    shared.progress(
        f"[ttft {m.ttft_s:.2f}s, {len(out.token_ids)} tokens, e2e {m.e2e_s:.2f}s, "
        f"finish={out.finish_reason}]"
    )
    return out.text


def main(argv):
    shared.setup_logging(FLAGS.log_level)
    check_flags(argv)
    text = _generate_dense() if FLAGS.engine == "dense" else _generate_paged()
    print(text)


def run():
    app.run(shared.main_guard(main), flags_parser=shared.parse_flags)


if __name__ == "__main__":
    run()
