SHELL := /bin/bash
# The two commands: `make demo` (the main job) and `make test` (every test). Both set up what they
# need on their own and are idempotent: scripts/setup.sh installs by level, `demo` only the
# build's libraries and torch, `test` the test servers and integrations, `bench` and `lint` the
# rest.
VENV   := .venv
PY     := $(VENV)/bin/python
BUILD  := build/py
JOBS   ?= 2

.PHONY: setup setup-test setup-bench setup-lint build build-tests test test-cpp test-python test-asan test-tsan test-sanitize fuzz demo bench \
        bench-deps bench-multirank bench-replication bench-interference bench-tiers bench-compress bench-goodput bench-incremental bench-scale bench-scale-torch bench-collective-depth clean crash-build test-crash run-cpp run-python-workers run-python-serial run-crash run-brownout run-brownout-apart run-under-ceph crashtest crashtest-nodes lint

setup:
	@scripts/setup.sh demo
setup-test:
	@scripts/setup.sh test
setup-bench:
	@scripts/setup.sh bench
setup-lint:
	@scripts/setup.sh lint

# One CMake build (scikit-build-core, persistent build dir build/py): `build` gives the Python
# package, the CLI and safepointd (what the demo uses); `build-tests` the C++ unit tests too, in
# the same build dir (switching between them reconfigures, it recompiles nothing).
PIP_BUILD = $(PY) -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=$(BUILD) \
	    -Cbuild.tool-args=-j$(JOBS)
build: setup
	@$(PIP_BUILD) -Ccmake.define.SAFEPOINT_BUILD_TESTS=OFF .
build-tests: setup-test
	@$(PIP_BUILD) -Ccmake.define.SAFEPOINT_BUILD_TESTS=ON .

# Each test target's recipe runs from a run-* target without prerequisites, so that `make test`
# builds once and then runs them (below); a run-* target alone needs a build first.
test-cpp: build-tests
	@$(MAKE) --no-print-directory run-cpp
run-cpp:
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)

# pytest-xdist: PYTEST_JOBS workers (the tests wait on agents and subprocesses more than they
# compute, so more workers than cores), a module's tests on one worker except the examples',
# which spread one by one (xdist groups and the order the workers take them in:
# tests/python/conftest.py); tests marked `serial` (a whole-machine resource: network
# namespaces, timing-sensitive measurements) run afterwards, alone. The slowest tests are listed
# at the end of each run (--durations), to keep `make test` within its time.
PYTEST_JOBS ?= 4
PYTEST = PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q
test-python: build-tests
	@$(MAKE) --no-print-directory run-python-workers
	@$(MAKE) --no-print-directory run-python-serial
run-python-workers:
	$(PYTEST) -n $(PYTEST_JOBS) --dist loadgroup --no-loadscope-reorder -m "not serial" --durations=15 tests/python
run-python-serial:
	$(PYTEST) -m serial --durations=10 tests/python

# One throwaway Ceph cluster (scripts/with-ceph.sh) for the C++ and the Python tests: the rados://
# and s3:// tests run against it, and skip where it cannot run (not root, Ceph not installed).
# The C++ tests run first, without the Python tests: their fault tests stop and kill Ceph
# daemons, and their private gateways bind free ports a concurrent gateway could take. Beside
# them run the short brownout run, on a second throwaway cluster of its own (it stops, kills and
# fills its cluster), and the short crash campaigns (the same build, build/py; neither Ceph nor
# fixed ports): all of them wait on timeouts, stopped daemons and killed processes more than
# they compute (the cores were 43-98% idle during the C++ tests and the brownout run), while the
# Python tests' workers, which run next, keep both cores busy. Each one's output is printed whole
# when it ends (--output-sync). The timing-sensitive serial tests run last, alone.
test: build-tests
	scripts/with-ceph.sh $(MAKE) --no-print-directory run-under-ceph
	$(MAKE) --no-print-directory run-python-serial
run-under-ceph:
	$(MAKE) --no-print-directory -j3 --output-sync=target run-cpp run-brownout-apart run-crash
	$(MAKE) --no-print-directory run-python-workers
run-brownout-apart:
	scripts/with-ceph.sh $(MAKE) --no-print-directory run-brownout

