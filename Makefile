# Two commands do all the set-up: `make demo` and `make test`.
# The venv is rebuilt whenever the pins change.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# One requirements file per concern (base, GPU telemetry, SGLang, dashboards),
# every pin listed, installed together with --no-deps so nothing resolves
# behind our back.
REQS    := $(sort $(wildcard requirements*.txt))

# mk/*.mk add what test and demo need beyond the venv (a compiled stub,
# Debian packages) to these two lists.
TEST_DEPS :=
DEMO_DEPS :=
-include $(sort $(wildcard mk/*.mk))

.PHONY: demo test bench clean

$(STAMP): $(REQS) pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-deps $(addprefix -r ,$(REQS))
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: $(STAMP) $(DEMO_DEPS)
	$(BIN)/pdwatch demo

test: $(STAMP) $(TEST_DEPS)
	$(BIN)/python -m pytest -q

bench: $(STAMP) $(TEST_DEPS)
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
