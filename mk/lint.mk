# Lint before the tests, as kubernetes-mixin's Makefile does: ruff over the
# whole tree (pyflakes, pycodestyle, isort, pyupgrade to Python 3.10, bugbear),
# and mypy strict on every layer and the CLI's own package, checked against
# Python 3.10 (the oldest Python SGLang runs on); the dashboards against 3.11,
# the oldest grafana-foundation-sdk installs on (its builders' typing.Self and
# StrEnum do not exist in 3.10, where they would read as untyped). mypy reads the
# package through build/typecheck/pdwatch, linked as the wheel installs it.
LAYERS := contract engine_patches sidecar alerts dashboards testbed
# The CLI's own modules and subpackages (in a worktree, pdwatch/ may also hold links to the layers).
TOP := $(filter-out $(addprefix pdwatch/,$(LAYERS)),$(wildcard pdwatch/*.py) $(patsubst %/__init__.py,%,$(wildcard pdwatch/*/__init__.py)))

.PHONY: lint
lint: $(STAMP)
	$(BIN)/ruff check .
	rm -rf build/typecheck && mkdir -p build/typecheck/pdwatch
	for d in $(LAYERS); do ln -sfn ../../../$$d build/typecheck/pdwatch/$$d; done
	for f in $(TOP); do ln -sfn ../../../$$f build/typecheck/$$f; done
	$(BIN)/mypy -p pdwatch --exclude '^build/typecheck/pdwatch/dashboards/'
	$(BIN)/mypy -p pdwatch.dashboards --python-version 3.11 --cache-dir build/mypy-cache-3.11

TEST_DEPS += lint