# Static checks: clang-format (check only, .clang-format) over the C++ sources, ruff and mypy over
# the Python package (configured in pyproject.toml). mypy reads the _core.pyi the build generates.
LINT_CXX_DIRS := src include apps python/ext
lint: build setup-lint
	find $(LINT_CXX_DIRS) \( -name '*.cc' -o -name '*.h' \) -print0 | \
	    xargs -0 clang-format --dry-run --Werror
	$(VENV)/bin/ruff check python/safepoint
	cp $(BUILD)/_core.pyi python/safepoint/_core.pyi
	$(VENV)/bin/mypy

# The crash campaign (tests/crash, docs/reliability.md): kill -9 at random moments and at named
# kill points. Every build has the kill points (armed only by SAFEPOINT_KILL_AT), so the campaign
# runs `make build`'s package, safepointd and CLI from build/py (`make test` runs the short
# campaign on the build-tests tree, the same build with the tests added). `make test` runs a
# short campaign, `make crashtest` a long one.
CRASH_BUILD := $(BUILD)
CRASH_KILLS ?= 1000
crash-build: build

# The short runs have fixed seeds (the same plan of kill points every time; where random-moment
# kills land still depends on timing); `make crashtest` draws new seeds each run. The short
# node-loss run (about three minutes, most of it starting the clusters and a zygote per node;
# the rounds arm the replication kill points, and CRASH_NODE_PARTITIONS_SHORT rounds cut a
# node off the network: docs/reliability.md, "Partition rounds") is skipped, saying why,
# without root or `ip netns` (its partition rounds without tc's blackhole qdisc).
CRASH_SEED ?= 20261129
CRASH_NODE_SEED ?= 20261202
CRASH_NODE_SHORT ?= 10
CRASH_NODE_PARTITIONS_SHORT ?= 6
test-crash: crash-build
	@$(MAKE) --no-print-directory run-crash
# The short brownout run (6 rounds: every phase, every fault, one OSD restart; about 2 minutes)
# runs under run-under-ceph beside the C++ tests and the crash campaigns, on a cluster of its own
# (run-brownout-apart): it stops, kills and fills its cluster. Without a cluster
# (SAFEPOINT_TEST_CEPH_DIR unset) it says so and passes.
CRASH_BROWNOUT_SEED ?= 20261273
CRASH_BROWNOUT_SHORT ?= 6
run-brownout:
	$(PY) tests/crash/brownout_campaign.py --rounds $(CRASH_BROWNOUT_SHORT) \
	    --seed $(CRASH_BROWNOUT_SEED) --build-dir $(CRASH_BUILD)
run-crash:
	$(PY) tests/crash/crashtest.py --kills 50 --seed $(CRASH_SEED) --build-dir $(CRASH_BUILD)
	$(PY) tests/crash/crashtest.py --nodes --rounds $(CRASH_NODE_SHORT) --seed $(CRASH_NODE_SEED) \
	    --partitions $(CRASH_NODE_PARTITIONS_SHORT) --build-dir $(CRASH_BUILD)

crashtest: crash-build
	$(PY) tests/crash/crashtest.py --kills $(CRASH_KILLS) --build-dir $(CRASH_BUILD)
	$(PY) tests/crash/crashtest.py --nodes --rounds $(CRASH_NODE_ROUNDS) \
	    --partitions $(CRASH_PARTITION_ROUNDS) --build-dir $(CRASH_BUILD)
	scripts/with-ceph.sh $(PY) tests/crash/brownout_campaign.py --rounds $(CRASH_BROWNOUT_ROUNDS) \
	    --build-dir $(CRASH_BUILD)

# Node-loss rounds alone (multi-node jobs with peer replication on network namespaces; root,
# else skipped), with the replication kill points armed in half the rounds, and the partition
# rounds (a node cut off the network, both ways or one, for a while or flapping, and a stale
# rank superseded by the job's next run) in their share.
# The storage brownout rounds (tests/crash/brownout_campaign.py; docs/reliability.md, "Brownout
# rounds") in their share: the throwaway Ceph's OSD stopped, killed or full and radosgw killed
# while a job persists, copies to a tier, collects chunks or loads; on a cluster of their own.
CRASH_NODE_ROUNDS ?= 60
CRASH_PARTITION_ROUNDS ?= 60
CRASH_BROWNOUT_ROUNDS ?= 50
crashtest-nodes: crash-build
	$(PY) tests/crash/crashtest.py --nodes --rounds $(CRASH_NODE_ROUNDS) \
	    --partitions $(CRASH_PARTITION_ROUNDS) --build-dir $(CRASH_BUILD)
	scripts/with-ceph.sh $(PY) tests/crash/brownout_campaign.py --rounds $(CRASH_BROWNOUT_ROUNDS) \
	    --build-dir $(CRASH_BUILD)

