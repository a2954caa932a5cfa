# The two commands: `make demo` (the main job) and `make test` (every test). Both set up what they
# need on their own (scripts/setup.sh) and are idempotent.
VENV   := .venv
PY     := $(VENV)/bin/python
BUILD  := build/py
JOBS   ?= 2

.PHONY: setup build test test-cpp test-python test-asan test-tsan test-sanitize demo bench clean

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

# Sanitizer builds of the C++ tests (the agent binary they start is sanitized too).
SAN_CMAKE = cmake -S . -G Ninja -DCMAKE_BUILD_TYPE=Debug -DSAFEPOINT_BUILD_PYTHON=OFF

test-asan: setup
	$(SAN_CMAKE) -B build/asan -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -D_GLIBCXX_ASSERTIONS" >/dev/null
	cmake --build build/asan -j$(JOBS) --target safepoint_tests safepointd safepoint_cli
	cd build/asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	    ctest --output-on-failure -j$(JOBS)

test-tsan: setup
	$(SAN_CMAKE) -B build/tsan -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" >/dev/null
	cmake --build build/tsan -j$(JOBS) --target safepoint_tests safepointd safepoint_cli
	cd build/tsan && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 ctest --output-on-failure -j$(JOBS)

test-sanitize: test-asan test-tsan

demo: build
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) examples/demo.py

bench: build
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/run.py
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/flash.py

clean:
	rm -rf build
