#!/usr/bin/env bash
# safepoint in a user's own environment with another torch than the pinned one (README,
# "Supported versions"):
#
#   scripts/other-torch.sh TORCH_VERSION [PYTHON]
#
# Makes a fresh virtual environment build/other-torch/<version>/venv (PYTHON: default python3),
# installs torch==TORCH_VERSION and pytest from the package index, then `pip install .` exactly as
# a user would (an isolated build: scikit-build-core and nanobind come from the index, the
# compiled parts are built against that torch), and runs the Python tests that need nothing but
# torch and the package (OTHER_TORCH_TESTS; within them, what needs an optional integration or the
# test Ceph skips). The Debian libraries the build needs come from `scripts/setup.sh demo`.
# PyPI's torch for x86_64 Linux is a CUDA build: pip also installs its nvidia-* packages (several
# GB); the tests run on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 TORCH_VERSION [PYTHON]" >&2; exit 2; }
version=$1
py=${2:-python3}
dir=build/other-torch/$version
OTHER_TORCH_TESTS=(test_roundtrip test_stateful test_pickle test_errors test_flash test_staging
                   test_dcp test_reshard test_cli test_advisor test_examples)

scripts/setup.sh demo
t0=$SECONDS
rm -rf "$dir"
"$py" -m venv "$dir/venv"
pip=("$dir/venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "torch==$version" pytest
"$dir/venv/bin/python" -c 'import sys, torch; print(f"other-torch: Python {sys.version.split()[0]}, torch {torch.__version__}")'
echo "other-torch: torch installed in $((SECONDS - t0)) s; building safepoint (pip install .)"
"${pip[@]}" -Cbuild-dir="$dir/build" .
echo "other-torch: built in $((SECONDS - t0)) s; testing"
files=()
for t in "${OTHER_TORCH_TESTS[@]}"; do files+=("tests/python/$t.py"); done
# (The guide's getting-started blocks run the whole demo and a two-node job: `make test` runs
# them; here they would only repeat test_example_runs_and_resumes' examples at greater cost.)
PATH="$PWD/$dir/venv/bin:$PATH" "$dir/venv/bin/python" -m pytest -q -p no:cacheprovider \
    -m "not serial" -k "not getting_started" "${files[@]}"
echo "other-torch: torch $version passed in $((SECONDS - t0)) s"