# Sanitizer builds of the C++ tests (the agent binary they start is sanitized too), in unity
# batches like the package build (SAFEPOINT_UNITY_BUILD): measured 2026-12-07 on this 2-core
# machine, from scratch, the ASan build 257 s instead of 537 s file by file and the TSan build
# 146 s instead of 425 s (their tests 4-8 min either way): 10 min of CI's hour. That every file
# also compiles alone is left to the dev build (`cmake -S . -B build`, unity off by default).
SAN_CMAKE = cmake -S . -G Ninja -DCMAKE_BUILD_TYPE=Debug -DSAFEPOINT_BUILD_PYTHON=OFF \
	    -DSAFEPOINT_UNITY_BUILD=ON

test-asan: setup-test
	$(SAN_CMAKE) -B build/asan -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -D_GLIBCXX_ASSERTIONS" >/dev/null
	cmake --build build/asan -j$(JOBS) --target safepoint_tests safepointd safepoint_cli
	cd build/asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	    ctest --output-on-failure -j$(JOBS)

test-tsan: setup-test
	$(SAN_CMAKE) -B build/tsan -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" >/dev/null
	cmake --build build/tsan -j$(JOBS) --target safepoint_tests safepointd safepoint_cli
	# UCX_MEM_EVENTS=no: UCX patches mmap/madvise at load for its RDMA registration cache, and those
	# hooks run on thread exits where TSan no longer tracks the thread (a crash in its interceptor).
	cd build/tsan && UCX_MEM_EVENTS=no TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$(CURDIR)/tests/tsan.supp ctest --output-on-failure -j$(JOBS)

test-sanitize: test-asan test-tsan

# libFuzzer targets (image reader, extras decoder, COMMIT record, agent protocol, compressed-chunk
# decoder, packed-image manifest), each run for FUZZ_SECONDS from the seed corpus in
# tests/fuzz/corpus; new inputs go to build/fuzz/corpus.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := image extras commit protocol codec manifest
fuzz: setup
	@command -v clang++ >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null)
	cmake -S . -B build/fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
	    -DSAFEPOINT_BUILD_TESTS=OFF -DSAFEPOINT_FUZZ=ON \
	    -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined" >/dev/null
	cmake --build build/fuzz -j$(JOBS) $(addprefix --target fuzz_,$(FUZZ_TARGETS))
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p build/fuzz/corpus/$$t; \
	  echo "fuzz_$$t for $(FUZZ_SECONDS) s"; \
	  build/fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	      build/fuzz/corpus/$$t tests/fuzz/corpus/$$t 2>&1 | grep -E "stat::|ERROR|SUMMARY|crash" ; \
	  test $${PIPESTATUS[0]} -eq 0 || exit 1; \
	done

demo: build
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) examples/demo.py

bench: build setup-bench bench-deps
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/run.py
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/flash.py
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/versions.py
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/save_path.py
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/restore.py
	$(MAKE) bench-multirank

# The goodput simulator against a real run with random SIGKILLs (docs/benchmarks.md, "Goodput
# simulator"; about 11 minutes): exits 1 when the prediction is more than 10% off.
bench-goodput: build setup-bench
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/goodput.py

