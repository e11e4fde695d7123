# The supported-version matrix (docs/sglang.md): each older SGLang release in a
# venv of its own under build/, beside the project's. The venv holds only the
# sglang wheel (--no-deps) and what it pins that the lock's versions cannot
# stand in for (mk/sglang_pins.py: transformers and what that pins); a .pth file
# adds the project venv's site-packages after its own, so the rest (torch,
# pdwatch itself) is shared and the release under test shadows the pinned one.
# For each release:
# `pdwatch check` (expected state, exit status) and the plugin's contract test
# on its real source (0.5.23, the pinned one, too: the same venv shape).
# live: then a live PD pair of that release on this CPU (tests/live/release:
# healthy, and transfer-wedge where the lifecycle is hooked), with the project's
# sidecar, Prometheus and Alertmanager (py-spy from the project venv's bin/, on
# PATH); about 4.5 minutes a release.
#   SGLANG_MATRIX='VERSION:STATE[:check-only|:live] ...' picks releases, each with
#   the plugin state `pdwatch check` must report there; check-only: no contract
#   test (a release without SGLang's plugin loader, where no row of the table
#   applies). tests/live covers the pinned release live, in `make test`.
SGLANG_MATRIX ?= 0.5.23:active 0.5.16:partial:live 0.5.13:partial 0.5.11:inactive 0.5.10:inactive:check-only
MATRIX_DIR    := build/sglang-matrix
MATRIX_SITE    = $(shell $(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# CPU torch beside PyPI's torchvision: torchvision's op registrations fail on
# import, and SGLang's scheduler imports torchvision; empty modules stand in for
# them in the matrix venvs only (as tests/engine_patches/sglang/conftest.py does).
TORCHVISION_STUB := import sys, types; \
	sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations")); \
	sys.modules.setdefault("torchvision._autograd_registrations", types.ModuleType("torchvision._autograd_registrations"))

$(MATRIX_DIR)/%/.installed: $(STAMP) mk/sglang_pins.py
	rm -rf $(MATRIX_DIR)/$*
	$(BIN)/python -m venv --without-pip $(MATRIX_DIR)/$*
	$(MATRIX_DIR)/$*/bin/python -c 'import site, sys; d = site.getsitepackages()[0]; \
		open(d + "/pdwatch-shared.pth", "w").write("import site; site.addsitedir(" + repr(sys.argv[1]) + ")\n"); \
		open(d + "/pdwatch-torchvision-stub.pth", "w").write(sys.argv[2] + "\n")' \
		"$(abspath $(MATRIX_SITE))" '$(TORCHVISION_STUB)'
	$(BIN)/python -m pip install -q --no-deps --no-compile \
		--target "$$($(MATRIX_DIR)/$*/bin/python -c 'import site; print(site.getsitepackages()[0])')" sglang==$*
	$(MATRIX_DIR)/$*/bin/python mk/sglang_pins.py
	touch $@

MATRIX_VERSIONS = $(foreach r,$(SGLANG_MATRIX),$(firstword $(subst :, ,$(r))))

.PHONY: test-matrix
test-matrix: $(STAMP) $(DEBIAN_TOOLS_STAMP) $(foreach v,$(MATRIX_VERSIONS),$(MATRIX_DIR)/$(v)/.installed)
	@set -e; for r in $(SGLANG_MATRIX); do \
		v=$${r%%:*}; rest=$${r#*:}; want=$${rest%%:*}; py=$(MATRIX_DIR)/$$v/bin/python; \
		echo "== sglang $$v: pdwatch check (expect $$want)"; \
		$$py -W ignore -m pdwatch.cli check --expect $$want; \
		case $$rest in *:check-only) continue;; esac; \
		echo "== sglang $$v: contract test"; \
		$$py -m pytest -q -p no:cacheprovider tests/engine_patches/sglang/test_contract.py; \
		case $$rest in *:live) ;; *) continue;; esac; \
		echo "== sglang $$v: live PD pair"; \
		PATH="$(abspath $(BIN)):$$PATH" $$py -m pytest -q -s -p no:cacheprovider tests/live/release; \
	done
