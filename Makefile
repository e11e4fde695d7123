# Two commands do all the set-up: `make demo` and `make test`.
# The venv is rebuilt whenever the pins change.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test bench lint clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# every pin is listed, so nothing resolves behind our back
	$(BIN)/python -m pip install -q --no-deps -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: $(STAMP)
	$(BIN)/pdwatch demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/recorder_cost.py
	$(BIN)/python bench/ingest_rate.py

clean:
	rm -rf $(VENV) build *.egg-info
