# The two commands: `make serve` and `make test` (and `make local-cluster`: the same on a local multi-node
# Ray cluster under its autoscaler, see README). Each sets up .venv and the default model first.
# `make test` checks the import layers (import-linter, contracts in pyproject.toml) before pytest.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PORT   ?= 8000
MODEL_CACHE := .cache/models
PACKAGES := engine kv_transfer serving prefill_service decode_service colocated_service router pdserve
# CPU machines get the CPU build pinned (an unpinned torch pulls a multi-GB CUDA build);
# machines with an NVIDIA driver take pip's default (CUDA) build.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.5' || echo 'torch==2.13.0')
PYTEST_ARGS ?=

.PHONY: install model bytecode serve local-cluster test bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m engine.kernels.build || echo "(the engine will use its pure-torch attention)"
	touch $@

install: $(VENV)/.installed

model: install
	$(PY) -m serving.models --cache-dir $(MODEL_CACHE)

# Every Ray worker imports these packages afresh. Where PYTHONDONTWRITEBYTECODE is set no process
# caches their bytecode and every replica compiled them again at its start (~1 s of CPU for the five
# replicas of an app); compiled here once (only changed files: ~0.05 s when up to date).
bytecode: install
	$(PY) -m compileall -q $(PACKAGES)

serve: model bytecode
	$(VENV)/bin/pdserve serve --port $(PORT) --model-cache $(MODEL_CACHE)

local-cluster: model bytecode
	$(VENV)/bin/pdserve local-cluster --port $(PORT) --model-cache $(MODEL_CACHE)

test: model bytecode
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest $(PYTEST_ARGS)

bench: model
	$(PY) benchmarks/engine_bench.py --model $(MODEL_CACHE)/SmolLM2-135M-Instruct

clean:
	rm -rf $(VENV) .pytest_cache
