"""Command-line interface (absl flags).

    python -m serving.cli generate --model=smollm2-135m \
        --prompt="What is the capital of France?" --max_tokens=32 --temperature=0

`--model` takes a preset name or a path to a GGUF file or a Hugging Face directory. The
model's chat template is applied unless `--raw`. `--engine=paged` (default) runs the paged
engine; `--engine=dense` runs the dense oracle loop.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags
from absl import logging as absl_logging

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset name, GGUF file or HF directory.")
flags.DEFINE_string("prompt", "What is the capital of France?", "The prompt.")
flags.DEFINE_string("system", None, "Optional system message (chat mode).")
flags.DEFINE_integer("max_tokens", 64, "Maximum new tokens.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_bool("raw", False, "Use the prompt as is, without the chat template.")
flags.DEFINE_enum("engine", "paged", ["paged", "dense"], "Paged engine or dense oracle loop.")
flags.DEFINE_string("mesh", None, "Device mesh, e.g. 'model:4' or 'data:2,model:4'.")
flags.DEFINE_string(
    "compilation_cache_dir",
    None,
    "JAX persistent compilation cache (default: ~/.cache/pagedjax/xla; '' or 'none': off).",
)


def _prompt_ids(tokenizer) -> list[int]:
    if FLAGS.raw:
        return tokenizer.encode(FLAGS.prompt)
    messages = [{"role": "system", "content": FLAGS.system}] if FLAGS.system else []
    messages.append({"role": "user", "content": FLAGS.prompt})
    return tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True),
        add_special_tokens=False,
    )


def _generate_dense() -> str:
    from models.dense_generate import generate_dense
    from models.registry import load_model

    t0 = time.perf_counter()
    model = load_model(FLAGS.model)
    print(
        f"[loaded {model.identity.name} rev {model.identity.revision[:12]} in "
        f"{time.perf_counter() - t0:.1f}s: {model.load_times_s}]",
        file=sys.stderr,
    )
    ids = _prompt_ids(model.tokenizer)
    out = generate_dense(
        model.params,
        model.config,
        ids,
        FLAGS.max_tokens,
        temperature=FLAGS.temperature,
        seed=FLAGS.seed,
        eos_token_ids=model.tokenizer.eos_token_ids,
    )
    print(
        f"[prefill {out['prefill_s']:.2f}s, {len(out['token_ids'])} tokens in "
        f"{out['decode_s']:.2f}s, finish={out['finish_reason']}]",
        file=sys.stderr,
    )
    return model.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def _generate_paged() -> str:
    from engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(FLAGS.model, mesh=FLAGS.mesh, compilation_cache_dir=FLAGS.compilation_cache_dir)
    ident = llm.model.identity
    print(
        f"[loaded {ident.name} rev {ident.revision[:19]} in {time.perf_counter() - t0:.1f}s: "
        + ", ".join(f"{k}={v:.2f}s" for k, v in llm.model.load_times_s.items())
        + "]",
        file=sys.stderr,
    )
    params = SamplingParams(
        temperature=FLAGS.temperature, max_tokens=FLAGS.max_tokens, seed=FLAGS.seed
    )
    if FLAGS.raw:
        prompt = FLAGS.prompt
    else:
        prompt = [{"role": "system", "content": FLAGS.system}] if FLAGS.system else []
        prompt.append({"role": "user", "content": FLAGS.prompt})
    out = llm.generate([prompt], params)[0]
    m = out.metrics
    print(
        f"[ttft {m.ttft_s:.2f}s, {len(out.token_ids)} tokens, e2e {m.e2e_s:.2f}s, "
        f"finish={out.finish_reason}]",
        file=sys.stderr,
    )
    return out.text


def main(argv):
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every checkpoint step
    if len(argv) != 2 or argv[1] != "generate":
        raise app.UsageError("usage: python -m serving.cli generate --model=... --prompt=...")
    text = _generate_dense() if FLAGS.engine == "dense" else _generate_paged()
    print(text)


def run():
    app.run(main)


if __name__ == "__main__":
    run()
