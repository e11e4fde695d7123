# Two commands do all the set-up: `make demo` and `make test`.
# The venv is rebuilt whenever the lock or pyproject.toml changes.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# One lock: every extra of pyproject.toml (the features, and what the tests, lint,
# packaging and SGLang on a CPU need) pinned together by `make lock` below.
LOCK    := requirements.lock

# mk/*.mk add what test and demo need beyond the venv (a compiled stub,
# Debian packages) to these two lists.
TEST_DEPS :=
DEMO_DEPS :=
-include $(sort $(wildcard mk/*.mk))

.PHONY: demo test bench clean lock

# The lock goes in as it stands, with --no-deps: it holds every dependency already,
# and pip must not resolve sglang's own list, which names CUDA builds (torch 2.14.1,
# flashinfer, sgl-kernel, nvidia-*); the `sglang` extra stands in for it. torch is
# the CPU build (+cpu), from where this machine's pip finds it.
$(STAMP): $(LOCK) pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-deps -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# `make lock` resolves every extra again with uv (pinned, in a venv of its own),
# keeping each version the lock has unless told: LOCK_ARGS='--upgrade-package NAME'
# moves one, LOCK_ARGS=--upgrade all. uv reads no pip configuration: it is handed
# pip's find-links, where the CPU build of torch lies. It reads [tool.uv] in
# pyproject.toml (the dependency lists it does not take as published).
UV_VERSION      := 0.13.9
UV_VENV         := build/uv-$(UV_VERSION)
LOCK_FIND_LINKS ?= $(shell $(PY) -m pip config get global.find-links 2>/dev/null)
LOCK_ARGS       ?=

$(UV_VENV)/bin/uv:
	$(PY) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install -q uv==$(UV_VERSION)

lock: $(UV_VENV)/bin/uv
	$< pip compile -q pyproject.toml --all-extras --python $(PY) \
		$(addprefix --find-links ,$(LOCK_FIND_LINKS)) $(LOCK_ARGS) \
		--custom-compile-command 'make lock' -o $(LOCK)
	sed -i '2a # Every extra of pyproject.toml, pinned together; the Makefile installs it with pip --no-deps.' $(LOCK)

demo: $(STAMP) $(DEMO_DEPS)
	$(BIN)/pdwatch demo

# tests/live/release is the version matrix's live leg (make test-matrix, mk/sglang_matrix.mk).
# tests/engine_patches/vllm runs in vLLM's own environment, as test-vllm (mk/vllm.mk), before the rest.
test: $(STAMP) $(TEST_DEPS)
	$(BIN)/python -m pytest -q --ignore=tests/live/release --ignore=tests/engine_patches/vllm

bench: $(STAMP) $(TEST_DEPS)
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
