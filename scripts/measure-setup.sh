#!/usr/bin/env bash
# Measures the README's "How long": a fresh clone of this checkout, ccache off, a fresh .venv:
#
#   scripts/measure-setup.sh [CLONE_DIR] [demo|test|both]     (defaults: /tmp/sp-measure, both)
#
# Prints the load (uptime) before and after, the seconds from `make demo` to the demo's first
# training step ("step   1" in its output) and to its end, then those of `make test` after it
# (set-up of the test level, the C++ tests' build, the tests). Debian packages that are already
# installed stay installed (apt-get's share of a fresh machine is not in these numbers), and pip
# may take wheels from its cache. Run it on an otherwise quiet machine: other builds beside it
# inflate every number.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-/tmp/sp-measure}
what=${2:-both}
rm -rf "$dir"
git clone -q "$src" "$dir"
cd "$dir"
export CCACHE_DISABLE=1
echo "measure: load before: $(uptime)"
if [ "$what" != test ]; then
  t0=$SECONDS
  first=""
  while IFS= read -r line; do
    printf '%s\n' "$line"
    if [ -z "$first" ] && [[ "$line" == *"step   1 "* ]]; then
      first=$((SECONDS - t0))
      echo "measure: make demo reached its first training step after ${first} s"
    fi
  done < <(make demo 2>&1)
  echo "measure: make demo: first step after ${first:-?} s, done after $((SECONDS - t0)) s"
fi
if [ "$what" != demo ]; then
  t0=$SECONDS
  make test
  echo "measure: make test (after make demo): $((SECONDS - t0)) s"
fi
echo "measure: load after: $(uptime)"
