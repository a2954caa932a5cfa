# The two commands: `make demo` (the main job) and `make test` (every test). Both set up what they
# need on their own (scripts/setup.sh) and are idempotent.
VENV   := .venv
PY     := $(VENV)/bin/python
BUILD  := build/py
JOBS   ?= 2

.PHONY: setup build test test-cpp test-python demo bench clean

setup:
	@scripts/setup.sh

# One CMake build (scikit-build-core, persistent build dir) gives the Python package, the CLI and
# the C++ unit tests.
build: setup
	@$(PY) -m pip install -q --no-build-isolation --no-deps \
	    -Cbuild-dir=$(BUILD) -Ccmake.define.SAFEPOINT_BUILD_TESTS=ON \
	    -Cbuild.tool-args=-j$(JOBS) .

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)

test-python: build
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q tests/python

test: test-cpp test-python

demo: build
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) examples/demo.py

bench: build
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/run.py
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/flash.py

clean:
	rm -rf build