# The peers the benchmarks compare against that the bench level does not install into .venv
# (bench/multirank.py, bench/save_path.py and bench/replication.py append these folders to their
# path; the environment's own packages win), none of them touching torch:
# - grpcio, which DLRover imports without declaring it;
# - lm-resiliency 0.2.0 (--no-deps: it would pull another torch);
# - nvidia-resiliency-ext 0.7.0 (--no-deps): its only wheel is for CPython 3.12 on glibc 2.39;
#   what the bench uses (checkpointing.async_ckpt) is pure Python and runs on 3.11, so pip unpacks
#   that wheel for 3.12 into the folder (its one compiled module, CUPTI's, is never imported);
# - torch-checkpointing 0.1.1 (--no-deps), which torchtitan 0.3.0 already brings at the test level.
bench-deps: setup-bench
	@$(PY) -c 'import grpc' 2>/dev/null || test -d build/bench/dlrover-deps || \
	  $(PY) -m pip install -q --target build/bench/dlrover-deps grpcio
	@$(PY) -c 'import lm_resiliency' 2>/dev/null || test -d build/bench/lmres-deps || \
	  $(PY) -m pip install -q --no-deps --target build/bench/lmres-deps lm-resiliency==0.2.0
	@test -d build/bench/nvrx-deps || $(PY) -m pip install -q --no-deps \
	  --target build/bench/nvrx-deps --python-version 3.12 --platform manylinux_2_39_x86_64 \
	  --only-binary=:all: nvidia-resiliency-ext==0.7.0
	@$(PY) -c 'import torch_checkpointing' 2>/dev/null || test -d build/bench/tckpt-deps || \
	  $(PY) -m pip install -q --no-deps --target build/bench/tckpt-deps torch-checkpointing==0.1.1

# 2- and 4-rank DDP and FSDP2 against DLRover, DCP, torch-checkpointing, NVRx, lm-resiliency
# and torch.save, with each one's peak host memory (about 10 minutes on 2 cores).
bench-multirank: build bench-deps
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/multirank.py

# Peer replication on network-namespace nodes (needs root; not part of `make bench`: it takes
# several minutes). lm-resiliency 0.2.0 is measured beside it when installed.
bench-replication: build bench-deps
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/replication.py

# The node agent's CPU time per GB persisted and replicated, next to dd's and iperf3's in the same
# run (root: network-namespace nodes; perf, when installed, profiles the agents).
bench-interference: build setup-bench
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/interference.py

# Lag from a step's commit on `path` to its commit on each lower tier (file://, and s3:// and
# rados:// on a throwaway single-host Ceph when this machine can run one). SIZES/RUNS override.
bench-tiers: build setup-bench
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH scripts/with-ceph.sh $(PY) bench/tiers.py \
	  $(if $(SIZES),--sizes $(SIZES)) $(if $(RUNS),--runs $(RUNS))

# The chunk codec on a small GPT trained on the CPU (cached in bench/.cache; a few minutes the
# first time) against zstd alone, zipnn and DCP's zstd extension, beside the disk's write speed.
bench-compress: build setup-bench
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/compress.py

# Incremental checkpoints (issue 12): a LoRA fine-tune of a frozen small GPT base on the CPU,
# bytes written per checkpoint and persist/load throughput, plain vs packed; XOR-delta measured.
bench-incremental: build setup-bench
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/incremental.py

# The scale harness (issue 32; docs/benchmarks.md, "Scale"): W ranks on N simulated nodes (one
# bench/scale_driver process of W/N rank threads and one agent per node), storage requests per
# committed step and per restore, metadata bytes and times, on POSIX, and on S3 and RADOS on a
# throwaway Ceph where this machine can run one. Writes build/bench/scale.json and prints the
# tables. CONFIGS=WxN,... (or all), STORES=posix,s3,rados, STEPS override.
bench-scale: build-tests
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH scripts/with-ceph.sh $(PY) bench/scale.py \
	  $(if $(CONFIGS),--configs $(CONFIGS)) $(if $(STORES),--stores $(STORES)) \
	  $(if $(STEPS),--steps $(STEPS))

# The Python layer with real torch.distributed processes, DCP side by side (issue 32 items 1 and
# 6; docs/benchmarks.md, "Python layer and DCP, W = 2..64"): W gloo processes of a small state
# each (W = 2..64), save and restore times, collectives per save and per restore, and file
# system calls under the checkpoint root counted by strace for both. WS=2,4,... COUNT_WS=...
# override; writes build/bench/scale_torch.json and prints the table.
bench-scale-torch: build-tests
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/scale_torch.py \
	  $(if $(WS),--ws $(WS)) $(if $(COUNT_WS),--count-ws $(COUNT_WS))

# The collectives' messages in sequence as W grows, every message delayed (issue 32; docs/
# benchmarks.md, "Collectives at scale"): gloo's all-reduce and all-gather against safepoint's
# recursive doubling, W gloo processes (W = 2..64). WS=2,4,... overrides; writes
# build/bench/collective_depth.json and prints the table.
bench-collective-depth: build-tests
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/collective_depth.py $(if $(WS),--ws $(WS))

clean:
	rm -rf build
