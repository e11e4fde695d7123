# Lint before the tests, as kubernetes-mixin's Makefile does: ruff over the
# whole tree (pyflakes, pycodestyle, isort, pyupgrade to Python 3.10, bugbear),
# and mypy strict on the contract, the engine side and the sidecar, checked
# against Python 3.10 (the oldest Python SGLang runs on). mypy reads the layer
# folders through build/typecheck/pdwatch, linked as the wheel installs them.
TYPED := contract engine_patches sidecar testbed

.PHONY: lint
lint: $(STAMP)
	$(BIN)/ruff check .
	mkdir -p build/typecheck/pdwatch
	ln -sfn ../../../pdwatch/__init__.py build/typecheck/pdwatch/__init__.py
	for d in $(TYPED); do ln -sfn ../../../$$d build/typecheck/pdwatch/$$d; done
	$(BIN)/mypy $(addprefix -p pdwatch.,$(TYPED))

TEST_DEPS += lint
