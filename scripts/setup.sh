#!/usr/bin/env bash
# Installs everything safepoint's build, tests and demo need; idempotent and quiet when done.
#  - Debian packages (apt-get) only when missing.
#  - A local virtual environment .venv with pinned Python packages. torch is pinned to the CPU
#    build 2.13.0: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PKGS=(g++ cmake ninja-build pkg-config libisal-dev libgtest-dev libgmock-dev libzstd-dev liburing-dev
          nlohmann-json3-dev libspdlog-dev libcli11-dev clang-format
          libucx-dev ucx-utils libssl-dev iperf3 iproute2
          python3-venv python3-dev
          ceph-mon ceph-osd ceph-mgr radosgw ceph-common librados-dev curl libcurl4-openssl-dev
          libcpp-httplib-dev prometheus)
missing=()
for p in "${APT_PKGS[@]}"; do
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
STAMP=.venv/.safepoint-deps-v7
if [ ! -f "$STAMP" ]; then
  echo "setup: installing Python packages into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0" numpy "nanobind>=2.4" "scikit-build-core>=0.10" \
      "cmake>=3.24" ninja pytest safetensors "ruff==0.17.5" "mypy==2.4.1" \
      "pytorch-lightning==2.6.6" "transformers==5.24.0" "accelerate==1.15.0" "dlrover==0.6.1" \
      "zipnn==0.5.4" "zstandard==0.25.0" "matplotlib==3.11.2" \
      "prometheus_client==0.26.0"
  # DLRover pulls the deprecated `pynvml` shim, which makes every `import torch.cuda` warn; the
  # module it wraps comes from nvidia-ml-py, so keep that one alone.
  .venv/bin/python -m pip uninstall -q -y pynvml
  .venv/bin/python -m pip install -q --force-reinstall --no-deps "nvidia-ml-py==13.615.71"
  touch "$STAMP"
fi
