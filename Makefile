# The two commands of the README:
#   make serve   install into .venv and serve the embedded default model on 127.0.0.1:8000
#   make test    install into .venv (and redis-server if missing) and run the whole test suite
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test redis bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch; a bare `pip install torch` would fetch a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

serve: install
	$(BIN)/pagedserve serve --host $(HOST) --port $(PORT)

# The Redis tests start their own redis-server on a loopback port; this makes sure it exists.
redis:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
	  else echo "redis-server is missing: sudo apt-get install redis-server" >&2; exit 1; fi; }

test: install redis
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
